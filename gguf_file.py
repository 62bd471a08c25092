"""Reading a llama.cpp GGUF file: its config as a Hugging Face dict, its tensors, its tokenizer."""
from __future__ import annotations

from pathlib import Path

import torch
import tokenizers
from tokenizers import Regex, decoders, models, pre_tokenizers

from tokenizer import Tokenizer

GGUF_ARCHS = {"llama": "llama", "qwen2": "qwen2", "qwen3": "qwen3"}  # GGUF architecture -> HF model_type

# How text is split before BPE, by tokenizer.ggml.pre (as in each model's own tokenizer.json)
LLAMA3_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
                r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
QWEN2_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
               r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")


def pre_tokenizer(pre: str):
    byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    if pre == "smollm":
        return pre_tokenizers.Sequence([pre_tokenizers.Digits(individual_digits=True),
                                        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)])
    if pre in ("llama-bpe", "llama3"):
        return pre_tokenizers.Sequence([pre_tokenizers.Split(Regex(LLAMA3_SPLIT), behavior="isolated"), byte_level])
    if pre == "qwen2":
        return pre_tokenizers.Sequence([pre_tokenizers.Split(Regex(QWEN2_SPLIT), behavior="isolated"), byte_level])
    return pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)  # GPT-2's own split


def field(reader, key, default=None):
    f = reader.fields.get(key)
    return default if f is None else f.contents()


def read_gguf(path: Path):
    """(config dict in Hugging Face names, get_tensor(hf_name) -> Tensor | None, Tokenizer, rope_interleaved).

    rope_interleaved: whether q/k rows come in the interleaved RoPE order of our model. llama.cpp's converter
    writes them so for Llama-type models; Qwen files keep the rotate-half order of the HF checkpoint.
    """
    import gguf

    try:
        reader = gguf.GGUFReader(str(path))
    except Exception as e:
        raise ValueError(f"cannot read GGUF file {path}: {e}") from None
    arch = field(reader, "general.architecture")
    if arch not in GGUF_ARCHS:
        raise ValueError(f"unsupported GGUF architecture {arch!r} in {path}; supported: {', '.join(GGUF_ARCHS)}")
    a = lambda key, default=None: field(reader, f"{arch}.{key}", default)
    tokens = field(reader, "tokenizer.ggml.tokens")
    n_heads, n_kv_heads = a("attention.head_count"), a("attention.head_count_kv") or a("attention.head_count")
    tensors = {t.name: t for t in reader.tensors}
    if "rope_freqs.weight" in tensors:
        raise ValueError(f"{path}: RoPE frequency factors (rope_freqs) in GGUF files are not supported; use the safetensors checkpoint")
    dim = a("embedding_length")
    config = {
        "model_type": GGUF_ARCHS[arch],
        "vocab_size": a("vocab_size") or len(tokens),
        "hidden_size": dim,
        "num_hidden_layers": a("block_count"),
        "num_attention_heads": n_heads,
        "num_key_value_heads": n_kv_heads,
        "head_dim": a("attention.key_length") or a("rope.dimension_count") or dim // n_heads,
        "intermediate_size": a("feed_forward_length"),
        "rms_norm_eps": a("attention.layer_norm_rms_epsilon"),
        "rope_theta": a("rope.freq_base", 10000.0),
        "max_position_embeddings": a("context_length", 4096),
        "attention_bias": "blk.0.attn_q.bias" in tensors,
        "tie_word_embeddings": "output.weight" not in tensors,
        "eos_token_id": field(reader, "tokenizer.ggml.eos_token_id"),
    }

    names = {"model.embed_tokens.weight": "token_embd.weight", "model.norm.weight": "output_norm.weight",
             "lm_head.weight": "output.weight"}
    layer_names = {"input_layernorm": "attn_norm", "post_attention_layernorm": "ffn_norm",
                   "self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v",
                   "self_attn.o_proj": "attn_output", "self_attn.q_norm": "attn_q_norm", "self_attn.k_norm": "attn_k_norm",
                   "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up", "mlp.down_proj": "ffn_down"}
    for i in range(config["num_hidden_layers"]):
        for hf, gg in layer_names.items():
            for kind in ("weight", "bias"):
                names[f"model.layers.{i}.{hf}.{kind}"] = f"blk.{i}.{gg}.{kind}"

    def get_tensor(hf_name: str) -> torch.Tensor | None:
        t = tensors.get(names.get(hf_name, ""))
        if t is None:
            return None
        shape = tuple(int(d) for d in reversed(t.shape))  # GGUF lists dimensions innermost first
        w = gguf.dequantize(t.data, t.tensor_type)  # float32; a view of the mapped file for F32 tensors
        return torch.from_numpy(w if w.flags.writeable else w.copy()).reshape(shape)

    if field(reader, "tokenizer.ggml.model") != "gpt2":
        raise ValueError(f"{path}: only byte-level BPE (gpt2) GGUF tokenizers are supported")
    bpe = models.BPE(vocab={t: i for i, t in enumerate(tokens)},
                     merges=[tuple(m.split(" ", 1)) for m in field(reader, "tokenizer.ggml.merges", [])])
    tok = tokenizers.Tokenizer(bpe)
    tok.pre_tokenizer = pre_tokenizer(field(reader, "tokenizer.ggml.pre", "gpt2"))
    tok.decoder = decoders.ByteLevel()
    token_type = field(reader, "tokenizer.ggml.token_type", [])
    tok.add_special_tokens([tokenizers.AddedToken(t, special=True, normalized=False)
                            for t, kind in zip(tokens, token_type) if kind == 3])  # 3: control token
    template_vars = {}
    for name in ("bos", "eos", "unknown", "padding"):
        i = field(reader, f"tokenizer.ggml.{name}_token_id")
        if i is not None:
            template_vars[{"unknown": "unk", "padding": "pad"}.get(name, name) + "_token"] = tokens[i]
    eos = {config["eos_token_id"]} if config["eos_token_id"] is not None else set()
    eot = field(reader, "tokenizer.ggml.eot_token_id")
    eos |= {eot} if eot is not None else set()
    return config, get_tensor, Tokenizer(tok, eos, field(reader, "tokenizer.chat_template"), template_vars), arch == "llama"

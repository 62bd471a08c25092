"""int8: every linear layer's weight in int8 with one scale per output channel, as gpt-fast's WeightOnlyInt8Linear,
and on a CPU int8 activations too (W8A8): each row rotated by a block Hadamard matrix (QuaRot's idea), quantized on
the fly, then an int8 x int8 product: oneDNN's int8 matmul on a prepacked weight where the CPU has AMX, else
torch._int_mm (AVX512-VNNI). A step reads a quarter of fp32's bytes, and no weight is ever dequantized: the int8
product beats the weight-only int8 kernel and bf16 at every row count (bench.py --only int8).

    quantize_int8(model)   # in place, on "meta" too: checkpoints.load quantizes each weight as it arrives
"""
from __future__ import annotations

import functools
import math

import torch
import torch.nn as nn
import torch.nn.functional as F

ROTATION_BLOCK = 64  # inputs mixed by one Hadamard block: an outlier channel spreads over 64, its peak 8x lower
NO_ZERO_POINT = torch.zeros((), dtype=torch.int64)  # int8 weights and activations are symmetric


def packs_for_amx() -> bool:
    """Whether int8 weights are prepacked for oneDNN's int8 matmul (onednn::qlinear_pointwise), which runs on AMX's
    tiles: on an Intel CPU with AMX, 2.2-3.5x torch._int_mm at 64 to 1,500 rows and 1.8x at one row (_int_mm takes
    oneDNN's older s8s8 GEMM, AVX512-VNNI; bench.py --only int8). Without AMX, _int_mm, which an AMD EPYC ran at its
    VNNI peak."""
    return torch.cpu._is_amx_tile_supported() and hasattr(torch.ops.onednn, "qlinear_prepack")


@functools.cache  # one tensor, shared by every layer of a block size, device and dtype
def hadamard(n: int, device=None, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Sylvester's n x n Hadamard matrix over sqrt(n), n a power of 2: orthogonal and symmetric, so H @ H = I."""
    h = torch.ones(1, 1, device=device)
    while h.shape[0] < n:
        h = torch.cat([torch.cat([h, h], 1), torch.cat([h, -h], 1)])
    return (h / n ** 0.5).to(dtype)


class Int8Linear(nn.Module):
    """A linear layer whose weight is int8, one scale per output channel; the bias stays in floating point.

    Inputs are rotated in blocks (x BD(H), BD(H) block-diagonal with Hadamard blocks of ROTATION_BLOCK, or of the
    largest power of 2 dividing in_features) and the weight holds W BD(H), so the product is unchanged (BD(H) is its
    own inverse). A channel whose activations run large, as a few do in every LLM, is spread over its block, so a
    row of activations quantizes to int8 without losing its small channels; no calibration is needed. With pack, a
    CPU weight is held prepacked for oneDNN (packs_for_amx), in an opaque layout that takes no `rows`: the output
    projection stays plain."""

    def __init__(self, linear: nn.Linear, pack: bool = False):
        super().__init__()
        w = linear.weight
        self.in_features, self.out_features, self.pack = w.shape[1], w.shape[0], pack
        self.block = math.gcd(self.in_features, ROTATION_BLOCK)
        self.register_buffer("weight", torch.empty(w.shape, dtype=torch.int8, device=w.device))  # [out, in]
        self.register_buffer("scales", torch.empty(w.shape[0], device=w.device))  # [out], fp32 as oneDNN takes them
        self.register_buffer("rotation", torch.empty(self.block, self.block, device=w.device))  # [block, block]
        self.bias = linear.bias
        if not w.is_meta:
            self.set_weight(w)

    def set_weight(self, w: torch.Tensor, dtype: torch.dtype | None = None) -> None:
        """Quantize a float weight [out, in]: rotated, then each row to -127..127 times its own scale. The rotation
        is then held in dtype, the activations' (default: w's), so that no product casts it."""
        dtype = dtype or w.dtype
        self.rotation = hadamard(self.block, w.device)  # the weight is rotated in fp32
        w = self.rotate(w.detach().float())
        self.scales = w.abs().amax(dim=1).clamp(min=1e-12) / 127
        self.weight = (w / self.scales[:, None]).round_().clamp_(-127, 127).to(torch.int8)
        if self.pack and w.device.type == "cpu":
            self.weight = torch.ops.onednn.qlinear_prepack(self.weight, None)  # the same bytes, blocked for the tiles
        self.rotation = hadamard(self.block, w.device, dtype)

    def rotate(self, x: torch.Tensor) -> torch.Tensor:
        # x [N, in] -> x BD(H), [N, in] in x's dtype (the rotation is held in it: the cast is a no-op)
        return (x.reshape(-1, self.block) @ self.rotation.to(x.dtype)).view(x.shape)

    def unpack(self) -> None:
        """The weight back to plain [out, in] int8 (torch.compile cannot trace oneDNN's opaque layout)."""
        if self.weight.is_mkldnn:
            self.weight, self.pack = self.weight.to_dense().t().contiguous(), False

    def forward(self, x: torch.Tensor, rows: torch.Tensor | None = None) -> torch.Tensor:
        # x [..., in] -> [..., out] in x's dtype; with rows, only those output channels
        w, scales = (self.weight, self.scales) if rows is None else (self.weight[rows], self.scales[rows])
        x2 = self.rotate(x.reshape(-1, x.shape[-1]))  # [N, in] in x's dtype: no fp32 copy of a prompt's activations
        if x.device.type != "cpu":
            y = F.linear(x2, w.to(x.dtype)) * scales.to(x.dtype)  # gpt-fast's form, which torch.compile fuses
        else:  # int8 x int8, each row of activations with its own scale
            x_scales = x2.abs().amax(dim=1, keepdim=True).float().clamp(min=1e-12) / 127  # [N, 1]
            xq = (x2 / x_scales).round_().to(torch.int8)  # within -127..127: x_scales is each row's largest / 127
            if w.is_mkldnn:  # the weight's scales applied inside the product, out in x's dtype
                y = torch.ops.onednn.qlinear_pointwise(xq, 1.0, 0, w, scales, NO_ZERO_POINT, None, 1.0, 0, x.dtype,
                                                       "none", [], "").mul_(x_scales.to(x.dtype))
            else:
                y = (torch._int_mm(xq, w.t()) * x_scales).mul_(scales)  # int32 [N, out] -> float, one temporary
        y = y.to(x.dtype)
        if self.bias is not None:
            y = y + (self.bias if rows is None else self.bias[rows])
        return y.view(*x.shape[:-1], -1)


def quantize_int8(model: nn.Module) -> nn.Module:
    """Every linear layer and the output projection to Int8Linear, in place (on "meta" too: weights come later).
    The embedding stays in floating point; a tied output projection gets an int8 copy of it. Prepacked for AMX
    where packs_for_amx says so, but for the output projection, whose rows a quote computes apart."""
    pack = packs_for_amx()
    for name, module in list(model.named_modules()):
        if isinstance(module, nn.Linear):
            parent, _, child = name.rpartition(".")
            setattr(model.get_submodule(parent), child, Int8Linear(module, pack=pack and name != "output"))
    return model

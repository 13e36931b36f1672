"""The FP32 master as (BF16 param, int16 remainder): an exact split in 2 + 2 bytes.

A BF16 number is the top 16 bits of an FP32 one. Every rank already holds the BF16 params, so
the master needs only the 16 bits below them (Apex's ``store_param_remainders``). With ``b`` the
FP32 bit pattern as int32:

    param bits     p = (b + 0x8000) >> 16          (arithmetic shift)
    remainder      r = b - (p << 16)               in [-0x8000, 0x7FFF]: an int16
    master bits    b = (p << 16) + r

``p`` is the FP32 value rounded to the nearest BF16, ties away from zero (adding half an ulp
to the magnitude bits; the carry runs into the exponent as it should). Exactly 2**16 FP32
patterns round to each BF16 one, so the split is a bijection. Round-to-nearest-*even* cannot be
split so: an even BF16 value has 2**16 + 1 FP32 values that round to it (both ties). So fzero
casts FP32 masters to BF16 params with this rule in every mode (``cast_params``): the two rules
differ only on exact ties (one FP32 value in 2**16), by one BF16 ulp, and an FP32 master and
a remainder master then train bit for bit the same.
"""
from __future__ import annotations

import torch

__all__ = ["round_bf16", "split", "join"]

_HALF = 0x8000


def round_bf16(master: torch.Tensor) -> torch.Tensor:
    """FP32 -> BF16, to nearest with ties away from zero (see the module docstring); NaN stays NaN,
    values beyond BF16's range become +-inf (the caller saturates)."""
    bits = (master.view(torch.int32) + _HALF) >> 16
    rounded = bits.to(torch.int16).view(torch.bfloat16)
    # NaN payloads in the low bits would round to inf: keep NaN
    return torch.where(torch.isnan(master), master.to(torch.bfloat16), rounded)


def split(master: torch.Tensor, param: torch.Tensor) -> torch.Tensor:
    """The int16 remainder of FP32 ``master`` below ``param``, its BF16 rounding (``[S]`` each)."""
    return (master.view(torch.int32) - (param.view(torch.int16).to(torch.int32) << 16)).to(torch.int16)


def join(param: torch.Tensor, remainder: torch.Tensor) -> torch.Tensor:
    """The FP32 master from its BF16 ``param`` and int16 ``remainder``, exactly."""
    return ((param.view(torch.int16).to(torch.int32) << 16) + remainder.to(torch.int32)).view(torch.float32)

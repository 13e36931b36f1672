"""The FP32 master as (BF16 param, int16 remainder): an exact split in 2 + 2 bytes.

A BF16 number is the top 16 bits of an FP32 one. Every rank already holds the BF16 params, so
the master needs only the 16 bits below them (Apex's ``store_param_remainders``). With ``b`` the
FP32 bit pattern as int32:

    param bits     p = (b + 0x8000) >> 16          (arithmetic shift)
    remainder      r = b - (p << 16)               in [-0x8000, 0x7FFF]: an int16
    master bits    b = (p << 16) + r

(computed as ``(b + 0x8000) & 0xFFFF0000`` and ``p * 2**16``: the same bits, see below).

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

from .mode import compiling

__all__ = ["round_bf16", "split", "join", "MAX_JOINED"]

_HALF = 0x8000
_HIGH = -0x10000  # int32 0xFFFF0000: the 16 bits a BF16 number keeps
_SHIFT = 0x10000  # * 2**16: 16 bits up (int32 arithmetic wraps as a shift does)
MAX_JOINED = torch.tensor(0x7F7F7FFF, dtype=torch.int32).view(torch.float32).item()  # BF16 max's last FP32

# No shifts here: inductor's CPU code generator has no vector form of ``>>``/``<<`` (nor of
# int16 values), and one such op turns the whole fused AdamW kernel it is part of into a scalar
# loop (a scalar kernel measured 6x slower). Nor has it one of reading FP32 bits as int32: each
# lane goes through memory. So ``round_bf16``, the cast of every BF16 step, is FP32 arithmetic
# when compiled for a CPU. ``split``/``join`` read and write the int16 remainder, so on a CPU
# their kernel stays scalar (docs/numerics.md has the numbers).


def round_bf16(master: torch.Tensor) -> torch.Tensor:
    """FP32 -> BF16, to nearest with ties away from zero (see the module docstring); NaN stays NaN,
    values beyond BF16's range become +-inf (the caller saturates). On the bits, except traced by
    ``torch.compile`` for a CPU, in FP32 arithmetic (``_round_bf16_arith``), bit for bit the same
    (a GPU compiler may fuse its multiply and add into one FMA, which the arithmetic cannot take,
    and reads bits as int32 at no cost)."""
    if compiling() and master.device.type == "cpu":
        return _round_bf16_arith(master)
    # (b + half) with the low 16 bits cleared is an FP32 value BF16 holds exactly: the cast that
    # follows does not round again.
    rounded = ((master.view(torch.int32) + _HALF) & _HIGH).view(torch.float32)
    # NaN payloads in the low bits would carry into inf (or wrap the sign): keep NaN
    return torch.where(master != master, master, rounded).to(torch.bfloat16)


_BIG, _DOWN, _UP = 2.0**100, 2.0**-32, 2.0**32  # Veltkamp's C * x must not overflow: scaled, exactly
_TINY = 2.0**-126  # below: FP32 subnormals, which BF16 rounds at fixed steps (2^-133)
_MAGIC8, _MAGIC9 = 1.5 * 2.0**-110, 1.5 * 2.0**-111  # (x + M) - M: to multiples of 2^-133, 2^-134
_INF = float("inf")  # compared with: inductor's CPU code has no vector isinf


def _veltkamp(x: torch.Tensor, bits: int) -> torch.Tensor:
    """``x`` to ``bits`` significant bits, to nearest (a tie either way): Dekker 1971."""
    c = x * (2.0 ** (24 - bits) + 1)
    return c + (x - c)


def _round_bf16_arith(x: torch.Tensor) -> torch.Tensor:
    """``round_bf16`` in FP32 arithmetic. Inductor's CPU code has no vector form of reading FP32
    bits as int32 (it moves each lane through memory), nor can a BF16 cast stand in for a
    rounding inside a graph (inductor drops a cast to BF16 and back). ``r`` is ``x`` rounded to
    BF16's 8 significant bits, to nearest; ``x`` is a tie iff it needs exactly 9 bits (it rounds
    to itself at 9, not at 8); a tie that went toward zero takes the other neighbour, ``2x - r``
    (exact). Subnormals round at BF16's fixed steps instead. Inductor compiles with
    ``-ffp-contract=off`` and without unsafe math, which Veltkamp's split needs; subnormal masters
    assume the default IEEE mode (``torch.set_flush_denormal(False)``)."""
    a = x.abs()
    big = a >= _BIG
    xs = x * torch.where(big, _DOWN, 1.0)
    tiny = a < _TINY
    r8 = torch.where(tiny, (x + _MAGIC8) - _MAGIC8, _veltkamp(xs, 8))
    r9 = torch.where(tiny, (x + _MAGIC9) - _MAGIC9, _veltkamp(xs, 9))  # (tiny: xs is x)
    toward_zero_tie = (r9 == xs) & (r8 != xs) & (r8.abs() < xs.abs())
    r = torch.where(toward_zero_tie, 2 * xs - r8, r8) * torch.where(big, _UP, 1.0)
    r = torch.where(a == _INF, x, r)
    return torch.copysign(r, x).to(torch.bfloat16)  # what rounds to 0 keeps the sign of x


def _high(param: torch.Tensor) -> torch.Tensor:
    """BF16 ``param``'s bits in the top half of an int32 (its FP32 bit pattern, exactly)."""
    return param.view(torch.int16).to(torch.int32) * _SHIFT


def split(master: torch.Tensor, param: torch.Tensor) -> torch.Tensor:
    """The int16 remainder of FP32 ``master`` below ``param``, its BF16 rounding (``[S]`` each).

    Beyond BF16's range (``|master| > MAX_JOINED``) the params saturate at BF16's largest finite
    value and the remainder at its largest, so the master comes back as ``+-MAX_JOINED``
    (3.3961e38), the largest FP32 value that rounds to that param; without the clamp the
    int16 would wrap (3.40e38 came back as 3.3867e38). An FP32 master keeps such values."""
    return (master.view(torch.int32) - _high(param)).clamp(-_HALF, _HALF - 1).to(torch.int16)


def join(param: torch.Tensor, remainder: torch.Tensor) -> torch.Tensor:
    """The FP32 master from its BF16 ``param`` and int16 ``remainder``, exactly."""
    return (_high(param) + remainder.to(torch.int32)).view(torch.float32)

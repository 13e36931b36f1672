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

from .tracing import compiling

__all__ = ["round_bf16", "split", "join", "MAX_JOINED"]

_HALF = 0x8000
_HIGH = -0x10000  # int32 0xFFFF0000: the 16 bits a BF16 number keeps
_TIE_TOWARD_ZERO_MASK = 0x1FFFF  # the last kept bit and the 16 below it
_SHIFT = 0x10000  # * 2**16: 16 bits up (int32 arithmetic wraps as a shift does)
MAX_JOINED = torch.tensor(0x7F7F7FFF, dtype=torch.int32).view(torch.float32).item()  # BF16 max's last FP32

# No shifts here: inductor's CPU code generator has no vector form of ``>>``/``<<`` (nor of
# int16 values), and one such op turns the whole fused AdamW kernel it is part of into a scalar
# loop, several times slower (docs/numerics.md). Nor has it one of reading FP32 bits as int32: each
# lane goes through memory. So ``round_bf16``, the cast of every BF16 step, is FP32 arithmetic
# when compiled for a CPU. ``split``/``join`` read and write the int16 remainder, so on a CPU
# their kernel stays scalar (docs/numerics.md has the numbers).


def round_bf16(master: torch.Tensor) -> torch.Tensor:
    """FP32 -> BF16, to nearest with ties away from zero (see the module docstring); NaN stays NaN,
    values beyond BF16's range become +-inf (the caller saturates). Three forms of the same bits,
    one for each place it runs:

    * eager: torch's cast, then the ties it took toward zero one BF16 ulp up
      (``_round_bf16_cast``): the fewest passes over memory;
    * compiled for a CPU: FP32 arithmetic (``_round_bf16_arith``), as inductor's CPU code has no
      vector form of reading FP32 bits as int32;
    * compiled otherwise (a GPU), or where inductor may contract or use unsafe math: on the int32
      bits (``_round_bf16_bits``), which a GPU reads at no cost. A GPU compiler may fuse the
      arithmetic form's multiply and add into one FMA, which breaks it; the cast form's int16
      fix-up has no vector form in inductor's CPU code."""
    if not compiling():
        return _round_bf16_cast(master)
    if master.device.type == "cpu" and _inductor_rounds_each_op():
        return _round_bf16_arith(master)
    return _round_bf16_bits(master)


def _round_bf16_bits(master: torch.Tensor) -> torch.Tensor:
    """``round_bf16`` on the int32 bits: ``(b + 0x8000) & 0xFFFF0000`` (the module docstring)."""
    # (b + half) with the low 16 bits cleared is an FP32 value BF16 holds exactly: the cast that
    # follows does not round again.
    rounded = ((master.view(torch.int32) + _HALF) & _HIGH).view(torch.float32)
    # NaN payloads in the low bits would carry into inf (or wrap the sign): keep NaN
    return torch.where(master != master, master, rounded).to(torch.bfloat16)


def _round_bf16_cast(master: torch.Tensor) -> torch.Tensor:
    """``round_bf16`` as torch's cast (to nearest, ties to even) and a fix-up: a tie whose kept
    bits end in 0 (FP32 bits ``b & 0x1FFFF == 0x8000``) went toward zero, to the even neighbour,
    whose last bit is 0; setting that bit is the neighbour away from zero. No carry, and a NaN
    (which the cast makes a NaN, whatever its payload) stays one. Eager only (see ``round_bf16``)."""
    param = master.to(torch.bfloat16, copy=True)  # a new tensor, whatever the input: changed in place below
    toward_zero_tie = (master.view(torch.int32) & _TIE_TOWARD_ZERO_MASK) == _HALF
    param.view(torch.int16).bitwise_or_(toward_zero_tie)
    return param


@torch.compiler.assume_constant_result  # read once, when the step is traced: not traced itself
def _inductor_rounds_each_op() -> bool:
    """Whether inductor compiles CPU code with every FP32 product and sum rounded on its own, as
    ``_round_bf16_arith`` needs: no contraction into FMAs and no unsafe math, its defaults. With
    ``TORCHINDUCTOR_CPP_ENABLE_FLOATING_POINT_CONTRACT_FLAG=fast`` or
    ``TORCHINDUCTOR_CPP_ENABLE_UNSAFE_MATH_OPT_FLAG=1`` (or the same in ``torch._inductor.config.cpp``)
    the arithmetic form rounds about a third of FP32 patterns wrongly; there the rounding stays on
    the bits (exact, slower). Flags passed as ``torch.compile(options=)`` take effect after tracing
    and are not seen here. (A kernel built with unsafe math also turns on flush-to-zero for the
    whole process when it loads, GCC's ``crtfastmath``: subnormals then read as zeros.)"""
    import torch._inductor.config as inductor_config

    cpp = inductor_config.cpp
    return (getattr(cpp, "enable_floating_point_contract_flag", None) in (False, "off")
            and getattr(cpp, "enable_unsafe_math_opt_flag", None) is False)


_BIG, _DOWN = 2.0**100, 2.0**-32  # Veltkamp's C * x must not overflow: scaled, exactly
_SPLIT9 = 2.0**15 + 1  # Veltkamp's C for 9 of FP32's 24 significant bits
_NUDGE = 1 + 2.0**-9


def _round_bf16_arith(x: torch.Tensor) -> torch.Tensor:
    """``round_bf16`` in FP32 arithmetic, for inductor's CPU code, which has no vector form of
    reading FP32 bits as int32 (it moves each lane through memory). The cast to BF16 rounds to
    nearest, ties to even; only exact ties need another rule, and every tie has at most 9
    significant bits. So a value of at most 9 bits is first moved a little away from zero,
    ``x * (1 + 2^-9)``, and then cast:

    * with ``x`` in ``[2^e, 2^(e+1))`` the move ``x * 2^-9`` is in ``[1/4, 1/2)`` of a BF16 ulp
      (``2^(e-7)``), and exact (at most 19 bits): a tie lands strictly between itself and its
      neighbour away from zero, which the cast then takes; a value BF16 holds exactly stays
      within half an ulp of itself and rounds back;
    * a subnormal master rounds at BF16's fixed step ``2^-133`` instead: its ties (odd multiples
      of ``2^-134``) have at most 8 bits, and a 9-bit value that is not a tie is at least its
      own last bit away from one, more than the move;
    * inf, NaN and zeros go through unchanged (``inf * c``, ``0 * c``).

    "At most 9 bits" is Veltkamp's split (Dekker 1971): ``c = C x``, ``c + (x - c)`` is ``x``
    rounded to 9 bits, equal to ``x`` iff it has at most 9. ``C x`` overflows beyond ``2^113``,
    so large values are tested at ``2^-32`` of their size (exactly; the test does not change).
    The split needs each product and sum rounded on its own: inductor's defaults, no FMA
    contraction and no unsafe math (``_inductor_rounds_each_op`` checks them). Subnormal masters
    assume the default IEEE mode (``torch.set_flush_denormal(False)``). Compiled, bit for bit
    the int32 form on every FP32 pattern (``FZERO_ALL_BINADES=1 pytest tests/test_remainder.py
    -k binade``; by default the binades where this arithmetic has its edges)."""
    xs = x * torch.where(x.abs() >= _BIG, _DOWN, 1.0)
    c = xs * _SPLIT9
    at_most_9_bits = c + (xs - c) == xs
    return torch.where(at_most_9_bits, x * _NUDGE, x).to(torch.bfloat16)


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

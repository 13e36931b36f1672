"""Adam moments and the AdamW recipe (torch.optim.AdamW semantics)."""
from __future__ import annotations

from typing import NamedTuple

import optree
import torch

from .protocol import GradientTransformation
from .combine import MaskedState, chain
from .context import ShardContext
from .fused import AdamWCoefficients, FusedStep
from .hyperparams import HYPERPARAM_RULES
from .quantize import BLOCK, block_scale, dequantize, is_stored, quantize, zeros as quantized_zeros
from .scalars import host_value, hyperparam, scalar, zero_count
from .scale import add_decayed_weights, learning_rate, next_learning_rate_state, scale_by_learning_rate
from .tree import map_leaves
from .validate import check_number

__all__ = ["ScaleByAdamState", "scale_by_adam", "adamw"]


class ScaleByAdamState(NamedTuple):
    """``count``: 0-d int32, applied updates so far. ``mu``/``nu``: first/second moments, like
    the updates (each leaf a ``transforms.quantize.Quantized`` with 8-bit moments). ``b1``,
    ``b2``, ``eps``: 0-d float64 hyperparameters."""

    count: torch.Tensor
    mu: object
    nu: object
    b1: torch.Tensor
    b2: torch.Tensor
    eps: torch.Tensor

    HYPERPARAMS = ("b1", "b2", "eps")


def scale_by_adam(
    b1: float = 0.9,
    b2: float = 0.999,
    eps: float = 1e-8,
    *,
    mu_dtype: torch.dtype | None = None,
    nu_dtype: torch.dtype | None = None,
) -> GradientTransformation:
    r"""Adam's direction, with both bias corrections and ``eps`` outside the square root:

    .. math::
        t \leftarrow t+1,\quad m \leftarrow \beta_1 m + (1-\beta_1) g,\quad
        v \leftarrow \beta_2 v + (1-\beta_2) g^2,\quad
        u = \frac{m / (1-\beta_1^t)}{\sqrt{v}/\sqrt{1-\beta_2^t} + \epsilon}

    (torch.optim.Adam's arrangement; ``sqrt(v)`` is multiplied by ``1/sqrt(1-b2^t)``, and the
    first moment is ``m + (1-b1)(g - m)``). The elementwise arithmetic is FP32, the 0-d bias
    corrections float64 then FP32. ``mu_dtype``/``nu_dtype`` say how each moment is stored
    between steps (optax's names):

    * ``None`` (default): the updates' dtype (FP32 under fzero's engine), 4 bytes per element;
    * ``torch.float32``: FP32; ``torch.bfloat16``: BF16 (rounded to nearest), 2 bytes;
    * ``torch.int8``: 8-bit codes with one FP32 scale per ``transforms.quantize.BLOCK`` (256)
      elements, ~1.016 bytes per element (``transforms.quantize``: the first moment on a signed
      map, the second on a non-negative map without 0). The update reads the stored moments,
      computes in FP32 and stores the new ones: this step's direction uses the unrounded new
      moments. The transform's ``block`` is then ``BLOCK``: on a flat shard (``context``) the
      shard must be a whole number of blocks, which fzero's engine arranges.

    ``b1``, ``b2`` must be in [0, 1) and ``eps`` finite and >= 0, and the dtypes one of the
    above, else ``ValueError``.
    """
    for name, value in (("b1", b1), ("b2", b2), ("eps", eps)):
        check_number("scale_by_adam", name, value, HYPERPARAM_RULES[name])
    for name, dtype in (("mu_dtype", mu_dtype), ("nu_dtype", nu_dtype)):
        if dtype not in MOMENT_DTYPES:
            raise ValueError(f"scale_by_adam: {name} must be None, torch.float32, torch.bfloat16 or torch.int8 "
                             f"(8-bit, block-wise), got {dtype!r}")
    quantized = torch.int8 in (mu_dtype, nu_dtype)

    def init(params, *, context: ShardContext | None = None):
        if quantized and context is not None:
            for p in optree.tree_leaves(params):
                if p.numel() % BLOCK:
                    raise ValueError(f"scale_by_adam: 8-bit moments keep one scale per {BLOCK} elements, and the "
                                     f"flat shard it runs on has {p.numel()} elements, not a whole number of blocks: "
                                     f"align the shard to {BLOCK} (fzero's engine does, from the transform's block)")

        def zeros(dtype, signed):
            if dtype == torch.int8:
                return optree.tree_map(lambda p: quantized_zeros(p, signed=signed), params)
            return optree.tree_map(lambda p: torch.zeros_like(p, dtype=dtype or p.dtype), params)

        return ScaleByAdamState(
            zero_count(params), zeros(mu_dtype, True), zeros(nu_dtype, False),
            hyperparam(b1, params), hyperparam(b2, params), hyperparam(eps, params),
        )

    def update(updates, state, params=None, **extra):
        count = state.count + 1
        # 0-d scalars in float64 (like torch.optim's Python floats), then fp32 for the [S] math.
        t = count.to(torch.float64)
        step_size = scalar(1 / (1 - state.b1**t))
        # sqrt(v) times 1/sqrt(1 - b2^t), where torch.optim's kernels divide by sqrt(1 - b2^t): one
        # division per element instead of two (a vector division costs several products: the
        # compiled step is faster, docs/performance.md). The two differ by a rounding.
        inv_bc2_sqrt = scalar(1 / torch.sqrt(1 - state.b2**t))
        w1, b2, w2, eps = scalar(1 - state.b1), scalar(state.b2), scalar(1 - state.b2), scalar(state.eps)

        def leaf(g, m_old, v_old):
            def moments():
                g32 = g.float()
                return _ema(_load(m_old), g32, w1), _load(v_old) * b2 + w2 * g32 * g32

            m, v = moments()
            u = (m * step_size) / (v.sqrt() * inv_bc2_sqrt + eps)
            # Compiled, 8-bit moments take their block scales from a second evaluation of the
            # same expressions: inductor stores a value that a reduction (the block maxima) and a
            # later loop (the encode and the update) both read, so it wrote the new FP32 moments to
            # shard-sized buffers between the two passes, 16 B/elem of traffic (and, on a CPU,
            # fresh pages each step) where recomputing them reads 4 B/elem again (the figures:
            # docs/performance.md, ``benchmarks/moments.py``).
            quantized_leaf = is_stored(m_old) or is_stored(v_old)
            peaks = moments() if quantized_leaf and torch.compiler.is_compiling() else (m, v)
            return (u.to(g.dtype), _store(m, m_old, signed=True, peak=peaks[0]),
                    _store(v, v_old, signed=False, peak=peaks[1]))

        # under each update leaf a moment is a tensor or a Quantized node
        u, mu, nu = map_leaves(leaf, updates, state.mu, state.nu, outputs=3)
        return u, state._replace(count=count, mu=mu, nu=nu)

    return GradientTransformation(init, update, block=BLOCK if quantized else 1)


MOMENT_DTYPES = (None, torch.float32, torch.bfloat16, torch.int8)  # how scale_by_adam may store a moment


def _ema(m: torch.Tensor, g: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """The first moment's average ``m + w * (g - m)`` (``w = 1 - b1``, 0-d): ``torch.lerp``'s
    form for weights under 0.5, written out. ``torch.lerp`` takes ``g - (g - m) * (1 - w)`` for
    the others and picks per element, which inductor's CPU code compiles into a select in every
    element's loop: the compiled BF16 step of the main job's GPT runs faster without it
    (docs/performance.md). The two differ by a rounding where ``b1 <= 0.5``, and where
    ``torch.lerp`` fuses the multiply and the add (its CPU kernel does)."""
    return m + w * (g - m)


def _load(moment) -> torch.Tensor:
    """A stored moment as FP32."""
    return dequantize(moment) if is_stored(moment) else moment.float()


def _store(x: torch.Tensor, old, *, signed: bool, peak: torch.Tensor):
    """The FP32 moment ``x`` stored as ``old`` is: quantized (``signed``: the first moment's
    map), with the block scales of ``peak`` (``x`` itself or the same values computed again),
    or cast to its dtype."""
    if is_stored(old):
        return quantize(x, signed=signed, scale=None if peak is x else block_scale(peak))
    return x.to(old.dtype)


def adamw(
    lr=1e-3,
    betas: tuple[float, float] = (0.9, 0.999),
    eps: float = 1e-8,
    weight_decay: float = 1e-2,
    *,
    weight_decay_mask=None,
    mu_dtype: torch.dtype | None = None,
    nu_dtype: torch.dtype | None = None,
) -> GradientTransformation:
    r"""AdamW with torch.optim.AdamW's defaults and semantics (decoupled decay):

    .. math:: p \leftarrow p - \mathrm{lr}\,(u_{adam} + \mathrm{wd}\, p)

    which equals torch's ``p *= 1 - lr*wd; p -= lr * u_adam``. ``lr`` is a float or a
    schedule ``count -> lr``. ``weight_decay_mask``: pytree of bools (or a callable on the
    params pytree) selecting the leaves that decay, e.g. ``lambda p: tree_map(lambda x: x.ndim >=
    2, p)`` for no decay on biases and norm gains; it refers to the params pytree also when the
    transform runs on a flat shard (see ``masked`` and ``ShardContext``).

    Invalid values raise ``ValueError`` here, as in torch.optim.AdamW: a float ``lr`` must be
    finite and >= 0, ``betas`` a pair in [0, 1), ``eps`` and ``weight_decay`` finite and >= 0.
    """
    if not callable(lr):
        check_number("adamw", "lr", lr, HYPERPARAM_RULES["lr"])
    try:
        b1, b2 = betas
    except (TypeError, ValueError):
        raise ValueError(f"adamw: betas must be a pair (b1, b2), got {betas!r}") from None
    check_number("adamw", "betas[0]", b1, HYPERPARAM_RULES["b1"])
    check_number("adamw", "betas[1]", b2, HYPERPARAM_RULES["b2"])
    check_number("adamw", "eps", eps, HYPERPARAM_RULES["eps"])
    check_number("adamw", "weight_decay", weight_decay, HYPERPARAM_RULES["weight_decay"])
    tx = chain(
        scale_by_adam(b1, b2, eps, mu_dtype=mu_dtype, nu_dtype=nu_dtype),
        add_decayed_weights(weight_decay, mask=weight_decay_mask),
        scale_by_learning_rate(lr),
    )

    def fused(state, *, grad_scale, found_inf, grad_norm):
        return _fused_adamw(lr, state, grad_scale=grad_scale, found_inf=found_inf)

    fused.updates_params = True
    return tx._replace(fused=fused)


def _fused_adamw(lr, state, *, grad_scale, found_inf):
    """``adamw``'s step with ``torch._fused_adamw_`` (one pass over params, grads and moments),
    as a ``FusedStep``: its 0-d work here, once; the kernel in place on a flat FP32 params
    tensor or a slice of it (see ``GradientTransformation.fused``).

    The kernel takes ``b1``, ``b2``, ``eps`` (and an unmasked ``weight_decay``) as Python
    floats: their ``host_value``; without one (a hyperparameter made by arithmetic, or state
    that a compiled step returned), the ``FusedStep``'s kernel is ``None`` and it gives only the
    coefficients (``FusedStep.adamw``, from the tensors); with moments not in FP32, or a masked
    decay and no kernel, it returns ``None`` and the caller runs ``update``. A masked decay is
    one more pass, ``p *= 1 - lr*wd`` where the mask is True, before the kernel (the same order
    as torch's AdamW), and gives no coefficients."""
    adam, decay, rate_state = state
    masked = isinstance(decay, MaskedState)
    decay = decay.inner if masked else decay
    floats = [host_value(x) for x in (adam.b1, adam.b2, adam.eps)]
    wd = 0.0 if masked else host_value(decay.weight_decay)
    fp32 = lambda x: isinstance(x, torch.Tensor) and x.dtype == torch.float32 and x.ndim == 1
    has_kernel = None not in floats and wd is not None and (not masked or isinstance(state[1].mask, torch.Tensor))
    if not (fp32(adam.mu) and fp32(adam.nu)) or not (has_kernel or not masked):
        return None
    rate = learning_rate(lr, rate_state)
    lr_t, inf_t = scalar(rate), found_inf.to(torch.float32)
    step = (adam.count + 1).to(torch.float32)  # the kernel's t (it does not count: torch.optim does)
    keep = scalar(torch.where(found_inf, 1.0, 1 - rate * decay.weight_decay)) if masked else None

    def kernel(params, grads, s):
        b1, b2, eps = floats
        if masked:  # decoupled decay where the mask is True; nothing on a skipped step
            params.mul_(torch.where(s[1].mask, keep, 1.0))
        torch._fused_adamw_([params], [grads], [s[0].mu], [s[0].nu], [], [step], lr=lr_t, beta1=b1, beta2=b2,
                            weight_decay=wd, eps=eps, amsgrad=False, maximize=False, grad_scale=grad_scale,
                            found_inf=inf_t)

    count = lambda c: torch.where(found_inf, c, c + 1)  # skipped steps are not counted
    new_state = (adam._replace(count=count(adam.count)), state[1], next_learning_rate_state(lr, rate_state, count))
    return FusedStep(kernel if has_kernel else None, new_state, grad_scale,
                     None if masked else lambda: _coefficients(adam, rate, decay.weight_decay))


def _coefficients(adam: ScaleByAdamState, rate: torch.Tensor, weight_decay: torch.Tensor) -> AdamWCoefficients:
    """``adamw``'s coefficients of the next step (``FusedStep.adamw``): each the 0-d FP32 value
    ``update`` computes for it, as it computes it."""
    t = (adam.count + 1).to(torch.float64)
    return AdamWCoefficients(scalar(1 - adam.b1), scalar(adam.b2), scalar(1 - adam.b2), scalar(adam.eps),
                             scalar(1 / (1 - adam.b1**t)), scalar(1 / torch.sqrt(1 - adam.b2**t)), -scalar(rate),
                             scalar(weight_decay))
"""fzero's own CPU kernels: the mixed-precision AdamW update (``adamw_update``), one pass per
element that reads the FP16 or BF16 grad, updates the FP32 master and both FP32 moments and
writes the param in its dtype (DeepSpeed's ``DeepSpeedCPUAdam`` is such a kernel, for
ZeRO-Offload's CPU step); and the eager norm's sum of squares (``sum_of_squares``), which reads
the grads once where torch's ops would first copy them into FP32 or float64.

Per element, with ``g`` the grad in FP32 times the 0-d ``mean_factor`` (``ShardGrads.mean``),
and the 0-d FP32 coefficients ``transforms.adam``'s arithmetic computes once per step::

    m' = m + w1 (g - m)                      w1 = 1 - b1
    v' = v b2 + (w2 g) g                     w2 = 1 - b2
    u  = (m' step_size) / (sqrt(v') inv_bc2 + eps)
    w' = w + neg_lr (u + wd w)               neg_lr = -lr
    p  = cast(clamp(w', -max, max))          FP16: to nearest, ties to even; BF16: ties away

each product and sum rounded on its own (no FMA contraction, ``-ffp-contract=off``), in the
order above: the same bits as the update inductor compiles from ``transforms.adamw``
(``tests/test_native.py``). In place; a skipped step (``skip``, read once per call) writes
nothing, or into new params (the pure step) only their cast of the master.

Why a kernel of its own: the CPU code inductor generates for the same arithmetic has no vector
form of reading FP32 bits as int32, so BF16's ties-away rounding is a dozen FP32 operations there
and the cast to BF16 another seven (``fzero.remainder``); a skip is three selects per element
where this kernel branches once per call. Compiled by ``torch.utils.cpp_extension`` at the first
``available()`` (an engine's ``init`` at world size 1, or the first eager norm of CPU grads) for
the machine it runs on (``-march=native``, the extension named after the CPU's flags and torch's
version), cached as torch caches extensions (``TORCH_EXTENSIONS_DIR``). Where it cannot be built
(no compiler) or ``FZERO_NATIVE=0``, ``available()`` is ``False`` and the step runs inductor's
loops and torch's kernels instead.
"""
from __future__ import annotations

import functools
import hashlib
import os
import platform
import warnings

import torch

__all__ = ["available", "adamw_update", "sum_of_squares", "COEFFICIENTS"]

# The 0-d FP32 values ``adamw_update`` takes, in this order (``transforms.adam.AdamWCoefficients``).
COEFFICIENTS = ("w1", "b2", "w2", "eps", "step_size", "inv_bc2", "neg_lr", "wd")

_SOURCE = r"""
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <c10/util/Half.h>
#include <cstdint>
#include <cstring>
#include <cmath>
#include <algorithm>
#include <vector>
#if defined(__AVX512F__) || defined(__F16C__)
#include <immintrin.h>
#endif

namespace {

struct Coef { float w1, b2, w2, eps, step_size, inv_bc2, neg_lr, wd, mean, big; };

inline float bits_to_float(uint32_t b) { float f; std::memcpy(&f, &b, 4); return f; }
inline uint32_t float_to_bits(float f) { uint32_t b; std::memcpy(&b, &f, 4); return b; }

// FP16 <-> FP32 of n elements: the hardware's conversions where there are some, LANES at a time.
constexpr int64_t LANES = 16, BLOCK = 512;
inline void half_to_float(const uint16_t* src, float* dst, int64_t n) {
  int64_t i = 0;
#if defined(__AVX512F__)
  for (; i + 16 <= n; i += 16) _mm512_storeu_ps(dst + i, _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i*)(src + i))));
#elif defined(__F16C__)
  for (; i + 8 <= n; i += 8) _mm256_storeu_ps(dst + i, _mm256_cvtph_ps(_mm_loadu_si128((const __m128i*)(src + i))));
#endif
  for (; i < n; ++i) dst[i] = static_cast<float>(c10::Half(src[i], c10::Half::from_bits()));
}
inline void float_to_half(const float* src, uint16_t* dst, int64_t n) {
  int64_t i = 0;
#if defined(__AVX512F__)
  for (; i + 16 <= n; i += 16)
    _mm256_storeu_si256((__m256i*)(dst + i), _mm512_cvtps_ph(_mm512_loadu_ps(src + i), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
#elif defined(__F16C__)
  for (; i + 8 <= n; i += 8)
    _mm_storeu_si128((__m128i*)(dst + i), _mm256_cvtps_ph(_mm256_loadu_ps(src + i), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
#endif
  for (; i < n; ++i) dst[i] = c10::Half(src[i]).x;
}

// Clamped to [-big, big]: NaN compares false and stays NaN.
inline float saturate(float w, float big) { return w < -big ? -big : (w > big ? big : w); }

// n <= BLOCK saturated FP32 values to P: 1 FP16 (to nearest, ties to even: the hardware's
// conversion), 2 BF16 (ties away from zero: half a BF16 ulp added to the magnitude bits).
template <int P>
inline void cast(const float* wf, uint16_t* p, int64_t n) {
  if constexpr (P == 1) {
    float_to_half(wf, p, n);
  } else {
    for (int64_t i = 0; i < n; ++i) {
      uint32_t b = float_to_bits(wf[i]);
      p[i] = wf[i] != wf[i] ? uint16_t(b >> 16) : uint16_t((b + 0x8000u) >> 16);
    }
  }
}

// One block of n <= BLOCK elements, in place. G: 0 zero grads (padding), 1 FP16, 2 BF16; P: 1 FP16
// params, 2 BF16.
template <int G, int P>
inline void block(const uint16_t* g, float* w, float* m, float* v, uint16_t* p, int64_t n, const Coef& c) {
  float gf[BLOCK], wf[BLOCK];
  if constexpr (G == 1) half_to_float(g, gf, n);
  for (int64_t i = 0; i < n; ++i) {
    float gi = G == 0 ? 0.0f : G == 1 ? gf[i] : bits_to_float(uint32_t(g[i]) << 16);
    gi = gi * c.mean;
    float mo = m[i], vo = v[i], wi = w[i];
    float mi = mo + c.w1 * (gi - mo);
    float vi = vo * c.b2 + (c.w2 * gi) * gi;
    float u = (mi * c.step_size) / (std::sqrt(vi) * c.inv_bc2 + c.eps);
    wi = wi + c.neg_lr * (u + c.wd * wi);
    m[i] = mi; v[i] = vi; w[i] = wi;
    wf[i] = saturate(wi, c.big);
  }
  cast<P>(wf, p, n);
}

// The params of n <= BLOCK elements from the master as it is (a skipped step into new params).
template <int P>
inline void cast_block(const float* w, uint16_t* p, int64_t n, float big) {
  float wf[BLOCK];
  for (int64_t i = 0; i < n; ++i) wf[i] = saturate(w[i], big);
  cast<P>(wf, p, n);
}

template <int G, int P>
void run(const uint16_t* g, float* w, float* m, float* v, uint16_t* p, int64_t n, const Coef& c) {
  at::parallel_for(0, (n + BLOCK - 1) / BLOCK, 128, [=, &c](int64_t lo, int64_t hi) {
    for (int64_t b = lo; b < hi; ++b) {
      int64_t i = b * BLOCK, k = std::min(BLOCK, n - i);
      block<G, P>(G == 0 ? nullptr : g + i, w + i, m + i, v + i, p + i, k, c);
    }
  });
}

template <int P>
void dispatch_grads(int G, const uint16_t* g, float* w, float* m, float* v, uint16_t* p, int64_t n, const Coef& c) {
  if (G == 0) run<0, P>(g, w, m, v, p, n, c);
  else if (G == 1) run<1, P>(g, w, m, v, p, n, c);
  else run<2, P>(g, w, m, v, p, n, c);
}

int kind(const at::Tensor& t) {
  if (t.scalar_type() == at::kHalf) return 1;
  TORCH_CHECK(t.scalar_type() == at::kBFloat16, "fzero.native: FP16 or BF16 expected, got ", t.scalar_type());
  return 2;
}

}  // namespace

void adamw_update(std::vector<at::Tensor> grads, std::vector<int64_t> starts, at::Tensor coef, at::Tensor mean_factor,
                  at::Tensor skip, at::Tensor master, at::Tensor m, at::Tensor v, at::Tensor params,
                  bool cast_on_skip) {
  const int64_t S = master.numel();
  for (const auto& t : {master, m, v})
    TORCH_CHECK(t.scalar_type() == at::kFloat && t.is_contiguous() && t.numel() == S && t.device().is_cpu(),
                "fzero.native: master and moments must be contiguous FP32 CPU tensors of ", S, " elements");
  TORCH_CHECK(params.is_contiguous() && params.numel() == S, "fzero.native: params must be contiguous, ", S, " elements");
  const int P = kind(params);
  auto cf = coef.contiguous().to(at::kFloat);
  const float* k = cf.data_ptr<float>();
  Coef c{k[0], k[1], k[2], k[3], k[4], k[5], k[6], k[7], mean_factor.item<float>(),
         P == 1 ? 65504.0f : bits_to_float(0x7F7F0000u)};
  auto* W = master.data_ptr<float>(); auto* M = m.data_ptr<float>(); auto* V = v.data_ptr<float>();
  auto* Pp = reinterpret_cast<uint16_t*>(params.data_ptr());
  if (skip.item<bool>()) {  // nothing changes; params of their own (cast_on_skip) get the master's cast
    if (cast_on_skip)
      at::parallel_for(0, (S + BLOCK - 1) / BLOCK, 128, [&](int64_t lo, int64_t hi) {
        for (int64_t b = lo; b < hi; ++b) {
          int64_t i = b * BLOCK, n = std::min(BLOCK, S - i);
          if (P == 1) cast_block<1>(W + i, Pp + i, n, c.big); else cast_block<2>(W + i, Pp + i, n, c.big);
        }
      });
    return;
  }
  // pieces in memory order, the gaps between them (padding) with zero grads
  std::vector<std::pair<int64_t, int64_t>> order;
  for (size_t i = 0; i < grads.size(); ++i) order.emplace_back(starts[i], int64_t(i));
  std::sort(order.begin(), order.end());
  int64_t pos = 0;
  auto span = [&](int G, const uint16_t* g, int64_t lo, int64_t n) {
    if (n <= 0) return;
    if (P == 1) dispatch_grads<1>(G, g, W + lo, M + lo, V + lo, Pp + lo, n, c);
    else dispatch_grads<2>(G, g, W + lo, M + lo, V + lo, Pp + lo, n, c);
  };
  for (auto [s, i] : order) {
    const auto& g = grads[i];
    TORCH_CHECK(g.is_contiguous() && s >= pos && s + g.numel() <= S, "fzero.native: grad piece ", i,
                " (", g.numel(), " elements from ", s, ") overlaps another or lies outside the shard of ", S);
    span(0, nullptr, pos, s - pos);
    span(kind(g), reinterpret_cast<const uint16_t*>(g.data_ptr()), s, g.numel());
    pos = s + g.numel();
  }
  span(0, nullptr, pos, S - pos);
}

namespace {

// The sum of the squares of one row of n elements (a multiple of L), in Acc: L lanes, each a
// running sum, then the lanes added pairwise. Every product and sum rounded on its own.
template <typename Acc, int L>
inline double row_sumsq(const float* x, int64_t n) {
  Acc acc[L] = {};
  for (int64_t i = 0; i < n; i += L)
    for (int l = 0; l < L; ++l) { Acc e = Acc(x[i + l]); acc[l] += e * e; }
  for (int w = L / 2; w >= 1; w /= 2)
    for (int l = 0; l < w; ++l) acc[l] += acc[l + w];
  return double(acc[0]);
}

// Elements [i, i + n) of a 1-D FP32, FP16 or BF16 tensor's data as FP32 in buf (k: 0, 1, 2).
inline const float* as_float(const void* data, int k, int64_t i, int64_t n, float* buf) {
  if (k == 0) return static_cast<const float*>(data) + i;
  const uint16_t* h = static_cast<const uint16_t*>(data) + i;
  if (k == 1) half_to_float(h, buf, n);
  else for (int64_t j = 0; j < n; ++j) buf[j] = bits_to_float(uint32_t(h[j]) << 16);
  return buf;
}

}  // namespace

at::Tensor sum_of_squares(std::vector<at::Tensor> pieces, int64_t row, bool wide) {
  TORCH_CHECK(row > 0 && row % 16 == 0 && row <= 4096, "fzero.native: a row of ", row, " elements");
  struct Row { const void* data; int k; int64_t at; };
  std::vector<Row> rows;
  std::vector<float> tails;  // every piece's elements after its last full row, end to end
  for (size_t i = 0; i < pieces.size(); ++i) {
    const auto& t = pieces[i];
    TORCH_CHECK(t.dim() == 1 && t.is_contiguous() && t.device().is_cpu(), "fzero.native: grad piece ", i,
                " must be a contiguous 1-D CPU tensor");
    const int k = t.scalar_type() == at::kFloat ? 0 : kind(t);
    const int64_t n = t.numel(), full = n / row * row;
    for (int64_t a = 0; a < full; a += row) rows.push_back({t.data_ptr(), k, a});
    float buf[4096];
    const float* x = as_float(t.data_ptr(), k, full, n - full, buf);
    tails.insert(tails.end(), x, x + (n - full));
  }
  tails.resize((tails.size() + row - 1) / row * row, 0.0f);  // zero-padded to full rows
  for (size_t a = 0; a < tails.size(); a += row) rows.push_back({tails.data(), 0, int64_t(a)});
  std::vector<double> sums(rows.size());
  at::parallel_for(0, int64_t(rows.size()), 64, [&](int64_t lo, int64_t hi) {
    float buf[4096];
    for (int64_t r = lo; r < hi; ++r) {
      const float* x = as_float(rows[r].data, rows[r].k, rows[r].at, row, buf);
      sums[r] = wide ? row_sumsq<double, 8>(x, row) : row_sumsq<float, 16>(x, row);
    }
  });
  double total = 0.0;  // in the rows' order: the same bits for the same rows, whatever the threads
  for (double x : sums) total += x;
  return at::scalar_tensor(total, at::TensorOptions().dtype(at::kDouble));
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, mod) {
  mod.def("adamw_update", &adamw_update);
  mod.def("sum_of_squares", &sum_of_squares);
}
"""

_FLAGS = ["-O3", "-march=native", "-ffp-contract=off", "-fno-math-errno", "-fopenmp"]


def _cpu_flags() -> str:
    """The CPU's model and instruction-set flags (Linux), else the platform: a build for one
    machine's ``-march=native`` is never loaded on another from a shared cache."""
    try:
        with open("/proc/cpuinfo") as f:
            lines = [line for line in f if line.startswith(("flags", "model name", "Features"))]
        return "".join(sorted(set(lines)))
    except OSError:
        return platform.processor() + platform.machine()


@functools.cache
def _module():
    """The built extension, or ``None`` where it cannot be built (warned once)."""
    if os.environ.get("FZERO_NATIVE", "1") == "0":
        return None
    from torch.utils.cpp_extension import load_inline

    key = hashlib.sha1("\n".join([_SOURCE, " ".join(_FLAGS), torch.__version__, _cpu_flags()]).encode()).hexdigest()
    try:
        return load_inline(f"fzero_native_{key[:16]}", cpp_sources=_SOURCE, extra_cflags=_FLAGS, verbose=False)
    except Exception as e:  # no compiler, or one that rejects the flags
        warnings.warn(f"fzero.native: the CPU AdamW kernel could not be built ({type(e).__name__}: {e}); "
                      "the step runs the compiled update instead", RuntimeWarning, stacklevel=3)
        return None


def available(device: torch.device) -> bool:
    """Whether the kernel runs for state on ``device``: a CPU, the extension built (at the first
    call: some 30 s on a 2-core CPU, once per machine and torch version)."""
    return device.type == "cpu" and _module() is not None


def adamw_update(grads: list[torch.Tensor], starts: list[int], coefficients: torch.Tensor, mean_factor: torch.Tensor,
                 skip: torch.Tensor, master: torch.Tensor, m: torch.Tensor, v: torch.Tensor, params: torch.Tensor, *,
                 cast_on_skip: bool = False) -> None:
    """The update of an ``[S]`` shard in place: ``grads[i]`` (1-D FP16 or BF16, contiguous)
    holds the elements from ``starts[i]`` (pieces in any order, not overlapping; the elements no
    piece holds have zero grads, the padding); ``coefficients`` ``[8]`` FP32 (``COEFFICIENTS``);
    ``master``, ``m``, ``v`` ``[S]`` FP32, written; ``params`` ``[S]`` FP16 or BF16, written
    with the new master's cast. A skipped step writes nothing (the params are the old master's
    cast already), or with ``cast_on_skip`` (new params: the pure step) only the params, the
    master's cast."""
    _module().adamw_update(grads, starts, coefficients, mean_factor, skip, master, m, v, params, cast_on_skip)


@torch.library.custom_op("fzero::adamw_update_", mutates_args=("master", "m", "v", "params"))
def _adamw_update_op(grads: list[torch.Tensor], starts: list[int], coefficients: torch.Tensor,
                     mean_factor: torch.Tensor, skip: torch.Tensor, master: torch.Tensor, m: torch.Tensor,
                     v: torch.Tensor, params: torch.Tensor, cast_on_skip: bool) -> None:
    """``adamw_update`` as an op a traced step keeps whole (``fzero.update.native_update``)."""
    adamw_update(grads, starts, coefficients, mean_factor, skip, master, m, v, params, cast_on_skip=cast_on_skip)


@_adamw_update_op.register_fake
def _(grads, starts, coefficients, mean_factor, skip, master, m, v, params, cast_on_skip):
    return None


def sum_of_squares(pieces: list[torch.Tensor], row: int, *, wide: bool) -> torch.Tensor:
    """``sum(g**2)`` over ``pieces`` (1-D FP16, BF16 or FP32, contiguous) as a 0-d float64, in
    rows of ``row`` elements: each piece's full rows in order, then the elements after them
    (every piece's, end to end) zero-padded to full rows. Each row's sum is taken in float64
    (``wide``) or FP32, in 16 (8) running sums added pairwise, and the rows' sums are added in
    float64 in that order: the same bits for the same pieces. Non-finite iff an element is
    inf or NaN, or (FP32) a row's sum overflows."""
    return torch.ops.fzero.sum_of_squares(pieces, row, wide)


@torch.library.custom_op("fzero::sum_of_squares", mutates_args=())
def _sum_of_squares_op(pieces: list[torch.Tensor], row: int, wide: bool) -> torch.Tensor:
    """``sum_of_squares`` as an op (a ``TorchDispatchMode``, ``benchmarks/traffic.py``, sees the
    pieces it reads)."""
    return _module().sum_of_squares(pieces, row, wide)


@_sum_of_squares_op.register_fake
def _(pieces, row, wide):
    return torch.empty((), dtype=torch.float64, device=pieces[0].device if pieces else "cpu")

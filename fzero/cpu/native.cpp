// fzero's own CPU kernels (fzero/cpu/native.py says what they compute and why; it builds this
// file with torch.utils.cpp_extension at the first use).
// torch/library.h and ATen/core, not torch/extension.h: no pybind11 and not all of torch's C++ API,
// whose headers are most of a build's time.
#include <torch/library.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/scalar_tensor.h>
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

// One block of n <= BLOCK elements, in place. G: the grads, 0 zeros (padding), 1 FP16, 2 BF16,
// 3 FP32; P: the params, 0 none (FP32 params that are the master itself), 1 FP16, 2 BF16, 3 FP32
// (the master's value: a cast to FP32 changes nothing, saturates nothing).
template <int G, int P>
inline void block(const void* g, float* w, float* m, float* v, void* p, int64_t n, const Coef& c) {
  const uint16_t* h = static_cast<const uint16_t*>(g);
  float gf[BLOCK], wf[BLOCK];
  if constexpr (G == 1) half_to_float(h, gf, n);
  for (int64_t i = 0; i < n; ++i) {
    float gi = G == 0 ? 0.0f : G == 1 ? gf[i] : G == 2 ? bits_to_float(uint32_t(h[i]) << 16)
                                                       : static_cast<const float*>(g)[i];
    gi = gi * c.mean;
    float mo = m[i], vo = v[i], wi = w[i];
    float mi = mo + c.w1 * (gi - mo);
    float vi = vo * c.b2 + (c.w2 * gi) * gi;
    float u = (mi * c.step_size) / (std::sqrt(vi) * c.inv_bc2 + c.eps);
    wi = wi + c.neg_lr * (u + c.wd * wi);
    m[i] = mi; v[i] = vi; w[i] = wi;
    if constexpr (P == 1 || P == 2) wf[i] = saturate(wi, c.big);
  }
  // FP32 params copied after the loop, as the others are cast: a store through one more pointer
  // the compiler cannot tell apart from the others kept the loop from its vector form
  if constexpr (P == 1 || P == 2) cast<P>(wf, static_cast<uint16_t*>(p), n);
  if constexpr (P == 3) std::memcpy(p, w, n * sizeof(float));
}

// The params of n <= BLOCK elements from the master as it is (a skipped step into new params).
template <int P>
inline void cast_block(const float* w, void* p, int64_t n, float big) {
  if constexpr (P == 3) {
    std::memcpy(p, w, n * sizeof(float));
  } else {
    float wf[BLOCK];
    for (int64_t i = 0; i < n; ++i) wf[i] = saturate(w[i], big);
    cast<P>(wf, static_cast<uint16_t*>(p), n);
  }
}

// The element size of the grads (G) and params (P) above, in bytes.
constexpr int64_t size_of(int k) { return k == 3 ? 4 : 2; }

template <int G, int P>
void run(const void* g, float* w, float* m, float* v, void* p, int64_t n, const Coef& c) {
  at::parallel_for(0, (n + BLOCK - 1) / BLOCK, 128, [=, &c](int64_t lo, int64_t hi) {
    for (int64_t b = lo; b < hi; ++b) {
      int64_t i = b * BLOCK, k = std::min(BLOCK, n - i);
      block<G, P>(G == 0 ? nullptr : static_cast<const char*>(g) + i * size_of(G), w + i, m + i, v + i,
                  P == 0 ? nullptr : static_cast<char*>(p) + i * size_of(P), k, c);
    }
  });
}

template <int P>
void dispatch_grads(int G, const void* g, float* w, float* m, float* v, void* p, int64_t n, const Coef& c) {
  if (G == 0) run<0, P>(g, w, m, v, p, n, c);
  else if (G == 1) run<1, P>(g, w, m, v, p, n, c);
  else if (G == 2) run<2, P>(g, w, m, v, p, n, c);
  else run<3, P>(g, w, m, v, p, n, c);
}

int kind(const at::Tensor& t) {
  if (t.scalar_type() == at::kHalf) return 1;
  if (t.scalar_type() == at::kFloat) return 3;
  TORCH_CHECK(t.scalar_type() == at::kBFloat16, "fzero.cpu.native: FP16, BF16 or FP32 expected, got ", t.scalar_type());
  return 2;
}

}  // namespace

// params: none where the FP32 params are the master itself (master="params"), written in place.
void adamw_update(std::vector<at::Tensor> grads, std::vector<int64_t> starts, at::Tensor coef, at::Tensor mean_factor,
                  at::Tensor skip, at::Tensor master, at::Tensor m, at::Tensor v, c10::optional<at::Tensor> params,
                  bool cast_on_skip) {
  const int64_t S = master.numel();
  for (const auto& t : {master, m, v})
    TORCH_CHECK(t.scalar_type() == at::kFloat && t.is_contiguous() && t.numel() == S && t.device().is_cpu(),
                "fzero.cpu.native: master and moments must be contiguous FP32 CPU tensors of ", S, " elements");
  int P = 0;
  void* Pp = nullptr;
  if (params.has_value()) {
    TORCH_CHECK(params->is_contiguous() && params->numel() == S && params->device().is_cpu(),
                "fzero.cpu.native: params must be a contiguous CPU tensor of ", S, " elements");
    P = kind(*params);
    Pp = params->data_ptr();
    TORCH_CHECK(!(P == 3 && Pp == master.data_ptr()), "fzero.cpu.native: FP32 params that are the master: pass none");
  }
  auto cf = coef.contiguous().to(at::kFloat);
  const float* k = cf.data_ptr<float>();
  Coef c{k[0], k[1], k[2], k[3], k[4], k[5], k[6], k[7], mean_factor.item<float>(),
         P == 1 ? 65504.0f : bits_to_float(0x7F7F0000u)};
  auto* W = master.data_ptr<float>(); auto* M = m.data_ptr<float>(); auto* V = v.data_ptr<float>();
  auto at_elem = [&](int64_t i) { return P == 0 ? nullptr : static_cast<char*>(Pp) + i * size_of(P); };
  if (skip.item<bool>()) {  // nothing changes; params of their own (cast_on_skip) get the master's cast
    if (cast_on_skip && P != 0)
      at::parallel_for(0, (S + BLOCK - 1) / BLOCK, 128, [&](int64_t lo, int64_t hi) {
        for (int64_t b = lo; b < hi; ++b) {
          int64_t i = b * BLOCK, n = std::min(BLOCK, S - i);
          if (P == 1) cast_block<1>(W + i, at_elem(i), n, c.big);
          else if (P == 2) cast_block<2>(W + i, at_elem(i), n, c.big);
          else cast_block<3>(W + i, at_elem(i), n, c.big);
        }
      });
    return;
  }
  // pieces in memory order, the gaps between them (padding) with zero grads
  std::vector<std::pair<int64_t, int64_t>> order;
  for (size_t i = 0; i < grads.size(); ++i) order.emplace_back(starts[i], int64_t(i));
  std::sort(order.begin(), order.end());
  int64_t pos = 0;
  auto span = [&](int G, const void* g, int64_t lo, int64_t n) {
    if (n <= 0) return;
    if (P == 0) dispatch_grads<0>(G, g, W + lo, M + lo, V + lo, nullptr, n, c);
    else if (P == 1) dispatch_grads<1>(G, g, W + lo, M + lo, V + lo, at_elem(lo), n, c);
    else if (P == 2) dispatch_grads<2>(G, g, W + lo, M + lo, V + lo, at_elem(lo), n, c);
    else dispatch_grads<3>(G, g, W + lo, M + lo, V + lo, at_elem(lo), n, c);
  };
  for (auto [s, i] : order) {
    const auto& g = grads[i];
    TORCH_CHECK(g.is_contiguous() && s >= pos && s + g.numel() <= S, "fzero.cpu.native: grad piece ", i,
                " (", g.numel(), " elements from ", s, ") overlaps another or lies outside the shard of ", S);
    span(0, nullptr, pos, s - pos);
    span(kind(g), g.data_ptr(), s, g.numel());
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
  TORCH_CHECK(row > 0 && row % 16 == 0 && row <= 4096, "fzero.cpu.native: a row of ", row, " elements");
  struct Row { const void* data; int k; int64_t at; };
  std::vector<Row> rows;
  std::vector<float> tails;  // every piece's elements after its last full row, end to end
  for (size_t i = 0; i < pieces.size(); ++i) {
    const auto& t = pieces[i];
    TORCH_CHECK(t.dim() == 1 && t.is_contiguous() && t.device().is_cpu(), "fzero.cpu.native: grad piece ", i,
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

// Called from Python as torch.ops.fzero_native.* (fzero/cpu/native.py wraps them in custom ops with
// their fake tensors and mutations).
TORCH_LIBRARY(fzero_native, m) {
  m.def("adamw_update", &adamw_update);
  m.def("sum_of_squares", &sum_of_squares);
}

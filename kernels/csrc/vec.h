// Helpers shared by the CPU kernels: dot products in AVX2 registers (AVX-512 where built for it)
// and the checks every entry point makes of its tensors.
#pragma once

#include <ATen/core/Tensor.h>

#include <cmath>
#include <cstdint>

#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
#endif

namespace tide {

inline void check_f32(const at::Tensor& t, const char* name) {
  TORCH_CHECK(t.scalar_type() == at::kFloat, name, " must be float32, got ", t.scalar_type());
  TORCH_CHECK(t.is_contiguous(), name, " must be contiguous");
  TORCH_CHECK(t.device().is_cpu(), name, " must be on the CPU");
}

#if defined(__AVX2__) && defined(__FMA__)
inline float hsum(__m256 v) {
  __m128 lo = _mm256_castps256_ps128(v), hi = _mm256_extractf128_ps(v, 1);
  lo = _mm_add_ps(lo, hi);
  lo = _mm_hadd_ps(lo, lo);
  lo = _mm_hadd_ps(lo, lo);
  return _mm_cvtss_f32(lo);
}

// [sum a, sum b, sum c, sum d] of four vectors' lanes.
inline __m128 hsum4(__m256 a, __m256 b, __m256 c, __m256 d) {
  const __m256 abcd = _mm256_hadd_ps(_mm256_hadd_ps(a, b), _mm256_hadd_ps(c, d));
  return _mm_add_ps(_mm256_castps256_ps128(abcd), _mm256_extractf128_ps(abcd, 1));
}

// Asks for the n cache lines at p + 16 * i, i < n (a stretch of the group a kernel dots later).
inline void prefetch_lines(const float* p, int n) {
  for (int i = 0; i < n; ++i) _mm_prefetch(reinterpret_cast<const char*>(p + 16 * i), _MM_HINT_T0);
}

// 1 input row x 4 weight rows, k unrolled twice: 8 independent accumulators, one x load per four
// weight loads. ``ahead`` (or null) is a later group of 4 rows, asked for a slice per step.
// Requires K % 16 == 0.
inline void dot_1x4(const float* x, const float* w, int64_t K, float out[4], const float* ahead) {
  const float *w0 = w, *w1 = w + K, *w2 = w + 2 * K, *w3 = w + 3 * K;
  __m256 a0 = _mm256_setzero_ps(), a1 = _mm256_setzero_ps(), a2 = _mm256_setzero_ps(),
         a3 = _mm256_setzero_ps(), b0 = _mm256_setzero_ps(), b1 = _mm256_setzero_ps(),
         b2 = _mm256_setzero_ps(), b3 = _mm256_setzero_ps();
  for (int64_t k = 0; k < K; k += 16) {
    if (ahead != nullptr) prefetch_lines(ahead + 4 * k, 4);
    const __m256 xa = _mm256_loadu_ps(x + k), xb = _mm256_loadu_ps(x + k + 8);
    a0 = _mm256_fmadd_ps(xa, _mm256_loadu_ps(w0 + k), a0);
    a1 = _mm256_fmadd_ps(xa, _mm256_loadu_ps(w1 + k), a1);
    a2 = _mm256_fmadd_ps(xa, _mm256_loadu_ps(w2 + k), a2);
    a3 = _mm256_fmadd_ps(xa, _mm256_loadu_ps(w3 + k), a3);
    b0 = _mm256_fmadd_ps(xb, _mm256_loadu_ps(w0 + k + 8), b0);
    b1 = _mm256_fmadd_ps(xb, _mm256_loadu_ps(w1 + k + 8), b1);
    b2 = _mm256_fmadd_ps(xb, _mm256_loadu_ps(w2 + k + 8), b2);
    b3 = _mm256_fmadd_ps(xb, _mm256_loadu_ps(w3 + k + 8), b3);
  }
  out[0] = hsum(_mm256_add_ps(a0, b0));
  out[1] = hsum(_mm256_add_ps(a1, b1));
  out[2] = hsum(_mm256_add_ps(a2, b2));
  out[3] = hsum(_mm256_add_ps(a3, b3));
}

// 2 input rows x 4 weight rows: 8 accumulators, 6 loads per 8 FMAs; out[i] holds input row i's
// four dot products; ``ahead`` as in dot_1x4. Requires K % 8 == 0.
inline void dot_2x4(const float* x0, const float* x1, const float* w, int64_t K, __m128 out[2], const float* ahead) {
  const float *w0 = w, *w1 = w + K, *w2 = w + 2 * K, *w3 = w + 3 * K;
  __m256 a0 = _mm256_setzero_ps(), a1 = _mm256_setzero_ps(), a2 = _mm256_setzero_ps(),
         a3 = _mm256_setzero_ps(), c0 = _mm256_setzero_ps(), c1 = _mm256_setzero_ps(),
         c2 = _mm256_setzero_ps(), c3 = _mm256_setzero_ps();
  for (int64_t k = 0; k < K; k += 8) {
    if (ahead != nullptr) prefetch_lines(ahead + 4 * k, 2);
    const __m256 xa = _mm256_loadu_ps(x0 + k), xc = _mm256_loadu_ps(x1 + k);
    const __m256 v0 = _mm256_loadu_ps(w0 + k), v1 = _mm256_loadu_ps(w1 + k);
    const __m256 v2 = _mm256_loadu_ps(w2 + k), v3 = _mm256_loadu_ps(w3 + k);
    a0 = _mm256_fmadd_ps(xa, v0, a0);
    a1 = _mm256_fmadd_ps(xa, v1, a1);
    a2 = _mm256_fmadd_ps(xa, v2, a2);
    a3 = _mm256_fmadd_ps(xa, v3, a3);
    c0 = _mm256_fmadd_ps(xc, v0, c0);
    c1 = _mm256_fmadd_ps(xc, v1, c1);
    c2 = _mm256_fmadd_ps(xc, v2, c2);
    c3 = _mm256_fmadd_ps(xc, v3, c3);
  }
  out[0] = hsum4(a0, a1, a2, a3);
  out[1] = hsum4(c0, c1, c2, c3);
}

#if defined(__AVX512F__)
// 4 input rows x 4 weight rows in 512-bit registers: 16 accumulators, 8 loads per 16 FMAs (the
// 2x4 block needs 6 per 8), which keeps a decode batch of 8-16 rows from being compute-bound;
// ``ahead`` as in dot_1x4. Requires K % 16 == 0.
inline void dot_4x4(const float* x, const float* w, int64_t K, float out[4][4], const float* ahead) {
  __m512 acc[4][4];
  for (int r = 0; r < 4; ++r)
    for (int j = 0; j < 4; ++j) acc[r][j] = _mm512_setzero_ps();
  for (int64_t k = 0; k < K; k += 16) {
    __m512 wv[4];
    if (ahead != nullptr) prefetch_lines(ahead + 4 * k, 4);
    for (int j = 0; j < 4; ++j) wv[j] = _mm512_loadu_ps(w + j * K + k);
    for (int r = 0; r < 4; ++r) {
      const __m512 xv = _mm512_loadu_ps(x + r * K + k);
      for (int j = 0; j < 4; ++j) acc[r][j] = _mm512_fmadd_ps(xv, wv[j], acc[r][j]);
    }
  }
  for (int r = 0; r < 4; ++r)
    for (int j = 0; j < 4; ++j) out[r][j] = _mm512_reduce_add_ps(acc[r][j]);
}
#endif

#endif  // __AVX2__

// a . b over n floats.
inline float dot(const float* a, const float* b, int64_t n) {
  int64_t i = 0;
  float acc = 0.0f;
#if defined(__AVX2__) && defined(__FMA__)
  __m256 v0 = _mm256_setzero_ps(), v1 = _mm256_setzero_ps();
  for (; i + 16 <= n; i += 16) {
    v0 = _mm256_fmadd_ps(_mm256_loadu_ps(a + i), _mm256_loadu_ps(b + i), v0);
    v1 = _mm256_fmadd_ps(_mm256_loadu_ps(a + i + 8), _mm256_loadu_ps(b + i + 8), v1);
  }
  acc = hsum(_mm256_add_ps(v0, v1));
#endif
  for (; i < n; ++i) acc += a[i] * b[i];
  return acc;
}

// out = x * rsqrt(mean(x^2) + eps) * w over n values (RMSNorm of one row).
inline void rms_norm_row(const float* x, const float* w, int64_t n, float eps, float* out) {
  const float inv = 1.0f / std::sqrt(dot(x, x, n) / static_cast<float>(n) + eps);
  for (int64_t i = 0; i < n; ++i) out[i] = x[i] * inv * w[i];
}

#if defined(__AVX512F__)
// e^x for x <= 0 (scores less their maximum), to float precision: x = k ln2 + g with |g| <= ln2/2
// (ln2 in two parts), e^g by its Taylor series to g^7, times 2^k; 0 below -87 (-inf included:
// a masked logit's probability is exactly 0).
inline __m512 exp512(__m512 x) {
  const __mmask16 live = _mm512_cmp_ps_mask(x, _mm512_set1_ps(-87.0f), _CMP_GE_OQ);
  x = _mm512_max_ps(x, _mm512_set1_ps(-87.0f));
  const __m512 k = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504f)),
                                        _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m512 g = _mm512_fnmadd_ps(k, _mm512_set1_ps(0.693359375f), x);
  g = _mm512_fnmadd_ps(k, _mm512_set1_ps(-2.12194440e-4f), g);
  __m512 y = _mm512_set1_ps(1.0f / 5040);
  for (const float c : {1.0f / 720, 1.0f / 120, 1.0f / 24, 1.0f / 6, 0.5f, 1.0f, 1.0f})
    y = _mm512_fmadd_ps(y, g, _mm512_set1_ps(c));
  return _mm512_maskz_mov_ps(live, _mm512_scalef_ps(y, k));
}
#endif

#if defined(__AVX2__) && defined(__FMA__)
// exp512 in 256-bit registers; 2^k is built in the exponent bits (k >= -126 after the clamp).
inline __m256 exp256(__m256 x) {
  const __m256 live = _mm256_cmp_ps(x, _mm256_set1_ps(-87.0f), _CMP_GE_OQ);
  x = _mm256_max_ps(x, _mm256_set1_ps(-87.0f));
  const __m256 k = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(1.44269504f)),
                                   _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m256 g = _mm256_fnmadd_ps(k, _mm256_set1_ps(0.693359375f), x);
  g = _mm256_fnmadd_ps(k, _mm256_set1_ps(-2.12194440e-4f), g);
  __m256 y = _mm256_set1_ps(1.0f / 5040);
  for (const float c : {1.0f / 720, 1.0f / 120, 1.0f / 24, 1.0f / 6, 0.5f, 1.0f, 1.0f})
    y = _mm256_fmadd_ps(y, g, _mm256_set1_ps(c));
  const __m256i two_k = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(k), _mm256_set1_epi32(127)), 23);
  return _mm256_and_ps(live, _mm256_mul_ps(y, _mm256_castsi256_ps(two_k)));
}
#endif

// p[i] = e^(p[i] - m) for i < n; returns their sum.
inline float exp_shifted(float* p, int64_t n, float m) {
  int64_t i = 0;
  float total = 0.0f;
#if defined(__AVX512F__)
  const __m512 vm = _mm512_set1_ps(m);
  __m512 acc = _mm512_setzero_ps();
  for (; i + 16 <= n; i += 16) {
    const __m512 e = exp512(_mm512_sub_ps(_mm512_loadu_ps(p + i), vm));
    _mm512_storeu_ps(p + i, e);
    acc = _mm512_add_ps(acc, e);
  }
  total = _mm512_reduce_add_ps(acc);
#elif defined(__AVX2__) && defined(__FMA__)
  const __m256 vm = _mm256_set1_ps(m);
  __m256 acc = _mm256_setzero_ps();
  for (; i + 8 <= n; i += 8) {
    const __m256 e = exp256(_mm256_sub_ps(_mm256_loadu_ps(p + i), vm));
    _mm256_storeu_ps(p + i, e);
    acc = _mm256_add_ps(acc, e);
  }
  total = hsum(acc);
#endif
  for (; i < n; ++i) total += (p[i] = std::exp(p[i] - m));
  return total;
}

}  // namespace tide

// Small-batch matrix kernels for CPU decode (fp32).
//
// At decode a linear layer sees a handful of rows (M <= 16) while its weight is megabytes; BLAS
// sgemm is tuned for large M and reaches a fraction of memory bandwidth there. These kernels
// stream each weight row once, dot it with every input row held in cache, and split the output
// columns over threads. Layouts follow Hugging Face: a weight is [N, K], y = x @ w^T.
#include <torch/extension.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <cmath>
#include <vector>

namespace {

constexpr int64_t kRowBlock = 4;

#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>

inline float hsum(__m256 v) {
  __m128 lo = _mm256_castps256_ps128(v), hi = _mm256_extractf128_ps(v, 1);
  lo = _mm_add_ps(lo, hi);
  lo = _mm_hadd_ps(lo, lo);
  lo = _mm_hadd_ps(lo, lo);
  return _mm_cvtss_f32(lo);
}

// Register block: 4 input rows x 2 weight rows -> 8 accumulators, each weight vector feeding 4 FMAs.
// Requires K % 8 == 0 (checked by the caller).
inline void dot_block_avx2(const float* const xr[4], const float* w0, const float* w1, int64_t K,
                           float out[4][2]) {
  __m256 a00 = _mm256_setzero_ps(), a01 = _mm256_setzero_ps(), a10 = _mm256_setzero_ps(),
         a11 = _mm256_setzero_ps(), a20 = _mm256_setzero_ps(), a21 = _mm256_setzero_ps(),
         a30 = _mm256_setzero_ps(), a31 = _mm256_setzero_ps();
  for (int64_t k = 0; k < K; k += 8) {
    const __m256 v0 = _mm256_loadu_ps(w0 + k), v1 = _mm256_loadu_ps(w1 + k);
    __m256 x = _mm256_loadu_ps(xr[0] + k);
    a00 = _mm256_fmadd_ps(x, v0, a00);
    a01 = _mm256_fmadd_ps(x, v1, a01);
    x = _mm256_loadu_ps(xr[1] + k);
    a10 = _mm256_fmadd_ps(x, v0, a10);
    a11 = _mm256_fmadd_ps(x, v1, a11);
    x = _mm256_loadu_ps(xr[2] + k);
    a20 = _mm256_fmadd_ps(x, v0, a20);
    a21 = _mm256_fmadd_ps(x, v1, a21);
    x = _mm256_loadu_ps(xr[3] + k);
    a30 = _mm256_fmadd_ps(x, v0, a30);
    a31 = _mm256_fmadd_ps(x, v1, a31);
  }
  out[0][0] = hsum(a00); out[0][1] = hsum(a01);
  out[1][0] = hsum(a10); out[1][1] = hsum(a11);
  out[2][0] = hsum(a20); out[2][1] = hsum(a21);
  out[3][0] = hsum(a30); out[3][1] = hsum(a31);
}
#endif

// y[r, n] = sum_k x[r, k] * w[n, k] for r < m, n in [n0, n1); y has leading dimension ldy.
// Weight rows are the outer loop so each is read from memory once, whatever m is.
void dot_rows(const float* x, int64_t m, int64_t K, const float* w, int64_t n0, int64_t n1,
              float* y, int64_t ldy) {
  int64_t n = n0;
#if defined(__AVX2__) && defined(__FMA__)
  if (K % 8 == 0) {
    float out[4][2];
    for (; n + 1 < n1; n += 2) {
      for (int64_t r0 = 0; r0 < m; r0 += kRowBlock) {
        const int64_t rm = std::min(kRowBlock, m - r0);
        const float* x0 = x + r0 * K;
        const float* xr[4] = {x0, rm > 1 ? x0 + K : x0, rm > 2 ? x0 + 2 * K : x0,
                              rm > 3 ? x0 + 3 * K : x0};
        dot_block_avx2(xr, w + n * K, w + (n + 1) * K, K, out);
        for (int64_t r = 0; r < rm; ++r) {
          y[(r0 + r) * ldy + n] = out[r][0];
          y[(r0 + r) * ldy + n + 1] = out[r][1];
        }
      }
    }
  }
#endif
  for (; n < n1; ++n) {
    const float* wn = w + n * K;
    for (int64_t r = 0; r < m; ++r) {
      const float* xr = x + r * K;
      float acc = 0.f;
#pragma omp simd reduction(+ : acc)
      for (int64_t k = 0; k < K; ++k) acc += wn[k] * xr[k];
      y[r * ldy + n] = acc;
    }
  }
}

void check_f32(const torch::Tensor& t, const char* name) {
  TORCH_CHECK(t.scalar_type() == torch::kFloat32, name, " must be float32, got ", t.scalar_type());
  TORCH_CHECK(t.is_contiguous(), name, " must be contiguous");
  TORCH_CHECK(t.device().is_cpu(), name, " must be on the CPU");
}

}  // namespace

// x [M, K], w [N, K] -> [M, N]
torch::Tensor small_linear(torch::Tensor x, torch::Tensor w) {
  check_f32(x, "x");
  check_f32(w, "w");
  TORCH_CHECK(x.dim() == 2 && w.dim() == 2 && x.size(1) == w.size(1),
              "shape mismatch: x ", x.sizes(), " w ", w.sizes());
  const int64_t M = x.size(0), K = x.size(1), N = w.size(0);
  auto y = torch::empty({M, N}, x.options());
  const float* xp = x.data_ptr<float>();
  const float* wp = w.data_ptr<float>();
  float* yp = y.data_ptr<float>();
  at::parallel_for(0, N, 32, [&](int64_t n0, int64_t n1) { dot_rows(xp, M, K, wp, n0, n1, yp, N); });
  return y;
}

// Routed experts for rows already sorted by expert.
// xs [R, H]; spans [A, 3] int64 rows (expert, lo, hi); gate_up [E, 2I, H]; down [E, H, I]
// -> ys [R, H] with ys[lo:hi] = down_e(silu(gate_e(xs)) * up_e(xs)).
torch::Tensor moe_experts(torch::Tensor xs, torch::Tensor spans, torch::Tensor gate_up,
                          torch::Tensor down) {
  check_f32(xs, "xs");
  check_f32(gate_up, "gate_up");
  check_f32(down, "down");
  TORCH_CHECK(spans.scalar_type() == torch::kInt64 && spans.dim() == 2 && spans.size(1) == 3,
              "spans must be int64 [A, 3]");
  const int64_t R = xs.size(0), H = xs.size(1), E = gate_up.size(0), I2 = gate_up.size(1);
  const int64_t I = I2 / 2;
  TORCH_CHECK(gate_up.size(2) == H && down.size(0) == E && down.size(1) == H && down.size(2) == I,
              "expert weight shapes gate_up ", gate_up.sizes(), " down ", down.sizes(),
              " do not fit hidden size ", H);
  auto sp = spans.contiguous();
  const int64_t A = sp.size(0);
  const int64_t* s = sp.data_ptr<int64_t>();
  for (int64_t a = 0; a < A; ++a) {
    TORCH_CHECK(s[3 * a] >= 0 && s[3 * a] < E, "expert id ", s[3 * a], " outside [0, ", E, ")");
    TORCH_CHECK(0 <= s[3 * a + 1] && s[3 * a + 1] <= s[3 * a + 2] && s[3 * a + 2] <= R, "bad span");
  }
  auto h = torch::empty({R, I2}, xs.options());
  auto act = torch::empty({R, I}, xs.options());
  auto ys = torch::empty({R, H}, xs.options());
  const float* xp = xs.data_ptr<float>();
  const float* gp = gate_up.data_ptr<float>();
  const float* dp = down.data_ptr<float>();
  float* hp = h.data_ptr<float>();
  float* ap = act.data_ptr<float>();
  float* yp = ys.data_ptr<float>();

  // Work items: (span, column chunk); every weight byte is read by exactly one item.
  constexpr int64_t kChunk = 64;
  const int64_t up_chunks = (I2 + kChunk - 1) / kChunk;
  at::parallel_for(0, A * up_chunks, 1, [&](int64_t b, int64_t e) {
    for (int64_t it = b; it < e; ++it) {
      const int64_t a = it / up_chunks, c = it % up_chunks;
      const int64_t ex = s[3 * a], lo = s[3 * a + 1], hi = s[3 * a + 2];
      const int64_t n0 = c * kChunk, n1 = std::min(I2, n0 + kChunk);
      dot_rows(xp + lo * H, hi - lo, H, gp + ex * I2 * H, n0, n1, hp + lo * I2, I2);
    }
  });
  for (int64_t r = 0; r < R; ++r) {
    const float* g = hp + r * I2;
    const float* u = g + I;
    float* o = ap + r * I;
    for (int64_t i = 0; i < I; ++i) o[i] = g[i] / (1.f + std::exp(-g[i])) * u[i];
  }
  const int64_t down_chunks = (H + kChunk - 1) / kChunk;
  at::parallel_for(0, A * down_chunks, 1, [&](int64_t b, int64_t e) {
    for (int64_t it = b; it < e; ++it) {
      const int64_t a = it / down_chunks, c = it % down_chunks;
      const int64_t ex = s[3 * a], lo = s[3 * a + 1], hi = s[3 * a + 2];
      const int64_t n0 = c * kChunk, n1 = std::min(H, n0 + kChunk);
      dot_rows(ap + lo * I, hi - lo, I, dp + ex * H * I, n0, n1, yp + lo * H, H);
    }
  });
  return ys;
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("small_linear", &small_linear, "x [M,K] @ w[N,K]^T for small M (fp32)");
  m.def("moe_experts", &moe_experts, "routed experts over expert-sorted rows (fp32)");
}

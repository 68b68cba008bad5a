// Small-batch matrix kernels for CPU decode (fp32 activations; fp32 or int8 weights).
//
// At decode a linear layer sees a handful of rows (M <= 16) while its weight is megabytes; BLAS
// sgemm is tuned for large M and reaches a fraction of memory bandwidth there. These kernels
// stream each weight row once, dot it with every input row held in cache, and split the output
// columns over threads. Layouts follow Hugging Face: a weight is [N, K], y = x @ w^T.
//
// Int8 weights (the "q8" kernels) carry a float32 scale per row and group of G consecutive
// columns (w[n, k] = q[n, k] * scale[n, k / G]): a quarter of the bytes per step, which is what
// bounds decode here. Each group's dot product is summed in float32 and scaled once.
#include <torch/extension.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <cmath>
#include <vector>

namespace {


#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>

inline float hsum(__m256 v) {
  __m128 lo = _mm256_castps256_ps128(v), hi = _mm256_extractf128_ps(v, 1);
  lo = _mm_add_ps(lo, hi);
  lo = _mm_hadd_ps(lo, lo);
  lo = _mm_hadd_ps(lo, lo);
  return _mm_cvtss_f32(lo);
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

// 2 input rows x 4 weight rows: 8 accumulators, 6 loads per 8 FMAs; ``ahead`` as in dot_1x4.
// Requires K % 16 == 0.
inline void dot_2x4(const float* x0, const float* x1, const float* w, int64_t K, float out[2][4],
                    const float* ahead) {
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
  out[0][0] = hsum(a0); out[0][1] = hsum(a1); out[0][2] = hsum(a2); out[0][3] = hsum(a3);
  out[1][0] = hsum(c0); out[1][1] = hsum(c1); out[1][2] = hsum(c2); out[1][3] = hsum(c3);
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

// 8 int8 weights -> 8 floats.
inline __m256 load_q8(const int8_t* p) {
  return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p))));
}

// 1 input row x 4 int8 weight rows, straight from the int8 bytes: each group of G columns
// (G % 8 == 0) is summed in float32, then scaled (scale rows [4, groups]) into out.
inline void dot_q8_1x4(const float* x, const int8_t* w, const float* scale, int64_t K, int64_t G, float out[4]) {
  const int8_t *w0 = w, *w1 = w + K, *w2 = w + 2 * K, *w3 = w + 3 * K;
  const int64_t groups = K / G;
  __m256 t0 = _mm256_setzero_ps(), t1 = _mm256_setzero_ps(), t2 = _mm256_setzero_ps(), t3 = _mm256_setzero_ps();
  for (int64_t g = 0; g < groups; ++g) {
    __m256 a0 = _mm256_setzero_ps(), a1 = _mm256_setzero_ps(), a2 = _mm256_setzero_ps(), a3 = _mm256_setzero_ps();
    for (int64_t k = g * G; k < (g + 1) * G; k += 8) {
      const __m256 xa = _mm256_loadu_ps(x + k);
      a0 = _mm256_fmadd_ps(xa, load_q8(w0 + k), a0);
      a1 = _mm256_fmadd_ps(xa, load_q8(w1 + k), a1);
      a2 = _mm256_fmadd_ps(xa, load_q8(w2 + k), a2);
      a3 = _mm256_fmadd_ps(xa, load_q8(w3 + k), a3);
    }
    t0 = _mm256_fmadd_ps(a0, _mm256_set1_ps(scale[g]), t0);
    t1 = _mm256_fmadd_ps(a1, _mm256_set1_ps(scale[groups + g]), t1);
    t2 = _mm256_fmadd_ps(a2, _mm256_set1_ps(scale[2 * groups + g]), t2);
    t3 = _mm256_fmadd_ps(a3, _mm256_set1_ps(scale[3 * groups + g]), t3);
  }
  out[0] = hsum(t0); out[1] = hsum(t1); out[2] = hsum(t2); out[3] = hsum(t3);
}

#endif

// How far ahead of the group of 4 weight rows it dots a kernel asks for the next ones: about
// 8 KB, and at least one group. Rows of 1-2 KB (an expert's 256- or 512-wide rows) are streams too
// short for the hardware prefetcher to follow; asked for ahead, a batch of 1-2 rows per expert
// streams them near memory bandwidth. Much further ahead, the lines leave L1 before their turn.
constexpr int64_t kAheadBytes = 8192;

// y[r, n] = sum_k x[r, k] * w[n, k] for r < m, n in [n0, n1); y has leading dimension ldy.
// Groups of 4 weight rows are the outer loop: each is read from memory once (a later one asked
// for meanwhile, up to row pf_end) and stays in L1 while every input row (four, two or one at a
// time) is dotted with it.
void dot_rows(const float* x, int64_t m, int64_t K, const float* w, int64_t n0, int64_t n1,
              float* y, int64_t ldy, int64_t pf_end = -1) {
  int64_t n = n0;
  if (pf_end < 0) pf_end = n1;
#if defined(__AVX2__) && defined(__FMA__)
  if (K % 16 == 0) {
    float o1[4], o2[2][4];
    const int64_t ahead_rows = 4 * std::max<int64_t>(1, kAheadBytes / (16 * K));
    for (; n + 3 < n1; n += 4) {
      const float* wn = w + n * K;
      const float* ahead = n + ahead_rows + 3 < pf_end ? wn + ahead_rows * K : nullptr;
      int64_t r = 0;
#if defined(__AVX512F__)
      float o4[4][4];
      for (; r + 3 < m; r += 4, ahead = nullptr) {
        dot_4x4(x + r * K, wn, K, o4, ahead);
        for (int i = 0; i < 4; ++i)
          for (int j = 0; j < 4; ++j) y[(r + i) * ldy + n + j] = o4[i][j];
      }
#endif
      for (; r + 1 < m; r += 2, ahead = nullptr) {
        dot_2x4(x + r * K, x + (r + 1) * K, wn, K, o2, ahead);
        for (int j = 0; j < 4; ++j) {
          y[r * ldy + n + j] = o2[0][j];
          y[(r + 1) * ldy + n + j] = o2[1][j];
        }
      }
      if (r < m) {
        dot_1x4(x + r * K, wn, K, o1, ahead);
        for (int j = 0; j < 4; ++j) y[r * ldy + n + j] = o1[j];
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

// One int8 weight row [K] with its scales [K / G] -> float32 [K].
void dequant_row(const int8_t* q, const float* scale, int64_t K, int64_t G, float* out) {
  for (int64_t g = 0, k = 0; k < K; ++g) {
    const float sc = scale[g];
    int64_t end = k + G;
#if defined(__AVX2__) && defined(__FMA__)
    const __m256 vs = _mm256_set1_ps(sc);
    for (; k + 7 < end; k += 8) _mm256_storeu_ps(out + k, _mm256_mul_ps(load_q8(q + k), vs));
#endif
    for (; k < end; ++k) out[k] = static_cast<float>(q[k]) * sc;
  }
}

// ``dot_rows`` with int8 weight rows q [N, K] and their scales [N, K / G]: each group of 4 rows
// is widened to float32 once (16 bytes of it per weight byte read, kept in cache) and every
// input row is dotted with it there, so memory carries a quarter of the bytes of fp32 weights.
void dot_rows_q8(const float* x, int64_t m, int64_t K, const int8_t* q, const float* scale, int64_t G,
                 int64_t n0, int64_t n1, float* y, int64_t ldy) {
  const int64_t groups = K / G;
  int64_t n = n0;
#if defined(__AVX2__) && defined(__FMA__)
  if (m == 1 && G % 8 == 0) {  // one row: dot the int8 bytes directly (widening them once is the work)
    float o[4];
    for (; n + 3 < n1; n += 4) {
      dot_q8_1x4(x, q + n * K, scale + n * groups, K, G, o);
      for (int j = 0; j < 4; ++j) y[n + j] = o[j];
    }
  }
#endif
  std::vector<float> rows(4 * K);
  for (; n < n1; n += 4) {
    const int64_t count = std::min<int64_t>(4, n1 - n);
    for (int64_t j = 0; j < count; ++j) dequant_row(q + (n + j) * K, scale + (n + j) * groups, K, G, rows.data() + j * K);
    dot_rows(x, m, K, rows.data(), 0, count, y + n, ldy);
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

namespace {

void check_q8(const torch::Tensor& q, const torch::Tensor& scale, const char* name) {
  TORCH_CHECK(q.scalar_type() == torch::kInt8 && q.is_contiguous() && q.device().is_cpu(), name,
              " must be contiguous int8 on the CPU, got ", q.scalar_type());
  check_f32(scale, "scale");
  TORCH_CHECK(scale.dim() == q.dim() && scale.sizes().slice(0, q.dim() - 1) == q.sizes().slice(0, q.dim() - 1),
              name, " scales ", scale.sizes(), " do not fit its weights ", q.sizes());
  const int64_t K = q.size(-1), groups = scale.size(-1);
  TORCH_CHECK(groups > 0 && K % groups == 0, name, ": ", groups, " scale groups do not divide ", K, " columns");
}

}  // namespace

// x [M, K] float32, q [N, K] int8, scale [N, K / G] float32 -> [M, N] = x @ (q * scale)^T
torch::Tensor small_linear_q8(torch::Tensor x, torch::Tensor q, torch::Tensor scale) {
  check_f32(x, "x");
  check_q8(q, scale, "q");
  TORCH_CHECK(x.dim() == 2 && q.dim() == 2 && x.size(1) == q.size(1),
              "shape mismatch: x ", x.sizes(), " q ", q.sizes());
  const int64_t M = x.size(0), K = x.size(1), N = q.size(0), G = K / scale.size(1);
  auto y = torch::empty({M, N}, x.options());
  const float* xp = x.data_ptr<float>();
  const int8_t* qp = q.data_ptr<int8_t>();
  const float* sp = scale.data_ptr<float>();
  float* yp = y.data_ptr<float>();
  at::parallel_for(0, N, 32, [&](int64_t n0, int64_t n1) { dot_rows_q8(xp, M, K, qp, sp, G, n0, n1, yp, N); });
  return y;
}

namespace {

// Expert weights [E, N, K]: float32, or int8 with float32 scales [E, N, K / G].
struct ExpertMats {
  const float* f32 = nullptr;
  const int8_t* q8 = nullptr;
  const float* scale = nullptr;
  int64_t G = 0;

  // out[:, n0:n1] (leading dimension ldy) = in [m, K] @ (expert e's rows n0..n1)^T
  void rows(const float* in, int64_t m, int64_t K, int64_t N, int64_t e, int64_t n0, int64_t n1, float* out,
            int64_t ldy) const {
    if (q8 != nullptr)
      dot_rows_q8(in, m, K, q8 + e * N * K, scale + e * N * (K / G), G, n0, n1, out, ldy);
    else
      dot_rows(in, m, K, f32 + e * N * K, n0, n1, out, ldy, N);
  }
};

// For every span (e, lo, hi): out[lo:hi] = in[lo:hi] @ w_e^T, w_e of shape [N, K]. Work items
// are (span, chunk of output columns), so every weight byte is read by exactly one item and the
// threads split the experts' weights between them.
void per_expert_linear(const float* in, const int64_t* s, int64_t A, int64_t K, const ExpertMats& w,
                       int64_t N, float* out) {
  constexpr int64_t kChunk = 64;
  const int64_t chunks = (N + kChunk - 1) / kChunk;
  at::parallel_for(0, A * chunks, 1, [&](int64_t b, int64_t e) {
    for (int64_t it = b; it < e; ++it) {
      const int64_t a = it / chunks, c = it % chunks;
      const int64_t ex = s[3 * a], lo = s[3 * a + 1], hi = s[3 * a + 2];
      const int64_t n0 = c * kChunk, n1 = std::min(N, n0 + kChunk);
      w.rows(in + lo * K, hi - lo, K, N, ex, n0, n1, out + lo * N, N);
    }
  });
}

// ys[lo:hi] = down_e(silu(gate_e(xs[lo:hi])) * up_e(xs[lo:hi])) for every span (e, lo, hi).
void run_experts(const float* xp, const int64_t* s, int64_t A, int64_t R, int64_t H, int64_t I,
                 const ExpertMats& gate_up, const ExpertMats& down, float* yp) {
  const int64_t I2 = 2 * I;
  std::vector<float> h(R * I2), act(R * I);
  per_expert_linear(xp, s, A, H, gate_up, I2, h.data());
  for (int64_t r = 0; r < R; ++r) {
    const float* g = h.data() + r * I2;
    const float* u = g + I;
    float* o = act.data() + r * I;
    for (int64_t i = 0; i < I; ++i) o[i] = g[i] / (1.f + std::exp(-g[i])) * u[i];
  }
  per_expert_linear(act.data(), s, A, I, down, H, yp);
}

void check_expert_shapes(const torch::Tensor& gate_up, const torch::Tensor& down, int64_t H) {
  const int64_t E = gate_up.size(0), I = gate_up.size(1) / 2;
  TORCH_CHECK(gate_up.dim() == 3 && down.dim() == 3 && gate_up.size(2) == H && down.size(0) == E &&
                  down.size(1) == H && down.size(2) == I,
              "expert weight shapes gate_up ", gate_up.sizes(), " down ", down.sizes(),
              " do not fit hidden size ", H);
}

void check_experts(const torch::Tensor& gate_up, const torch::Tensor& down, int64_t H) {
  check_f32(gate_up, "gate_up");
  check_f32(down, "down");
  check_expert_shapes(gate_up, down, H);
}

// The whole routed-expert step for a few tokens: group (token, k) pairs by expert (counting
// sort), run each active expert once, and sum the weighted outputs per token.
torch::Tensor routed(const torch::Tensor& x, const torch::Tensor& ids, const torch::Tensor& weights, int64_t E,
                     int64_t I, const ExpertMats& gate_up, const ExpertMats& down) {
  check_f32(x, "x");
  check_f32(weights, "weights");
  TORCH_CHECK(ids.scalar_type() == torch::kInt64 && ids.is_contiguous(), "ids must be contiguous int64");
  TORCH_CHECK(ids.dim() == 2 && ids.sizes() == weights.sizes() && ids.size(0) == x.size(0),
              "ids ", ids.sizes(), " and weights ", weights.sizes(), " must be [T, K] for x ", x.sizes());
  const int64_t T = x.size(0), H = x.size(1), K = ids.size(1), R = T * K;
  const int64_t* id = ids.data_ptr<int64_t>();
  std::vector<int64_t> count(E + 1, 0);
  for (int64_t j = 0; j < R; ++j) {
    TORCH_CHECK(id[j] >= 0 && id[j] < E, "expert id ", id[j], " outside [0, ", E, ")");
    ++count[id[j] + 1];
  }
  for (int64_t e = 0; e < E; ++e) count[e + 1] += count[e];  // start row of each expert
  std::vector<int64_t> spans, row_of(R);
  for (int64_t e = 0; e < E; ++e)
    if (count[e + 1] > count[e]) spans.insert(spans.end(), {e, count[e], count[e + 1]});
  std::vector<int64_t> next(count.begin(), count.end() - 1);
  for (int64_t j = 0; j < R; ++j) row_of[j] = next[id[j]]++;  // stable: token order per expert
  std::vector<float> xs(R * H), ys(R * H);
  const float* xp = x.data_ptr<float>();
  for (int64_t j = 0; j < R; ++j) std::copy_n(xp + (j / K) * H, H, xs.data() + row_of[j] * H);
  run_experts(xs.data(), spans.data(), static_cast<int64_t>(spans.size() / 3), R, H, I, gate_up, down, ys.data());
  auto out = torch::zeros({T, H}, x.options());
  float* op = out.data_ptr<float>();
  const float* wp = weights.data_ptr<float>();
  for (int64_t j = 0; j < R; ++j) {
    const float wj = wp[j];
    const float* yr = ys.data() + row_of[j] * H;
    float* o = op + (j / K) * H;
    for (int64_t c = 0; c < H; ++c) o[c] += wj * yr[c];
  }
  return out;
}

ExpertMats f32_mats(const torch::Tensor& w) {
  ExpertMats m;
  m.f32 = w.data_ptr<float>();
  return m;
}

ExpertMats q8_mats(const torch::Tensor& q, const torch::Tensor& scale) {
  ExpertMats m;
  m.q8 = q.data_ptr<int8_t>();
  m.scale = scale.data_ptr<float>();
  m.G = q.size(2) / scale.size(2);
  return m;
}

}  // namespace

// Routed experts for rows already sorted by expert.
// xs [R, H]; spans [A, 3] int64 rows (expert, lo, hi); gate_up [E, 2I, H]; down [E, H, I]
// -> ys [R, H] with ys[lo:hi] = down_e(silu(gate_e(xs)) * up_e(xs)).
torch::Tensor moe_experts(torch::Tensor xs, torch::Tensor spans, torch::Tensor gate_up,
                          torch::Tensor down) {
  check_f32(xs, "xs");
  TORCH_CHECK(spans.scalar_type() == torch::kInt64 && spans.dim() == 2 && spans.size(1) == 3,
              "spans must be int64 [A, 3]");
  const int64_t R = xs.size(0), H = xs.size(1), E = gate_up.size(0);
  check_experts(gate_up, down, H);
  auto sp = spans.contiguous();
  const int64_t A = sp.size(0);
  const int64_t* s = sp.data_ptr<int64_t>();
  for (int64_t a = 0; a < A; ++a) {
    TORCH_CHECK(s[3 * a] >= 0 && s[3 * a] < E, "expert id ", s[3 * a], " outside [0, ", E, ")");
    TORCH_CHECK(0 <= s[3 * a + 1] && s[3 * a + 1] <= s[3 * a + 2] && s[3 * a + 2] <= R, "bad span");
  }
  auto ys = torch::empty({R, H}, xs.options());
  run_experts(xs.data_ptr<float>(), s, A, R, H, gate_up.size(1) / 2, f32_mats(gate_up), f32_mats(down),
              ys.data_ptr<float>());
  return ys;
}

// x [T, H]; ids [T, K] int64; weights [T, K] float32; gate_up [E, 2I, H]; down [E, H, I] -> [T, H].
torch::Tensor moe_routed(torch::Tensor x, torch::Tensor ids, torch::Tensor weights,
                         torch::Tensor gate_up, torch::Tensor down) {
  check_experts(gate_up, down, x.size(1));
  return routed(x, ids, weights, gate_up.size(0), gate_up.size(1) / 2, f32_mats(gate_up), f32_mats(down));
}

// The same with int8 experts: gate_up_q [E, 2I, H] with scales [E, 2I, H / G1], down_q [E, H, I]
// with scales [E, H, I / G2].
torch::Tensor moe_routed_q8(torch::Tensor x, torch::Tensor ids, torch::Tensor weights, torch::Tensor gate_up_q,
                            torch::Tensor gate_up_scale, torch::Tensor down_q, torch::Tensor down_scale) {
  check_q8(gate_up_q, gate_up_scale, "gate_up");
  check_q8(down_q, down_scale, "down");
  check_expert_shapes(gate_up_q, down_q, x.size(1));
  return routed(x, ids, weights, gate_up_q.size(0), gate_up_q.size(1) / 2, q8_mats(gate_up_q, gate_up_scale),
                q8_mats(down_q, down_scale));
}

namespace {

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

// Heads attended together by one task: they share every latent row read.
constexpr int64_t kHeadBlock = 16;


#if defined(__AVX512F__)
// e^x for x <= 0 (scores less their maximum), to float precision: x = k ln2 + g with |g| <= ln2/2
// (ln2 in two parts), e^g by its Taylor series to g^7, times 2^k.
inline __m512 exp512(__m512 x) {
  x = _mm512_max_ps(x, _mm512_set1_ps(-87.0f));
  const __m512 k = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504f)),
                                        _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m512 g = _mm512_fnmadd_ps(k, _mm512_set1_ps(0.693359375f), x);
  g = _mm512_fnmadd_ps(k, _mm512_set1_ps(-2.12194440e-4f), g);
  __m512 y = _mm512_set1_ps(1.0f / 5040);
  for (const float c : {1.0f / 720, 1.0f / 120, 1.0f / 24, 1.0f / 6, 0.5f, 1.0f, 1.0f})
    y = _mm512_fmadd_ps(y, g, _mm512_set1_ps(c));
  return _mm512_scalef_ps(y, k);
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
#endif
  for (; i < n; ++i) total += (p[i] = std::exp(p[i] - m));
  return total;
}

#if defined(__AVX512F__)
// o[j] += sum_s w[j * n + s] * row(s)[r0, r0 + 64) for NH heads j: 4 x NH accumulators held over
// a tile of rows, each row slice read once for all NH heads.
template <int NH>
inline void add_weighted_tile(const float* w, int64_t n, const float* const* rows, int64_t s0, int64_t s1,
                              int64_t r0, int64_t R, float* o) {
  __m512 acc[NH][4];
  for (int j = 0; j < NH; ++j)
    for (int c = 0; c < 4; ++c) acc[j][c] = _mm512_loadu_ps(o + j * R + r0 + 16 * c);
  for (int64_t s = s0; s < s1; ++s) {
    const float* row = rows[s - s0] + r0;
    const __m512 v0 = _mm512_loadu_ps(row), v1 = _mm512_loadu_ps(row + 16), v2 = _mm512_loadu_ps(row + 32),
                 v3 = _mm512_loadu_ps(row + 48);
    for (int j = 0; j < NH; ++j) {
      const __m512 x = _mm512_set1_ps(w[j * n + s]);
      acc[j][0] = _mm512_fmadd_ps(x, v0, acc[j][0]);
      acc[j][1] = _mm512_fmadd_ps(x, v1, acc[j][1]);
      acc[j][2] = _mm512_fmadd_ps(x, v2, acc[j][2]);
      acc[j][3] = _mm512_fmadd_ps(x, v3, acc[j][3]);
    }
  }
  for (int j = 0; j < NH; ++j)
    for (int c = 0; c < 4; ++c) _mm512_storeu_ps(o + j * R + r0 + 16 * c, acc[j][c]);
}
#endif

// o[h * R + r] += sum_s w[h * n + s] * row(s)[r] for heads h < nh, rows s < n (row(s): the first
// R floats of latent s). Vectorized in tiles of rows that stay in L1 while every head reads them.
template <typename RowOf>
inline void add_weighted_rows(const float* w, int64_t n, int64_t nh, RowOf row_of, int64_t R, float* o) {
#if defined(__AVX512F__)
  if (R % 64 == 0) {
    constexpr int64_t kTile = 64;
    const float* rows[kTile];
    for (int64_t s0 = 0; s0 < n; s0 += kTile) {
      const int64_t s1 = std::min(n, s0 + kTile);
      for (int64_t s = s0; s < s1; ++s) rows[s - s0] = row_of(s);
      for (int64_t r0 = 0; r0 < R; r0 += 64) {
        int64_t h = 0;
        for (; h + 4 <= nh; h += 4) add_weighted_tile<4>(w + h * n, n, rows, s0, s1, r0, R, o + h * R);
        for (; h < nh; ++h) add_weighted_tile<1>(w + h * n, n, rows, s0, s1, r0, R, o + h * R);
      }
    }
    return;
  }
#endif
  for (int64_t s = 0; s < n; ++s) {
    const float* row = row_of(s);
    for (int64_t h = 0; h < nh; ++h) {
      const float x = w[h * n + s];
      for (int64_t r = 0; r < R; ++r) o[h * R + r] += x * row[r];
    }
  }
}

}  // namespace

// Absorbed MLA decode over one layer of the paged latent pool, the contract of
// kernels.mla_decode.mla_decode (fp32): q_lat [B, H, R], q_rope [B, H, P], kv [slots, R + P],
// block_table [B, X] int64, seq_lens [B] int64 (each in 1..X*Z) -> out [B, H, R] =
// softmax_s((q_lat . c_s + q_rope . k_s) * scale) @ c. Token s of row b is in slot
// block_table[b, s / Z] * Z + s % Z; only s < seq_lens[b] is read. A task takes one row and a
// block of heads: each latent is read once for the block's scores and once for its output.
torch::Tensor mla_decode_paged(torch::Tensor q_lat, torch::Tensor q_rope, torch::Tensor kv,
                               torch::Tensor block_table, torch::Tensor seq_lens, double scale,
                               int64_t page_size) {
  check_f32(q_lat, "q_lat");
  check_f32(q_rope, "q_rope");
  check_f32(kv, "kv");
  TORCH_CHECK(q_lat.dim() == 3 && q_rope.dim() == 3 && kv.dim() == 2, "q_lat, q_rope must be 3-D, kv 2-D");
  const int64_t B = q_lat.size(0), H = q_lat.size(1), R = q_lat.size(2), P = q_rope.size(2);
  TORCH_CHECK(q_rope.size(0) == B && q_rope.size(1) == H, "q_rope must be [B, H, P] like q_lat");
  TORCH_CHECK(kv.size(1) == R + P, "kv rows hold ", kv.size(1), " values, need R + P = ", R + P);
  TORCH_CHECK(page_size >= 1 && kv.size(0) % page_size == 0, "kv slots must be whole pages");
  TORCH_CHECK(block_table.scalar_type() == torch::kInt64 && block_table.dim() == 2 && block_table.size(0) == B,
              "block_table must be int64 [B, X]");
  TORCH_CHECK(seq_lens.scalar_type() == torch::kInt64 && seq_lens.numel() == B, "seq_lens must be int64 [B]");
  auto bt = block_table.contiguous();
  auto lens = seq_lens.contiguous();
  const int64_t X = bt.size(1), Z = page_size, pages = kv.size(0) / Z, D = R + P;
  const int64_t* tab = bt.data_ptr<int64_t>();
  const int64_t* len = lens.data_ptr<int64_t>();
  int64_t longest = 0;
  for (int64_t b = 0; b < B; ++b) {
    TORCH_CHECK(len[b] >= 1 && len[b] <= X * Z, "seq_lens[", b, "] = ", len[b], " outside [1, ", X * Z, "]");
    for (int64_t x = 0; x < (len[b] + Z - 1) / Z; ++x)
      TORCH_CHECK(tab[b * X + x] >= 0 && tab[b * X + x] < pages, "block_table[", b, ", ", x, "] = ",
                  tab[b * X + x], " outside the pool's ", pages, " pages");
    longest = std::max(longest, len[b]);
  }
  auto out = torch::empty({B, H, R}, q_lat.options());
  const float *ql = q_lat.data_ptr<float>(), *qr = q_rope.data_ptr<float>(), *cache = kv.data_ptr<float>();
  float* op = out.data_ptr<float>();
  const int64_t blocks = (H + kHeadBlock - 1) / kHeadBlock;
  const float sc = static_cast<float>(scale);
  at::parallel_for(0, B * blocks, 1, [&](int64_t lo, int64_t hi) {
    std::vector<float> p(kHeadBlock * longest), qf(kHeadBlock * D);
    for (int64_t task = lo; task < hi; ++task) {
      const int64_t b = task / blocks, h0 = (task % blocks) * kHeadBlock, nh = std::min(kHeadBlock, H - h0);
      const int64_t n = len[b];
      float mx[kHeadBlock], sum[kHeadBlock];
      std::fill(mx, mx + nh, -INFINITY);
      // each head's query as one [R + P] row, the layout of a latent: a score is one dot product
      for (int64_t h = 0; h < nh; ++h) {
        const int64_t q = b * H + h0 + h;
        std::copy(ql + q * R, ql + (q + 1) * R, qf.data() + h * D);
        std::copy(qr + q * P, qr + (q + 1) * P, qf.data() + h * D + R);
      }
      for (int64_t s = 0; s < n; ++s) {
        const float* row = cache + (tab[b * X + s / Z] * Z + s % Z) * D;
        int64_t h = 0;
#if defined(__AVX2__) && defined(__FMA__)
        for (; D % 16 == 0 && h + 4 <= nh; h += 4) {  // four heads per read of the row
          float four[4];
          dot_1x4(row, qf.data() + h * D, D, four, nullptr);
          for (int64_t j = 0; j < 4; ++j) p[(h + j) * n + s] = four[j] * sc;
        }
#endif
        for (; h < nh; ++h) p[h * n + s] = dot(qf.data() + h * D, row, D) * sc;
        for (int64_t j = 0; j < nh; ++j) mx[j] = std::max(mx[j], p[j * n + s]);
      }
      float* o = op + (b * H + h0) * R;  // the block's nh heads' outputs, R each
      for (int64_t h = 0; h < nh; ++h) sum[h] = exp_shifted(p.data() + h * n, n, mx[h]);
      std::fill(o, o + nh * R, 0.0f);
      add_weighted_rows(p.data(), n, nh, [&](int64_t s) { return cache + (tab[b * X + s / Z] * Z + s % Z) * D; },
                        R, o);
      for (int64_t h = 0; h < nh; ++h) {
        const float inv = 1.0f / sum[h];
        for (int64_t r = 0; r < R; ++r) o[h * R + r] *= inv;
      }
    }
  });
  return out;
}

// RMSNorm of each row of x [M, H] (fp32): y = x * rsqrt(mean(x^2) + eps) * w, w [H]. One
// call in place of the half-dozen ops (and their dispatch) a decode-sized norm costs in torch.
torch::Tensor rms_norm(torch::Tensor x, torch::Tensor w, double eps) {
  check_f32(x, "x");
  check_f32(w, "w");
  TORCH_CHECK(x.dim() == 2 && w.dim() == 1 && w.size(0) == x.size(1), "shape mismatch: x ", x.sizes(), " w ",
              w.sizes());
  const int64_t M = x.size(0), H = x.size(1);
  auto y = torch::empty_like(x);
  const float *xp = x.data_ptr<float>(), *wp = w.data_ptr<float>();
  float* yp = y.data_ptr<float>();
  at::parallel_for(0, M, 64, [&](int64_t m0, int64_t m1) {
    for (int64_t m = m0; m < m1; ++m) {
      const float* row = xp + m * H;
      const float inv = 1.0f / std::sqrt(dot(row, row, H) / static_cast<float>(H) + static_cast<float>(eps));
      float* out = yp + m * H;
      for (int64_t h = 0; h < H; ++h) out[h] = row[h] * inv * wp[h];
    }
  });
  return y;
}

namespace {

// The k largest of values[0..n) (ties: the lower index first), best first, into out.
void top_k(const float* values, int64_t n, int64_t k, int64_t* out, std::vector<int64_t>& idx) {
  idx.resize(n);
  for (int64_t i = 0; i < n; ++i) idx[i] = i;
  std::partial_sort(idx.begin(), idx.begin() + k, idx.end(), [&](int64_t a, int64_t b) {
    return values[a] > values[b] || (values[a] == values[b] && a < b);
  });
  std::copy(idx.begin(), idx.begin() + k, out);
}

}  // namespace

// DeepSeek top-K routing from the gate's logits [T, E] (fp32), the contract of model.moe.route:
// scores = softmax or sigmoid(logits); ``method`` 0 greedy, 1 group_limited_greedy (groups
// ranked by their best score, the others' scores taken as 0), 2 noaux_tc (choice = scores +
// bias, groups ranked by the sum of their best two, the others excluded); the K best choices,
// weighted by their unbiased scores (normalised to sum 1 when ``norm`` and K > 1) times
// ``scaling``. Returns (ids [T, K] int64, best first; weights [T, K] fp32).
std::tuple<torch::Tensor, torch::Tensor> moe_route(torch::Tensor logits, c10::optional<torch::Tensor> bias,
                                                   int64_t K, int64_t G, int64_t KG, int64_t method,
                                                   bool softmax, bool norm, double scaling) {
  check_f32(logits, "logits");
  TORCH_CHECK(logits.dim() == 2, "logits must be [T, E]");
  const int64_t T = logits.size(0), E = logits.size(1);
  TORCH_CHECK(method >= 0 && method <= 2, "method must be 0, 1 or 2, got ", method);
  TORCH_CHECK(K >= 1 && K <= E, "K = ", K, " outside [1, ", E, "]");
  const bool grouped = method > 0 && G > 1;
  TORCH_CHECK(!grouped || (E % G == 0 && KG >= 1 && KG <= G && K <= KG * (E / G)),
              "groups: E = ", E, ", G = ", G, ", KG = ", KG, ", K = ", K);
  const float* bp = nullptr;
  if (bias.has_value() && method == 2) {
    check_f32(*bias, "bias");
    TORCH_CHECK(bias->numel() == E, "bias must have E = ", E, " values");
    bp = bias->data_ptr<float>();
  }
  auto ids = torch::empty({T, K}, logits.options().dtype(torch::kInt64));
  auto weights = torch::empty({T, K}, logits.options());
  const float* lp = logits.data_ptr<float>();
  int64_t* ip = ids.data_ptr<int64_t>();
  float* wp = weights.data_ptr<float>();
  const int64_t F = grouped ? E / G : E;
  std::vector<float> scores(E), choice(E), group_score(grouped ? G : 0);
  std::vector<int64_t> idx, kept(grouped ? KG : 0);
  for (int64_t t = 0; t < T; ++t) {
    const float* l = lp + t * E;
    if (softmax) {
      const float mx = *std::max_element(l, l + E);
      float total = 0.0f;
      for (int64_t e = 0; e < E; ++e) total += (scores[e] = std::exp(l[e] - mx));
      for (int64_t e = 0; e < E; ++e) scores[e] /= total;
    } else {
      for (int64_t e = 0; e < E; ++e) scores[e] = 1.0f / (1.0f + std::exp(-l[e]));
    }
    for (int64_t e = 0; e < E; ++e) choice[e] = bp != nullptr ? scores[e] + bp[e] : scores[e];
    if (grouped) {
      for (int64_t g = 0; g < G; ++g) {
        const float* c = choice.data() + g * F;
        if (method == 2 && F >= 2) {
          int64_t best2[2];
          top_k(c, F, 2, best2, idx);
          group_score[g] = c[best2[0]] + c[best2[1]];
        } else {
          group_score[g] = *std::max_element(c, c + F);
        }
      }
      top_k(group_score.data(), G, KG, kept.data(), idx);
      const float fill = method == 2 ? -INFINITY : 0.0f;
      for (int64_t g = 0; g < G; ++g)
        if (std::find(kept.begin(), kept.end(), g) == kept.end()) std::fill_n(choice.data() + g * F, F, fill);
    }
    int64_t* out = ip + t * K;
    top_k(choice.data(), E, K, out, idx);
    float total = 0.0f;
    for (int64_t j = 0; j < K; ++j) total += (wp[t * K + j] = scores[out[j]]);
    const float d = norm && K > 1 ? total + 1e-20f : 1.0f;
    for (int64_t j = 0; j < K; ++j) wp[t * K + j] = wp[t * K + j] / d * static_cast<float>(scaling);
  }
  return {ids, weights};
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("small_linear", &small_linear, "x [M,K] @ w[N,K]^T for small M (fp32)");
  m.def("moe_experts", &moe_experts, "routed experts over expert-sorted rows (fp32)");
  m.def("moe_routed", &moe_routed, "group by expert, run, and combine weighted outputs (fp32)");
  m.def("small_linear_q8", &small_linear_q8, "x [M,K] @ (q[N,K] * scale)^T for small M (int8 weights)");
  m.def("moe_routed_q8", &moe_routed_q8, "moe_routed with int8 expert weights and group scales");
  m.def("mla_decode_paged", &mla_decode_paged, "absorbed MLA decode over a paged latent pool (fp32)");
  m.def("rms_norm", &rms_norm, "RMSNorm of each row (fp32)");
  m.def("moe_route", &moe_route, "DeepSeek top-K routing from gate logits (fp32)");
}

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
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/empty_like.h>
#include <ATen/ops/zeros.h>

#include <algorithm>
#include <cmath>
#include <vector>

#include "cpu_gemv.h"
#include "cpu_mla.h"
#include "vec.h"

using namespace tide;

namespace {


#if defined(__AVX2__) && defined(__FMA__)
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
    float o1[4];
    __m128 o2[2];
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
        _mm_storeu_ps(y + r * ldy + n, o2[0]);
        _mm_storeu_ps(y + (r + 1) * ldy + n, o2[1]);
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


}  // namespace

// x [M, K], w [N, K] -> [M, N]
at::Tensor small_linear(at::Tensor x, at::Tensor w) {
  check_f32(x, "x");
  check_f32(w, "w");
  TORCH_CHECK(x.dim() == 2 && w.dim() == 2 && x.size(1) == w.size(1),
              "shape mismatch: x ", x.sizes(), " w ", w.sizes());
  const int64_t M = x.size(0), K = x.size(1), N = w.size(0);
  auto y = at::empty({M, N}, x.options());
  const float* xp = x.data_ptr<float>();
  const float* wp = w.data_ptr<float>();
  float* yp = y.data_ptr<float>();
  at::parallel_for(0, N, 32, [&](int64_t n0, int64_t n1) { dot_rows(xp, M, K, wp, n0, n1, yp, N); });
  return y;
}

namespace {

void check_q8(const at::Tensor& q, const at::Tensor& scale, const char* name) {
  TORCH_CHECK(q.scalar_type() == at::kChar && q.is_contiguous() && q.device().is_cpu(), name,
              " must be contiguous int8 on the CPU, got ", q.scalar_type());
  check_f32(scale, "scale");
  TORCH_CHECK(scale.dim() == q.dim() && scale.sizes().slice(0, q.dim() - 1) == q.sizes().slice(0, q.dim() - 1),
              name, " scales ", scale.sizes(), " do not fit its weights ", q.sizes());
  const int64_t K = q.size(-1), groups = scale.size(-1);
  TORCH_CHECK(groups > 0 && K % groups == 0, name, ": ", groups, " scale groups do not divide ", K, " columns");
}

}  // namespace

// x [M, K] float32, q [N, K] int8, scale [N, K / G] float32 -> [M, N] = x @ (q * scale)^T
at::Tensor small_linear_q8(at::Tensor x, at::Tensor q, at::Tensor scale) {
  check_f32(x, "x");
  check_q8(q, scale, "q");
  TORCH_CHECK(x.dim() == 2 && q.dim() == 2 && x.size(1) == q.size(1),
              "shape mismatch: x ", x.sizes(), " q ", q.sizes());
  const int64_t M = x.size(0), K = x.size(1), N = q.size(0), G = K / scale.size(1);
  auto y = at::empty({M, N}, x.options());
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

// ys[lo:hi] = down_e(silu(gate_e(xs[lo:hi])) * up_e(xs[lo:hi])) for every span (e, lo, hi); with a
// finite ``limit`` (DeepSeek-V4) the gate is clipped above at it and the up to [-limit, limit] first.
void run_experts(const float* xp, const int64_t* s, int64_t A, int64_t R, int64_t H, int64_t I,
                 const ExpertMats& gate_up, const ExpertMats& down, float* yp, float limit = INFINITY) {
  const int64_t I2 = 2 * I;
  std::vector<float> h(R * I2), act(R * I);
  per_expert_linear(xp, s, A, H, gate_up, I2, h.data());
  const bool clip = std::isfinite(limit);
  for (int64_t r = 0; r < R; ++r) {
    const float* g = h.data() + r * I2;
    const float* u = g + I;
    float* o = act.data() + r * I;
    if (clip) {
      for (int64_t i = 0; i < I; ++i) {
        const float gi = std::min(g[i], limit), ui = std::min(std::max(u[i], -limit), limit);
        o[i] = gi / (1.f + std::exp(-gi)) * ui;
      }
    } else {
      for (int64_t i = 0; i < I; ++i) o[i] = g[i] / (1.f + std::exp(-g[i])) * u[i];
    }
  }
  per_expert_linear(act.data(), s, A, I, down, H, yp);
}

void check_expert_shapes(const at::Tensor& gate_up, const at::Tensor& down, int64_t H) {
  const int64_t E = gate_up.size(0), I = gate_up.size(1) / 2;
  TORCH_CHECK(gate_up.dim() == 3 && down.dim() == 3 && gate_up.size(2) == H && down.size(0) == E &&
                  down.size(1) == H && down.size(2) == I,
              "expert weight shapes gate_up ", gate_up.sizes(), " down ", down.sizes(),
              " do not fit hidden size ", H);
}

void check_experts(const at::Tensor& gate_up, const at::Tensor& down, int64_t H) {
  check_f32(gate_up, "gate_up");
  check_f32(down, "down");
  check_expert_shapes(gate_up, down, H);
}

// The whole routed-expert step for a few tokens: group (token, k) pairs by expert (counting
// sort), run each active expert once, and sum the weighted outputs per token.
at::Tensor routed(const at::Tensor& x, const at::Tensor& ids, const at::Tensor& weights, int64_t E,
                     int64_t I, const ExpertMats& gate_up, const ExpertMats& down, float limit = INFINITY) {
  check_f32(x, "x");
  check_f32(weights, "weights");
  TORCH_CHECK(ids.scalar_type() == at::kLong && ids.is_contiguous(), "ids must be contiguous int64");
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
  run_experts(xs.data(), spans.data(), static_cast<int64_t>(spans.size() / 3), R, H, I, gate_up, down, ys.data(),
              limit);
  auto out = at::zeros({T, H}, x.options());
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

ExpertMats f32_mats(const at::Tensor& w) {
  ExpertMats m;
  m.f32 = w.data_ptr<float>();
  return m;
}

ExpertMats q8_mats(const at::Tensor& q, const at::Tensor& scale) {
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
at::Tensor moe_experts(at::Tensor xs, at::Tensor spans, at::Tensor gate_up,
                          at::Tensor down) {
  check_f32(xs, "xs");
  TORCH_CHECK(spans.scalar_type() == at::kLong && spans.dim() == 2 && spans.size(1) == 3,
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
  auto ys = at::empty({R, H}, xs.options());
  run_experts(xs.data_ptr<float>(), s, A, R, H, gate_up.size(1) / 2, f32_mats(gate_up), f32_mats(down),
              ys.data_ptr<float>());
  return ys;
}

// x [T, H]; ids [T, K] int64; weights [T, K] float32; gate_up [E, 2I, H]; down [E, H, I] -> [T, H].
at::Tensor moe_routed(at::Tensor x, at::Tensor ids, at::Tensor weights,
                         at::Tensor gate_up, at::Tensor down) {
  check_experts(gate_up, down, x.size(1));
  return routed(x, ids, weights, gate_up.size(0), gate_up.size(1) / 2, f32_mats(gate_up), f32_mats(down));
}

// moe_routed with the SwiGLU clipped at ``limit`` (DeepSeek-V4's experts).
at::Tensor moe_routed_clipped(at::Tensor x, at::Tensor ids, at::Tensor weights, at::Tensor gate_up,
                                 at::Tensor down, double limit) {
  check_experts(gate_up, down, x.size(1));
  TORCH_CHECK(limit > 0, "limit must be > 0, got ", limit);
  return routed(x, ids, weights, gate_up.size(0), gate_up.size(1) / 2, f32_mats(gate_up), f32_mats(down),
                static_cast<float>(limit));
}

// The same with int8 experts: gate_up_q [E, 2I, H] with scales [E, 2I, H / G1], down_q [E, H, I]
// with scales [E, H, I / G2].
at::Tensor moe_routed_q8(at::Tensor x, at::Tensor ids, at::Tensor weights, at::Tensor gate_up_q,
                            at::Tensor gate_up_scale, at::Tensor down_q, at::Tensor down_scale) {
  check_q8(gate_up_q, gate_up_scale, "gate_up");
  check_q8(down_q, down_scale, "down");
  check_expert_shapes(gate_up_q, down_q, x.size(1));
  return routed(x, ids, weights, gate_up_q.size(0), gate_up_q.size(1) / 2, q8_mats(gate_up_q, gate_up_scale),
                q8_mats(down_q, down_scale));
}

namespace {

// The index of the first largest of x[0..n), a NaN counting as the largest (torch.argmax's rule):
// one pass, each lane keeping its first largest and where it stands.
int64_t argmax_row(const float* x, int64_t n) {
  int64_t i = 0, best = 0;
  float top = -INFINITY;
#if defined(__AVX2__) && defined(__FMA__)
  if (n >= 8) {
    __m256 vtop = _mm256_set1_ps(-INFINITY), nan = _mm256_setzero_ps();
    __m256i vidx = _mm256_setzero_si256(), cur = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
    const __m256i eight = _mm256_set1_epi32(8);
    for (; i + 8 <= n; i += 8, cur = _mm256_add_epi32(cur, eight)) {
      const __m256 v = _mm256_loadu_ps(x + i);
      nan = _mm256_or_ps(nan, _mm256_cmp_ps(v, v, _CMP_UNORD_Q));
      const __m256 gt = _mm256_cmp_ps(v, vtop, _CMP_GT_OQ);
      vtop = _mm256_blendv_ps(vtop, v, gt);
      vidx = _mm256_blendv_epi8(vidx, cur, _mm256_castps_si256(gt));
    }
    if (_mm256_movemask_ps(nan) != 0) {
      for (int64_t j = 0;; ++j)
        if (std::isnan(x[j])) return j;
    }
    alignas(32) float lanes[8];
    alignas(32) int32_t where[8];
    _mm256_store_ps(lanes, vtop);
    _mm256_store_si256(reinterpret_cast<__m256i*>(where), vidx);
    top = lanes[0], best = where[0];
    for (int c = 1; c < 8; ++c)
      if (lanes[c] > top || (lanes[c] == top && where[c] < best)) top = lanes[c], best = where[c];
  }
#endif
  for (; i < n; ++i) {
    if (std::isnan(x[i])) return i;
    if (x[i] > top) top = x[i], best = i;
  }
  return best;
}

}  // namespace

// The index of the largest value of each row of x [M, V] (fp32) -> [M] int64, the first of equal
// ones and a NaN counting as the largest, as torch.argmax: vectorized, which torch's CPU
// reduction is not (a greedy decode step's argmax over a 129K vocabulary is milliseconds there).
at::Tensor argmax_rows(at::Tensor x) {
  check_f32(x, "x");
  TORCH_CHECK(x.dim() == 2 && x.size(1) >= 1, "x must be [M, V] with V >= 1, got ", x.sizes());
  const int64_t M = x.size(0), V = x.size(1);
  auto out = at::empty({M}, x.options().dtype(at::kLong));
  const float* xp = x.data_ptr<float>();
  int64_t* op = out.data_ptr<int64_t>();
  at::parallel_for(0, M, std::max<int64_t>(1, 65536 / V), [&](int64_t m0, int64_t m1) {
    for (int64_t m = m0; m < m1; ++m) op[m] = argmax_row(xp + m * V, V);
  });
  return out;
}

// RMSNorm of each row of x [M, H] (fp32): y = x * rsqrt(mean(x^2) + eps) * w, w [H]. One
// call in place of the half-dozen ops (and their dispatch) a decode-sized norm costs in torch.
at::Tensor rms_norm(at::Tensor x, at::Tensor w, double eps) {
  check_f32(x, "x");
  check_f32(w, "w");
  TORCH_CHECK(x.dim() == 2 && w.dim() == 1 && w.size(0) == x.size(1), "shape mismatch: x ", x.sizes(), " w ",
              w.sizes());
  const int64_t M = x.size(0), H = x.size(1);
  auto y = at::empty_like(x);
  const float *xp = x.data_ptr<float>(), *wp = w.data_ptr<float>();
  float* yp = y.data_ptr<float>();
  at::parallel_for(0, M, 64, [&](int64_t m0, int64_t m1) {
    for (int64_t m = m0; m < m1; ++m) rms_norm_row(xp + m * H, wp, H, static_cast<float>(eps), yp + m * H);
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
std::tuple<at::Tensor, at::Tensor> moe_route(at::Tensor logits, c10::optional<at::Tensor> bias,
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
  auto ids = at::empty({T, K}, logits.options().dtype(at::kLong));
  auto weights = at::empty({T, K}, logits.options());
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

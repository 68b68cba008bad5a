// Sampling a step's rows from float32 CPU logits: temperature, top-k, top-p, one draw per row.
//
// model.sampling's contract, in a few vectorized passes over each row instead of a dozen batched
// torch ops (each a pass over [R, V], with a sort or a top-k of the whole vocabulary for the
// truncated rows): the softmax of logits / temperature; a top-k row's k most likely tokens (one
// pass with a heap); a top-p row's smallest prefix of its most likely tokens whose mass reaches
// top_p (among the kCandidates most likely when they hold it, else among the tokens above a
// probability found by bisection); then the token where the row's uniform u in (0, 1] falls in
// the cumulative sum of the kept probabilities (in double, by blocks of kBlock tokens, so that
// 129k float terms do not bias the rare tokens).
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>

#include <algorithm>
#include <cmath>
#include <numeric>
#include <vector>

#include "cpu_gemv.h"
#include "vec.h"

using namespace tide;

namespace {

constexpr int64_t kCandidates = 1024;  // model.sampling.NUCLEUS_CANDIDATES
constexpr int64_t kBlock = 1024;       // model.sampling.DRAW_BLOCK

// p[i] = l[i] / temperature for i < n; returns their maximum.
float scaled(const float* l, int64_t n, float temperature, float* p) {
  int64_t i = 0;
  float top = -INFINITY;
#if defined(__AVX2__) && defined(__FMA__)
  const __m256 t = _mm256_set1_ps(temperature);
  __m256 vtop = _mm256_set1_ps(-INFINITY);
  for (; i + 8 <= n; i += 8) {
    const __m256 v = _mm256_div_ps(_mm256_loadu_ps(l + i), t);
    _mm256_storeu_ps(p + i, v);
    vtop = _mm256_max_ps(vtop, v);
  }
  alignas(32) float lanes[8];
  _mm256_store_ps(lanes, vtop);
  for (const float x : lanes) top = std::max(top, x);
#endif
  for (; i < n; ++i) top = std::max(top, p[i] = l[i] / temperature);
  return top;
}

// The sum of p[lo..hi) in float (8 lanes): a block's mass.
float block_sum(const float* p, int64_t lo, int64_t hi) {
  int64_t i = lo;
  float total = 0.0f;
#if defined(__AVX2__) && defined(__FMA__)
  __m256 acc = _mm256_setzero_ps();
  for (; i + 8 <= hi; i += 8) acc = _mm256_add_ps(acc, _mm256_loadu_ps(p + i));
  total = hsum(acc);
#endif
  for (; i < hi; ++i) total += p[i];
  return total;
}

// The first index where the running sum of p[0..n) reaches target, given the masses of its
// blocks of kBlock tokens: the block first (cumulated in double), then the token in it; the last
// token with any mass when rounding leaves the sum short; never a token of mass 0.
int64_t invert(const float* p, int64_t n, const std::vector<float>& blocks, double target) {
  double before = 0.0;
  for (size_t b = 0; b < blocks.size(); ++b) {
    if (before + blocks[b] >= target && blocks[b] > 0.0f) {
      const int64_t lo = static_cast<int64_t>(b) * kBlock, hi = std::min(n, lo + kBlock);
      const double left = std::min(target - before, static_cast<double>(blocks[b]));
      double run = 0.0;
      int64_t last = -1;
      for (int64_t i = lo; i < hi; ++i) {
        if (p[i] <= 0.0f) continue;
        run += p[i];
        last = i;
        if (run >= left) return i;
      }
      return last;
    }
    before += blocks[b];
  }
  for (int64_t i = n - 1; i > 0; --i)
    if (p[i] > 0.0f) return i;
  return 0;
}

int64_t invert(const float* p, int64_t n, double target) {
  std::vector<float> blocks;
  for (int64_t lo = 0; lo < n; lo += kBlock) blocks.push_back(block_sum(p, lo, std::min(n, lo + kBlock)));
  return invert(p, n, blocks, target);
}

// Whether token a (mass pa) ranks before token b: more likely, or as likely with a lower id.
inline bool ranks_before(float pa, int32_t a, float pb, int32_t b) { return pa > pb || (pa == pb && a < b); }

// The n most likely tokens of p[0..V), most likely first, into order[0..n): one pass keeping the
// best n in a heap, skipping eight tokens at a time that are none of them above its worst.
void most_likely(const float* p, int64_t V, int64_t n, std::vector<int32_t>& order) {
  // ordered by ranks_before, a heap's front is its least likely token
  const auto before = [&](int32_t a, int32_t b) { return ranks_before(p[a], a, p[b], b); };
  std::vector<int32_t> heap;
  heap.reserve(n);
  int64_t i = 0;
  for (; i < V && static_cast<int64_t>(heap.size()) < n; ++i) {
    heap.push_back(static_cast<int32_t>(i));
    std::push_heap(heap.begin(), heap.end(), before);
  }
  const auto consider = [&](int64_t j) {  // j comes after every id in the heap: as likely is not enough
    if (p[j] > p[heap.front()]) {
      std::pop_heap(heap.begin(), heap.end(), before);
      heap.back() = static_cast<int32_t>(j);
      std::push_heap(heap.begin(), heap.end(), before);
    }
  };
#if defined(__AVX2__) && defined(__FMA__)
  for (; i + 8 <= V; i += 8) {
    if (_mm256_movemask_ps(_mm256_cmp_ps(_mm256_loadu_ps(p + i), _mm256_set1_ps(p[heap.front()]), _CMP_GT_OQ)) == 0)
      continue;
    for (int64_t j = i; j < i + 8; ++j) consider(j);
  }
#endif
  for (; i < V; ++i) consider(i);
  std::sort_heap(heap.begin(), heap.end(), before);
  std::copy(heap.begin(), heap.end(), order.begin());
}

// The mass of the tokens of p[0..n) with p >= t (float, 8 lanes).
float mass_above(const float* p, int64_t n, float t) {
  int64_t i = 0;
  float total = 0.0f;
#if defined(__AVX2__) && defined(__FMA__)
  const __m256 vt = _mm256_set1_ps(t);
  __m256 acc = _mm256_setzero_ps();
  for (; i + 8 <= n; i += 8) {
    const __m256 v = _mm256_loadu_ps(p + i);
    acc = _mm256_add_ps(acc, _mm256_and_ps(_mm256_cmp_ps(v, vt, _CMP_GE_OQ), v));
  }
  total = hsum(acc);
#endif
  for (; i < n; ++i) total += p[i] >= t ? p[i] : 0.0f;
  return total;
}

// The tokens that hold a nucleus of mass ``need`` (p's numerators are at most 1, their largest
// exactly 1): those with p >= e^x for about the largest x whose tokens' mass reaches need (x by
// bisection on the log scale, a vectorized pass a step), most likely first, into order; returns
// how many. A flat row's nucleus without a sort of the whole vocabulary.
int64_t nucleus(const float* p, int64_t V, double need, std::vector<int32_t>& order) {
  float lo = -88.0f, hi = 0.0f;  // e^-88 is below every float the exp gives but 0
  for (int it = 0; it < 40 && hi - lo > 1e-6f; ++it) {
    const float mid = 0.5f * (lo + hi);
    (mass_above(p, V, std::exp(mid)) >= need ? lo : hi) = mid;
  }
  const float t = std::exp(lo);
  int64_t n = 0;
  for (int64_t i = 0; i < V; ++i)
    if (p[i] >= t) order[n++] = static_cast<int32_t>(i);
  std::sort(order.begin(), order.begin() + n, [&](int32_t a, int32_t b) { return ranks_before(p[a], a, p[b], b); });
  return n;
}

// One row: logits l [V] -> a token. p and order are the row's scratch, [V] each.
int64_t sample_row(const float* l, int64_t V, float temperature, int64_t top_k, float top_p, double u,
                   std::vector<float>& p, std::vector<int32_t>& order) {
  const float top = scaled(l, V, temperature, p.data());
  if (top == -INFINITY) return 0;  // every token masked: nothing to draw from (callers never ask)
  exp_shifted(p.data(), V, top);   // p: the softmax's numerators (0 for a masked token)
  std::vector<float> blocks;
  double total = 0.0;
  for (int64_t lo = 0; lo < V; lo += kBlock) total += blocks.emplace_back(block_sum(p.data(), lo, std::min(V, lo + kBlock)));
  const bool by_k = top_k > 0 && top_k < V;
  if (!by_k && top_p >= 1.0f) return invert(p.data(), V, blocks, u * total);
  // the row's candidates, most likely first
  int64_t n = by_k ? top_k : std::min(V, kCandidates);
  most_likely(p.data(), V, n, order);
  double held = 0.0;
  for (int64_t j = 0; j < n; ++j) held += p[order[j]];
  if (by_k) {
    total = held;  // probabilities over the top-k
  } else if (n < V && held < top_p * total) {  // the nucleus is past the candidates
    n = nucleus(p.data(), V, top_p * total, order);
    held = 0.0;
    for (int64_t j = 0; j < n; ++j) held += p[order[j]];
    if (held < top_p * total) {  // the float masses of the bisection fell short: sort them all
      n = V;
      std::iota(order.begin(), order.end(), 0);
      std::sort(order.begin(), order.end(), [&](int32_t a, int32_t b) { return ranks_before(p[a], a, p[b], b); });
    }
  }
  // top-p: the smallest prefix whose mass reaches top_p (at least one token)
  std::vector<float> kept;
  double mass = 0.0;
  for (int64_t j = 0; j < n && (j == 0 || mass < top_p * total); ++j) {
    kept.push_back(p[order[j]]);
    mass += p[order[j]];
  }
  return order[invert(kept.data(), static_cast<int64_t>(kept.size()), u * mass)];
}

}  // namespace

// logits [R, V] float32; temperature [R] (> 0), top_k [R] int64 (0: off), top_p [R] float32
// (1: off), u [R] float64 in (0, 1] -> tokens [R] int64.
at::Tensor sample_rows(at::Tensor logits, at::Tensor temperature, at::Tensor top_k, at::Tensor top_p,
                          at::Tensor u) {
  check_f32(logits, "logits");
  check_f32(temperature, "temperature");
  check_f32(top_p, "top_p");
  TORCH_CHECK(logits.dim() == 2 && logits.size(1) >= 1, "logits must be [R, V] with V >= 1, got ", logits.sizes());
  const int64_t R = logits.size(0), V = logits.size(1);
  TORCH_CHECK(V < (int64_t{1} << 31), "a vocabulary of ", V, " tokens is too large");
  TORCH_CHECK(temperature.numel() == R && top_p.numel() == R, "temperature and top_p must have R = ", R, " values");
  TORCH_CHECK(top_k.scalar_type() == at::kLong && top_k.is_contiguous() && top_k.numel() == R,
              "top_k must be contiguous int64 [R]");
  TORCH_CHECK(u.scalar_type() == at::kDouble && u.is_contiguous() && u.numel() == R,
              "u must be contiguous float64 [R]");
  const float *lp = logits.data_ptr<float>(), *tp = temperature.data_ptr<float>(), *pp = top_p.data_ptr<float>();
  const int64_t* kp = top_k.data_ptr<int64_t>();
  const double* up = u.data_ptr<double>();
  for (int64_t r = 0; r < R; ++r)
    TORCH_CHECK(tp[r] > 0.0f && pp[r] > 0.0f && pp[r] <= 1.0f && kp[r] >= 0 && up[r] > 0.0 && up[r] <= 1.0,
                "row ", r, ": temperature ", tp[r], ", top_k ", kp[r], ", top_p ", pp[r], ", u ", up[r],
                " (need temperature > 0, top_k >= 0, 0 < top_p <= 1, 0 < u <= 1)");
  auto out = at::empty({R}, logits.options().dtype(at::kLong));
  int64_t* op = out.data_ptr<int64_t>();
  at::parallel_for(0, R, 1, [&](int64_t r0, int64_t r1) {
    std::vector<float> p(V);
    std::vector<int32_t> order(V);
    for (int64_t r = r0; r < r1; ++r) op[r] = sample_row(lp + r * V, V, tp[r], kp[r], pp[r], up[r], p, order);
  });
  return out;
}

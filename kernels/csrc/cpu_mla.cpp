// Absorbed MLA attention over one layer of the paged latent pool, on the CPU (fp32).
//
// Legend: B decode rows, T chunk queries, H heads, R latent rank, P rope dims, D = R + P values
// per latent row, Z page size, X block-table width.
//
// A query-head (one head of one query) scores latent row s with one dot product of its
// [q_lat, q_rope] and the row [c_kv, k_rope], and returns the softmax-weighted sum of the rows'
// c_kv (the caller folds W_UK into q_lat and W_UV into the output). Every query-head of a sequence
// reads the same rows, so the work is cut into tasks of (sequence, block of its query-heads, span
// of its rows): a tile of rows is read into cache once for the whole block, scored, and summed
// under an online softmax (running max, sum and output per query-head). A long sequence is cut
// into several spans so that every thread has work even for one decode row or one prefill chunk;
// the spans' partial results are merged by their log-sum-exp at the end (flash-decoding).
#include <ATen/Parallel.h>
#include <torch/extension.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <vector>

#include "cpu_mla.h"
#include "vec.h"

using namespace tide;

namespace {

constexpr int64_t kTile = 64;             // rows scored together, then summed while still in cache
constexpr int64_t kMinSpan = 256;         // the fewest rows a task takes from a sequence
constexpr int64_t kOutBytes = 256 << 10;  // a task's running outputs stay within this (about L2)
constexpr int64_t kTasksPerThread = 4;    // spans are cut so that threads can balance their tasks

#if defined(__AVX512F__)
// o[j * R + r0 + c] += sum_s w[j * n + s] * rows[s][r0 + c] for NH heads j and the 64 columns c:
// 4 x NH accumulators held over the tile, each row slice read once for all NH heads.
template <int NH>
inline void add_weighted_cols(const float* w, int64_t n, const float* const* rows, int64_t r0, int64_t R,
                              float* o) {
  __m512 acc[NH][4];
  for (int j = 0; j < NH; ++j)
    for (int c = 0; c < 4; ++c) acc[j][c] = _mm512_loadu_ps(o + j * R + r0 + 16 * c);
  for (int64_t s = 0; s < n; ++s) {
    const float* row = rows[s] + r0;
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
constexpr int64_t kCols = 64;  // columns per add_weighted_cols
constexpr int kHeads = 4;      // heads per add_weighted_cols
#elif defined(__AVX2__) && defined(__FMA__)
// The same over 16 columns in 256-bit registers: 2 x NH accumulators.
template <int NH>
inline void add_weighted_cols(const float* w, int64_t n, const float* const* rows, int64_t r0, int64_t R,
                              float* o) {
  __m256 acc[NH][2];
  for (int j = 0; j < NH; ++j)
    for (int c = 0; c < 2; ++c) acc[j][c] = _mm256_loadu_ps(o + j * R + r0 + 8 * c);
  for (int64_t s = 0; s < n; ++s) {
    const float* row = rows[s] + r0;
    const __m256 v0 = _mm256_loadu_ps(row), v1 = _mm256_loadu_ps(row + 8);
    for (int j = 0; j < NH; ++j) {
      const __m256 x = _mm256_broadcast_ss(w + j * n + s);
      acc[j][0] = _mm256_fmadd_ps(x, v0, acc[j][0]);
      acc[j][1] = _mm256_fmadd_ps(x, v1, acc[j][1]);
    }
  }
  for (int j = 0; j < NH; ++j)
    for (int c = 0; c < 2; ++c) _mm256_storeu_ps(o + j * R + r0 + 8 * c, acc[j][c]);
}
constexpr int64_t kCols = 16;
constexpr int kHeads = 6;
#endif

// o[j * R + r] += sum_s w[j * n + s] * rows[s][r] for heads j < nh, rows s < n (the first R
// values of each): every row slice is read once per block of heads while it is in L1.
inline void add_weighted_rows(const float* w, int64_t n, int64_t nh, const float* const* rows, int64_t R,
                              float* o) {
#if defined(__AVX512F__) || (defined(__AVX2__) && defined(__FMA__))
  if (R % kCols == 0) {
    for (int64_t r0 = 0; r0 < R; r0 += kCols) {
      int64_t j = 0;
      for (; j + kHeads <= nh; j += kHeads) add_weighted_cols<kHeads>(w + j * n, n, rows, r0, R, o + j * R);
      for (; j < nh; ++j) add_weighted_cols<1>(w + j * n, n, rows, r0, R, o + j * R);
    }
    return;
  }
#endif
  for (int64_t s = 0; s < n; ++s) {
    const float* row = rows[s];
    for (int64_t j = 0; j < nh; ++j) {
      const float x = w[j * n + s];
      for (int64_t r = 0; r < R; ++r) o[j * R + r] += x * row[r];
    }
  }
}

// p[j * n + i] = sc * (q_j . rows[i]) for query-heads j < nq (rows of q [nq, D]) and rows i < n:
// four query-heads (in L1) against two latent rows at a time.
inline void scores(const float* q, int64_t nq, const float* const* rows, int64_t n, int64_t D, float sc, float* p) {
  int64_t j = 0;
#if defined(__AVX2__) && defined(__FMA__)
  if (D % 8 == 0) {
    float o2[2][4];
    for (; j + 4 <= nq; j += 4) {
      int64_t i = 0;
      for (; i + 2 <= n; i += 2) {
        dot_2x4(rows[i], rows[i + 1], q + j * D, D, o2, nullptr);
        for (int c = 0; c < 4; ++c) {
          p[(j + c) * n + i] = o2[0][c] * sc;
          p[(j + c) * n + i + 1] = o2[1][c] * sc;
        }
      }
      for (; i < n; ++i)
        for (int c = 0; c < 4; ++c) p[(j + c) * n + i] = dot(q + (j + c) * D, rows[i], D) * sc;
    }
  }
#endif
  for (; j < nq; ++j)
    for (int64_t i = 0; i < n; ++i) p[j * n + i] = dot(q + j * D, rows[i], D) * sc;
}

// What every task reads: the queries, the pool, and for each query-head how many rows it sees.
struct Problem {
  const float *q_lat, *q_rope, *kv;
  int64_t R, P, D, Z;
  float scale;
  const int64_t* lim;  // [N * H]: query-head j attends rows 0 .. lim[j] - 1
};

// Query-heads [h0, h1) (flat over queries and heads) of one sequence over its rows [s0, s1).
struct Task {
  const int64_t* pages;  // the sequence's block-table row
  int64_t h0, h1, s0, s1;
  int64_t part;  // its partial results' slot, or -1: the only span, written to the output
};

// Runs one task: the running max m, sum l and unnormalized output o [h1 - h0, R] of each
// query-head over the task's rows (o, m and l start at -inf and zeros here).
void attend(const Problem& pb, const Task& t, float* o, float* m, float* l, std::vector<float>& q,
            std::vector<float>& p) {
  const int64_t nq = t.h1 - t.h0, R = pb.R, P = pb.P, D = pb.D, Z = pb.Z;
  q.resize(nq * D);
  p.resize(nq * kTile);
  for (int64_t j = 0; j < nq; ++j) {  // each query-head as one [R + P] row, the layout of a latent
    std::copy_n(pb.q_lat + (t.h0 + j) * R, R, q.data() + j * D);
    std::copy_n(pb.q_rope + (t.h0 + j) * P, P, q.data() + j * D + R);
  }
  std::fill(m, m + nq, -INFINITY);
  std::fill(l, l + nq, 0.0f);
  std::fill(o, o + nq * R, 0.0f);
  const float* rows[kTile];
  for (int64_t t0 = t.s0; t0 < t.s1; t0 += kTile) {
    const int64_t n = std::min(kTile, t.s1 - t0);
    for (int64_t i = 0; i < n; ++i) rows[i] = pb.kv + (t.pages[(t0 + i) / Z] * Z + (t0 + i) % Z) * D;
    scores(q.data(), nq, rows, n, D, pb.scale, p.data());
    for (int64_t j = 0; j < nq; ++j) {
      float* pj = p.data() + j * n;
      const int64_t seen = std::clamp<int64_t>(pb.lim[t.h0 + j] - t0, 0, n);  // causal: a prefix of the tile
      if (seen > 0) {
        const float top = *std::max_element(pj, pj + seen);
        if (top > m[j]) {  // rescale what was summed under the old max
          const float alpha = std::exp(m[j] - top);
          for (int64_t r = 0; r < R; ++r) o[j * R + r] *= alpha;
          l[j] *= alpha;
          m[j] = top;
        }
        l[j] += exp_shifted(pj, seen, m[j]);
      }
      std::fill(pj + seen, pj + n, 0.0f);
    }
    add_weighted_rows(p.data(), n, nq, rows, R, o);
  }
}

// A sequence's block-table row, its queries [q0, q1) and the most rows any of them attends.
struct SeqRows {
  const int64_t* pages;
  int64_t q0, q1, len;
};

// The attention of every query-head: query-head j = (query q, head h) = q * H + h sees
// lim[j] rows of the sequence whose block-table row is pages_of(q); queries [q0, q1) of one
// sequence are contiguous. Returns [N, H, R].
template <typename SeqOf>
torch::Tensor attend_all(const Problem& pb, int64_t N, int64_t H, int64_t num_seqs, SeqOf seq_of,
                         const torch::Tensor& like) {
  auto out = torch::empty({N, H, pb.R}, like.options());
  float* op = out.data_ptr<float>();
  const int64_t threads = at::get_num_threads();
  const int64_t block = std::max<int64_t>(1, kOutBytes / (4 * pb.R));  // query-heads per task, at most
  // spans: long enough to amortize a merge, short enough that threads get kTasksPerThread each
  int64_t work = 0;  // rows to read, once per block of query-heads
  for (int64_t s = 0; s < num_seqs; ++s) {
    const SeqRows seq = seq_of(s);
    work += seq.len * (((seq.q1 - seq.q0) * H + block - 1) / block);
  }
  int64_t span = threads > 1 ? std::max(kMinSpan, (work + kTasksPerThread * threads - 1) / (kTasksPerThread * threads))
                             : INT64_MAX / 2;
  span = threads > 1 ? (span + kTile - 1) / kTile * kTile : span;
  std::vector<Task> tasks;
  std::vector<std::pair<int64_t, int64_t>> merges;  // (first task, spans) of query-head blocks cut in spans
  int64_t parts = 0;
  for (int64_t s = 0; s < num_seqs; ++s) {
    const auto [pages, q0, q1, len] = seq_of(s);
    const int64_t nqh = (q1 - q0) * H, blocks = (nqh + block - 1) / block, per = (nqh + blocks - 1) / blocks;
    const int64_t spans = (len + span - 1) / span;
    for (int64_t h0 = q0 * H; h0 < q1 * H; h0 += per) {
      const int64_t h1 = std::min(q1 * H, h0 + per);
      if (spans > 1) merges.emplace_back(static_cast<int64_t>(tasks.size()), spans);
      for (int64_t k = 0; k < spans; ++k)
        tasks.push_back({pages, h0, h1, k * span, std::min(len, (k + 1) * span), spans > 1 ? parts++ : -1});
    }
  }
  std::vector<int64_t> order(tasks.size());  // longest first: the last tasks taken are short
  for (size_t i = 0; i < order.size(); ++i) order[i] = static_cast<int64_t>(i);
  auto size = [&](int64_t i) { return (tasks[i].s1 - tasks[i].s0) * (tasks[i].h1 - tasks[i].h0); };
  std::stable_sort(order.begin(), order.end(), [&](int64_t a, int64_t b) { return size(a) > size(b); });
  const int64_t R = pb.R;
  std::vector<float> part_o(parts * block * R), part_m(parts * block), part_l(parts * block);
  std::atomic<int64_t> next{0};
  at::parallel_for(0, std::min<int64_t>(threads, tasks.size()), 1, [&](int64_t, int64_t) {
    std::vector<float> q, p, m(block), l(block);
    for (int64_t i; (i = next.fetch_add(1)) < static_cast<int64_t>(tasks.size());) {
      const Task& t = tasks[order[i]];
      if (t.part >= 0) {
        const int64_t at = t.part * block;
        attend(pb, t, part_o.data() + at * R, part_m.data() + at, part_l.data() + at, q, p);
        continue;
      }
      float* o = op + t.h0 * R;
      attend(pb, t, o, m.data(), l.data(), q, p);
      for (int64_t j = 0; j < t.h1 - t.h0; ++j) {
        const float inv = 1.0f / l[j];
        for (int64_t r = 0; r < R; ++r) o[j * R + r] *= inv;
      }
    }
  });
  // each cut block: out = sum_k o_k e^(m_k - M) / sum_k l_k e^(m_k - M), M the largest m_k
  at::parallel_for(0, merges.size(), 1, [&](int64_t lo, int64_t hi) {
    for (int64_t b = lo; b < hi; ++b) {
      const auto [first, spans] = merges[b];
      const Task& t0 = tasks[first];
      for (int64_t j = 0; j < t0.h1 - t0.h0; ++j) {
        float top = -INFINITY, total = 0.0f;
        for (int64_t k = 0; k < spans; ++k) top = std::max(top, part_m[tasks[first + k].part * block + j]);
        float* o = op + (t0.h0 + j) * R;
        std::fill(o, o + R, 0.0f);
        for (int64_t k = 0; k < spans; ++k) {
          const int64_t at = tasks[first + k].part * block + j;
          if (part_l[at] == 0.0f) continue;  // a span past this query-head's rows
          const float w = std::exp(part_m[at] - top);
          total += part_l[at] * w;
          const float* po = part_o.data() + at * R;
          for (int64_t r = 0; r < R; ++r) o[r] += w * po[r];
        }
        const float inv = 1.0f / total;
        for (int64_t r = 0; r < R; ++r) o[r] *= inv;
      }
    }
  });
  return out;
}

void check_queries(const torch::Tensor& q_lat, const torch::Tensor& q_rope, const torch::Tensor& kv,
                   int64_t page_size) {
  check_f32(q_lat, "q_lat");
  check_f32(q_rope, "q_rope");
  check_f32(kv, "kv");
  TORCH_CHECK(q_lat.dim() == 3 && q_rope.dim() == 3 && kv.dim() == 2, "q_lat, q_rope must be 3-D, kv 2-D");
  TORCH_CHECK(q_rope.size(0) == q_lat.size(0) && q_rope.size(1) == q_lat.size(1), "q_rope must be [B, H, P] like q_lat");
  TORCH_CHECK(kv.size(1) == q_lat.size(2) + q_rope.size(2), "kv rows hold ", kv.size(1), " values, need R + P = ",
              q_lat.size(2) + q_rope.size(2));
  TORCH_CHECK(page_size >= 1 && kv.size(0) % page_size == 0, "kv slots must be whole pages");
}

// The first ``len`` tokens of a block-table row are in the pool's ``pages`` pages.
void check_pages(const int64_t* row, int64_t row_idx, int64_t len, int64_t Z, int64_t pages) {
  for (int64_t x = 0; x < (len + Z - 1) / Z; ++x)
    TORCH_CHECK(row[x] >= 0 && row[x] < pages, "block_table[", row_idx, ", ", x, "] = ", row[x],
                " outside the pool's ", pages, " pages");
}

Problem problem(const torch::Tensor& q_lat, const torch::Tensor& q_rope, const torch::Tensor& kv, double scale,
                int64_t page_size, const int64_t* lim) {
  const int64_t R = q_lat.size(2), P = q_rope.size(2);
  return {q_lat.data_ptr<float>(), q_rope.data_ptr<float>(), kv.data_ptr<float>(), R, P, R + P, page_size,
          static_cast<float>(scale), lim};
}

}  // namespace

// Absorbed MLA decode, the contract of kernels.mla_decode.mla_decode (fp32): q_lat [B, H, R],
// q_rope [B, H, P], kv [slots, R + P], block_table [B, X] int64, seq_lens [B] int64 (each in
// 1..X*Z) -> out [B, H, R] = softmax_s((q_lat . c_s + q_rope . k_s) * scale) @ c. Token s of row
// b is in slot block_table[b, s / Z] * Z + s % Z; only s < seq_lens[b] is read.
torch::Tensor mla_decode_paged(torch::Tensor q_lat, torch::Tensor q_rope, torch::Tensor kv,
                               torch::Tensor block_table, torch::Tensor seq_lens, double scale,
                               int64_t page_size) {
  check_queries(q_lat, q_rope, kv, page_size);
  const int64_t B = q_lat.size(0), H = q_lat.size(1);
  TORCH_CHECK(block_table.scalar_type() == torch::kInt64 && block_table.dim() == 2 && block_table.size(0) == B,
              "block_table must be int64 [B, X]");
  TORCH_CHECK(seq_lens.scalar_type() == torch::kInt64 && seq_lens.numel() == B, "seq_lens must be int64 [B]");
  auto bt = block_table.contiguous();
  auto lens = seq_lens.contiguous();
  const int64_t X = bt.size(1), Z = page_size, pages = kv.size(0) / Z;
  const int64_t* tab = bt.data_ptr<int64_t>();
  const int64_t* len = lens.data_ptr<int64_t>();
  std::vector<int64_t> lim(B * H);
  for (int64_t b = 0; b < B; ++b) {
    TORCH_CHECK(len[b] >= 1 && len[b] <= X * Z, "seq_lens[", b, "] = ", len[b], " outside [1, ", X * Z, "]");
    check_pages(tab + b * X, b, len[b], Z, pages);
    std::fill_n(lim.data() + b * H, H, len[b]);
  }
  const Problem pb = problem(q_lat, q_rope, kv, scale, page_size, lim.data());
  return attend_all(pb, B, H, B, [&](int64_t b) { return SeqRows{tab + b * X, b, b + 1, len[b]}; }, q_lat);
}

// A prefill chunk's absorbed attention over its sequence in the pool: q_lat [T, H, R],
// q_rope [T, H, P] of the tokens at positions start .. start + T - 1, whose latents (and those of
// every earlier token) are in the pool at block_table [X] int64; query t attends tokens
// 0 .. start + t (causal). -> [T, H, R], as mla_decode_paged with T rows of that table.
torch::Tensor mla_chunk_paged(torch::Tensor q_lat, torch::Tensor q_rope, torch::Tensor kv,
                              torch::Tensor block_table, int64_t start, double scale, int64_t page_size) {
  check_queries(q_lat, q_rope, kv, page_size);
  const int64_t T = q_lat.size(0), H = q_lat.size(1);
  TORCH_CHECK(block_table.scalar_type() == torch::kInt64 && block_table.dim() == 1, "block_table must be int64 [X]");
  auto bt = block_table.contiguous();
  const int64_t Z = page_size, len = start + T;
  TORCH_CHECK(T >= 1 && start >= 0 && len <= bt.size(0) * Z, "a chunk of ", T, " tokens from ", start,
              " does not fit a block table of ", bt.size(0), " pages of ", Z);
  check_pages(bt.data_ptr<int64_t>(), 0, len, Z, kv.size(0) / Z);
  std::vector<int64_t> lim(T * H);
  for (int64_t t = 0; t < T; ++t) std::fill_n(lim.data() + t * H, H, start + t + 1);
  const Problem pb = problem(q_lat, q_rope, kv, scale, page_size, lim.data());
  const int64_t* tab = bt.data_ptr<int64_t>();
  return attend_all(pb, T, H, 1, [&](int64_t) { return SeqRows{tab, 0, T, len}; }, q_lat);
}

namespace {

// RoPE of one head's rope part x [P] by angles cos, sin [P / 2] into out [P], in the de-interleaved
// layout [rotated firsts, rotated seconds] (model.rope.apply_rope): firsts x[2i] (interleave) or
// x[i], seconds x[2i + 1] or x[P/2 + i]. Products and differences rounded one at a time, as the
// torch ops round them (no fused multiply-add), so the latents equal the unfused path's.
__attribute__((optimize("fp-contract=off"))) void rope_row(const float* x, const float* cos, const float* sin,
                                                          int64_t P, bool interleave, float* out) {
  const int64_t half = P / 2;
  for (int64_t i = 0; i < half; ++i) {
    const float x1 = interleave ? x[2 * i] : x[i], x2 = interleave ? x[2 * i + 1] : x[half + i];
    const float a = x1 * cos[i], b = x2 * sin[i], c = x2 * cos[i], d = x1 * sin[i];
    out[i] = a - b;
    out[half + i] = c + d;
  }
}

}  // namespace

// The absorbed MLA decode of one layer, from its projections to its heads' values: q [B, H*(N+P)]
// (the query projection's output, each head [q_nope, q_rope]), kv_a [B, R+P] (kv_a_proj_with_mqa's
// output), kv_norm [R], cos/sin [B, P/2] (each row's angles), w_uk [H, N, R], w_uv_t [H, R, V],
// kv [slots, R+P] one layer of the pool -> [B, H*V]. Writes row b's latent [RMSNorm(c_kv) * kv_norm,
// rope(k_rope)] into kv at new_slots[b], then attends as mla_decode_paged with q_lat = q_nope @
// W_UK and returns o_lat @ W_UV: one call for what is a dozen small ops per layer in torch.
torch::Tensor mla_decode_fused(torch::Tensor q, torch::Tensor kv_a, torch::Tensor kv_norm, double eps,
                               torch::Tensor cos, torch::Tensor sin, bool interleave, torch::Tensor w_uk,
                               torch::Tensor w_uv_t, torch::Tensor kv, torch::Tensor new_slots,
                               torch::Tensor block_table, torch::Tensor seq_lens, double scale, int64_t page_size) {
  for (const auto& [t, name] : {std::pair{&q, "q"}, {&kv_a, "kv_a"}, {&kv_norm, "kv_norm"}, {&cos, "cos"},
                                {&sin, "sin"}, {&w_uk, "w_uk"}, {&w_uv_t, "w_uv_t"}, {&kv, "kv"}})
    check_f32(*t, name);
  TORCH_CHECK(w_uk.dim() == 3 && w_uv_t.dim() == 3 && w_uv_t.size(0) == w_uk.size(0) && w_uv_t.size(1) == w_uk.size(2),
              "w_uk must be [H, N, R] and w_uv_t [H, R, V]");
  const int64_t B = q.size(0), H = w_uk.size(0), N = w_uk.size(1), R = w_uk.size(2), D = kv.size(1), P = D - R;
  TORCH_CHECK(P > 0 && P % 2 == 0 && kv_norm.numel() == R, "kv rows of ", D, " values do not fit rank ", R,
              " and an even rope part");
  TORCH_CHECK(q.dim() == 2 && q.size(1) == H * (N + P), "q must be [B, H * (N + P)] = [B, ", H * (N + P), "]");
  TORCH_CHECK(kv_a.dim() == 2 && kv_a.size(0) == B && kv_a.size(1) == D, "kv_a must be [B, ", D, "]");
  TORCH_CHECK(cos.sizes() == sin.sizes() && cos.dim() == 2 && cos.size(0) == B && cos.size(1) == P / 2,
              "cos and sin must be [B, P / 2]");
  TORCH_CHECK(new_slots.scalar_type() == torch::kInt64 && new_slots.numel() == B, "new_slots must be int64 [B]");
  auto slots = new_slots.contiguous();
  const int64_t* sp = slots.data_ptr<int64_t>();
  for (int64_t b = 0; b < B; ++b)
    TORCH_CHECK(sp[b] >= 0 && sp[b] < kv.size(0), "new_slots[", b, "] = ", sp[b], " outside the pool's ", kv.size(0),
                " slots");
  auto q_rope = torch::empty({B, H, P}, q.options());
  const float *qp = q.data_ptr<float>(), *ap = kv_a.data_ptr<float>(), *cp = cos.data_ptr<float>(),
              *snp = sin.data_ptr<float>(), *np = kv_norm.data_ptr<float>();
  float *rp = q_rope.data_ptr<float>(), *kvp = kv.data_ptr<float>();
  for (int64_t b = 0; b < B; ++b) {
    const float *c = cp + b * (P / 2), *s = snp + b * (P / 2);
    for (int64_t h = 0; h < H; ++h) rope_row(qp + (b * H + h) * (N + P) + N, c, s, P, interleave, rp + (b * H + h) * P);
    float* row = kvp + sp[b] * D;  // the new token's latent, in place
    rms_norm_row(ap + b * D, np, R, static_cast<float>(eps), row);
    rope_row(ap + b * D + R, c, s, P, interleave, row + R);
  }
  auto q_nope = q.view({B, H, N + P}).narrow(2, 0, N).transpose(0, 1);  // [H, B, N]
  auto q_lat = at::bmm(q_nope, w_uk).transpose(0, 1).contiguous();      // [B, H, R]
  auto o_lat = mla_decode_paged(q_lat, q_rope, kv, block_table, seq_lens, scale, page_size);  // [B, H, R]
  return at::bmm(o_lat.transpose(0, 1), w_uv_t).transpose(0, 1).reshape({B, -1});  // [B, H * V]
}

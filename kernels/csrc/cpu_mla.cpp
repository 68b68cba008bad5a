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
#include <ATen/core/Tensor.h>
#include <ATen/ops/bmm.h>
#include <ATen/ops/empty.h>

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
    // heads in groups of at most kHeads, as even as they come (8 heads: 4 + 4, not 6 + 1 + 1)
    const int64_t groups = (nh + kHeads - 1) / kHeads;
    for (int64_t r0 = 0; r0 < R; r0 += kCols) {
      for (int64_t g = 0, j = 0; g < groups; ++g) {
        const int64_t size = nh / groups + (g < nh % groups ? 1 : 0);
        const float* wj = w + j * n;
        float* oj = o + j * R;
        switch (size) {
          case 1: add_weighted_cols<1>(wj, n, rows, r0, R, oj); break;
          case 2: add_weighted_cols<2>(wj, n, rows, r0, R, oj); break;
          case 3: add_weighted_cols<3>(wj, n, rows, r0, R, oj); break;
          case 4: add_weighted_cols<4>(wj, n, rows, r0, R, oj); break;
#if !defined(__AVX512F__)
          case 5: add_weighted_cols<5>(wj, n, rows, r0, R, oj); break;
          case 6: add_weighted_cols<6>(wj, n, rows, r0, R, oj); break;
#endif
        }
        j += size;
      }
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

// Asks for the D floats of each of rows[0 .. n - 1] (into L2).
inline void prefetch_rows(const float* const* rows, int64_t n, int64_t D) {
#if defined(__AVX2__) && defined(__FMA__)
  for (int64_t i = 0; i < n; ++i)
    for (int64_t b = 0; b < D; b += 16) _mm_prefetch(reinterpret_cast<const char*>(rows[i] + b), _MM_HINT_T1);
#endif
}

// p[j * n + i] = sc * (q_j . rows[i]) for query-heads j < nq (rows of q [nq, D]) and rows i < n:
// four query-heads (in L1) against two latent rows at a time. Meanwhile asks for the next tile's
// rows ``ahead`` [n_ahead], two with each pair of rows scored: they sit in scattered pages, where
// the hardware prefetcher starts late, and a burst of requests would overflow its queue.
inline void scores(const float* q, int64_t nq, const float* const* rows, int64_t n, int64_t D, float sc, float* p,
                   const float* const* ahead, int64_t n_ahead) {
  int64_t j = 0;
#if defined(__AVX2__) && defined(__FMA__)
  if (D % 8 == 0) {
    const __m128 vsc = _mm_set1_ps(sc);
    alignas(16) float o0[4], o1[4];
    for (; j + 4 <= nq; j += 4) {
      int64_t i = 0;
      for (; i + 2 <= n; i += 2) {
        if (j == 0 && i < n_ahead) prefetch_rows(ahead + i, std::min<int64_t>(2, n_ahead - i), D);
        __m128 s[2];
        dot_2x4(rows[i], rows[i + 1], q + j * D, D, s, nullptr);
        _mm_store_ps(o0, _mm_mul_ps(s[0], vsc));
        _mm_store_ps(o1, _mm_mul_ps(s[1], vsc));
        for (int c = 0; c < 4; ++c) {
          p[(j + c) * n + i] = o0[c];
          p[(j + c) * n + i + 1] = o1[c];
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

// The largest of p[0 .. n - 1], n >= 1.
inline float max_of(const float* p, int64_t n) {
  int64_t i = 0;
  float top = p[0];
#if defined(__AVX2__) && defined(__FMA__)
  if (n >= 8) {
    __m256 m = _mm256_loadu_ps(p);
    for (i = 8; i + 8 <= n; i += 8) m = _mm256_max_ps(m, _mm256_loadu_ps(p + i));
    __m128 h = _mm_max_ps(_mm256_castps256_ps128(m), _mm256_extractf128_ps(m, 1));
    h = _mm_max_ps(h, _mm_movehl_ps(h, h));
    h = _mm_max_ss(h, _mm_shuffle_ps(h, h, 1));
    top = _mm_cvtss_f32(h);
  }
#endif
  for (; i < n; ++i) top = std::max(top, p[i]);
  return top;
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
  const float* tiles[2][kTile];  // this tile's rows and the next one's
  auto fill = [&](int64_t t0, const float** rows) {
    const int64_t n = std::max<int64_t>(0, std::min(kTile, t.s1 - t0));
    for (int64_t i = 0; i < n; ++i) rows[i] = pb.kv + (t.pages[(t0 + i) / Z] * Z + (t0 + i) % Z) * D;
    return n;
  };
  fill(t.s0, tiles[0]);
  for (int64_t t0 = t.s0, k = 0; t0 < t.s1; t0 += kTile, k ^= 1) {
    const float** rows = tiles[k];
    const int64_t n = std::min(kTile, t.s1 - t0), n_next = fill(t0 + kTile, tiles[k ^ 1]);
    scores(q.data(), nq, rows, n, D, pb.scale, p.data(), tiles[k ^ 1], n_next);
    for (int64_t j = 0; j < nq; ++j) {
      float* pj = p.data() + j * n;
      const int64_t seen = std::clamp<int64_t>(pb.lim[t.h0 + j] - t0, 0, n);  // causal: a prefix of the tile
      if (seen > 0) {
        const float top = max_of(pj, seen);
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
at::Tensor attend_all(const Problem& pb, int64_t N, int64_t H, int64_t num_seqs, SeqOf seq_of,
                         const at::Tensor& like) {
  auto out = at::empty({N, H, pb.R}, like.options());
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

void check_queries(const at::Tensor& q_lat, const at::Tensor& q_rope, const at::Tensor& kv,
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

Problem problem(const at::Tensor& q_lat, const at::Tensor& q_rope, const at::Tensor& kv, double scale,
                int64_t page_size, const int64_t* lim) {
  const int64_t R = q_lat.size(2), P = q_rope.size(2);
  return {q_lat.data_ptr<float>(), q_rope.data_ptr<float>(), kv.data_ptr<float>(), R, P, R + P, page_size,
          static_cast<float>(scale), lim};
}

// A chunk's T queries (positions start .. start + T - 1 of the sequence at chunk_table [Xc]) and
// then B decode rows (row b: seq_lens[b] tokens at block_table [B, X]); T or B may be 0.
struct Rows {
  int64_t T = 0, start = 0, B = 0, X = 0;
  const int64_t *chunk_tab = nullptr, *tab = nullptr, *len = nullptr;
  at::Tensor keep_chunk, keep_tab, keep_len;  // contiguous copies the pointers read
};

Rows chunk_rows(const at::Tensor& chunk_table, int64_t start, int64_t T, int64_t Z, int64_t pages, Rows rows = {}) {
  TORCH_CHECK(chunk_table.scalar_type() == at::kLong && chunk_table.dim() == 1, "block_table must be int64 [X]");
  rows.keep_chunk = chunk_table.contiguous();
  TORCH_CHECK(T >= 1 && start >= 0 && start + T <= rows.keep_chunk.size(0) * Z, "a chunk of ", T, " tokens from ",
              start, " does not fit a block table of ", rows.keep_chunk.size(0), " pages of ", Z);
  rows.chunk_tab = rows.keep_chunk.data_ptr<int64_t>();
  check_pages(rows.chunk_tab, 0, start + T, Z, pages);
  rows.T = T;
  rows.start = start;
  return rows;
}

Rows decode_rows(const at::Tensor& block_table, const at::Tensor& seq_lens, int64_t B, int64_t Z, int64_t pages,
                 Rows rows = {}) {
  TORCH_CHECK(block_table.scalar_type() == at::kLong && block_table.dim() == 2 && block_table.size(0) == B,
              "block_table must be int64 [B, X]");
  TORCH_CHECK(seq_lens.scalar_type() == at::kLong && seq_lens.numel() == B, "seq_lens must be int64 [B]");
  rows.keep_tab = block_table.contiguous();
  rows.keep_len = seq_lens.contiguous();
  rows.B = B;
  rows.X = rows.keep_tab.size(1);
  rows.tab = rows.keep_tab.data_ptr<int64_t>();
  rows.len = rows.keep_len.data_ptr<int64_t>();
  for (int64_t b = 0; b < B; ++b) {
    TORCH_CHECK(rows.len[b] >= 1 && rows.len[b] <= rows.X * Z, "seq_lens[", b, "] = ", rows.len[b], " outside [1, ",
                rows.X * Z, "]");
    check_pages(rows.tab + b * rows.X, b, rows.len[b], Z, pages);
  }
  return rows;
}

// The attention of every row's heads in one parallel pass (the chunk's queries first):
// q_lat [T + B, H, R], q_rope [T + B, H, P] -> [T + B, H, R].
at::Tensor attend_rows(const at::Tensor& q_lat, const at::Tensor& q_rope, const at::Tensor& kv,
                          const Rows& rows, double scale, int64_t page_size) {
  const int64_t H = q_lat.size(1), T = rows.T, B = rows.B;
  TORCH_CHECK(q_lat.size(0) == T + B, "q_lat holds ", q_lat.size(0), " rows, the chunk and the batch ", T + B);
  std::vector<int64_t> lim((T + B) * H);
  for (int64_t t = 0; t < T; ++t) std::fill_n(lim.data() + t * H, H, rows.start + t + 1);
  for (int64_t b = 0; b < B; ++b) std::fill_n(lim.data() + (T + b) * H, H, rows.len[b]);
  const Problem pb = problem(q_lat, q_rope, kv, scale, page_size, lim.data());
  const int64_t first = T > 0 ? 1 : 0;  // the chunk is sequence 0 when there is one
  return attend_all(pb, T + B, H, first + B, [&](int64_t s) {
    if (s < first) return SeqRows{rows.chunk_tab, 0, T, rows.start + T};
    const int64_t b = s - first;
    return SeqRows{rows.tab + b * rows.X, T + b, T + b + 1, rows.len[b]};
  }, q_lat);
}

}  // namespace

// Absorbed MLA decode, the contract of kernels.mla_decode.mla_decode (fp32): q_lat [B, H, R],
// q_rope [B, H, P], kv [slots, R + P], block_table [B, X] int64, seq_lens [B] int64 (each in
// 1..X*Z) -> out [B, H, R] = softmax_s((q_lat . c_s + q_rope . k_s) * scale) @ c. Token s of row
// b is in slot block_table[b, s / Z] * Z + s % Z; only s < seq_lens[b] is read.
at::Tensor mla_decode_paged(at::Tensor q_lat, at::Tensor q_rope, at::Tensor kv,
                               at::Tensor block_table, at::Tensor seq_lens, double scale,
                               int64_t page_size) {
  check_queries(q_lat, q_rope, kv, page_size);
  const Rows rows = decode_rows(block_table, seq_lens, q_lat.size(0), page_size, kv.size(0) / page_size);
  return attend_rows(q_lat, q_rope, kv, rows, scale, page_size);
}

// A prefill chunk's absorbed attention over its sequence in the pool: q_lat [T, H, R],
// q_rope [T, H, P] of the tokens at positions start .. start + T - 1, whose latents (and those of
// every earlier token) are in the pool at block_table [X] int64; query t attends tokens
// 0 .. start + t (causal). -> [T, H, R], as mla_decode_paged with T rows of that table.
at::Tensor mla_chunk_paged(at::Tensor q_lat, at::Tensor q_rope, at::Tensor kv,
                              at::Tensor block_table, int64_t start, double scale, int64_t page_size) {
  check_queries(q_lat, q_rope, kv, page_size);
  const Rows rows = chunk_rows(block_table, start, q_lat.size(0), page_size, kv.size(0) / page_size);
  return attend_rows(q_lat, q_rope, kv, rows, scale, page_size);
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

// A layer's absorbed MLA attention from its projections to its heads' values, for a pass of a
// prefill chunk's T rows (positions chunk_start .. chunk_start + T - 1 of the sequence at
// chunk_table [X'], none when it is absent) and then B decode rows (block_table [B, X], seq_lens
// [B]): q [T+B, H*(N+P)] (the query projection's output, each head [q_nope, q_rope]), kv_a
// [T+B, R+P] (kv_a_proj_with_mqa's output), kv_norm [R], cos/sin [T+B, P/2] (each row's angles),
// w_uk [H, N, R], w_uv_t [H, R, V], kv [slots, R+P] one layer of the pool -> [T+B, H*V]. Writes
// row i's latent [RMSNorm(c_kv) * kv_norm, rope(k_rope)] into kv at new_slots[i], then attends as
// mla_chunk_paged and mla_decode_paged do (all rows in one parallel pass) with q_lat = q_nope @
// W_UK, and returns o_lat @ W_UV: one call for what is a dozen small ops per layer in torch.
at::Tensor mla_fused(at::Tensor q, at::Tensor kv_a, at::Tensor kv_norm, double eps, at::Tensor cos,
                        at::Tensor sin, bool interleave, at::Tensor w_uk, at::Tensor w_uv_t, at::Tensor kv,
                        at::Tensor new_slots, at::Tensor block_table, at::Tensor seq_lens,
                        c10::optional<at::Tensor> chunk_table, int64_t chunk_start, double scale,
                        int64_t page_size) {
  for (const auto& [t, name] : {std::pair{&q, "q"}, {&kv_a, "kv_a"}, {&kv_norm, "kv_norm"}, {&cos, "cos"},
                                {&sin, "sin"}, {&w_uk, "w_uk"}, {&w_uv_t, "w_uv_t"}, {&kv, "kv"}})
    check_f32(*t, name);
  TORCH_CHECK(w_uk.dim() == 3 && w_uv_t.dim() == 3 && w_uv_t.size(0) == w_uk.size(0) && w_uv_t.size(1) == w_uk.size(2),
              "w_uk must be [H, N, R] and w_uv_t [H, R, V]");
  const int64_t n = q.size(0), H = w_uk.size(0), N = w_uk.size(1), R = w_uk.size(2), D = kv.size(1), P = D - R;
  TORCH_CHECK(P > 0 && P % 2 == 0 && kv_norm.numel() == R, "kv rows of ", D, " values do not fit rank ", R,
              " and an even rope part");
  TORCH_CHECK(q.dim() == 2 && q.size(1) == H * (N + P), "q must be [rows, H * (N + P)] = [rows, ", H * (N + P), "]");
  TORCH_CHECK(kv_a.dim() == 2 && kv_a.size(0) == n && kv_a.size(1) == D, "kv_a must be [rows, ", D, "]");
  TORCH_CHECK(cos.sizes() == sin.sizes() && cos.dim() == 2 && cos.size(0) == n && cos.size(1) == P / 2,
              "cos and sin must be [rows, P / 2]");
  TORCH_CHECK(new_slots.scalar_type() == at::kLong && new_slots.numel() == n, "new_slots must be int64 [rows]");
  TORCH_CHECK(page_size >= 1 && kv.size(0) % page_size == 0, "kv slots must be whole pages");
  TORCH_CHECK(block_table.dim() == 2 && block_table.size(0) <= n, "block_table must be [B, X] with B <= rows");
  const int64_t B = block_table.size(0), T = n - B, pages = kv.size(0) / page_size;
  TORCH_CHECK(T == 0 || chunk_table.has_value(), "q holds ", T, " rows more than the batch and there is no chunk");
  Rows rows = decode_rows(block_table, seq_lens, B, page_size, pages);
  if (T > 0) rows = chunk_rows(*chunk_table, chunk_start, T, page_size, pages, std::move(rows));
  auto slots = new_slots.contiguous();
  const int64_t* sp = slots.data_ptr<int64_t>();
  for (int64_t i = 0; i < n; ++i)
    TORCH_CHECK(sp[i] >= 0 && sp[i] < kv.size(0), "new_slots[", i, "] = ", sp[i], " outside the pool's ", kv.size(0),
                " slots");
  auto q_rope = at::empty({n, H, P}, q.options());
  const float *qp = q.data_ptr<float>(), *ap = kv_a.data_ptr<float>(), *cp = cos.data_ptr<float>(),
              *snp = sin.data_ptr<float>(), *np = kv_norm.data_ptr<float>();
  float *rp = q_rope.data_ptr<float>(), *kvp = kv.data_ptr<float>();
  for (int64_t i = 0; i < n; ++i) {
    const float *c = cp + i * (P / 2), *s = snp + i * (P / 2);
    for (int64_t h = 0; h < H; ++h) rope_row(qp + (i * H + h) * (N + P) + N, c, s, P, interleave, rp + (i * H + h) * P);
    float* row = kvp + sp[i] * D;  // the new token's latent, in place
    rms_norm_row(ap + i * D, np, R, static_cast<float>(eps), row);
    rope_row(ap + i * D + R, c, s, P, interleave, row + R);
  }
  auto q_nope = q.view({n, H, N + P}).narrow(2, 0, N).transpose(0, 1);  // [H, rows, N]
  auto q_lat = at::bmm(q_nope, w_uk).transpose(0, 1).contiguous();      // [rows, H, R]
  auto o_lat = attend_rows(q_lat, q_rope, kv, rows, scale, page_size);  // [rows, H, R]
  return at::bmm(o_lat.transpose(0, 1), w_uv_t).transpose(0, 1).reshape({n, -1});  // [rows, H * V]
}

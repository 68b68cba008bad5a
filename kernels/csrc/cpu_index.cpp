// DeepSeek's lightning indexer at decode: each row's top-k keys by index score, over keys read
// in place (a paged pool's plane, addressed by each row's candidate slots).
//
// score[b, s] = sum_g w[b, g] * relu(scale * q[b, g] . keys[slots[b, s]]) for s < lens[b]; the k
// best of each row, ties broken towards the earlier candidate (kernels.index_topk's contract,
// whose torch reference is ref_index_topk). Rows are cut over the threads.
//
// Legend: B rows, G indexer heads, I head dim, S candidates per row, k kept.
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/full.h>

#include <algorithm>
#include <numeric>
#include <vector>

#include "cpu_index.h"
#include "vec.h"

using namespace tide;

at::Tensor index_topk(at::Tensor q, at::Tensor w, at::Tensor keys, at::Tensor slots, at::Tensor lens,
                      int64_t k, double scale) {
  check_f32(q, "q");
  check_f32(w, "w");
  check_f32(keys, "keys");
  TORCH_CHECK(q.dim() == 3 && w.dim() == 2 && keys.dim() == 2 && slots.dim() == 2 && lens.dim() == 1,
              "q [B, G, I], w [B, G], keys [slots, I], slots [B, S], lens [B]");
  const int64_t B = q.size(0), G = q.size(1), I = q.size(2), S = slots.size(1);
  TORCH_CHECK(w.size(0) == B && w.size(1) == G && slots.size(0) == B && lens.size(0) == B,
              "w, slots and lens need one row per query row");
  TORCH_CHECK(keys.size(1) == I, "keys hold ", keys.size(1), " values, q's heads ", I);
  TORCH_CHECK(k >= 1, "k must be >= 1, got ", k);
  TORCH_CHECK(slots.scalar_type() == at::kLong && lens.scalar_type() == at::kLong, "slots and lens must be int64");
  q = q.contiguous();
  w = w.contiguous();
  keys = keys.contiguous();
  slots = slots.contiguous();
  lens = lens.contiguous();
  const float* qp = q.data_ptr<float>();
  const float* wp = w.data_ptr<float>();
  const float* kp = keys.data_ptr<float>();
  const int64_t* sp = slots.data_ptr<int64_t>();
  const int64_t* lp = lens.data_ptr<int64_t>();
  const int64_t num_keys = keys.size(0);
  for (int64_t b = 0; b < B; ++b) {
    TORCH_CHECK(lp[b] >= 0 && lp[b] <= S, "lens[", b, "] = ", lp[b], " is outside [0, ", S, "]");
    for (int64_t s = 0; s < lp[b]; ++s)
      TORCH_CHECK(sp[b * S + s] >= 0 && sp[b * S + s] < num_keys, "slots[", b, ", ", s, "] = ", sp[b * S + s],
                  " is outside the keys' ", num_keys);
  }
  at::Tensor out = at::full({B, k}, -1, slots.options());
  int64_t* op = out.data_ptr<int64_t>();
  const float sc = static_cast<float>(scale);
  at::parallel_for(0, B, 1, [&](int64_t lo, int64_t hi) {
    std::vector<float> score;
    std::vector<int64_t> order;
    for (int64_t b = lo; b < hi; ++b) {
      const int64_t n = lp[b];
      score.assign(n, 0.0f);
      for (int64_t s = 0; s < n; ++s) {
        const float* key = kp + sp[b * S + s] * I;
        float acc = 0.0f;
        for (int64_t g = 0; g < G; ++g) {
          const float d = dot(qp + (b * G + g) * I, key, I) * sc;
          if (d > 0.0f) acc += wp[b * G + g] * d;
        }
        score[s] = acc;
      }
      order.resize(n);
      std::iota(order.begin(), order.end(), 0);
      const int64_t keep = std::min(k, n);
      // the k best, earlier candidates first among equal scores; then in candidate order
      auto better = [&](int64_t x, int64_t y) { return score[x] > score[y] || (score[x] == score[y] && x < y); };
      std::nth_element(order.begin(), order.begin() + (keep ? keep - 1 : 0), order.end(), better);
      std::sort(order.begin(), order.begin() + keep);
      std::copy(order.begin(), order.begin() + keep, op + b * k);
    }
  });
  return out;
}

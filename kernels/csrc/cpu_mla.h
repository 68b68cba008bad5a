// The paged MLA attention kernels (cpu_mla.cpp); cpu_decode.cpp binds them into the module.
#pragma once

#include <torch/types.h>

torch::Tensor mla_decode_paged(torch::Tensor q_lat, torch::Tensor q_rope, torch::Tensor kv,
                               torch::Tensor block_table, torch::Tensor seq_lens, double scale,
                               int64_t page_size);

torch::Tensor mla_chunk_paged(torch::Tensor q_lat, torch::Tensor q_rope, torch::Tensor kv,
                              torch::Tensor block_table, int64_t start, double scale, int64_t page_size);

torch::Tensor mla_fused(torch::Tensor q, torch::Tensor kv_a, torch::Tensor kv_norm, double eps, torch::Tensor cos,
                        torch::Tensor sin, bool interleave, torch::Tensor w_uk, torch::Tensor w_uv_t, torch::Tensor kv,
                        torch::Tensor new_slots, torch::Tensor block_table, torch::Tensor seq_lens,
                        c10::optional<torch::Tensor> chunk_table, int64_t chunk_start, double scale,
                        int64_t page_size);

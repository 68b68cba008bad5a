// The paged MLA attention kernels (cpu_mla.cpp); cpu_gemv.cpp binds them into the module.
#pragma once

#include <torch/extension.h>

torch::Tensor mla_decode_paged(torch::Tensor q_lat, torch::Tensor q_rope, torch::Tensor kv,
                               torch::Tensor block_table, torch::Tensor seq_lens, double scale,
                               int64_t page_size);

torch::Tensor mla_chunk_paged(torch::Tensor q_lat, torch::Tensor q_rope, torch::Tensor kv,
                              torch::Tensor block_table, int64_t start, double scale, int64_t page_size);

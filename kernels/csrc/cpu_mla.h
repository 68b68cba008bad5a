// The paged MLA attention kernels (cpu_mla.cpp); cpu_decode.cpp binds them into the module.
#pragma once

#include <ATen/core/Tensor.h>

at::Tensor mla_decode_paged(at::Tensor q_lat, at::Tensor q_rope, at::Tensor kv,
                               at::Tensor block_table, at::Tensor seq_lens, double scale,
                               int64_t page_size);

at::Tensor mla_chunk_paged(at::Tensor q_lat, at::Tensor q_rope, at::Tensor kv,
                              at::Tensor block_table, int64_t start, double scale, int64_t page_size);

at::Tensor mla_fused(at::Tensor q, at::Tensor kv_a, at::Tensor kv_norm, double eps, at::Tensor cos,
                        at::Tensor sin, bool interleave, at::Tensor w_uk, at::Tensor w_uv_t, at::Tensor kv,
                        at::Tensor new_slots, at::Tensor block_table, at::Tensor seq_lens,
                        c10::optional<at::Tensor> chunk_table, int64_t chunk_start, double scale,
                        int64_t page_size);

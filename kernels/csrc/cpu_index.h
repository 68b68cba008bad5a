// The lightning indexer's decode top-k (cpu_index.cpp); cpu_decode.cpp binds it into the module.
#pragma once

#include <ATen/core/Tensor.h>

at::Tensor index_topk(at::Tensor q, at::Tensor w, at::Tensor keys, at::Tensor slots, at::Tensor lens,
                      int64_t k, double scale);

// The small-batch kernels of cpu_gemv.cpp, for the other sources of the module (cpu_decode.cpp
// chains them into a whole decode step and binds them). Contracts as documented where they are
// defined.
#pragma once

#include <ATen/core/Tensor.h>

#include <tuple>

at::Tensor small_linear(at::Tensor x, at::Tensor w);

at::Tensor moe_experts(at::Tensor xs, at::Tensor spans, at::Tensor gate_up, at::Tensor down);

at::Tensor argmax_rows(at::Tensor x);

at::Tensor small_linear_q8(at::Tensor x, at::Tensor q, at::Tensor scale);

at::Tensor rms_norm(at::Tensor x, at::Tensor w, double eps);

std::tuple<at::Tensor, at::Tensor> moe_route(at::Tensor logits, c10::optional<at::Tensor> bias,
                                                   int64_t K, int64_t G, int64_t KG, int64_t method,
                                                   bool softmax, bool norm, double scaling);

at::Tensor moe_routed(at::Tensor x, at::Tensor ids, at::Tensor weights, at::Tensor gate_up,
                         at::Tensor down);

at::Tensor moe_routed_clipped(at::Tensor x, at::Tensor ids, at::Tensor weights, at::Tensor gate_up,
                              at::Tensor down, double limit);
at::Tensor moe_routed_q8(at::Tensor x, at::Tensor ids, at::Tensor weights, at::Tensor gate_up_q,
                            at::Tensor gate_up_scale, at::Tensor down_q, at::Tensor down_scale);

// cpu_sample.cpp: one token per row of float32 logits [R, V] (model.sampling's contract).
at::Tensor sample_rows(at::Tensor logits, at::Tensor temperature, at::Tensor top_k, at::Tensor top_p,
                          at::Tensor u);


// The small-batch kernels of cpu_gemv.cpp, for the other sources of the module (cpu_decode.cpp
// chains them into a whole decode step and binds them). Contracts as documented where they are
// defined.
#pragma once

#include <torch/types.h>

#include <tuple>

torch::Tensor small_linear(torch::Tensor x, torch::Tensor w);

torch::Tensor moe_experts(torch::Tensor xs, torch::Tensor spans, torch::Tensor gate_up, torch::Tensor down);

torch::Tensor argmax_rows(torch::Tensor x);

torch::Tensor small_linear_q8(torch::Tensor x, torch::Tensor q, torch::Tensor scale);

torch::Tensor rms_norm(torch::Tensor x, torch::Tensor w, double eps);

std::tuple<torch::Tensor, torch::Tensor> moe_route(torch::Tensor logits, c10::optional<torch::Tensor> bias,
                                                   int64_t K, int64_t G, int64_t KG, int64_t method,
                                                   bool softmax, bool norm, double scaling);

torch::Tensor moe_routed(torch::Tensor x, torch::Tensor ids, torch::Tensor weights, torch::Tensor gate_up,
                         torch::Tensor down);

torch::Tensor moe_routed_q8(torch::Tensor x, torch::Tensor ids, torch::Tensor weights, torch::Tensor gate_up_q,
                            torch::Tensor gate_up_scale, torch::Tensor down_q, torch::Tensor down_scale);

// cpu_sample.cpp: one token per row of float32 logits [R, V] (model.sampling's contract).
torch::Tensor sample_rows(torch::Tensor logits, torch::Tensor temperature, torch::Tensor top_k, torch::Tensor top_p,
                          torch::Tensor u);


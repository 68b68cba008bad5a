// A whole decode step of a float32 CPU model in one call: every layer's norms, projections,
// attention (mla_fused) and MLP or MoE, then the final norm and the LM head; or a mixed pass, a
// prefill chunk's rows beside the decode rows.
//
// At decode sizes a layer is a few dozen small ops, and in Python each costs its dispatch on top
// of its work; here the same kernels run back to back with no interpreter between them. Every op
// is the one the Python path (model.model.DeepseekModel._forward) runs for a batch of at most
// SMALL_ROWS rows, in the same order, so the logits are the same bits.
//
// Legend: B rows, M hidden, L layers, D latent values per token.
#include <ATen/TensorOperators.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/cat.h>
#include <ATen/ops/linear.h>
#include <ATen/ops/silu.h>
#include <torch/csrc/utils/pybind.h>

#include <tuple>
#include <utility>
#include <vector>

#include "cpu_gemv.h"
#include "cpu_index.h"
#include "cpu_mla.h"

namespace {

// y = x @ w^T (+ bias) for a weight held as float32 ``w`` [N, K] or int8 ``q`` with ``scale``:
// the GEMV kernels, or torch's linear when there is a bias (as model.layers.linear does).
struct Linear {
  c10::optional<at::Tensor> w, q, scale, bias;

  Linear(c10::optional<at::Tensor> w_, c10::optional<at::Tensor> q_, c10::optional<at::Tensor> scale_,
         c10::optional<at::Tensor> bias_)
      : w(std::move(w_)), q(std::move(q_)), scale(std::move(scale_)), bias(std::move(bias_)) {
    TORCH_CHECK(w.has_value() != q.has_value(), "a Linear is float32 (w) or int8 (q, scale), exactly one");
    TORCH_CHECK(q.has_value() == scale.has_value(), "an int8 Linear needs its scale");
    TORCH_CHECK(!(bias.has_value() && q.has_value()), "an int8 Linear has no bias here");
  }

  at::Tensor operator()(const at::Tensor& x) const {
    if (bias.has_value()) return at::linear(x, *w, *bias);
    if (q.has_value()) return small_linear_q8(x.contiguous(), *q, *scale);
    return small_linear(x.contiguous(), *w);
  }
};

// down(silu(gate(x)) * up(x)), gate and up fused in one [2I, M] weight (model.layers.SwiGLU).
struct Mlp {
  Linear gate_up, down;

  at::Tensor operator()(const at::Tensor& x) const {
    auto gu = gate_up(x).chunk(2, -1);
    return down(at::silu(gu[0]) * gu[1]);
  }
};

// The gate, routed experts (all in this process) and shared experts of one MoE layer
// (model.moe.MoE with a LocalExpertExecutor); routing arguments as moe_route's.
struct Moe {
  at::Tensor gate;  // [E, M]
  c10::optional<at::Tensor> bias;
  int64_t top_k, groups, topk_groups, method;
  bool softmax, norm;
  double scaling;
  at::Tensor gate_up, down;  // [E, 2I, M], [E, M, I]: float32, or int8 with the scales below
  c10::optional<at::Tensor> gate_up_scale, down_scale;
  c10::optional<Mlp> shared;

  at::Tensor operator()(const at::Tensor& x) const {
    auto [ids, weights] = moe_route(at::linear(x, gate), bias, top_k, groups, topk_groups, method, softmax, norm,
                                    scaling);
    auto y = gate_up_scale.has_value()
                 ? moe_routed_q8(x, ids, weights, gate_up, *gate_up_scale, down, *down_scale)
                 : moe_routed(x, ids, weights, gate_up, down);
    return shared.has_value() ? y + (*shared)(x) : y;
  }
};

// One decoder layer: MLA (queries straight from x, or through the q_a low-rank path) and its FFN.
struct Layer {
  at::Tensor input_norm, post_norm;
  c10::optional<Linear> q, q_a, q_b;
  c10::optional<at::Tensor> q_a_norm;
  Linear kv_a;
  at::Tensor kv_a_norm, w_uk, w_uv_t;  // [R], [H, N, R], [H, R, V]
  Linear o;
  double scale;
  c10::optional<Mlp> mlp;
  c10::optional<Moe> moe;
};

// An MTP layer's input stage (model.mtp.MtpLayer.inputs): eh_proj([enorm(embed[t]), hnorm(h)]).
struct DraftInputs {
  at::Tensor embed, enorm, hnorm;  // [V, M], [M], [M]
  Linear eh_proj;                  // [M, 2M]

  at::Tensor operator()(const at::Tensor& hidden, const at::Tensor& next_ids, double eps) const {
    auto e = rms_norm(embed.index_select(0, next_ids), enorm, eps);
    return eh_proj(at::cat({e, rms_norm(hidden, hnorm, eps)}, -1));
  }
};

class DecodeStep {
 public:
  DecodeStep(double eps, bool interleave, at::Tensor norm, Linear lm_head)
      : eps_(eps), interleave_(interleave), norm_(std::move(norm)), lm_head_(std::move(lm_head)) {}

  void add_layer(at::Tensor input_norm, c10::optional<Linear> q, c10::optional<Linear> q_a,
                 c10::optional<at::Tensor> q_a_norm, c10::optional<Linear> q_b, Linear kv_a,
                 at::Tensor kv_a_norm, at::Tensor w_uk, at::Tensor w_uv_t, Linear o, double scale,
                 at::Tensor post_norm, c10::optional<Mlp> mlp, c10::optional<Moe> moe) {
    TORCH_CHECK(q.has_value() != q_a.has_value(), "layer ", layers_.size(), ": queries come from q or q_a, one");
    TORCH_CHECK(!q_a.has_value() || (q_a_norm.has_value() && q_b.has_value()),
                "layer ", layers_.size(), ": q_a needs q_a_norm and q_b");
    TORCH_CHECK(mlp.has_value() != moe.has_value(), "layer ", layers_.size(), ": an MLP or an MoE, one");
    layers_.push_back(Layer{std::move(input_norm), std::move(post_norm), std::move(q), std::move(q_a), std::move(q_b),
                            std::move(q_a_norm), std::move(kv_a), std::move(kv_a_norm), std::move(w_uk),
                            std::move(w_uv_t), std::move(o), scale, std::move(mlp), std::move(moe)});
  }

  int64_t num_layers() const { return static_cast<int64_t>(layers_.size()); }

  // Makes this the step of an MTP layer, which ``verify`` runs as the draft.
  void set_draft_inputs(at::Tensor embed, at::Tensor enorm, at::Tensor hnorm, Linear eh_proj) {
    draft_inputs_ = DraftInputs{std::move(embed), std::move(enorm), std::move(hnorm), std::move(eh_proj)};
  }

  // h [B, M] the tokens' embeddings, cos/sin [B, P/2] their angles, kv [L, slots, D] the pool,
  // new_slots [B], block_tables [B, X], seq_lens [B] (the new token included) -> fp32 logits
  // [B, V]; the new latents are written into kv. A mixed pass: the first T of the rows (h, cos,
  // sin, new_slots hold T + B) are a prefill chunk at positions chunk_start .. of the sequence
  // at chunk_table (mla_fused's), and only the rows from ``logits_from`` on get logits.
  at::Tensor forward(at::Tensor h, at::Tensor cos, at::Tensor sin, at::Tensor kv,
                        at::Tensor new_slots, at::Tensor block_tables, at::Tensor seq_lens,
                        int64_t page_size, c10::optional<at::Tensor> chunk_table, int64_t chunk_start,
                        int64_t logits_from) const {
    h = run_layers(h, cos, sin, kv, new_slots, block_tables, seq_lens, page_size, chunk_table, chunk_start);
    return lm_head_(rms_norm(h.narrow(0, logits_from, h.size(0) - logits_from), norm_, eps_));
  }

  // forward's logits, and every row's final hidden state as the LM head reads it (normed) [T + B, M]:
  // what a multi-token-prediction layer drafts from.
  std::tuple<at::Tensor, at::Tensor> forward_hidden(at::Tensor h, at::Tensor cos, at::Tensor sin, at::Tensor kv,
                                                    at::Tensor new_slots, at::Tensor block_tables,
                                                    at::Tensor seq_lens, int64_t page_size,
                                                    c10::optional<at::Tensor> chunk_table, int64_t chunk_start,
                                                    int64_t logits_from) const {
    h = run_layers(h, cos, sin, kv, new_slots, block_tables, seq_lens, page_size, chunk_table, chunk_start);
    auto normed = rms_norm(h, norm_, eps_);
    return {lm_head_(normed.narrow(0, logits_from, normed.size(0) - logits_from)), normed};
  }

  // A speculative decode pass and its drafts in one call: forward_hidden over the rows (a
  // sequence's last token and its drafts, at consecutive positions), each row's argmax as the
  // token after it, then ``draft`` (an MTP layer's step, its kv [1, slots, D] ``draft_kv``) at
  // the same positions with those tokens as its inputs. -> (logits [B, V], normed hidden states
  // [B, M], the argmaxes [B], the draft after each [B] (the MTP logits' argmax), the MTP's normed
  // hidden states [B, M]). The MTP latents written are right for the rows whose sampled token is
  // their argmax (every row under greedy decoding).
  std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor> verify(
      at::Tensor h, at::Tensor cos, at::Tensor sin, at::Tensor kv, at::Tensor draft_kv, at::Tensor new_slots,
      at::Tensor block_tables, at::Tensor seq_lens, int64_t page_size, const DecodeStep& draft) const {
    TORCH_CHECK(draft.draft_inputs_.has_value(), "verify's draft must be an MTP layer's step");
    auto [logits, normed] = forward_hidden(h, cos, sin, kv, new_slots, block_tables, seq_lens, page_size,
                                           c10::nullopt, 0, 0);
    auto guesses = argmax_rows(logits);
    auto x = (*draft.draft_inputs_)(normed, guesses, eps_);
    auto [draft_logits, draft_normed] = draft.forward_hidden(x, cos, sin, draft_kv, new_slots, block_tables,
                                                             seq_lens, page_size, c10::nullopt, 0, 0);
    return {logits, normed, guesses, argmax_rows(draft_logits), draft_normed};
  }

 private:
  at::Tensor run_layers(at::Tensor h, const at::Tensor& cos, const at::Tensor& sin, const at::Tensor& kv,
                        const at::Tensor& new_slots, const at::Tensor& block_tables, const at::Tensor& seq_lens,
                        int64_t page_size, const c10::optional<at::Tensor>& chunk_table, int64_t chunk_start) const {
    TORCH_CHECK(kv.dim() == 3 && kv.size(0) == num_layers(), "kv must be [", num_layers(), ", slots, D], got ",
                kv.sizes());
    for (int64_t i = 0; i < num_layers(); ++i) {
      const Layer& l = layers_[i];
      auto x = rms_norm(h.contiguous(), l.input_norm, eps_);
      auto queries = l.q.has_value() ? (*l.q)(x) : (*l.q_b)(rms_norm((*l.q_a)(x), *l.q_a_norm, eps_));
      auto attn = mla_fused(queries, l.kv_a(x), l.kv_a_norm, eps_, cos, sin, interleave_, l.w_uk, l.w_uv_t,
                            kv.select(0, i), new_slots, block_tables, seq_lens, chunk_table, chunk_start, l.scale,
                            page_size);
      h = h + l.o(attn);
      x = rms_norm(h, l.post_norm, eps_);
      h = h + (l.mlp.has_value() ? (*l.mlp)(x) : (*l.moe)(x));
    }
    return h;
  }

  double eps_;
  bool interleave_;
  at::Tensor norm_;
  Linear lm_head_;
  std::vector<Layer> layers_;
  c10::optional<DraftInputs> draft_inputs_;
};

}  // namespace

// The module: the kernels of cpu_gemv.cpp, cpu_mla.cpp and cpu_sample.cpp, and DecodeStep with the
// weight types it is built from. The one source with pybind11 and torch's tensor caster (the
// slowest to compile); the bindings need nothing else of torch/extension.h.
PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  namespace py = pybind11;
  m.def("small_linear", &small_linear, "x [M,K] @ w[N,K]^T for small M (fp32)");
  m.def("moe_experts", &moe_experts, "routed experts over expert-sorted rows (fp32)");
  m.def("moe_routed", &moe_routed, "group by expert, run, and combine weighted outputs (fp32)");
  m.def("moe_routed_clipped", &moe_routed_clipped, "moe_routed with DeepSeek-V4's clipped SwiGLU (fp32)");
  m.def("small_linear_q8", &small_linear_q8, "x [M,K] @ (q[N,K] * scale)^T for small M (int8 weights)");
  m.def("moe_routed_q8", &moe_routed_q8, "moe_routed with int8 expert weights and group scales");
  m.def("mla_decode_paged", &mla_decode_paged, "absorbed MLA decode over a paged latent pool (fp32)");
  m.def("mla_fused", &mla_fused,
        "a layer's absorbed MLA attention of a prefill chunk and decode rows from their projections (fp32)");
  m.def("mla_chunk_paged", &mla_chunk_paged, "a prefill chunk's absorbed MLA attention over a paged latent pool (fp32)");
  m.def("rms_norm", &rms_norm, "RMSNorm of each row (fp32)");
  m.def("index_topk", &index_topk, "each row's top-k keys by lightning-indexer score (fp32)");
  m.def("argmax_rows", &argmax_rows, "the index of each row's largest value (fp32)");
  m.def("moe_route", &moe_route, "DeepSeek top-K routing from gate logits (fp32)");
  m.def("sample_rows", &sample_rows, "one token per row: temperature, top-k, top-p, an inverse-CDF draw (fp32)");
  py::class_<Linear>(m, "Linear", "a projection: float32 w [N, K] (and bias), or int8 q [N, K] with scale")
      .def(py::init<c10::optional<at::Tensor>, c10::optional<at::Tensor>, c10::optional<at::Tensor>,
                    c10::optional<at::Tensor>>(),
           py::arg("w") = py::none(), py::arg("q") = py::none(), py::arg("scale") = py::none(),
           py::arg("bias") = py::none());
  py::class_<Mlp>(m, "Mlp", "down(silu(gate(x)) * up(x)), gate and up in one [2I, M] Linear")
      .def(py::init([](Linear gate_up, Linear down) { return Mlp{std::move(gate_up), std::move(down)}; }),
           py::arg("gate_up"), py::arg("down"));
  py::class_<Moe>(m, "Moe", "an MoE layer's gate (moe_route's arguments), local experts and shared experts")
      .def(py::init([](at::Tensor gate, c10::optional<at::Tensor> bias, int64_t top_k, int64_t groups,
                       int64_t topk_groups, int64_t method, bool softmax, bool norm, double scaling,
                       at::Tensor gate_up, at::Tensor down, c10::optional<at::Tensor> gate_up_scale,
                       c10::optional<at::Tensor> down_scale, c10::optional<Mlp> shared) {
             TORCH_CHECK(gate_up_scale.has_value() == down_scale.has_value(), "int8 experts need both scales");
             return Moe{std::move(gate), std::move(bias), top_k, groups, topk_groups, method, softmax, norm,
                        scaling, std::move(gate_up), std::move(down), std::move(gate_up_scale),
                        std::move(down_scale), std::move(shared)};
           }),
           py::arg("gate"), py::arg("bias"), py::arg("top_k"), py::arg("groups"), py::arg("topk_groups"),
           py::arg("method"), py::arg("softmax"), py::arg("norm"), py::arg("scaling"), py::arg("gate_up"),
           py::arg("down"), py::arg("gate_up_scale") = py::none(), py::arg("down_scale") = py::none(),
           py::arg("shared") = py::none());
  py::class_<DecodeStep>(m, "DecodeStep", "a float32 CPU model's whole decode step, layer by layer in C++")
      .def(py::init<double, bool, at::Tensor, Linear>(), py::arg("eps"), py::arg("interleave"), py::arg("norm"),
           py::arg("lm_head"))
      .def("add_layer", &DecodeStep::add_layer, py::arg("input_norm"), py::arg("q"), py::arg("q_a"),
           py::arg("q_a_norm"), py::arg("q_b"), py::arg("kv_a"), py::arg("kv_a_norm"), py::arg("w_uk"),
           py::arg("w_uv_t"), py::arg("o"), py::arg("scale"), py::arg("post_norm"), py::arg("mlp"), py::arg("moe"))
      .def("set_draft_inputs", &DecodeStep::set_draft_inputs, py::arg("embed"), py::arg("enorm"), py::arg("hnorm"),
           py::arg("eh_proj"))
      .def_property_readonly("num_layers", &DecodeStep::num_layers)
      .def("forward", &DecodeStep::forward, py::arg("h"), py::arg("cos"), py::arg("sin"), py::arg("kv"),
           py::arg("new_slots"), py::arg("block_tables"), py::arg("seq_lens"), py::arg("page_size"),
           py::arg("chunk_table") = py::none(), py::arg("chunk_start") = 0, py::arg("logits_from") = 0,
           py::call_guard<py::gil_scoped_release>())
      .def("forward_hidden", &DecodeStep::forward_hidden, py::arg("h"), py::arg("cos"), py::arg("sin"),
           py::arg("kv"), py::arg("new_slots"), py::arg("block_tables"), py::arg("seq_lens"), py::arg("page_size"),
           py::arg("chunk_table") = py::none(), py::arg("chunk_start") = 0, py::arg("logits_from") = 0,
           py::call_guard<py::gil_scoped_release>())
      .def("verify", &DecodeStep::verify, py::arg("h"), py::arg("cos"), py::arg("sin"), py::arg("kv"),
           py::arg("draft_kv"), py::arg("new_slots"), py::arg("block_tables"), py::arg("seq_lens"),
           py::arg("page_size"), py::arg("draft"), py::call_guard<py::gil_scoped_release>());
}

"""A float32 CPU model's decode step, or mixed pass, as one C++ call (``kernels/csrc/cpu_decode.cpp``).

Legend: B rows, M hidden, K experts per token, E expert slots.

``DeepseekModel.decode`` hands a decode pass of its own here, and ``DeepseekModel.mixed`` a mixed
pass whose prefill chunk attends absorbed (its rows beside the decode rows), when the model can
take it: float32 on the CPU with the kernels built, projections float32 or int8
(``model.quant``), routed experts in this process (a ``LocalExpertExecutor`` not running
Triton), and no routing hook. The C++ step runs every layer's kernels back to back, the same
kernels in the same order as the Python path for up to ``max_rows`` rows, so its logits are the
same bits; more rows (where BLAS takes over the projections) and anything it cannot hold take
the Python path.

The step holds references to the weights it was built from; it is rebuilt when any of them is
replaced (``quantize_model``, a new expert executor): ``CpuStep.of`` compares their identities.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, NamedTuple

import torch

from kernels.cpu_gemv import ROUTE_METHODS, cpu_kernels
from model.layers import SMALL_ROWS, SwiGLU
from model.mla import MLAWeights
from model.moe import _GEMV_ROWS_PER_EXPERT, LocalExpertExecutor, MoE
from model.quant import Q8Weight

if TYPE_CHECKING:
    from model.kv_cache import LatentKVPool
    from model.model import DecoderLayer, DeepseekModel, _Chunk, _DecodeBatch, _Rows
    from model.mtp import MtpLayer

__all__ = ["CpuStep", "Stack"]


class _Ineligible(Exception):
    """A weight or setting the C++ step does not take."""


class Stack(NamedTuple):
    """Decoder layers run back to back, then a norm and an LM head: the model's own, or an MTP
    layer's (``model.mtp``, which ``mtp`` then is: its input stage runs in ``CpuStep.verify``);
    ``first`` is the pool layer of its first."""

    layers: list[DecoderLayer]
    norm: torch.Tensor
    lm_head: torch.Tensor
    first: int = 0
    mtp: MtpLayer | None = None


class CpuStep:
    def __init__(self, model: DeepseekModel, key: list, stack: Stack | None = None) -> None:
        """The step of ``model`` (or of ``stack``, an MTP layer of it) as it is now; ``step`` is
        None (and ``why_not`` says why) when the model has something the C++ step cannot run:
        that answer is kept as long as the weights are (``of``), so such a model pays one check
        per pass, not a build."""
        self.key = key
        self.stack = stack or Stack(model.layers, model.norm, model.lm_head)
        self.max_rows = SMALL_ROWS
        self.step, self.why_not = None, ""
        try:
            self.step = self._build(model, self.stack)
        except _Ineligible as e:
            self.why_not = str(e)

    def _build(self, model: DeepseekModel, stack: Stack):
        mod = cpu_kernels()
        if mod is None or model.paged_kernel != "cpu":
            raise _Ineligible("no C++ kernels for this model")
        cfg = model.cfg
        step = mod.DecodeStep(cfg.rms_norm_eps, cfg.rope_interleave, stack.norm, _linear(mod, stack.lm_head))
        for layer in stack.layers:
            attn, w = layer.attn, layer.attn.w
            mlp = moe = None
            if isinstance(layer.mlp, MoE):
                moe = self._moe(mod, layer.mlp)
            else:
                mlp = _mlp(mod, layer.mlp)
            step.add_layer(
                layer.input_norm, _linear(mod, w.q), _linear(mod, w.q_a, w.q_a_bias), w.q_a_norm, _linear(mod, w.q_b),
                _linear(mod, w.kv_a, w.kv_a_bias), w.kv_a_norm, attn.w_uk, attn.w_uv_t, _linear(mod, w.o, w.o_bias),
                attn.scale, layer.post_attn_norm, mlp, moe,
            )
        if stack.mtp is not None:
            m = stack.mtp
            _check_f32(m.embed, m.enorm, m.hnorm)
            step.set_draft_inputs(m.embed, m.enorm, m.hnorm, _linear(mod, m.eh_proj))
        return step

    @classmethod
    def of(cls, model: DeepseekModel, cached: CpuStep | None, stack: Stack | None = None) -> CpuStep:
        """The step for ``model`` (or ``stack``) as its weights are now: ``cached`` when none
        was replaced since it was built, else a new one."""
        stack = stack or Stack(model.layers, model.norm, model.lm_head)
        key = _weights_key(stack)
        if cached is not None and _same(cached.key, key):
            return cached
        return cls(model, key, stack)

    def takes(self, rows: int) -> bool:
        """Whether the C++ step runs a pass of ``rows`` rows."""
        return self.step is not None and rows <= self.max_rows

    def _kv(self, pool: LatentKVPool) -> torch.Tensor:
        return pool.data.narrow(0, self.stack.first, len(self.stack.layers))

    def __call__(self, batch: _DecodeBatch, pool: LatentKVPool, hidden: bool = False):
        """The decode pass of ``batch`` (``DeepseekModel.decode``'s inputs as the Python path
        takes them, at most ``max_rows`` rows) -> fp32 logits [B, V]; writes the new latents.
        ``hidden``: (the logits, the rows' final hidden states normed [B, M])."""
        run = self.step.forward_hidden if hidden else self.step.forward
        return run(batch.h, batch.cos, batch.sin, self._kv(pool), batch.new_slots, batch.block_tables, batch.lens(),
                   pool.page_size)

    def verify(self, batch: _DecodeBatch, pool: LatentKVPool, draft: CpuStep):
        """A speculative decode pass of ``batch`` and MTP layer ``draft``'s pass over the same
        rows, each row's argmax as its next token, in one call -> (fp32 logits [B, V], normed
        hidden states [B, M], the argmaxes [B], the draft after each row [B], the MTP's normed
        hidden states [B, M]); writes both passes' latents (the MTP's right where a row's token is
        its argmax)."""
        return self.step.verify(batch.h, batch.cos, batch.sin, self._kv(pool), draft._kv(pool), batch.new_slots,
                                batch.block_tables, batch.lens(), pool.page_size, draft.step)

    def mixed(self, chunk: _Chunk, batch: _DecodeBatch, rows: _Rows, pool: LatentKVPool, hidden: bool = False):
        """The mixed pass of an absorbed prefill ``chunk`` (T rows) and a decode ``batch`` (B rows,
        T + B at most ``max_rows``; ``rows`` their inputs joined) -> fp32 logits [1 + B, V] of the
        chunk's last token and the batch's rows; writes the new latents. ``hidden``: (the logits,
        every row's final hidden state normed [T + B, M])."""
        run = self.step.forward_hidden if hidden else self.step.forward
        return run(rows.h, rows.cos, rows.sin, self._kv(pool), rows.new_slots, batch.block_tables, batch.lens(),
                   pool.page_size, chunk.block_table, chunk.start, chunk.t - 1)

    def _moe(self, mod, moe: MoE):
        executor = moe.executor
        if type(executor) is not LocalExpertExecutor or executor.impl == "triton" or moe.impl == "triton" \
                or moe.on_route is not None:
            raise _Ineligible("routed experts outside this process, on Triton, or a routing hook")
        cfg, experts = moe.cfg, executor.layers[moe.layer_idx]
        slots = experts.gate_up.shape[0]
        # past this many rows the Python path runs the experts as a grouped GEMM
        self.max_rows = min(self.max_rows, _GEMV_ROWS_PER_EXPERT * slots // cfg.num_experts_per_tok)
        if isinstance(experts.gate_up, Q8Weight) and isinstance(experts.down, Q8Weight):
            gate_up, gate_up_scale, down, down_scale = experts.gate_up.q, experts.gate_up.scale, experts.down.q, \
                experts.down.scale
        elif isinstance(experts.gate_up, torch.Tensor) and isinstance(experts.down, torch.Tensor):
            gate_up, gate_up_scale, down, down_scale = experts.gate_up, None, experts.down, None
            _check_f32(gate_up, down)
        else:
            raise _Ineligible("experts neither float32 nor int8")
        bias = moe.gate.e_score_correction_bias
        bias = bias.float().contiguous() if bias is not None and cfg.topk_method == "noaux_tc" else None
        return mod.Moe(moe.gate.weight.float(), bias, cfg.num_experts_per_tok, cfg.n_group, cfg.topk_group,
                       ROUTE_METHODS.index(cfg.topk_method), cfg.scoring_func == "softmax", cfg.norm_topk_prob,
                       cfg.routed_scaling_factor, gate_up.contiguous(), down.contiguous(), gate_up_scale, down_scale,
                       _mlp(mod, moe.shared) if moe.shared is not None else None)


def _check_f32(*tensors: torch.Tensor) -> None:
    if any(t.dtype != torch.float32 or t.device.type != "cpu" or t.requires_grad for t in tensors):
        raise _Ineligible("a weight that is not a float32 CPU tensor")


def _linear(mod, w, bias: torch.Tensor | None = None):
    """The C++ ``Linear`` of a weight as ``model.layers.linear`` takes it (None for no weight)."""
    if w is None:
        return None
    if isinstance(w, Q8Weight):
        if bias is not None:
            raise _Ineligible("an int8 weight with a bias")
        return mod.Linear(q=w.q, scale=w.scale)
    if not isinstance(w, torch.Tensor):
        raise _Ineligible(f"a {type(w).__name__} weight")
    _check_f32(w, *([bias] if bias is not None else []))
    return mod.Linear(w=w.contiguous(), bias=bias)


def _mlp(mod, mlp: SwiGLU):
    return mod.Mlp(_linear(mod, mlp.gate_up), _linear(mod, mlp.down))


def _weights_key(stack: Stack) -> list:
    """Every object the step is built from, held (so no identity is reused while the step lives):
    a replaced weight, expert table, executor or routing hook differs in identity."""
    key: list = [stack.norm, stack.lm_head]
    if stack.mtp is not None:
        key += (stack.mtp.embed, stack.mtp.enorm, stack.mtp.hnorm, stack.mtp.eh_proj)
    for layer in stack.layers:
        attn, mlp = layer.attn, layer.mlp
        key += (layer.input_norm, layer.post_attn_norm, attn.w_uk, attn.w_uv_t)
        key += (getattr(attn.w, f) for f in MLAWeights.__slots__)
        if isinstance(mlp, MoE):
            tables = getattr(mlp.executor, "layers", None)
            experts = tables.get(mlp.layer_idx) if isinstance(tables, dict) else None
            key += (mlp.gate.weight, mlp.gate.e_score_correction_bias, mlp.executor, mlp.on_route, experts,
                    getattr(experts, "gate_up", None), getattr(experts, "down", None))
            mlp = mlp.shared
        key += (mlp, getattr(mlp, "gate_up", None), getattr(mlp, "down", None))
    return key


def _same(a: list, b: list) -> bool:
    return len(a) == len(b) and all(x is y for x, y in zip(a, b, strict=True))

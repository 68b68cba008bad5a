"""Fixed-shape decode steps: a batch padded up to a bucket size, every input in a static buffer.

Legend: B rows of a step, K its bucket (B <= K), X pages per block-table row, Z page size,
V vocab.

A bucket's step has one shape whatever the batch and the context: block tables are X pages wide
(the pool's longest sequence), and the paged attention kernels (Triton's, or the C++ one on a
float32 CPU model) read only each row's own tokens, so the width costs nothing. The K - B padding
rows decode token 0 at position 0 of the pool's scratch page, a page no sequence is given: they
write only there and their logits are dropped.

On CUDA each bucket's step is captured once as a CUDA graph (``capture``) and replayed: the step
copies its inputs into the buffers and launches every kernel of every layer with no Python in
between, which at small batches is most of a decode step's time. A capture that fails (a kernel
that reads a value back to the host) leaves that bucket eager, with a warning: outputs never
depend on whether a step was captured. Without CUDA the same step runs eagerly (on a float32
CPU model as one C++ call: ``model.cpu_step``).

Speculative decoding's steps take the same shape: a verify step is a decode step whose rows are
each sequence's last token and drafts, returning the rows' hidden states beside their logits
(``hidden``); a draft step is an MTP layer's pass (``draft_layer``), whose rows carry a hidden
state as input too.
"""

from __future__ import annotations

import logging

import torch

from model.kv_cache import LatentKVPool
from model.model import DeepseekModel

__all__ = ["FixedShapeDecode", "buckets_up_to", "tuning_tokens"]

log = logging.getLogger(__name__)


def tuning_tokens(rows: int, vocab_size: int) -> torch.Tensor:
    """``rows`` distinct-as-possible token ids spread over the vocabulary (a stride coprime with
    most vocabulary sizes), for the steps that tune kernels before a capture."""
    return (torch.arange(rows, dtype=torch.long) * 7919 + 1) % vocab_size


def buckets_up_to(max_batch: int) -> list[int]:
    """Batch sizes a step is padded to: powers of two below ``max_batch``, then ``max_batch``."""
    if max_batch < 1:
        raise ValueError(f"max_batch must be >= 1, got {max_batch}")
    out = [1]
    while out[-1] * 2 < max_batch:
        out.append(out[-1] * 2)
    return out + ([max_batch] if out[-1] != max_batch else [])


class FixedShapeDecode:
    def __init__(self, model: DeepseekModel, pool: LatentKVPool, scratch_page: int, max_pages: int,
                 buckets: list[int], capture: bool = False, hidden: bool = False,
                 draft_layer: int | None = None) -> None:
        """``scratch_page``: a page of ``pool`` that no sequence holds (padding rows write there);
        ``max_pages``: the block-table width, at least any sequence's pages; ``buckets``: the
        batch sizes (ascending); ``capture``: capture a CUDA graph per bucket (CUDA only);
        ``hidden``: the step returns (logits, the rows' normed hidden states), as
        ``decode(hidden=True)``; ``draft_layer``: the step is that MTP layer's ``draft`` (it
        returns both too)."""
        if model.paged_kernel is None:
            raise ValueError("fixed-shape decode needs a paged attention kernel (impl 'triton', or a float32 CPU "
                             "model with the CPU kernels built)")
        if not 0 <= scratch_page < pool.num_pages:
            raise ValueError(f"scratch page {scratch_page} is not a page of the {pool.num_pages}-page pool")
        if capture and model.device.type != "cuda":
            raise ValueError(f"CUDA graphs need a CUDA model, this one is on {model.device}")
        if not buckets or sorted(set(buckets)) != list(buckets) or buckets[0] < 1:
            raise ValueError(f"buckets must be ascending positive batch sizes, got {buckets}")
        if draft_layer is not None and not 0 <= draft_layer < len(model.mtp):
            raise ValueError(f"the model has {len(model.mtp)} MTP layers, not a layer {draft_layer}")
        self.model, self.pool, self.scratch_page = model, pool, scratch_page
        self.hidden, self.draft_layer = hidden or draft_layer is not None, draft_layer
        self.buckets = list(buckets)
        self.width = max_pages
        self.max_len = max_pages * pool.page_size
        dev, k = model.device, self.buckets[-1]
        self.tokens = torch.zeros(k, dtype=torch.long, device=dev)
        self.positions = torch.zeros(k, dtype=torch.long, device=dev)
        self.tables = torch.full((k, max_pages), scratch_page, dtype=torch.long, device=dev)
        self.hidden_in = torch.zeros(k, model.cfg.hidden_size, dtype=model.dtype, device=dev) \
            if draft_layer is not None else None
        # the RoPE table must hold every position before a graph captures its address
        model.rope.cos_sin(self.positions[:1], model.dtype, top=self.max_len)
        self._graphs: dict[int, tuple[torch.cuda.CUDAGraph, torch.Tensor]] = {}
        if capture:
            self.capture()

    def bucket(self, b: int) -> int:
        """The smallest bucket that holds ``b`` rows."""
        for k in self.buckets:
            if k >= b:
                return k
        raise ValueError(f"a batch of {b} is larger than the largest bucket, {self.buckets[-1]}")

    @property
    def captured(self) -> list[int]:
        return sorted(self._graphs)

    @torch.inference_mode()
    def __call__(self, token_ids: torch.Tensor, block_tables: torch.Tensor, positions: torch.Tensor,
                 hidden_in: torch.Tensor | None = None):
        """``model.decode``'s contract (token_ids [B], block_tables [B, W <= X], positions [B];
        writes the new latents) -> fp32 logits [B, V], valid until the next step; with
        ``hidden`` (logits, normed hidden states [B, M]). A draft step: ``model.draft``'s, its
        ``hidden_in`` [B, M] the rows' input hidden states, ``token_ids`` the next tokens."""
        b, w = block_tables.shape
        if w > self.width:
            raise ValueError(f"block tables of {w} pages are wider than this step's {self.width}")
        k = self.bucket(b)
        self.tokens[:b].copy_(token_ids, non_blocking=True)
        self.positions[:b].copy_(positions, non_blocking=True)
        self.tables[:b, :w].copy_(block_tables, non_blocking=True)
        if self.hidden_in is not None:
            self.hidden_in[:b].copy_(hidden_in, non_blocking=True)
        self._pad(b, k)
        graph = self._graphs.get(k)
        out = self._step(k) if graph is None else graph[1]
        if graph is not None:
            graph[0].replay()
        return tuple(t[:b] for t in out) if self.hidden else out[:b]

    def _pad(self, lo: int, hi: int) -> None:
        """Rows ``lo:hi`` decode token 0 at position 0 of the scratch page."""
        self.tokens[lo:hi] = 0
        self.positions[lo:hi] = 0
        self.tables[lo:hi, 0] = self.scratch_page
        if self.hidden_in is not None:
            self.hidden_in[lo:hi] = 0

    def _step(self, k: int):
        """The step of the first ``k`` rows of the buffers -> logits [k, V] (with ``hidden``: and
        their normed hidden states [k, M])."""
        if self.draft_layer is not None:
            return self.model.draft(self.draft_layer, self.hidden_in[:k], self.tokens[:k], self.pool, self.tables[:k],
                                    self.positions[:k], max_len=self.max_len)
        return self.model.decode(self.tokens[:k], self.pool, self.tables[:k], self.positions[:k], max_len=self.max_len,
                                 **({"hidden": True} if self.hidden else {}))

    def capture(self) -> None:
        """Capture every bucket's step as a CUDA graph, the largest first (the smaller ones reuse
        its memory). The buffers hold padding rows only meanwhile: nothing but the scratch page
        is written."""
        self._pad(0, self.buckets[-1])
        # the warm-up steps tune the kernels' tiles: distinct tokens, so their rows route over the
        # experts as a real batch's do (padding's token 0 would send every row to the same ones)
        self.tokens[:] = tuning_tokens(len(self.tokens), self.model.cfg.vocab_size).to(self.tokens.device)
        memory = torch.cuda.graph_pool_handle()
        for k in reversed(self.buckets):
            side = torch.cuda.Stream()
            side.wait_stream(torch.cuda.current_stream())
            try:
                with torch.inference_mode(), torch.cuda.stream(side):
                    for _ in range(2):  # Triton compiles and tunes here, not inside the capture
                        self._step(k)
                torch.cuda.current_stream().wait_stream(side)
                graph = torch.cuda.CUDAGraph()
                with torch.inference_mode(), torch.cuda.graph(graph, pool=memory):
                    out = self._step(k)
            except RuntimeError as e:  # a host sync in some kernel: this bucket stays eager
                torch.cuda.synchronize()
                log.warning("decode step of batch %d not captured as a CUDA graph (%s); it runs eagerly", k, e)
                continue
            self._graphs[k] = (graph, out)
        torch.cuda.synchronize()
        self._pad(0, self.buckets[-1])

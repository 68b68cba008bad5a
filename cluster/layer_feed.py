"""A prompt's loaded prefix written into its pages layer by layer, as its first pass reaches each.

The prefix's units come from a ``cachedir.layered.LayeredLoad``: their payloads fill layer by
layer on the cache's reader thread while the engine computes. The feed is the prefill pass's
``before_layer``: before layer ``l`` reads the pool it waits for layer ``l`` of every unit and
copies those rows into the prompt's pages. ``finish`` (after the pass) writes the layers the
pass did not reach (the MTP layers') and says whether the load was verified: until it says yes
nothing of the pass may be used.
"""

from __future__ import annotations

import time
import warnings

import torch

from cachedir.unit import Unit
from cluster.kv_manager import KVManager
from cluster.request import Sequence

__all__ = ["LayerFeed"]


class LayerFeed:
    def __init__(self, load, kv: KVManager, seq: Sequence, first: int, units: list[Unit], timeout_s: float) -> None:
        """``units`` are ``seq``'s units ``first``, ``first + 1``, ... (their pages given);
        ``load`` fills their payloads; waits end after ``timeout_s`` (the load is then a miss)."""
        self.load, self.kv, self.first, self.units = load, kv, first, units
        self.timeout_s = timeout_s
        self.layers = units[0].num_layers
        self.written = 0  # layers in the pages so far
        with warnings.catch_warnings():  # read-only buffers: write_layer copies them
            warnings.simplefilter("ignore", UserWarning)
            self._flat = [torch.frombuffer(u.payload, dtype=kv.pool.dtype) for u in units]
        self._pages = [p for j in range(len(units)) for p in kv.unit_page_list(seq, first + j)]
        self.failed = False
        self.waited_s = 0.0  # time the pass spent waiting for layers (not its compute)

    def __call__(self, layer: int) -> None:
        """Before the pass's layer ``layer``: every layer up to it in the pages."""
        while self.written <= min(layer, self.layers - 1):
            self._write(self.written)
            self.written += 1

    def _write(self, layer: int) -> None:
        t0 = time.perf_counter()
        ready = not self.failed and self.load.layer(layer, self.timeout_s)
        self.waited_s += time.perf_counter() - t0
        if not ready:
            self.failed = True  # the pass goes on over whatever the pages hold; it is discarded
            return
        tokens = self.kv.unit_tokens
        rows = torch.cat([flat[layer * tokens * unit.dim : (layer + 1) * tokens * unit.dim].view(tokens, unit.dim)
                          for flat, unit in zip(self._flat, self.units, strict=True)])
        self.kv.pool.write_layer(self._pages, layer, rows)  # every unit's rows of the layer in one copy

    def finish(self) -> bool:
        """After the pass: the remaining layers in the pages; whether the load was whole and
        verified (else the pass's results must be thrown away)."""
        self(self.layers - 1)
        t0 = time.perf_counter()
        ok = not self.failed and self.load.verified(self.timeout_s)
        self.waited_s += time.perf_counter() - t0
        return ok

"""The replica's latent KV: the paged pool, its pages (shared prefixes counted by reference), the
running sequences' block-table rows, and moving cache units and handed-off prompts in and out.

A sequence's ``pages`` list its pages in order; while it runs it also holds a row of the block
tables (``cluster.block_tables``: on the engine's device, changed in place) that mirrors them, so
a decode step reads rows instead of building tables from Python lists. Whole-unit pages of finished prompts stay in the prefix table (one reference each)
for later requests; ``allocate`` drops its least recently used entries when pages run short.
"""

from __future__ import annotations

import array
import heapq
import warnings
from collections import Counter
from collections.abc import Iterable

import torch

from cachedir.unit import Unit
from cluster.block_tables import BlockTables
from cluster.pages import PageAllocator, PrefixTable
from cluster.request import Sequence
from model.model import DeepseekModel

__all__ = ["KVManager", "long_tensor"]


def long_tensor(values: list[int]) -> torch.Tensor:
    """An int64 tensor [N] of ``values`` (a fifth of ``torch.tensor``'s time on a list: it
    infers a type per element, tens of microseconds for a batch's tokens)."""
    return torch.frombuffer(array.array("q", values), dtype=torch.int64) if values else torch.zeros(0, dtype=torch.long)


class KVManager:
    def __init__(self, model: DeepseekModel, num_pages: int, page_size: int, max_rows: int, unit_tokens: int) -> None:
        if unit_tokens % page_size:
            raise ValueError(f"page_size {page_size} must divide the {unit_tokens}-token unit")
        # one page past the allocator's: the scratch page that a fixed-shape step's padding rows write
        self.pool = self._new_pool(model, num_pages + 1, page_size)
        self.scratch_page = num_pages
        self.pages = PageAllocator(num_pages)
        self.prefix = PrefixTable(self.pages)
        self.num_pages, self.page_size, self.unit_tokens = num_pages, page_size, unit_tokens
        self.unit_pages = unit_tokens // page_size
        self.max_pages = min(num_pages, -(-(model.cfg.max_position_embeddings + 1) // page_size))
        self._tables = BlockTables(max_rows, self.max_pages, 0, model.device)
        self._free_rows = list(range(max_rows))  # a heap: the lowest free row is taken first

    def _new_pool(self, model: DeepseekModel, num_pages: int, page_size: int):
        return model.new_pool(num_pages, page_size)

    def pages_for(self, tokens: int) -> int:
        return -(-tokens // self.page_size)

    # -- pages ---------------------------------------------------------------------------
    def allocate(self, n: int) -> list[int] | None:
        """``n`` fresh pages, dropping prefix entries if that frees enough; None otherwise."""
        pages = self.pages.allocate(n)
        if pages is None:
            self.prefix.evict(n)
            pages = self.pages.allocate(n)
        return pages

    def admit(self, seq: Sequence, shared: list[list[int]], tokens: int) -> bool:
        """Pages for ``tokens`` tokens of ``seq``: the ``shared`` prefix pages (a reference each)
        and fresh ones for the rest; False (nothing held) when too few are free."""
        for pages in shared:
            self.pages.incref(pages)
        fresh = self.allocate(self.pages_for(tokens) - len(shared) * self.unit_pages)
        if fresh is None:
            for pages in shared:
                self.pages.release(pages)
            return False
        seq.pages = [p for pages in shared for p in pages] + fresh
        return True

    def grow(self, seq: Sequence) -> bool:
        """A page for ``seq``'s next token when its pages are full (its table row too, while it
        runs), dropping prefix entries for it if need be; False when none is free."""
        return self.grow_to(seq, seq.length, evict=True)

    def grow_to(self, seq: Sequence, tokens: int, evict: bool = False) -> bool:
        """Pages for ``seq``'s first ``tokens`` positions (its table row too, while it runs):
        free ones, or with ``evict`` those prefix entries give up (a speculative step's drafts
        take only free ones); False (nothing taken) when too few."""
        need = self.pages_for(tokens) - len(seq.pages)
        if need <= 0:
            return True
        pages = self.allocate(need) if evict else self.pages.allocate(need)
        if pages is None:
            return False
        if seq.row is not None:
            self._tables.write(seq.row, len(seq.pages), pages)
        seq.pages.extend(pages)
        return True

    def release(self, seq: Sequence) -> None:
        self.pages.release(seq.pages)
        seq.pages = []

    share_at_input = False  # units are shared when the sequence finishes (its pages are all held then)

    def match(self, keys: list[bytes]) -> list:
        """The pool's pages of the longest run of ``keys`` (the prefix table's) a prompt can go on
        after, for ``admit``."""
        return self.prefix.match(keys)

    def table(self, seq: Sequence) -> torch.Tensor:
        """``seq``'s block table for a prefill chunk."""
        return long_tensor(seq.pages)

    def prepare(self, seq: Sequence, end: int) -> None:
        """Before a chunk computes ``seq`` up to ``end``: pages it needs beyond ``admit``'s (none here)."""

    def trim(self, seq: Sequence) -> None:
        """After a pass: give back what ``seq`` no longer needs (nothing here)."""

    def share(self, keys: list[bytes], seq: Sequence) -> None:
        """Keep ``seq``'s pages of its whole units ``keys`` for later prompts (prefix sharing)."""
        for i, key in enumerate(keys):
            self.prefix.insert(key, self.unit_page_list(seq, i))

    def unit_page_list(self, seq: Sequence, unit: int) -> list[int]:
        return seq.pages[unit * self.unit_pages : (unit + 1) * self.unit_pages]

    # -- block-table rows ----------------------------------------------------------------
    def claim_row(self, seq: Sequence) -> None:
        """``seq`` starts running: the lowest free row of the block tables (running rows stay
        packed from row 0), filled with its pages."""
        seq.row = heapq.heappop(self._free_rows)
        self._tables.write(seq.row, 0, seq.pages)

    def free_row(self, seq: Sequence) -> None:
        heapq.heappush(self._free_rows, seq.row)
        seq.row = None

    def tables(self, batch: list[Sequence]) -> torch.Tensor:
        """Block tables [B, W] of running sequences (W: the longest's pages) on the model's
        device: a view of the rows when the batch holds consecutive rows in order (no copy that
        grows with context), else the rows gathered."""
        return self._tables.rows([s.row for s in batch], max([len(s.pages) for s in batch]))

    # -- units and prompts in and out ----------------------------------------------------
    def fits(self, unit: Unit) -> bool:
        """Whether ``unit`` holds KV of this pool's shape and dtype."""
        return (unit.num_layers == self.pool.row_layers and unit.dim == self.pool.row_dim
                and unit.dtype == str(self.pool.dtype).removeprefix("torch.")
                and len(unit.token_ids) == self.unit_tokens)

    def write_unit(self, seq: Sequence, index: int, unit: Unit) -> None:
        """``unit``'s KV into the pages of ``seq``'s unit ``index``."""
        with warnings.catch_warnings():  # the buffer is read-only; write_pages copies it
            warnings.simplefilter("ignore", UserWarning)
            flat = torch.frombuffer(unit.payload, dtype=self.pool.dtype)
        self.pool.write_unit(self.unit_page_list(seq, index), index,
                             flat.view(unit.num_layers, self.unit_tokens, unit.dim))

    @property
    def resumable(self) -> bool:
        """Whether going on after a cached unit needs a resume record too (``model.v4.kv``)."""
        return hasattr(self.pool, "read_resume")

    def fits_resume(self, unit: Unit) -> bool:
        return (unit.num_layers == 1 and len(unit.token_ids) == 1 and unit.dim == self.pool.resume_dim
                and unit.dtype == str(self.pool.dtype).removeprefix("torch."))

    def read_resume(self, seq: Sequence, end: int) -> torch.Tensor:
        """What going on after ``seq``'s first ``end`` tokens needs besides their units: [1, 1, dim]."""
        return self.pool.read_resume(self._window_table(seq), end).cpu().contiguous()

    def _window_table(self, seq: Sequence) -> torch.Tensor:
        """The pages of ``seq``'s per-token window rows (here: its pages)."""
        return long_tensor(seq.pages)

    def write_resume(self, seq: Sequence, end: int, unit: Unit, start: int) -> None:
        """A resume record (``read_resume``'s) into ``seq``'s pages from position ``start``."""
        with warnings.catch_warnings():  # the buffer is read-only; the write copies it
            warnings.simplefilter("ignore", UserWarning)
            flat = torch.frombuffer(unit.payload, dtype=self.pool.dtype)
        self.pool.write_resume(self._window_table(seq), end, flat.view(1, 1, unit.dim), start)

    def unit_bytes(self) -> int:
        """Bytes of one cache unit of this pool's KV."""
        return self.pool.row_layers * self.unit_tokens * self.pool.row_dim * self.pool.dtype.itemsize

    def read_unit(self, seq: Sequence, index: int) -> torch.Tensor:
        """The KV of ``seq``'s unit ``index``: [row_layers, unit_tokens, row_dim], a copy in host
        memory."""
        return self.pool.read_unit(self.unit_page_list(seq, index), index).cpu().contiguous()

    def import_prompt(self, seq: Sequence, kv: torch.Tensor) -> None:
        """A prompt's KV computed elsewhere (``export_prompt``'s) into ``seq``'s pages."""
        self.pool.import_tokens(long_tensor(seq.pages), kv, len(seq.req.prompt_ids))

    def export_prompt(self, seq: Sequence) -> torch.Tensor:
        """``seq``'s prompt KV in host memory, handed to another replica (``pool.handoff_shape``)."""
        return self.pool.export_tokens(long_tensor(seq.pages), len(seq.req.prompt_ids))

    # -- checks --------------------------------------------------------------------------
    def check_integrity(self, seqs: Iterable[Sequence], running: list[Sequence]) -> None:
        """Every page's refcount equals its holders (``seqs``, prefix entries): no leak, no
        double free; the running sequences' rows mirror their pages; no other row is taken."""
        seqs, running_ids = list(seqs), {id(s) for s in running}
        self.pages.check_integrity()
        holders = Counter(p for s in seqs for p in s.pages)
        holders.update(p for pages in self.prefix.entries() for p in pages)
        for page in range(self.num_pages):
            assert self.pages.refcount(page) == holders[page], (page, self.pages.refcount(page), holders[page])
        rows = [s.row for s in running]
        assert None not in rows and sorted(rows + self._free_rows) == list(range(self._tables.shape[0])), rows
        for s in running:
            assert self._tables.host[s.row, : len(s.pages)].tolist() == s.pages, (s.req.request_id, s.pages)
        assert torch.equal(self._tables.device_copy().cpu(), self._tables.host), "device block tables drifted"
        assert all(s.row is None for s in seqs if id(s) not in running_ids)

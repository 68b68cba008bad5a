"""KV whose per-token rows are needed only near the end of a sequence (DeepSeek-V4's window).

A V4 pool keeps two page spaces: pages for a sequence's compressed entries, kept while it runs
and shared by prefix as V3's latent pages are, and *window pages* for its per-token rows (the
sliding window's K=V, the compressors' inputs), which only the last ``keep`` positions need.
``WindowKVManager`` gives each sequence window pages as its chunks and decode steps reach them and
takes back those that fall behind ``keep``, so a sequence holds its compressed entries plus a
fixed window however long it grows. Its window pages are ``Sequence.window_pages`` (-1 where none
is held), beside ``pages``, and its block tables are [2, pages] (``model.v4.model``).

A prompt's units become prefix entries once it is computed (by its end its window is gone), each
keeping the window pages it still has; a later prompt shares a run of units only up to one after
which those pages hold what going on reads.
"""

from __future__ import annotations

from collections import Counter, OrderedDict
from collections.abc import Iterable

import torch

from cachedir.unit import Unit
from cluster.block_tables import BlockTables
from cluster.kv_manager import KVManager, long_tensor
from cluster.pages import PageAllocator
from cluster.request import Sequence

__all__ = ["WindowKVManager", "kv_manager"]


def kv_manager(model, num_pages: int, page_size: int, max_rows: int, unit_tokens: int, max_chunk: int,
               drafts: int = 0) -> KVManager:
    """The KV manager a model's pool needs: ``WindowKVManager`` where the model keeps window rows
    apart (``model.window_keep``), else ``KVManager``. ``drafts``: speculative tokens a running
    sequence verifies a step, past its next position."""
    keep = getattr(model, "window_keep", None)
    if keep is None:
        return KVManager(model, num_pages, page_size, max_rows, unit_tokens)
    return WindowKVManager(model, num_pages, page_size, max_rows, unit_tokens, keep, max_chunk, drafts)


class WindowKVManager(KVManager):
    def __init__(self, model, num_pages: int, page_size: int, max_rows: int, unit_tokens: int, keep: int,
                 max_chunk: int, drafts: int = 0) -> None:
        """``keep``: positions behind the next one whose window rows a sequence must hold (what
        its next token reads, and a resume record at its last whole unit); ``max_chunk``: the
        longest prefill chunk, whose rows are held at once; ``drafts``: the positions past the
        next one that a speculative step writes."""
        self.back = keep  # going on at a position reads this many window rows behind it
        self.keep = keep + unit_tokens  # ... and a resume record at the last whole unit, up to a unit behind
        per_seq = -(-(self.keep + drafts) // page_size) + 2
        # every running sequence and one part-prefilled prompt hold a window each, one chunk more
        self.num_window_pages = (max_rows + 1) * per_seq + -(-max_chunk // page_size) + 1
        super().__init__(model, num_pages, page_size, max_rows, unit_tokens)
        self.window = PageAllocator(self.num_window_pages)
        self.window_scratch = self.num_window_pages  # what released entries of a table point at
        self._wtables = BlockTables(max_rows, self.max_pages, self.window_scratch, model.device)
        self._window_of: OrderedDict[bytes, list[int]] = OrderedDict()  # prefix entry -> its window pages

    def _new_pool(self, model, num_pages: int, page_size: int):
        return model.new_pool(num_pages, page_size, num_window_pages=self.num_window_pages + 1)

    # -- window pages ----------------------------------------------------------------------
    def _window_alloc(self, must: bool = True) -> int | None:
        page = self.window.allocate(1)
        while page is None and self._window_of:  # prefix entries' windows go first
            _, pages = self._window_of.popitem(last=False)
            self.window.release(pages)
            page = self.window.allocate(1)
        assert page is not None or not must, f"window pages ({self.num_window_pages}) sized for every sequence ran out"
        return None if page is None else page[0]

    def _cover(self, seq: Sequence, start: int, end: int, must: bool = True) -> bool:
        """Window pages for positions [start, end) where ``seq`` holds none; unless ``must``,
        False when one cannot be had (those taken are kept)."""
        z = self.page_size
        for j in range(max(0, start) // z, -(-end // z)):
            if seq.window_pages[j] < 0:
                page = self._window_alloc(must)
                if page is None:
                    return False
                seq.window_pages[j] = page
                if seq.row is not None:
                    self._wtables.write(seq.row, j, [page])
        return True

    def trim(self, seq: Sequence) -> None:
        """Give back ``seq``'s window pages wholly behind ``keep`` positions before its next."""
        behind = (seq.num_computed - self.keep) // self.page_size  # pages before this are not read again
        for j in range(max(0, behind)):
            if seq.window_pages[j] >= 0:
                self.window.release([seq.window_pages[j]])
                seq.window_pages[j] = -1
                if seq.row is not None:
                    self._wtables.write(seq.row, j, [self.window_scratch])

    def prepare(self, seq: Sequence, end: int) -> None:
        self._cover(seq, seq.num_computed, end)

    # -- the base's calls, for both page spaces ---------------------------------------------
    def match(self, keys: list[bytes]) -> list:
        """The longest run of cached units after which the prefix entries hold the window pages
        of the ``back`` positions that going on reads."""
        run = self.prefix.match(keys)
        units_back = -(-self.back // self.unit_tokens)
        for n in range(len(run), 0, -1):
            if all(self._window_of.get(keys[i]) for i in range(max(0, n - units_back), n)):
                return run[:n]
        return []

    def admit(self, seq: Sequence, shared: list[list[int]], tokens: int) -> bool:
        """The base's pages, and of the shared units' window pages (the prefix entries') those of
        the last ``back`` positions, a reference each."""
        if not super().admit(seq, shared, tokens):
            return False
        seq.window_pages = [-1] * len(seq.pages)
        n = len(shared)
        for i in range(max(0, n - -(-self.back // self.unit_tokens)), n):
            pages = self._window_of[seq.unit_keys[i]]
            self._window_of.move_to_end(seq.unit_keys[i])
            self.window.incref(pages)
            seq.window_pages[i * self.unit_pages : (i + 1) * self.unit_pages] = pages
        return True

    def grow(self, seq: Sequence) -> bool:
        """The base's (its ``grow_to`` is this class's: the next token's window page too), then
        the window pages fallen behind given back."""
        if not super().grow(seq):
            return False
        self.trim(seq)
        return True

    def grow_to(self, seq: Sequence, tokens: int, evict: bool = False) -> bool:
        """The base's pages, and window pages from the next token's position up to ``tokens`` (a
        speculative step's drafts: their rows are written, and those accepted read, before a
        later step would cover them)."""
        if not super().grow_to(seq, tokens, evict):
            return False
        seq.window_pages += [-1] * (len(seq.pages) - len(seq.window_pages))
        return self._cover(seq, seq.length - 1, tokens, must=False)

    def release(self, seq: Sequence) -> None:
        self.window.release([p for p in seq.window_pages if p >= 0])
        seq.window_pages = []
        super().release(seq)

    share_at_input = True  # a prompt's window rows are gone by the time it finishes: share its units when computed

    def share(self, keys: list[bytes], seq: Sequence) -> None:
        super().share(keys, seq)
        for i, key in enumerate(keys):
            pages = seq.window_pages[i * self.unit_pages : (i + 1) * self.unit_pages]
            if key not in self._window_of and len(pages) == self.unit_pages and min(pages) >= 0:
                self.window.incref(pages)
                self._window_of[key] = pages
        self._drop_stale()

    def _drop_stale(self) -> None:
        """Window pages of prefix entries that the table itself dropped."""
        held = set(self.prefix.keys())
        for key in [k for k in self._window_of if k not in held]:
            self.window.release(self._window_of.pop(key))

    def allocate(self, n: int) -> list[int] | None:
        entries = len(self.prefix)
        pages = super().allocate(n)
        if len(self.prefix) != entries:  # it dropped prefix entries for pages
            self._drop_stale()
        return pages

    def claim_row(self, seq: Sequence) -> None:
        super().claim_row(seq)
        self._wtables.write(seq.row, 0, [p if p >= 0 else self.window_scratch for p in seq.window_pages])

    def free_row(self, seq: Sequence) -> None:
        self._wtables.clear(seq.row)
        super().free_row(seq)

    def table(self, seq: Sequence) -> torch.Tensor:
        return torch.stack((long_tensor(seq.pages),
                            long_tensor([p if p >= 0 else self.window_scratch for p in seq.window_pages])))

    def tables(self, batch: list[Sequence]) -> torch.Tensor:
        """[B, 2, W]: each row's entry pages, then its window pages."""
        pages = super().tables(batch)
        return torch.stack((pages, self._wtables.rows([s.row for s in batch], pages.shape[1])), dim=1)

    # -- records in and out ----------------------------------------------------------------
    def _window_table(self, seq: Sequence) -> torch.Tensor:
        return long_tensor([p if p >= 0 else self.window_scratch for p in seq.window_pages])

    def write_resume(self, seq: Sequence, end: int, unit: Unit, start: int) -> None:
        self._cover(seq, max(start, end - self.keep), end)
        super().write_resume(seq, end, unit, start)

    def import_prompt(self, seq: Sequence, kv: torch.Tensor) -> None:
        seq.window_pages = seq.window_pages or [-1] * len(seq.pages)
        n = len(seq.req.prompt_ids)
        self._cover(seq, n - self.keep, n)
        self.pool.import_tokens(self.table(seq), kv, n)

    def export_prompt(self, seq: Sequence) -> torch.Tensor:
        return self.pool.export_tokens(self.table(seq), len(seq.req.prompt_ids))

    # -- checks ------------------------------------------------------------------------------
    def check_integrity(self, seqs: Iterable[Sequence], running: list[Sequence]) -> None:
        """The base's checks, and the same for window pages: each page's refcount equals its
        holders (sequences, prefix entries); a running sequence's window row mirrors its pages;
        no sequence holds more than ``keep`` positions' worth past a chunk."""
        seqs = list(seqs)
        super().check_integrity(seqs, running)
        self.window.check_integrity()
        holders = Counter(p for s in seqs for p in s.window_pages if p >= 0)
        holders.update(p for pages in self._window_of.values() for p in pages)
        for page in range(self.num_window_pages):
            assert self.window.refcount(page) == holders[page], (page, self.window.refcount(page), holders[page])
        for s in running:
            want = [p if p >= 0 else self.window_scratch for p in s.window_pages]
            assert self._wtables.host[s.row, : len(want)].tolist() == want, (s.req.request_id, s.window_pages)
        assert torch.equal(self._wtables.device_copy().cpu(), self._wtables.host), "device window tables drifted"
        assert set(self._window_of) <= set(self.prefix.keys())

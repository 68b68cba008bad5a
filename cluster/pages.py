"""Page allocation for the paged latent KV pool, with reference counts for shared prefixes.

A page is either free or held by one or more owners (sequences, the prefix table). Pages holding
a complete 64-token cache unit are immutable once written, so sequences that share a prompt
prefix share those pages; everything after the shared prefix is private to one sequence.
"""

from __future__ import annotations

from collections import OrderedDict

__all__ = ["PageAllocator", "PrefixTable"]


class PageAllocator:
    def __init__(self, num_pages: int) -> None:
        if num_pages <= 0:
            raise ValueError(f"num_pages must be > 0, got {num_pages}")
        self.num_pages = num_pages
        self._free = list(range(num_pages - 1, -1, -1))
        self._refs = [0] * num_pages

    @property
    def num_free(self) -> int:
        return len(self._free)

    def allocate(self, n: int) -> list[int] | None:
        """``n`` fresh pages (refcount 1), or None when fewer are free (nothing allocated)."""
        if n > len(self._free):
            return None
        pages = [self._free.pop() for _ in range(n)]
        for p in pages:
            self._refs[p] = 1
        return pages

    def incref(self, pages: list[int]) -> None:
        for p in pages:
            assert self._refs[p] > 0, f"incref of free page {p}"
            self._refs[p] += 1

    def release(self, pages: list[int]) -> None:
        for p in pages:
            assert self._refs[p] > 0, f"double free of page {p}"
            self._refs[p] -= 1
            if self._refs[p] == 0:
                self._free.append(p)

    def refcount(self, page: int) -> int:
        return self._refs[page]

    def check_integrity(self) -> None:
        free = set(self._free)
        assert len(free) == len(self._free), "a page is free twice"
        for p in range(self.num_pages):
            assert (self._refs[p] == 0) == (p in free), f"page {p}: refs {self._refs[p]}, free {p in free}"


class PrefixTable:
    """Unit key -> the pages holding that unit in this replica's pool (one reference each).

    Entries outlive the sequences that wrote them; ``evict`` drops least recently used entries
    to give pages back under memory pressure.
    """

    def __init__(self, allocator: PageAllocator) -> None:
        self.allocator = allocator
        self._entries: OrderedDict[bytes, list[int]] = OrderedDict()

    def __len__(self) -> int:
        return len(self._entries)

    def match(self, keys: list[bytes]) -> list[list[int]]:
        """Pages of the longest run of ``keys`` from the first that is in the table."""
        out = []
        for k in keys:
            pages = self._entries.get(k)
            if pages is None:
                break
            self._entries.move_to_end(k)
            out.append(pages)
        return out

    def insert(self, key: bytes, pages: list[int]) -> None:
        if key in self._entries:
            self._entries.move_to_end(key)
            return
        self.allocator.incref(pages)
        self._entries[key] = pages

    def entries(self) -> list[list[int]]:
        return list(self._entries.values())

    def keys(self) -> list[bytes]:
        return list(self._entries)

    def evict(self, pages_needed: int) -> int:
        """Drop LRU entries until ``pages_needed`` pages are free or the table is empty."""
        freed_entries = 0
        while self.allocator.num_free < pages_needed and self._entries:
            _, pages = self._entries.popitem(last=False)
            self.allocator.release(pages)
            freed_entries += 1
        return freed_entries

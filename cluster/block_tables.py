"""Block-table rows kept on the engine's device and changed in place.

Legend: R rows (running sequences), X pages a row can hold, B a pass's rows, W its widest row.

A running sequence's row mirrors its pages. A change (pages appended, a row filled when a
sequence starts running or cleared when it stops) is written to the host copy and logged; before
a pass reads the tables, the logged entries move to the device as (flat index, value) pairs
through one pinned staging buffer, in one copy, and are scattered into the device tensor. A decode
step so moves bytes that grow with the pages it added, not with batch x context (tables of 256
rows at 128K context are 21 MB). The device tensor is a separate tensor on the CPU too, so every
engine runs the same path.
"""

from __future__ import annotations

import array

import torch

__all__ = ["BlockTables"]


def _longs(values) -> torch.Tensor:
    return torch.frombuffer(array.array("q", values), dtype=torch.int64)


class BlockTables:
    """[R, X] int64 block tables: ``host`` (what checks read) and the device copy passes read."""

    def __init__(self, rows: int, pages: int, fill: int, device: str | torch.device = "cpu") -> None:
        self.device = torch.device(device)
        self.fill = fill
        self.host = torch.full((rows, pages), fill, dtype=torch.long)
        self._extent = [0] * rows  # per row: entries past this were never written (hold ``fill``)
        self._dev = self.host.to(self.device, copy=True)
        self._log: dict[int, int] = {}  # flat index -> value, the last write winning
        self._pinned = self.device.type == "cuda"
        self._staging = torch.empty(2, 0, dtype=torch.long)
        self._copied: torch.cuda.Event | None = None  # the last staged copy, before the buffer is reused
        self.moved = 0  # entries moved to the device so far

    @property
    def shape(self) -> torch.Size:
        return self.host.shape

    def write(self, row: int, start: int, values: list[int]) -> None:
        """Row ``row``'s entries ``start..start+len(values)-1`` become ``values``."""
        if not values:
            return
        self.host[row, start : start + len(values)] = _longs(values)
        base = row * self.host.shape[1] + start
        for i, v in enumerate(values):
            self._log[base + i] = v
        self._extent[row] = max(self._extent[row], start + len(values))

    def clear(self, row: int) -> None:
        """Every entry of row ``row`` written so far becomes ``fill`` again."""
        self.write(row, 0, [self.fill] * self._extent[row])
        self._extent[row] = 0

    def rows(self, rows: list[int], width: int) -> torch.Tensor:
        """The device tables of ``rows`` [B, width]: a view when the rows are consecutive and in
        order (no copy that grows with context), else the rows gathered on the device."""
        self.sync()
        if rows == list(range(rows[0], rows[0] + len(rows))):
            return self._dev[rows[0] : rows[0] + len(rows), :width]
        return self._dev[:, :width].index_select(0, _longs(rows).to(self.device, non_blocking=self._pinned))

    def sync(self) -> None:
        """Move the logged changes to the device (one copy of their index/value pairs)."""
        if not self._log:
            return
        n = len(self._log)
        if self._staging.shape[1] < n:
            self._staging = torch.empty(2, max(n, 2 * self._staging.shape[1], 256), dtype=torch.long,
                                        pin_memory=self._pinned)
        elif self._copied is not None:
            self._copied.synchronize()  # the previous copy out of the buffer has finished
        stage = self._staging[:, :n]
        stage[0] = _longs(self._log.keys())
        stage[1] = _longs(self._log.values())
        pairs = stage.to(self.device, non_blocking=self._pinned, copy=True)
        self._dev.view(-1).index_copy_(0, pairs[0], pairs[1])
        if self._pinned:
            self._copied = torch.cuda.Event()
            self._copied.record()
        self.moved += n
        self._log.clear()

    def device_copy(self) -> torch.Tensor:
        """The device tables after ``sync``, for checks."""
        self.sync()
        return self._dev

"""How long a prefill chunk may be so that the step it rides in stays within a time budget.

A chunk of ``new`` prompt tokens from position ``start`` costs, beside the decode tokens of its
pass, ``fixed_s + token_s * new + attn_s * new * (start + new)``: a per-pass overhead, the
projections and experts of its rows, and its queries' attention over the whole prefix, which
makes a token late in a long prompt dearer than an early one. ``ChunkCost`` fits the three
coefficients (non-negative, by least squares) to the chunks it observed (the latest, and one of
every size and context seen) and answers the longest chunk that fits a budget, trusting the fit
only up to twice the longest chunk it saw.
"""

from __future__ import annotations

import math
from collections import deque

import numpy as np

__all__ = ["ChunkCost", "chunk_within"]


def chunk_within(seconds: float, start: int, token_s: float, attn_s: float, cap: int) -> int:
    """The most prompt tokens n <= ``cap`` from position ``start`` with
    ``token_s * n + attn_s * n * (start + n) <= seconds`` (0 when not even one fits)."""
    if seconds <= 0:
        return 0
    lin = token_s + attn_s * start  # the cost is attn_s n^2 + lin n
    root = lin + math.sqrt(lin * lin + 4 * attn_s * seconds)  # the root 2 s / root, without cancellation
    return cap if root <= 0 else min(cap, int(2 * seconds / root))


GROWTH = 2  # a chunk is at most this many times the longest chunk observed

# every subset of the terms (0 fixed, 1 per token, 2 attention), the plainer first
_TERMS = ((1,), (1, 2), (0, 1), (0, 1, 2), (2,), (0, 2), (0,))


def _features(new: int, start: int) -> tuple[float, float, float]:
    return 1.0, float(new), float(new) * (start + new)


class ChunkCost:
    """The fitted cost of a prefill chunk's own share of a forward pass: ``(new tokens, start,
    seconds)`` of the latest ``window`` chunks, and of the latest chunk of every other size and
    context seen (by powers of two of each). Chunks of one prompt late in its prefill are all
    about as long and as deep: they tell the cost of such a chunk but not how it divides between
    the terms, which the spread of earlier sizes and contexts does."""

    def __init__(self, window: int = 16) -> None:
        self.recent: deque[tuple[int, int, float]] = deque(maxlen=window)
        self._spread: dict[tuple[int, int], tuple[int, int, float]] = {}
        self._coef: tuple[float, float, float] | None = None

    def observe(self, new: int, start: int, seconds: float) -> None:
        sample = (new, start, seconds)
        self.recent.append(sample)
        self._spread[new.bit_length(), start.bit_length()] = sample
        self._coef = None

    @property
    def samples(self) -> list[tuple[int, int, float]]:
        """What the fit reads: the recent chunks and the spread of the others."""
        recent = set(self.recent)
        return list(self.recent) + [x for x in self._spread.values() if x not in recent]

    def coefficients(self) -> tuple[float, float, float] | None:
        """(fixed_s, token_s, attn_s) >= 0 minimizing the squared error over the samples (the
        best of the least-squares fits on every subset of the terms whose coefficients all come
        out non-negative: exact for three terms), the fewer and plainer terms when samples fit
        several alike (a cost per token first); None before any sample."""
        if not self.recent:
            return None
        if self._coef is None:
            samples = self.samples
            a = np.array([_features(n, s) for n, s, _ in samples])
            y = np.array([secs for _, _, secs in samples])
            scale = np.linalg.norm(a, axis=0)
            a = a / scale  # columns of like size: the attention term is ~1e5 times the fixed one
            best, best_err = np.zeros(3), float(np.sum(y * y))
            for cols in _TERMS:
                sol = np.linalg.lstsq(a[:, cols], y, rcond=None)[0]
                if (sol < 0).any():
                    continue
                err = float(np.sum((a[:, cols] @ sol - y) ** 2))
                if err < best_err * (1 - 1e-6) - 1e-18:  # clearly better than a plainer fit
                    best, best_err = np.zeros(3), err
                    best[list(cols)] = sol
            self._coef = tuple(float(c) for c in best / scale)
        return self._coef

    def predict(self, new: int, start: int) -> float | None:
        """The fitted seconds of a chunk of ``new`` tokens from ``start`` (None before any sample)."""
        coef = self.coefficients()
        if coef is None:
            return None
        return sum(c * f for c, f in zip(coef, _features(new, start), strict=True))

    def longest_within(self, seconds: float, start: int, cap: int) -> int | None:
        """The most tokens from ``start`` (at most ``cap``) whose chunk fits ``seconds``, and at
        most ``GROWTH`` times the longest chunk observed (a fit to chunks of like sizes may split
        their cost between its terms anyhow, and extrapolates far from them badly); None before
        any sample."""
        coef = self.coefficients()
        if coef is None:
            return None
        fixed_s, token_s, attn_s = coef
        cap = min(cap, GROWTH * max(n for n, _, _ in self.samples))
        return chunk_within(seconds - fixed_s, start, token_s, attn_s, cap)

"""Constrained decoding for the engine: each constrained request's grammar (``model.grammar``:
JSON, a schema, a choice of texts, a regex or an EBNF grammar, on xgrammar) and its place in it.

A grammar compiles on a thread of its own, never the engine's: a request whose grammar is not
compiled yet waits before its last prompt token (``ready``) while the others go on. The masks of
a decode batch are filled on another thread while the forward pass runs (``prefetch``), and
applied to the logits on their device (``apply``). After the pass the batch waits for them at
most ``wait_s``: a row whose mask is later is returned as late, sits the step out and decodes the
same position again in the next, so one slow grammar never stalls the others. An R1 request is
free while it thinks, until its ``constrain_after`` token.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from concurrent.futures import FIRST_COMPLETED, Future, ThreadPoolExecutor, wait
from concurrent.futures import TimeoutError as FutureTimeout

import torch

from cluster.request import Sequence
from model.grammar import GrammarError, Grammars, GrammarState, GrammarVocab, apply_masks

__all__ = ["Constraints"]


class Constraints:
    def __init__(self, vocab: Callable[[], GrammarVocab] | None, vocab_size: int, eos_id: int | None) -> None:
        """``vocab()``: the tokenizer's vocabulary as grammars read it (asked once, on the first
        constrained request); ``eos_id`` ends a constrained output."""
        self._vocab, self.vocab_size, self.eos_id = vocab, vocab_size, eos_id
        self._grammars: Grammars | None = None
        self._lock = threading.Lock()
        self._compile = ThreadPoolExecutor(1, thread_name_prefix="grammar-compile")
        self._masks = ThreadPoolExecutor(1, thread_name_prefix="grammar-masks")
        self._filling: dict[GrammarState, Future] = {}  # a state -> the job filling its mask
        self._compiling: set[Future] = set()

    def grammars(self) -> Grammars:
        """The vocabulary's compiler (built on first use, on the compile thread)."""
        with self._lock:
            if self._grammars is None:
                if self._vocab is None:
                    raise ValueError("structured output needs the tokenizer's vocabulary (Engine(grammar_vocab=...))")
                stops = [self.eos_id] if self.eos_id is not None else []
                self._grammars = Grammars(self._vocab(), self.vocab_size, stops)
            return self._grammars

    def start(self, seq: Sequence) -> None:
        """Compile ``seq``'s grammar on the compile thread; its state then reads the tokens another
        replica already generated for it (``continued_ids``: a ``GrammarError`` when they cannot
        start such an output)."""
        req = seq.req
        if self._vocab is None:
            raise ValueError("structured output needs the tokenizer's vocabulary (Engine(grammar_vocab=...))")

        def compiled() -> GrammarState:
            grammars = self.grammars()
            state = grammars.state(req.grammar, req.constrain_after)
            for tok in req.continued_ids:
                state.feed(tok)
            if state.done():
                raise GrammarError("the continued tokens are a whole output already")
            return state

        seq.grammar = self._compile.submit(compiled)
        self._compiling.add(seq.grammar)
        seq.grammar.add_done_callback(self._compiling.discard)

    def wait_compiled(self, timeout: float) -> None:
        """Block until a grammar being compiled is done, or ``timeout`` (a loop with nothing
        else to do rests here rather than spin, which would starve the compile thread of the GIL)."""
        pending = list(self._compiling)
        if pending:
            wait(pending, timeout, return_when=FIRST_COMPLETED)

    @staticmethod
    def ready(seq: Sequence) -> bool:
        """Whether ``seq``'s grammar is compiled (or it has none): before that it waits."""
        return not isinstance(seq.grammar, Future) or seq.grammar.done()

    @staticmethod
    def _state(seq: Sequence) -> GrammarState | None:
        """``seq``'s grammar state (its compilation's error raised here, where the sequence fails)."""
        if isinstance(seq.grammar, Future):
            seq.grammar = seq.grammar.result()
        return seq.grammar

    def _active(self, batch: list[Sequence]) -> tuple[list[int], list[GrammarState]]:
        rows = [b for b, s in enumerate(batch) if s.grammar is not None and self._state(s).active]
        return rows, [batch[b].grammar for b in rows]

    def prefetch(self, batch: list[Sequence]) -> None:
        """Fill the masks ``apply`` will need for ``batch`` on the mask thread (while the forward
        pass runs)."""
        states = [s.grammar for s in batch if isinstance(s.grammar, GrammarState) and s.grammar.active
                  and not s.grammar.ready]
        if not states:
            return
        job = self._masks.submit(lambda: [s.mask() for s in states])
        for state in states:
            self._filling[state] = job

        def forget(done: Future) -> None:
            for state in states:
                if self._filling.get(state) is done:
                    del self._filling[state]

        job.add_done_callback(forget)

    def apply(self, logits: torch.Tensor, batch: list[Sequence], wait_s: float | None = None) -> tuple[torch.Tensor, list[int]]:
        """``logits`` [B, V] with each constrained row's disallowed tokens at -inf (a copy), and
        the rows whose masks the mask thread is still filling after ``wait_s`` (None: waits for
        them): those rows are left as they are and must not be sampled."""
        rows, states = self._active(batch)
        late: list[int] = []
        deadline = None if wait_s is None else time.monotonic() + wait_s
        for b, state in zip(rows, states, strict=True):
            job = self._filling.get(state)
            if state.ready or job is None:
                continue  # filled, or filled here (a state no job holds)
            try:
                job.result(timeout=None if deadline is None else max(0.0, deadline - time.monotonic()))
            except FutureTimeout:
                late.append(b)
            except Exception:  # noqa: BLE001 - filled again here, where its error is the row's
                pass
        if late:
            keep = [i for i, b in enumerate(rows) if b not in late]
            rows, states = [rows[i] for i in keep], [states[i] for i in keep]
        return apply_masks(logits, rows, states), late

    def holds(self, seq: Sequence) -> bool:
        """Whether the grammar decides ``seq``'s next token (min_tokens does not hold EOS back)."""
        return isinstance(seq.grammar, GrammarState) and seq.grammar.active

    def feed(self, seq: Sequence, tok: int) -> None:
        """The grammar reads ``tok`` (a ``GrammarError`` when it cannot)."""
        if seq.grammar is not None:
            self._state(seq).feed(tok)

    def done(self, seq: Sequence) -> bool:
        """Whether ``seq``'s constrained output is complete (the request ends)."""
        return seq.grammar is not None and self._state(seq).done()

    def close(self) -> None:
        self._compile.shutdown(wait=False, cancel_futures=True)
        self._masks.shutdown(wait=False, cancel_futures=True)

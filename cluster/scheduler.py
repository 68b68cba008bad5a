"""The engine's scheduler: which sequences run each step and how much of a prompt is computed.

It holds the waiting queue (oldest first) and the running sequences (each with a block-table
row), and decides per step:

* the **decode batch**: every running sequence, each given a page for its next token; when the
  pool runs out the newest running sequence is **preempted** (its pages freed, queued first to
  be recomputed from its tokens);
* the **prefill chunks**: waiting prompts in order, admitted while pages and seats allow, within
  a token budget: ``max_prefill_tokens``, or while sequences decode (``itl_factor``) a chunk sized
  from measured speeds so that nine in ten mixed passes take at most ``itl_factor`` decode steps'
  time (a decode step of a batch the size of the running one, timed again when the batch has
  grown or shrunk; ``cluster.chunk_sizing`` predicts a chunk's cost; how far the latest passes
  ran past their prediction is the margin), or ``itl_floor_s`` where that is longer (a pass
  that short is no latency anyone streaming notices, and decode steps far shorter would cut a
  prompt into chunks whose per-pass overhead outweighs their tokens). A chunk that does not
  finish its prompt is the step's last; a prompt whose every position is scored (prompt
  logprobs) goes at most ``scored_chunk`` tokens a chunk (the engine sizes it so that the
  chunk's logits fit its bound);
* **background work** (``GenerationRequest.background``: batch lines) yields to interactive
  requests: it queues behind every interactive prompt, holds at most ``background_share`` of the
  seats and of the pages (the rest stay free for interactive arrivals), and is preempted first,
  both when the pool runs out and when an interactive prompt finds no seat or pages; a step that
  prefills an interactive prompt leaves the background rows out of its decode (they go on the next),
  and a decode step takes only as many background rows as keep it within ``background_slack`` of
  the interactive rows' own step time, by measured step times (on a GPU, whose decode steps cost
  about the same for 1 row as for 16, that is most of them; on a CPU, few or none); while
  interactive requests came in the last ``INTERACTIVE_QUIET_S``, no step of background rows alone
  runs (one arriving would wait for it); after that the batch runs whole.

What admission means (pages, shared prefixes, cached units, a handed-off prompt's KV) is the
engine's: it passes ``admit`` and ``admit_prefilled``. No model, no Ray: the engine runs the
passes and reports their times back (``observe_decode``, ``observe_chunk``).
"""

from __future__ import annotations

import statistics
import time
from collections import deque
from collections.abc import Callable

from cluster.chunk_sizing import ChunkCost
from cluster.kv_manager import KVManager
from cluster.request import Sequence

__all__ = ["CHUNK_COST_SAMPLES", "DECODE_SAMPLES", "LIKE_ROWS", "MIN_CHUNK", "MIXED_SAMPLES", "OVERRUN_QUANTILE",
           "SCORED_CHUNK", "Scheduler", "scored_chunk"]

MIN_CHUNK = 1  # the shortest prefill chunk itl_factor makes (it rides in the decode's pass)
CHUNK_COST_SAMPLES = 16  # the latest chunks whose own cost sizes the next one (itl_factor)
DECODE_SAMPLES = 16  # the latest decode passes of a batch's size whose median is its step's time
LIKE_ROWS = 1.25  # a decode pass of r rows times batches of r / LIKE_ROWS .. r * LIKE_ROWS rows
MIXED_SAMPLES = 64  # the latest mixed passes whose overrun of their prediction sets the margin
OVERRUN_QUANTILE = 0.9  # the share of mixed passes kept within itl_factor decode steps
MIN_OVERRUN_SAMPLES = 8  # until this many mixed passes were timed, no margin
MAX_OVERRUN = 1.25  # the largest margin: past it the prediction has lost track, and a prefill would crawl
INTERACTIVE_QUIET_S = 10.0  # after this long without interactive decodes, background work runs at full size
SCORED_CHUNK = 512  # the longest chunk of a prompt scored whole, at most (its logits [T, V] are all kept)

SCORED_LOGIT_BYTES = 8  # a scored position's logit, float32, and its log-softmax


def scored_chunk(bound_mib: int, vocab_size: int) -> int:
    """The longest chunk of a scored prompt whose logits fit ``bound_mib`` (1 to ``SCORED_CHUNK``)."""
    return max(1, min(SCORED_CHUNK, (bound_mib << 20) // (vocab_size * SCORED_LOGIT_BYTES)))


class Scheduler:
    def __init__(self, kv: KVManager, max_num_seqs: int, max_prefill_tokens: int, itl_factor: float,
                 admit: Callable[[Sequence], bool], admit_prefilled: Callable[[Sequence], bool],
                 stats: dict[str, int], itl_floor_s: float = 0.0, scored_chunk: int = SCORED_CHUNK,
                 ready: Callable[[Sequence], bool] = lambda seq: True, background_share: float = 0.5,
                 background_slack: float = 0.05) -> None:
        """``admit(seq)``: give a waiting sequence its pages (False: not enough yet);
        ``ready(seq)``: whether it may produce its first token (its grammar is compiled): until
        then its prompt stops short of its last token and others go first;
        ``admit_prefilled(seq)``: the same for a prompt prefilled on another replica, which then
        decodes at once; ``stats``: counters it adds to (``preemptions``); ``itl_floor_s``: the
        time a mixed pass may always take (with ``itl_factor`` on); ``scored_chunk``: the longest
        chunk of a scored prompt; ``background_share``: the share of seats and pages background
        sequences may hold; ``background_slack``: how much longer than the interactive rows' own
        a decode step with background rows may be."""
        self.kv = kv
        self.background_seats = int(max_num_seqs * background_share)
        self.background_pages = int(kv.num_pages * background_share)
        self.background_slack = background_slack
        self._interactive_s = float("-inf")  # when an interactive request last decoded
        self.max_num_seqs, self.max_prefill_tokens, self.itl_factor = max_num_seqs, max_prefill_tokens, itl_factor
        self.itl_floor_s, self.scored_chunk, self._ready = itl_floor_s, scored_chunk, ready
        self._admit, self._admit_prefilled = admit, admit_prefilled
        self.stats = stats
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.prefill_samples: deque[tuple[int, int, float]] = deque(maxlen=64)  # (new, cached, seconds)
        self._decode_times: deque[tuple[int, float]] = deque(maxlen=8 * DECODE_SAMPLES)  # (rows, seconds)
        self._chunk_cost = ChunkCost(CHUNK_COST_SAMPLES)  # of a chunk's own share of a mixed pass
        self._overruns: deque[float] = deque(maxlen=MIXED_SAMPLES)  # a mixed pass's time / its prediction

    # -- queues --------------------------------------------------------------------------
    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def queue_state(self, limit: int = 256) -> list[tuple[int, int]]:
        """(new, cached) prompt tokens of the waiting requests, oldest first (prefill LB input)."""
        out = []
        for seq in list(self.waiting)[:limit]:
            cached = max(seq.num_computed, seq.expected_cached)
            out.append((max(0, seq.length - cached), cached))
        return out

    def add(self, seq: Sequence) -> None:
        """Queue ``seq`` last among its kind: an interactive one before every background one."""
        if seq.req.background:
            self.waiting.append(seq)
        else:
            self._interactive_s = time.monotonic()
            self.waiting.insert(self._first_background(), seq)

    def _first_background(self) -> int:
        """The queue position of the first background sequence (the queue's length if none)."""
        for i, seq in enumerate(self.waiting):
            if seq.req.background:
                return i
        return len(self.waiting)

    def remove(self, seq: Sequence) -> None:
        """``seq`` leaves whichever it is in, the queue or the running batch (an abort)."""
        if seq.row is not None:
            self.leave_running(seq)
        else:
            self.waiting.remove(seq)

    def join_running(self, seq: Sequence) -> None:
        """``seq`` joins the decode batch: it gets a row of the block tables."""
        self.kv.claim_row(seq)
        self.running.append(seq)

    def leave_running(self, seq: Sequence) -> None:
        self.running.remove(seq)
        self.kv.free_row(seq)

    def prefilled(self, seq: Sequence) -> None:
        """``seq``'s prompt is computed: it leaves the queue and decodes."""
        self.waiting.remove(seq)
        self.join_running(seq)

    def preempt(self, seq: Sequence) -> None:
        """Free ``seq``'s pages and queue it first among its kind for recomputation (its tokens
        are kept)."""
        self.leave_running(seq)
        self.kv.release(seq)
        seq.num_computed = 0
        self.waiting.insert(self._first_background() if seq.req.background else 0, seq)
        self.stats["preemptions"] += 1
        if seq.req.background:
            self.stats["background_preemptions"] = self.stats.get("background_preemptions", 0) + 1

    def victim(self) -> Sequence:
        """The running sequence to preempt: the newest background one, else the newest."""
        for seq in reversed(self.running):
            if seq.req.background:
                return seq
        return self.running[-1]

    def _background_room(self, seq: Sequence) -> bool:
        """Whether background ``seq`` may be admitted: background sequences then hold at most
        their share of the seats and of the pages."""
        held = [s for s in self.running if s.req.background]
        held += [s for s in self.waiting if s.req.background and s.pages]  # admitted, prefilling
        pages = sum(len(s.pages) for s in held) + self.kv.pages_for(seq.length + 1)
        return len(held) < self.background_seats and pages <= self.background_pages

    def _yield_background(self, batch: list[Sequence]) -> bool:
        """Preempt the newest running background sequence (out of this step's ``batch`` too) so
        that an interactive prompt has its seat and pages; False when none runs."""
        victim = next((s for s in reversed(self.running) if s.req.background), None)
        if victim is None:
            return False
        self.preempt(victim)
        if victim in batch:
            batch.remove(victim)
        return True

    # -- a step's work -------------------------------------------------------------------
    def decode_batch(self) -> list[Sequence]:
        """The running sequences that decode this step, each with a page for its next token
        (the newest are preempted when the pool runs out), in block-table row order. O(batch):
        a new page goes into the sequence's table row."""
        batch = []
        for seq in list(self.running):
            if seq.row is None:
                continue  # preempted while making room for another
            while not self.kv.grow(seq):
                victim = self.victim()
                self.preempt(victim)
                if victim in batch:
                    batch.remove(victim)
                if victim is seq:
                    break
            if seq.row is not None:
                batch.append(seq)
        batch.sort(key=lambda s: s.row)  # in row order: the block tables are a view of their rows
        return self._within_slack(batch)

    def _within_slack(self, batch: list[Sequence]) -> list[Sequence]:
        """``batch`` with as many background rows as keep the step within ``background_slack`` of
        the interactive rows' own step time (both measured: ``decode_s``); those left out sit
        this step out, the least advanced ones go first. One row more than the largest size
        measured within is tried (running it measures it). Without interactive rows, while
        interactive requests decoded within ``INTERACTIVE_QUIET_S``, none: one arriving never
        waits behind a step of batch work; after that, all of them."""
        interactive = sum(not seq.req.background for seq in batch)
        background = len(batch) - interactive
        if interactive:
            self._interactive_s = time.monotonic()
        elif not self._interactive_recently():
            return batch
        else:
            return []
        if background and not self.background_slack:  # no slack: none beside interactive rows
            return [s for s in batch if not s.req.background]
        base = self.decode_s(interactive) if background else None
        if base is None:
            return batch
        keep = 0
        for k in range(1, background + 1):  # growing: a size not measured yet is tried alone
            t = self.decode_s(interactive + k)
            if t is not None and t > base * (1 + self.background_slack):
                break
            keep = k
            if t is None:
                break
        if keep == background:
            return batch
        chosen = set(map(id, sorted((s for s in batch if s.req.background), key=lambda s: len(s.output_ids))[:keep]))
        return [s for s in batch if not s.req.background or id(s) in chosen]

    def prefill_budget(self, start: int = 0, rows: int | None = None) -> int:
        """Prompt tokens this step may prefill from position ``start``: ``max_prefill_tokens``, or
        while sequences decode (and ``itl_factor`` is on) as many as keep the mixed pass within
        itl_factor decode steps' time with the margin of ``overrun`` (or within ``itl_floor_s``,
        where that is longer), at least ``MIN_CHUNK``. A chunk's time is fitted to the latest chunks
        (``cluster.chunk_sizing``): its queries attend over the whole prefix, so a chunk shrinks as
        its prompt's context grows. ``rows``: the step's decode rows (default: every running
        sequence; background ones may sit a step out). Until a decode step of that many was timed,
        none (this step decodes alone, and is timed: a batch that grew as prompts joined it is timed
        again, or its chunks would be sized by a smaller batch's step and shrink to nothing); until
        a chunk was, ``MIN_CHUNK``."""
        cap = self.max_prefill_tokens
        rows = len(self.running) if rows is None else rows  # this step's decode rows (background ones may sit out)
        if not rows or not self.itl_factor:
            return cap
        decode_s = self.decode_s(rows)
        if decode_s is None:
            return 0
        chunk_s = max(self.itl_factor * decode_s / self.overrun, self.itl_floor_s) - decode_s
        fits = self._chunk_cost.longest_within(chunk_s, start, cap)
        return min(cap, MIN_CHUNK) if fits is None else max(MIN_CHUNK, fits)

    def prefill_chunks(self, batch: list[Sequence]) -> list[tuple[Sequence, int]]:
        """The prompt chunks this step computes, oldest first: (sequence, end), each from the
        sequence's ``num_computed``, within ``prefill_budget()`` tokens; a chunk that does not
        finish its prompt is the last. Admits what it schedules (an interactive prompt preempts
        background sequences for its seat and pages); a sequence prefilled elsewhere joins
        ``batch`` at once; with an interactive prompt's chunk, background rows leave ``batch``."""
        budget = self.prefill_budget(self.waiting[0].num_computed if self.waiting else 0, len(batch))
        chunks: list[tuple[Sequence, int]] = []
        taking = 0  # prompts this step finishes: they take seats when they join the batch
        i, blocked = 0, False  # blocked: a sequence could not have its pages; none after it may
        while budget > 0 and i < len(self.waiting):
            seq = self.waiting[i]
            room = self._background_room_now(seq, batch, chunks) if seq.req.background else budget
            if not room or not self._seat(seq, taking, batch):
                break
            ready = self._ready(seq)
            if seq.req.prefilled is not None and not seq.output_ids:
                if not ready or blocked:  # it decodes at once: it waits whole
                    i += 1
                    continue
                if not self._admit_prefilled(seq):
                    break
                seq.scheduled_s = seq.scheduled_s or time.monotonic()
                del self.waiting[i]
                self.join_running(seq)
                batch.append(seq)
                continue
            if not seq.pages and (blocked or not self._pages(seq, batch)):
                if seq.req.background:
                    break  # background work waits for room; every sequence after it is background too
                # not enough pages yet: it waits for running sequences to finish, and so does every
                # sequence after it but those already holding theirs (a prompt that waited for its
                # grammar, behind one preempted), which go on
                blocked = True
                i += 1
                continue
            seq.scheduled_s = seq.scheduled_s or time.monotonic()
            end = min(seq.length, seq.num_computed + min(budget, room))
            if seq.prompt_logprobs is not None:
                end = min(end, seq.num_computed + self.scored_chunk)
            if not ready and end == seq.length:  # its last token's logits wait for the grammar
                end = seq.length - 1
                if end <= seq.num_computed:
                    i += 1
                    continue
            chunks.append((seq, end))
            budget -= end - seq.num_computed
            if end < seq.length:
                break  # the rest of this prompt in the next step (chunked prefill)
            taking += 1
            i += 1
        if any(not seq.req.background for seq, _ in chunks):  # an interactive prompt's pass stays short:
            batch[:] = [seq for seq in batch if not seq.req.background]  # background rows sit it out
        return chunks

    def _interactive_recently(self) -> bool:
        return time.monotonic() - self._interactive_s <= INTERACTIVE_QUIET_S

    def _background_room_now(self, seq: Sequence, batch: list[Sequence], chunks: list) -> int:
        """Prompt tokens background ``seq`` may prefill this step: any while no interactive request
        came within ``INTERACTIVE_QUIET_S``; else none in a pass without interactive rows or with an
        interactive prompt's chunk (one arriving, or that prompt, would wait for it), and in a
        pass of interactive rows as many as its measured cost keeps within ``background_slack``
        of their step."""
        if not self._interactive_recently():
            return self.max_prefill_tokens
        if not batch or not self.background_slack or any(not s.req.background for s, _ in chunks):
            return 0
        decode_s = self.decode_s(len(batch))
        if decode_s is None:
            return 0
        return self._chunk_cost.longest_within(self.background_slack * decode_s, seq.num_computed,
                                               self.max_prefill_tokens) or 0

    def _seat(self, seq: Sequence, taking: int, batch: list[Sequence]) -> bool:
        """Whether ``seq`` has a seat in the batch once this step's ``taking`` prompts joined it:
        an interactive one preempts a background sequence for one."""
        while len(self.running) + taking >= self.max_num_seqs:
            if seq.req.background or not self._yield_background(batch):
                return False
        return True

    def _pages(self, seq: Sequence, batch: list[Sequence]) -> bool:
        """Admit ``seq`` (its pages): background work within its share; an interactive prompt
        preempts background sequences until it fits."""
        if seq.req.background:
            return self._background_room(seq) and self._admit(seq)
        while not self._admit(seq):
            if not self._yield_background(batch):
                return False
        return True

    # -- measured speeds -----------------------------------------------------------------
    def observe_decode(self, seconds: float, rows: int) -> None:
        """A decode pass of its own of ``rows`` sequences took ``seconds``."""
        self._decode_times.append((rows, seconds))

    def decode_s(self, rows: int) -> float | None:
        """A decode step's seconds for a batch of ``rows``: the median of the latest
        ``DECODE_SAMPLES`` passes of batches within ``LIKE_ROWS`` of it (None before any). A
        median: on a busy machine a pass now and then takes a quarter longer, which would lift a
        mean, and with it every chunk's budget, above the typical step that inter-token latency
        is measured against."""
        like = [s for r, s in reversed(self._decode_times) if rows / LIKE_ROWS <= r <= rows * LIKE_ROWS]
        return statistics.median(like[:DECODE_SAMPLES]) if like else None

    @property
    def overrun(self) -> float:
        """How far mixed passes run past their prediction (a decode step and the chunk's fitted
        cost): the ``OVERRUN_QUANTILE`` of the latest ``MIXED_SAMPLES`` passes' time over it,
        within [1, ``MAX_OVERRUN``]; 1 before ``MIN_OVERRUN_SAMPLES``. Chunks are sized for the
        prediction times this, so that on a machine whose passes jitter most of them still keep
        within ``itl_factor`` (on a steady one it is about 1: chunks as long as the budget allows)."""
        if len(self._overruns) < MIN_OVERRUN_SAMPLES:
            return 1.0
        ranked = sorted(self._overruns)
        return min(MAX_OVERRUN, max(1.0, ranked[min(len(ranked) - 1, int(OVERRUN_QUANTILE * len(ranked)))]))

    def observe_chunk(self, new: int, start: int, seconds: float, rows: int) -> None:
        """A pass computed ``new`` prompt tokens from position ``start`` in ``seconds``, with the
        decode tokens of ``rows`` sequences riding in it (0: none)."""
        self.prefill_samples.append((new, start, seconds))
        decode_s = self.decode_s(rows) if rows else None
        if decode_s is not None:
            predicted = self._chunk_cost.predict(new, start)
            if predicted is not None:
                self._overruns.append(seconds / (decode_s + predicted))
            seconds = max(seconds - decode_s, seconds / 2)  # the chunk's own share of a mixed pass
        self._chunk_cost.observe(new, start, seconds)

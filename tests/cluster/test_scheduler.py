"""The scheduler alone: admission order, chunks within a budget, seats, preemption of the newest,
and chunk sizes from measured speeds. No forward pass: the tests play the engine's part."""

from __future__ import annotations

import time

import pytest

from cluster.kv_manager import KVManager
from cluster.request import GenerationRequest, Sequence
from cluster.scheduler import (
    DECODE_SAMPLES,
    LIKE_ROWS,
    MAX_OVERRUN,
    MIN_CHUNK,
    MIXED_SAMPLES,
    Scheduler,
)
from model.checkpoint import build_model, random_state_dict
from model.config import named_config

PAGE = 16


@pytest.fixture(scope="module")
def model():
    cfg = named_config("tiny")
    return build_model(cfg, random_state_dict(cfg, seed=0))


def _sched(model, num_pages=64, max_num_seqs=4, max_prefill_tokens=100, itl_factor=0.0, itl_floor_s=0.0,
           ready=lambda seq: True, background_share=0.5):
    kv = KVManager(model, num_pages, PAGE, max_num_seqs, 64)
    stats = {"preemptions": 0}
    admitted: list[str] = []

    def admit(seq: Sequence) -> bool:
        if not kv.admit(seq, [], seq.length + 1):
            return False
        admitted.append(seq.req.request_id)
        return True

    sched = Scheduler(kv, max_num_seqs, max_prefill_tokens, itl_factor, admit, lambda seq: False, stats,
                      itl_floor_s=itl_floor_s, ready=ready, background_share=background_share)
    return sched, admitted


def _queue(sched: Scheduler, name: str, prompt: int) -> Sequence:
    seq = Sequence(GenerationRequest(name, tuple(range(prompt)), max_tokens=8), [])
    sched.waiting.append(seq)
    return seq


def _prefill(sched: Scheduler, chunks) -> None:
    """What the engine does after a chunk: its tokens are computed; a whole prompt decodes."""
    for seq, end in chunks:
        seq.num_computed = end
        if end == seq.length:
            sched.prefilled(seq)
            seq.output_ids.append(1)


def test_prompts_are_chunked_oldest_first_within_the_budget(model):
    sched, admitted = _sched(model, max_prefill_tokens=100)
    a, b, c = _queue(sched, "a", 30), _queue(sched, "b", 150), _queue(sched, "c", 10)
    chunks = sched.prefill_chunks([])
    assert [(s.req.request_id, end) for s, end in chunks] == [("a", 30), ("b", 70)]  # b's rest waits: the last
    assert admitted == ["a", "b"] and a.scheduled_s is not None and c.scheduled_s is None
    _prefill(sched, chunks)
    assert sched.running == [a] and list(sched.waiting) == [b, c]
    chunks = sched.prefill_chunks(sched.decode_batch())
    assert [(s.req.request_id, end) for s, end in chunks] == [("b", 150), ("c", 10)]


def test_no_more_prompts_than_seats(model):
    sched, _ = _sched(model, max_num_seqs=2, max_prefill_tokens=1000)
    for name in "abc":
        _queue(sched, name, 5)
    chunks = sched.prefill_chunks([])
    assert [s.req.request_id for s, _ in chunks] == ["a", "b"]
    _prefill(sched, chunks)
    assert sched.prefill_chunks(sched.decode_batch()) == []  # c waits for a seat


def test_a_prompt_without_pages_waits_and_blocks_the_ones_behind(model):
    sched, admitted = _sched(model, num_pages=4, max_prefill_tokens=1000)
    _queue(sched, "big", 100)  # 7 pages: more than the pool
    _queue(sched, "small", 5)
    assert sched.prefill_chunks([]) == [] and admitted == []  # first come, first served


def test_a_prompt_waits_for_its_grammar_before_its_last_token_and_goes_on_behind_a_blocked_one(model):
    """A prompt whose grammar is compiling is computed but for its last token; one preempted
    ahead of it that cannot have its pages back does not stop it once its grammar is ready."""
    compiled: set[str] = set()
    sched, admitted = _sched(model, num_pages=4, max_prefill_tokens=1000,
                             ready=lambda seq: seq.req.request_id in compiled)
    waits = _queue(sched, "waits", 20)
    chunks = sched.prefill_chunks([])
    assert chunks == [(waits, 19)] and admitted == ["waits"]
    _prefill(sched, chunks)
    assert sched.prefill_chunks([]) == []  # nothing more to do before the grammar is ready
    big = Sequence(GenerationRequest("big", tuple(range(60)), max_tokens=8), [])
    sched.waiting.appendleft(big)  # preempted: first in line, and 4 pages do not fit beside waits' 2
    compiled.add("waits")
    assert sched.prefill_chunks([]) == [(waits, 20)] and admitted == ["waits"]


def test_the_newest_running_sequence_is_preempted_when_pages_run_out(model):
    sched, _ = _sched(model, num_pages=4, max_prefill_tokens=1000)
    old, new = _queue(sched, "old", 2 * PAGE - 2), _queue(sched, "new", PAGE - 2)
    _prefill(sched, sched.prefill_chunks([]))  # old holds 2 pages, new 1, one is free
    for _ in range(2):
        old.output_ids.append(1)
        new.output_ids.append(1)
        old.num_computed, new.num_computed = old.length - 1, new.length - 1
        batch = sched.decode_batch()
    assert batch == [old] and sched.stats["preemptions"] == 1
    assert list(sched.waiting) == [new] and new.num_computed == 0 and new.pages == [] and new.row is None
    assert len(old.pages) == 3  # grew into the freed page


def _add(sched: Scheduler, name: str, prompt: int, background: bool = False) -> Sequence:
    seq = Sequence(GenerationRequest(name, tuple(range(prompt)), max_tokens=8, background=background), [])
    sched.add(seq)
    return seq


def _names(seqs) -> list[str]:
    return [s.req.request_id for s in seqs]


def test_background_work_queues_behind_every_interactive_prompt(model):
    sched, _ = _sched(model)
    _add(sched, "b1", 5, background=True)
    _add(sched, "i1", 5)
    _add(sched, "b2", 5, background=True)
    _add(sched, "i2", 5)
    assert _names(sched.waiting) == ["i1", "i2", "b1", "b2"]


def test_background_work_holds_at_most_its_share_of_seats_and_pages(model):
    sched, _ = _sched(model, num_pages=8, max_num_seqs=4, max_prefill_tokens=1000)
    for k in range(3):
        _add(sched, f"b{k}", 5, background=True)
    chunks = sched.prefill_chunks([])
    assert _names(s for s, _ in chunks) == ["b0", "b1"]  # 2 of 4 seats
    _prefill(sched, chunks)
    assert sched.prefill_chunks(sched.decode_batch()) == []  # b2 waits, though seats are free
    i = _add(sched, "i", 5)
    assert sched.prefill_chunks(sched.decode_batch()) == [(i, 5)]  # interactive work takes them

    sched, _ = _sched(model, num_pages=8, max_num_seqs=4, max_prefill_tokens=1000)
    _add(sched, "big", 3 * PAGE + 5, background=True)  # 4 pages: half the pool
    _add(sched, "more", 5, background=True)
    assert _names(s for s, _ in sched.prefill_chunks([])) == ["big"]  # "more" would pass half the pages


def test_an_interactive_prompt_preempts_background_work_for_its_seat_and_pages(model):
    sched, _ = _sched(model, num_pages=8, max_num_seqs=2, max_prefill_tokens=1000, background_share=1.0)
    b1, b2 = _add(sched, "b1", 5, background=True), _add(sched, "b2", 5, background=True)
    _prefill(sched, sched.prefill_chunks([]))
    assert sched.running == [b1, b2]
    i = _add(sched, "i", 5)
    batch = sched.decode_batch()
    assert sched.prefill_chunks(batch) == [(i, 5)]  # the newest background one gave its seat
    assert batch == [] and b1.row is not None  # b1 keeps its seat, sitting this step out
    assert _names(sched.waiting) == ["i", "b2"] and b2.pages == [] and b2.row is None
    assert sched.stats["background_preemptions"] == 1

    sched, _ = _sched(model, num_pages=4, max_num_seqs=4, max_prefill_tokens=1000, background_share=1.0)
    b = _add(sched, "b", 3 * PAGE - 2, background=True)  # 3 of 4 pages
    _prefill(sched, sched.prefill_chunks([]))
    i = _add(sched, "i", 2 * PAGE - 2)  # needs 2
    assert sched.prefill_chunks(sched.decode_batch()) == [(i, 2 * PAGE - 2)] and b.pages == []
    assert _names(sched.waiting) == ["i", "b"]


def test_background_rows_sit_out_the_step_that_prefills_an_interactive_prompt(model):
    sched, _ = _sched(model, max_prefill_tokens=1000)
    b = _add(sched, "b", 5, background=True)
    _prefill(sched, sched.prefill_chunks([]))
    i = _add(sched, "i", 5)
    _prefill(sched, sched.prefill_chunks(sched.decode_batch()))
    assert sched.running == [b, i]
    late = _add(sched, "late", 5)
    batch = sched.decode_batch()
    assert sched.prefill_chunks(batch) == [(late, 5)] and batch == [i]  # b keeps its seat and pages
    assert b.row is not None and b.pages
    _prefill(sched, [(late, 5)])
    batch = sched.decode_batch()
    assert sched.prefill_chunks(batch) == [] and batch == [b, i, late]  # then it goes on (nothing measured)
    more = _add(sched, "more", 5, background=True)
    batch = sched.decode_batch()  # a background prompt rides in interactive rows' pass only as far as
    assert sched.prefill_chunks(batch) == [] and batch == [b, i, late]  # measured costs allow: none yet
    for seq in (i, late):
        sched.leave_running(seq)
    sched._interactive_s -= 3600  # quiet: background work runs whole
    batch = sched.decode_batch()
    assert sched.prefill_chunks(batch) == [(more, 5)] and batch == [b]


def test_a_decode_step_takes_only_the_background_rows_its_measured_time_allows(model):
    sched, _ = _sched(model, max_num_seqs=8, max_prefill_tokens=1000, background_share=1.0)
    bs = [_add(sched, f"b{k}", 5, background=True) for k in range(4)]
    _prefill(sched, sched.prefill_chunks([]))
    i = _add(sched, "i", 5)
    _prefill(sched, sched.prefill_chunks(sched.decode_batch()))
    for k, b in enumerate(bs):
        b.output_ids += [1] * (4 - k)  # b3 is the least advanced
    assert sched.decode_batch() == [*bs, i]  # nothing measured: every row runs (and is timed)
    for rows, secs in ((1, 0.010), (2, 0.0102), (3, 0.0103), (4, 0.016), (5, 0.020)):
        for _ in range(3):
            sched.observe_decode(secs, rows)
    batch = sched.decode_batch()
    assert batch[-1] is i and {s.req.request_id for s in batch[:-1]} == {"b3", "b2"}  # 3 rows: within 5%
    sched.background_slack = 1.5
    assert len(sched.decode_batch()) == 5  # a slack the 5-row step keeps within
    sched.background_slack = 0.05
    sched._decode_times.clear()
    for _ in range(3):
        sched.observe_decode(0.010, 1)
    assert len(sched.decode_batch()) == 2  # larger steps not measured yet: one background row tried
    sched.background_slack = 0  # none beside interactive rows, measured or not
    assert sched.decode_batch() == [i]
    late = _add(sched, "late", 5, background=True)  # nor a background prompt's chunk in their pass
    assert sched.prefill_chunks(sched.decode_batch()) == [] and late.pages == []
    sched.leave_running(i)
    sched._interactive_s -= 3600  # quiet: background work runs whole
    assert len(sched.decode_batch()) == 4 and sched.prefill_chunks(sched.decode_batch()) == [(late, 5)]


def test_background_work_rides_beside_interactive_rows_on_a_gpu_only(model):
    """A CPU engine's compute shares the cores with the interactive requests' HTTP path: by
    default no background row rides beside them there; a GPU's spare rows take some."""
    from tests.cluster.test_engine import _engine

    assert _engine(model).scheduler.background_slack == 0
    assert _engine(model, background_slack=0.2).scheduler.background_slack == 0.2


def test_no_step_of_background_rows_alone_runs_while_interactive_requests_come(model):
    from cluster.scheduler import INTERACTIVE_QUIET_S

    sched, _ = _sched(model, max_num_seqs=8, max_prefill_tokens=1000, background_share=1.0)
    for k in range(4):
        _add(sched, f"b{k}", 5, background=True)
    _prefill(sched, sched.prefill_chunks([]))
    for rows, secs in ((1, 0.010), (2, 0.0104), (3, 0.015), (4, 0.020)):
        for _ in range(3):
            sched.observe_decode(secs, rows)
    assert len(sched.decode_batch()) == 4  # no interactive request yet: all of it
    sched._interactive_s = time.monotonic()  # one decoded just now
    assert sched.decode_batch() == []  # one arriving would wait for the step
    sched._interactive_s -= INTERACTIVE_QUIET_S + 1
    assert len(sched.decode_batch()) == 4


def test_background_work_is_preempted_before_newer_interactive_work_when_pages_run_out(model):
    sched, _ = _sched(model, num_pages=4, max_prefill_tokens=1000, background_share=1.0)
    b = _add(sched, "b", PAGE - 1, background=True)  # 1 page
    _prefill(sched, sched.prefill_chunks([]))
    i = _add(sched, "i", 2 * PAGE - 2)  # 2 pages, one stays free
    _prefill(sched, sched.prefill_chunks(sched.decode_batch()))
    assert sched.running == [b, i]
    for _ in range(2):
        for seq in (b, i):
            if seq.row is not None:
                seq.output_ids.append(1)
                seq.num_computed = seq.length - 1
        batch = sched.decode_batch()  # the second: b takes the free page, then i needs one
    assert batch == [i] and list(sched.waiting) == [b] and b.pages == [] and len(i.pages) == 3


def test_chunks_are_sized_from_measured_speeds_while_sequences_decode(model):
    sched, _ = _sched(model, max_prefill_tokens=4096, itl_factor=3.0)
    assert sched.prefill_budget() == 4096  # nothing decodes: a whole chunk
    _queue(sched, "a", 8)
    _prefill(sched, sched.prefill_chunks([]))
    assert sched.running and sched.prefill_budget() == 0  # a decode step not timed yet: it decodes alone
    sched.observe_decode(0.010, 1)
    assert sched.prefill_budget() == MIN_CHUNK  # no chunk timed yet
    for n in (64, 128, 256, 512):  # 0.1 ms a token, on top of the 10 ms decode riding along
        sched.observe_chunk(n, 0, 0.010 + n * 1e-4, rows=1)
    assert sched.prefill_samples[-1] == (512, 0, pytest.approx(0.0612))
    assert sched.prefill_budget() == pytest.approx(200, abs=8)  # (3 - 1) x 10 ms of chunk time


@pytest.mark.parametrize("floor_s", [0.0, 0.010])
def test_a_pass_may_always_take_the_floor_where_itl_factor_steps_are_shorter(model, floor_s):
    """A small model's decode step of a millisecond leaves a chunk 1.5 ms beside it at
    itl_factor 2.5, a few tokens once the pass's overhead is paid; the floor gives the mixed pass
    10 ms. A slower step's own budget is longer than the floor, which then changes nothing."""
    sched, _ = _sched(model, max_prefill_tokens=4096, itl_factor=2.5, itl_floor_s=floor_s)
    _queue(sched, "a", 8)
    _prefill(sched, sched.prefill_chunks([]))
    for n in (64, 128, 256, 512):  # 0.5 ms a pass and 0.05 ms a token, beside a 1 ms decode
        sched.observe_chunk(n, 0, 0.0005 + n * 5e-5, rows=0)
    sched.observe_decode(0.001, 1)
    expected = 170 if floor_s else 20  # (10 - 1 - 0.5) / 0.05, else (2.5 x 1 - 1 - 0.5) / 0.05
    assert sched.prefill_budget() == pytest.approx(expected, abs=2)
    sched.observe_decode(0.010, 1)  # a slower step (its median with the 1 ms one: 5.5 ms)
    assert sched.prefill_budget() == pytest.approx((2.5 * 0.0055 - 0.0055 - 0.0005) / 5e-5, abs=2)


def test_a_decode_steps_time_is_the_median_of_the_latest_passes(model):
    """A pass slowed now and then (a busy machine) does not lift the time chunks are sized by."""
    sched, _ = _sched(model)
    for seconds in (0.010, 0.011, 0.030, 0.010, 0.012):
        sched.observe_decode(seconds, 4)
    assert sched.decode_s(4) == 0.011
    for _ in range(DECODE_SAMPLES):
        sched.observe_decode(0.020, 4)
    assert sched.decode_s(4) == 0.020  # the older passes are forgotten


def test_a_batch_that_grew_is_timed_again_before_chunks_ride_in_it(model):
    """A decode step's time stands for batches within LIKE_ROWS of the one timed: when prompts
    join the batch past that, the next step decodes alone (and is timed), and then chunks are
    sized by the bigger batch's step."""
    sched, _ = _sched(model, max_num_seqs=8, max_prefill_tokens=4096, itl_factor=3.0)
    for name in "ab":
        _queue(sched, name, 8)
    _prefill(sched, sched.prefill_chunks([]))
    sched.observe_decode(0.010, 2)
    for n in (64, 128, 256, 512):  # 0.1 ms a token beside the two rows' 10 ms
        sched.observe_chunk(n, 0, 0.010 + n * 1e-4, rows=2)
    assert sched.prefill_budget() == pytest.approx(200, abs=8)  # (3 - 1) x 10 ms of chunk time
    for name in "cd":
        _queue(sched, name, 8)
    _prefill(sched, sched.prefill_chunks(sched.decode_batch()))
    assert len(sched.running) == 4 and 4 > 2 * LIKE_ROWS
    assert sched.decode_s(4) is None and sched.prefill_budget() == 0  # this step decodes alone
    sched.observe_decode(0.020, 4)
    assert sched.prefill_budget() == pytest.approx(400, abs=16)  # (3 - 1) x 20 ms
    assert sched.decode_s(5) == 0.020 and sched.decode_s(2) == 0.010  # each batch size by its like


def _timed(model, slow_every: int, slow: float) -> Scheduler:
    """A scheduler whose decode step takes 10 ms and whose mixed passes cost 0.1 ms a prompt
    token beside it, every ``slow_every``-th pass ``slow`` times as long (0: none)."""
    sched, _ = _sched(model, max_prefill_tokens=4096, itl_factor=3.0)
    _queue(sched, "a", 8)
    _prefill(sched, sched.prefill_chunks([]))
    sched.observe_decode(0.010, 1)
    for k in range(MIXED_SAMPLES):
        n = (64, 128, 256, 512)[k % 4]
        late = slow if slow_every and k % slow_every == 0 else 1.0
        sched.observe_chunk(n, 0, late * (0.010 + n * 1e-4), rows=1)
    return sched


def test_chunks_leave_room_for_passes_that_run_past_their_prediction(model):
    """On a machine whose passes jitter, chunks are sized so that nine in ten mixed passes keep
    within itl_factor decode steps, not only the typical one; on a steady one they are not cut;
    the margin is bounded (a machine busy for a while must not stall a prefill on it)."""
    steady, jittery, stalled = _timed(model, 0, 1.0), _timed(model, 5, 1.15), _timed(model, 2, 3.0)
    assert steady.overrun == pytest.approx(1.0, abs=0.01)
    assert steady.prefill_budget() == pytest.approx(200, abs=8)  # (3 - 1) x 10 ms of chunk time
    assert 1.1 < jittery.overrun < MAX_OVERRUN  # one pass in five 15% late: the 90th percentile
    assert jittery.prefill_budget() < 0.85 * steady.prefill_budget()
    assert stalled.overrun == MAX_OVERRUN


def test_a_background_prompt_rides_in_interactive_rows_pass_only_as_far_as_the_slack_allows(model):
    sched, _ = _sched(model, max_num_seqs=8, max_prefill_tokens=1000, background_share=1.0)
    i = _add(sched, "i", 5)
    _prefill(sched, sched.prefill_chunks([]))
    for _ in range(3):
        sched.observe_decode(0.010, 1)
    for n in (8, 16, 32, 64, 128):  # a chunk's own cost: 0.1 ms a token
        for start in (0, 64):
            sched._chunk_cost.observe(n, start, 1e-4 * n)
    b = _add(sched, "b", 100, background=True)
    batch = sched.decode_batch()
    ((seq, end),) = sched.prefill_chunks(batch)
    assert seq is b and 1 <= end <= 8 and batch == [i]  # 5% of a 10 ms step: about 5 tokens


def test_an_interactive_prompt_is_not_held_by_background_rows_that_sit_out(model):
    """Background rows sitting out (interactive requests came lately) are not this step's rows:
    the prompt's budget is a whole chunk, not none until a step of their size is timed."""
    sched, _ = _sched(model, max_num_seqs=8, max_prefill_tokens=1000, itl_factor=2.5, background_share=1.0)
    bs = [_add(sched, f"b{k}", 5, background=True) for k in range(4)]
    _prefill(sched, sched.prefill_chunks([]))
    i = _add(sched, "i", 50)  # interactive work came: the background rows sit out
    batch = sched.decode_batch()
    assert batch == [] and sched.prefill_chunks(batch) == [(i, 50)] and all(b.row is not None for b in bs)

"""The engine loop without Ray: concurrent streams from an event loop, a caller that leaves, a
step that fails, a handoff's KV, duplicate ids, the upkeep callbacks."""

from __future__ import annotations

import asyncio
import threading

import pytest

from cluster.engine_loop import EngineLoop, PromptKV
from cluster.request import FinishReason, GenerationRequest, RequestOutput, TokenSources
from model.sampling_params import TokenLogprob
from tests.cluster.test_engine import _engine, _prompt, _ref, _tokens


def _run(coro):
    return asyncio.run(asyncio.wait_for(coro, timeout=120))


async def _collect(loop: EngineLoop, req: GenerationRequest) -> list:
    return [item async for item in loop.stream(req)]


def test_concurrent_streams_equal_the_model_alone(model):
    seen = []
    loop = EngineLoop(_engine(model, max_num_seqs=4), on_output=seen.append).start()
    prompts = {f"r{i}": _prompt(30 + 17 * i, i) for i in range(4)}

    async def main():
        return await asyncio.gather(*(_collect(loop, GenerationRequest(rid, p, 8)) for rid, p in prompts.items()))

    for (rid, p), outs in zip(prompts.items(), _run(main()), strict=True):
        assert _tokens(outs) == _ref(model, p, 8), rid
        assert outs[-1].finished and outs[-1].finish_reason == FinishReason.LENGTH
        assert all(not o.finished for o in outs[:-1])
    assert {o.request_id for o in seen if o.finished} == set(prompts)  # on_output saw every one
    assert loop.in_flight() == 0
    loop.stop()


def test_a_caller_that_leaves_aborts_its_request(model):
    engine = _engine(model)
    loop = EngineLoop(engine).start()

    async def main():
        stream = loop.stream(GenerationRequest("long", _prompt(40, 1), 2000, ignore_eos=True))
        await anext(stream)
        await stream.aclose()  # the client went away after one output
        for _ in range(200):
            if not engine.has_work():
                return True
            await asyncio.sleep(0.01)
        return False

    assert _run(main())
    engine.check_integrity()  # its pages are back
    assert engine.kv.pages.num_free + sum(len(p) for p in engine.kv.prefix.entries()) == engine.cfg.num_pages
    loop.stop()


def test_a_failing_step_fails_the_requests_in_flight_and_the_loop_goes_on(model):
    engine = _engine(model)
    real = engine.step
    fail = threading.Event()

    def step():
        if fail.is_set():
            fail.clear()
            raise RuntimeError("device lost")
        return real()

    engine.step = step
    loop = EngineLoop(engine).start()

    async def main():
        fail.set()
        with pytest.raises(RuntimeError, match="device lost"):
            await _collect(loop, GenerationRequest("a", _prompt(20, 2), 4))
        return await _collect(loop, GenerationRequest("b", _prompt(20, 3), 4))

    assert _tokens(_run(main())) == _ref(model, _prompt(20, 3), 4)
    assert loop.alive
    loop.stop()


def test_fail_all_raises_in_every_stream(model):
    loop = EngineLoop(_engine(model)).start()

    async def main():
        streams = [loop.stream(GenerationRequest(f"r{i}", _prompt(20, i), 3000, ignore_eos=True)) for i in range(2)]
        for s in streams:
            await anext(s)
        loop.fail_all(ConnectionAbortedError("node lent to training"))
        for s in streams:
            with pytest.raises(ConnectionAbortedError):
                while True:
                    await anext(s)

    _run(main())
    loop.stop()


def test_a_handoff_stream_ends_with_the_prompt_kv(model):
    loop = EngineLoop(_engine(model)).start()
    prompt = _prompt(50, 4)
    items = _run(_collect(loop, GenerationRequest("h", prompt, 8, handoff=True)))
    *outs, kv = items
    assert isinstance(kv, PromptKV) and tuple(kv.kv.shape)[1] == len(prompt)
    assert outs[-1].finish_reason == FinishReason.HANDOFF and outs[-1].handoff is not None
    loop.stop()


def test_a_duplicate_id_is_refused_and_the_first_request_goes_on(model):
    loop = EngineLoop(_engine(model)).start()
    prompt = _prompt(25, 5)

    async def main():
        first = loop.stream(GenerationRequest("same", prompt, 6))
        head = [await anext(first)]
        with pytest.raises(ValueError, match="duplicate request id 'same'"):
            await _collect(loop, GenerationRequest("same", prompt, 6))
        return head + [o async for o in first]

    assert _tokens(_run(main())) == _ref(model, prompt, 6)
    loop.stop()


def test_tick_runs_while_idle_and_failing_callbacks_do_not_stop_the_loop(model):
    ticks = threading.Semaphore(0)

    def tick():
        ticks.release()
        raise OSError("directory down")

    def on_output(o):
        raise OSError("usage disk full")

    loop = EngineLoop(_engine(model), on_output=on_output, tick=tick, idle_wait_s=0.01).start()
    assert all(ticks.acquire(timeout=10) for _ in range(3))  # idle, it still ticks
    outs = _run(_collect(loop, GenerationRequest("x", _prompt(20, 6), 4)))
    assert _tokens(outs) == _ref(model, _prompt(20, 6), 4) and loop.alive
    loop.stop()


@pytest.mark.parametrize("more", [False, True])
def test_the_steps_compute_with_the_loops_threads(model, more):
    """``threads`` sets torch's threads on the loop's thread alone (they are per thread), which
    ``threads_used`` reports; the caller's are untouched. None: the process's."""
    import torch

    engine = _engine(model)
    seen = []
    step = engine.step
    engine.step = lambda: seen.append(torch.get_num_threads()) or step()
    mine = torch.get_num_threads()
    want = mine + 1 if more else mine
    loop = EngineLoop(engine, threads=want if more else None).start()
    outs = _run(_collect(loop, GenerationRequest("r", _prompt(20, 3), 3)))
    loop.stop()
    assert _tokens(outs) == _ref(model, _prompt(20, 3), 3)
    assert set(seen) == {want} and loop.threads_used == want
    assert torch.get_num_threads() == mine


def test_a_streams_outputs_are_batched_within_the_interval_and_the_last_goes_at_once(model):
    """With an interval far longer than the request: the first output at once, then everything
    else as one output that goes when the request finishes, not when the interval is up; the
    same tokens, text and logprobs as one output per step."""
    import time

    from model.sampling import SamplingParams

    prompt = _prompt(30, 4)
    req = GenerationRequest("r", prompt, 12, SamplingParams(logprobs=1), ignore_eos=True)
    alone = EngineLoop(_engine(model)).start()
    every = _run(_collect(alone, req))
    alone.stop()
    loop = EngineLoop(_engine(model), stream_batching_interval_s=60.0).start()
    t0 = time.monotonic()
    batched = _run(_collect(loop, req))
    took = time.monotonic() - t0
    loop.stop()
    assert len(every) > 2 and len(batched) == 2 and took < 30  # the finished output did not wait the 60 s
    assert _tokens(batched) == _tokens(every) == _ref(model, prompt, 12)
    assert "".join(o.text for o in batched) == "".join(o.text for o in every)
    lps = [lp for o in batched for lp in o.new_logprobs]
    assert [lp.token for lp in lps] == _tokens(every)
    assert [lp.logprob for lp in lps] == pytest.approx([lp.logprob for o in every for lp in o.new_logprobs])
    assert batched[-1].finished and batched[-1].completion_tokens == 12


def test_outputs_a_slow_caller_has_not_taken_go_as_one(model):
    """No interval: a caller that comes back after the request finished gets the rest as one."""
    engine = _engine(model)
    loop = EngineLoop(engine).start()
    prompt = _prompt(25, 5)

    async def main():
        stream = loop.stream(GenerationRequest("r", prompt, 10, ignore_eos=True))
        first = await anext(stream)
        for _ in range(500):  # the engine finishes the request while the caller is away
            if not engine.has_work():
                break
            await asyncio.sleep(0.01)
        return [first] + [o async for o in stream]

    outs = _run(main())
    loop.stop()
    assert len(outs) == 2 and outs[-1].finished and _tokens(outs) == _ref(model, prompt, 10)



def test_outputs_joined_as_one_keep_the_first_ones_prompt_logprobs():
    scored = [None, TokenLogprob(7, -1.5)]
    first = RequestOutput("r", [3], "a", False, None, 2, 1, 0, TokenSources(), prompt_logprobs=scored)
    later = RequestOutput("r", [4, 5], "bc", True, FinishReason.LENGTH, 2, 3, 0, TokenSources())
    one = first.then(later)
    assert one.new_token_ids == [3, 4, 5] and one.text == "abc" and one.finished
    assert one.prompt_logprobs is scored and later.then(later).prompt_logprobs is None


def test_a_request_whose_sampling_fails_fails_alone_and_its_neighbours_get_their_tokens(model, monkeypatch):
    """A hostile neighbour: one request's sampling raises (in its batch, then alone), at its first
    token or mid-stream. Only its stream raises RequestFailed; the streams decoding beside it get
    the model's own tokens; the engine's pages all come back."""
    import cluster.engine as engine_mod
    from cluster.request import RequestFailed
    from model.sampling import SamplingParams

    real = engine_mod.sample
    calls = {"n": 0}

    def sample(logits, params, *rest):
        calls["n"] += 1
        if any(p.seed == 666 for p in params) and calls["n"] > 3:  # the hostile row, from its 3rd call on
            raise RuntimeError("sampler check failed")
        return real(logits, params, *rest)

    monkeypatch.setattr(engine_mod, "sample", sample)
    engine = _engine(model, max_num_seqs=4)
    loop = EngineLoop(engine).start()
    prompts = {f"n{i}": _prompt(30 + 9 * i, 40 + i) for i in range(3)}

    async def main():
        hostile = GenerationRequest("hostile", _prompt(12, 7), 40, SamplingParams(0.7, seed=666), ignore_eos=True)
        neighbours = [_collect(loop, GenerationRequest(rid, p, 24, ignore_eos=True)) for rid, p in prompts.items()]
        return await asyncio.gather(_collect(loop, hostile), *neighbours, return_exceptions=True)

    hostile_out, *neighbours = _run(main())
    assert isinstance(hostile_out, RequestFailed) and "sampler check failed" in str(hostile_out)
    for (rid, p), outs in zip(prompts.items(), neighbours, strict=True):
        assert _tokens(outs) == _ref(model, p, 24), rid
    engine.check_integrity()
    assert not engine.has_work()
    loop.stop()


def test_sampling_values_below_float32s_resolution_are_greedy_or_floored(model):
    """temperature or top_p of 1e-300 (0 in float32 where the sampler computes) are a greedy
    request and the most likely token: the engine samples them, with the model's tokens."""
    from model.sampling import SamplingParams

    assert SamplingParams(temperature=1e-300).temperature == 0.0 and SamplingParams(temperature=1e-300).greedy
    assert SamplingParams(temperature=0.9, top_p=1e-300).top_p > 0
    engine = _engine(model)
    p = _prompt(20, 5)
    engine.add_request(GenerationRequest("t", p, 6, SamplingParams(temperature=1e-300)))
    engine.add_request(GenerationRequest("p", p, 6, SamplingParams(temperature=0.9, top_p=1e-300, seed=1)))
    out = engine.run_to_completion()
    assert _tokens(out["t"]) == _tokens(out["p"]) == _ref(model, p, 6)

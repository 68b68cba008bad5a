"""The P/D handoff between two ``LLMServer`` actors (``actors/pd_handoff.py``): the prefill stream's
last item is a ticket, the decode replica pulls the prompt's KV from the prefill replica's outbox
over TCP (never through Ray's object store) and the answer equals the model alone; when the
prefill replica is gone before the pull, the pull fails so that the request starts over."""

from __future__ import annotations

import asyncio
import dataclasses
import os

import pytest

from tests.waiting import until

pytestmark = [pytest.mark.ray, pytest.mark.slow]
CHECKPOINT_SEED = 17

MAX_TOKENS = 6
PROMPT = [256] + [(j * 13) % 250 + 3 for j in range(37)]


def _server(checkpoint, tmp_path_factory, cpu_threads=None, stream_batching_interval_ms=0.0):
    import ray

    from actors.llm_server import LLMServer
    from actors.replica_config import ReplicaConfig, StoreSection
    from cluster.engine import EngineConfig

    return ray.remote(num_cpus=0)(LLMServer).remote(ReplicaConfig(
        str(checkpoint), StoreSection(str(tmp_path_factory.mktemp("cache"))), enable_cache=False,
        engine=EngineConfig(num_pages=64), tidal=False, cpu_threads=cpu_threads,
        stream_batching_interval_ms=stream_batching_interval_ms))


def _dead(actor) -> bool:
    import ray

    try:
        ray.get(actor.check_health.remote(), timeout=30)
    except ray.exceptions.RayActorError:
        return True
    return False


def _refused(host: str, port: int) -> bool:
    import socket

    try:
        socket.create_connection((host, port), timeout=5).close()
    except ConnectionRefusedError:
        return True
    return False


def test_decode_pulls_the_kv_from_the_prefill_replicas_outbox_and_a_lost_one_starts_over(
        local_ray, checkpoint, tmp_path_factory):
    import ray

    from actors.pd_handoff import read_prefill
    from actors.replica_pool import continuable
    from cluster.kv_transfer import KVTicket
    from cluster.request import GenerationRequest
    from deploy.ingress.dispatch import decode_request
    from model.checkpoint import load_model
    from model.generate import generate
    from model.sampling import SamplingParams

    # the decode replica computes with one thread more (cpu_threads) than the prefill replica's
    # (Ray's, or the suite's OMP_NUM_THREADS); the decode replica's outputs after the first wait
    # for the request's end (an interval longer than it), the prefill replica's go a step at a time
    ray_threads = int(os.environ.get("OMP_NUM_THREADS") or 1)
    prefill = _server(checkpoint, tmp_path_factory)
    decode = _server(checkpoint, tmp_path_factory, cpu_threads=ray_threads + 1, stream_batching_interval_ms=60_000)
    ray.get([prefill.check_health.remote(), decode.check_health.remote()], timeout=300)
    threads = [ray.get(r.stats.remote(gpus=False), timeout=60)["threads"] for r in (prefill, decode)]
    assert threads == [ray_threads, ray_threads + 1]
    req = GenerationRequest("", tuple(PROMPT), MAX_TOKENS, SamplingParams(logprobs=2), ignore_eos=True)

    async def colocated() -> list:
        return [await ref for ref in decode.generate.options(num_returns="streaming").remote(req)]

    whole = asyncio.run(colocated())

    async def run() -> list[int]:
        refs = prefill.generate.options(num_returns="streaming").remote(dataclasses.replace(req, handoff=True))
        last, kv = await read_prefill(refs)
        assert last.finished and last.handoff.kv is None and kv is not None, last  # the tensor came apart
        ticket = ray.get(kv)
        assert isinstance(ticket, KVTicket) and ticket.shape[1] == len(PROMPT)  # only the ticket went through Ray
        decode_req = decode_request(req, last, kv)
        return [await ref for ref in decode.generate.options(num_returns="streaming").remote(decode_req)]

    split = asyncio.run(run())
    assert len(split) == 2 and split[-1].finished  # the first output, then the rest as one
    tokens = [t for item in split for t in item.new_token_ids]
    assert tokens == generate(load_model(checkpoint), PROMPT, MAX_TOKENS, eos_id=None)
    # logprobs too, the first token's computed on the prefill replica
    logprobs = [lp for item in split for lp in item.new_logprobs]
    want = [lp for item in whole for lp in item.new_logprobs]
    assert [lp.token for lp in logprobs] == tokens and [len(lp.top) for lp in logprobs] == [2] * MAX_TOKENS
    assert [lp.logprob for lp in logprobs] == pytest.approx([lp.logprob for lp in want], abs=1e-5)
    outbox = ray.get(prefill.stats.remote(gpus=False), timeout=60)["kv_outbox"]
    assert outbox["held"] == 0 and outbox["sent_bytes"] > 0  # pulled once, then let go

    async def lost() -> BaseException:
        refs = prefill.generate.options(num_returns="streaming").remote(dataclasses.replace(req, handoff=True))
        last, kv = await read_prefill(refs)
        ray.kill(prefill, no_restart=True)  # before the decode replica pulled the KV
        until(lambda: _dead(prefill), 60, "the prefill replica to die")
        ticket = ray.get(kv)  # (a process Ray calls dead may still be exiting: wait until it is gone)
        until(lambda: _refused(ticket.host, ticket.port), 60, "the prefill replica's outbox to close")
        try:
            [await ref for ref in decode.generate.options(num_returns="streaming").remote(decode_request(req, last, kv))]
        except Exception as e:  # noqa: BLE001 - the error is the point
            return e
        raise AssertionError("the decode replica streamed without the KV")

    error = asyncio.run(lost())
    assert continuable(error), repr(error)  # the ingress starts the request over elsewhere
    assert ray.get(decode.check_health.remote(), timeout=30) is None  # and the decode replica serves on


def test_a_request_that_ends_on_the_prefill_replica_hands_nothing_off(local_ray, checkpoint, tmp_path_factory):
    import ray

    from actors.pd_handoff import read_prefill
    from cluster.request import GenerationRequest
    from model.checkpoint import load_model
    from model.generate import generate

    prefill = _server(checkpoint, tmp_path_factory)
    ray.get(prefill.check_health.remote(), timeout=300)
    req = GenerationRequest("", tuple(PROMPT), 1, ignore_eos=True, handoff=True)
    last, kv = asyncio.run(read_prefill(prefill.generate.options(num_returns="streaming").remote(req)))
    assert kv is None and last.finished
    assert last.new_token_ids == generate(load_model(checkpoint), PROMPT, 1, eos_id=None)

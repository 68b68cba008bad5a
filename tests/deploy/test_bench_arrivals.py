"""Open-loop load for the trace replays (deploy/bench/arrivals.py): arrival times from the trace's
timestamps, and requests sent at them against a real HTTP server whatever is in flight."""

from __future__ import annotations

import asyncio
import json
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from deploy.bench.arrivals import open_loop, rebase, trace_arrivals


def _trace(path, stamps_ms):
    path.write_text("".join(json.dumps({"timestamp": t, "input_length": 512, "output_length": 8, "hash_ids": [i]}) + "\n"
                            for i, t in enumerate(stamps_ms)))
    return path


def test_arrivals_keep_the_traces_spacing_at_the_chosen_mean_rate(tmp_path):
    trace = _trace(tmp_path / "t.jsonl", [1000, 1000, 3000, 7000, 9000])  # 4 gaps over 8 s: 0.5 a second
    assert trace_arrivals(trace, 5, rate=2.0) == pytest.approx([0, 0, 0.5, 1.5, 2.0])  # 4 gaps over 2 s
    assert trace_arrivals(trace, 5, rate=0.25) == pytest.approx([0, 0, 4, 12, 16])
    assert trace_arrivals(trace, 2, rate=1.0, skip=2) == pytest.approx([0, 1.0])  # records 3-4, from the first
    assert trace_arrivals(trace, 100, rate=1.0, skip=5) == []


def test_arrivals_of_one_instant_are_spaced_evenly_and_the_rate_must_be_positive(tmp_path):
    trace = _trace(tmp_path / "t.jsonl", [500, 500, 500])
    assert trace_arrivals(trace, 3, rate=4.0) == pytest.approx([0, 0.25, 0.5])
    with pytest.raises(ValueError, match="rate must be positive"):
        trace_arrivals(trace, 3, rate=0)


def test_a_window_of_arrivals_starts_at_its_first():
    assert rebase([0.0, 1.0, 2.5, 4.0], 1, 3) == [0.0, 1.5]
    assert rebase(None, 0, 2) is None
    assert rebase([1.0], 1, 1) == []


class _SlowCompletions(BaseHTTPRequestHandler):
    """/v1/completions streaming one token after ``delay`` seconds; notes when each request came."""

    delay = 0.4
    seen: list[float] = []
    protocol_version = "HTTP/1.0"

    def do_POST(self):  # noqa: N802 (http.server's name)
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        type(self).seen.append(time.perf_counter())
        time.sleep(self.delay)
        self.send_response(200)
        self.send_header("Content-Type", "text/event-stream")
        self.end_headers()
        usage = {"prompt_tokens": len(body["prompt"]), "completion_tokens": 1, "prompt_cache_hit_tokens": 0}
        for chunk in ({"choices": [{"text": "x"}]}, {"choices": [], "usage": usage}):
            self.wfile.write(f"data: {json.dumps(chunk)}\n\n".encode())
        self.wfile.write(b"data: [DONE]\n\n")

    def log_message(self, *args):
        pass


@pytest.fixture(scope="module")
def slow_server():
    server = ThreadingHTTPServer(("127.0.0.1", 0), _SlowCompletions)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    yield f"http://127.0.0.1:{server.server_address[1]}"
    server.shutdown()
    server.server_close()


def test_open_loop_sends_each_request_at_its_arrival_whatever_is_in_flight(slow_server):
    _SlowCompletions.seen = []
    finished: list[int] = []
    t0 = time.perf_counter()
    results = asyncio.run(open_loop(slow_server, [([1, 2], 1), ([3], 1), ([4, 5, 6], 1)], [0.0, 0.1, 0.2],
                                    done=finished.append))
    took = time.perf_counter() - t0
    assert [r["status"] for r in results] == [200, 200, 200]
    assert [r["usage"]["prompt_tokens"] for r in results] == [2, 1, 3]  # each in its place
    assert finished == [1, 2, 3]
    came = [t - _SlowCompletions.seen[0] for t in sorted(_SlowCompletions.seen)]
    assert came[1] == pytest.approx(0.1, abs=0.08) and came[2] == pytest.approx(0.2, abs=0.08)  # not after the 0.4 s ones
    assert all(0.4 <= r["ttft"] < 0.4 + 0.3 for r in results)  # none waited for another
    assert took < 3 * 0.4  # a closed loop of one client would take 1.2 s


def test_open_loop_needs_an_arrival_per_request():
    with pytest.raises(ValueError, match="2 arrival times for 1 requests"):
        asyncio.run(open_loop("http://127.0.0.1:9", [([1], 1)], [0.0, 1.0]))


def test_the_closed_loop_keeps_as_many_in_flight_as_it_has_clients(slow_server):
    from deploy.bench.cluster_bench import _replay

    work = [([1], 1), ([2, 3], 1), ([4], 1)]
    for clients, least, most in ((1, 3 * 0.4, 10.0), (3, 0.4, 2 * 0.4)):
        t0 = time.perf_counter()
        results = asyncio.run(_replay(slow_server, work, clients))
        took = time.perf_counter() - t0
        assert [r["usage"]["prompt_tokens"] for r in results] == [1, 2, 1]
        assert least <= took < most, (clients, took)
    # given arrivals, the same call is the open loop
    assert [r["status"] for r in asyncio.run(_replay(slow_server, work[:1], 1, arrivals=[0.0]))] == [200]

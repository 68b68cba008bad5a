"""Shared by the day/night tests: a simulated 3-node Ray cluster running Serve, and a request
stream whose every answer is checked against the model computed alone."""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Callable, Iterator

import httpx

from tests.waiting import until


class ClientThreads:
    """Two threads running ``_run(worker)`` until the ``with`` block ends (``_stop`` is set)."""

    def __init__(self) -> None:
        self._stop = threading.Event()
        self._threads = [threading.Thread(target=self._run, args=(w,), daemon=True) for w in range(2)]

    def _run(self, worker: int) -> None:
        raise NotImplementedError

    def __enter__(self):
        for t in self._threads:
            t.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        for t in self._threads:
            t.join(timeout=300)


@contextlib.contextmanager
def three_node_app(args: dict) -> Iterator[str]:
    """The app built from ``args`` served on the connected (three-node) Ray, its HTTP proxy on a
    free port; yields its URL once healthy."""
    from deploy.app import build_app
    from tests.shared_ray import serving

    with serving(build_app(args), 300) as url:
        yield url


@contextlib.contextmanager
def day_after_a_failure(args: dict) -> Iterator[None]:
    """A night that fails half-way gives its nodes back, so the module's next test starts from a
    day (a node left leased would hold a replica's CPU and its redeploy would wait forever)."""
    from deploy.tidal import return_nodes

    try:
        yield
    except BaseException:
        with contextlib.suppress(Exception):
            return_nodes(args, timeout_s=120)
        raise


def under_a_stream(url: str, checkpoint, prompt: Callable[[int], list[int]], max_tokens: int,
                   action: Callable[[list], None]) -> None:
    """Two clients send greedy requests while ``action(answers)`` runs; then no request may have
    failed and every answer must equal the model computed alone."""
    from model.checkpoint import load_model
    from model.generate import generate
    from model.tokenizer import load_tokenizer

    answers: list[tuple[int, int, str]] = []
    stop = threading.Event()

    def stream(worker: int) -> None:
        i = worker * 10_000
        with httpx.Client(timeout=300) as client:
            while not stop.is_set():
                i += 1
                r = client.post(f"{url}/v1/completions", json={"model": "tiny", "prompt": prompt(i),
                                                               "max_tokens": max_tokens, "temperature": 0,
                                                               "ignore_eos": True})
                answers.append((i, r.status_code, r.json()["choices"][0]["text"] if r.status_code == 200 else r.text))

    threads = [threading.Thread(target=stream, args=(w,), daemon=True) for w in range(2)]
    for t in threads:
        t.start()
    try:
        until(lambda: answers, 120, "the streams' first answer")
        action(answers)
    finally:
        stop.set()
        for t in threads:
            t.join(timeout=300)
    failed = [(i, s, text[:200]) for i, s, text in answers if s != 200]
    assert failed == [], failed
    assert len(answers) >= 4, answers
    model, tok = load_model(checkpoint), load_tokenizer(checkpoint)
    wrong = [i for i, _, text in answers if text != tok.decode(generate(model, prompt(i), max_tokens, eos_id=None))]
    assert wrong == []

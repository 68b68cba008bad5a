"""Batch jobs without I/O: reading an input file, the run order by shared prefix, and the shapes
the official client reads."""

from __future__ import annotations

import json

import pytest

from cluster.batch import BatchJob, BatchStatus, LineResult, parse_input, prefix_groups

CHAT = "/v1/chat/completions"


def _line(custom_id: str, url: str = CHAT, **extra) -> str:
    return json.dumps({"custom_id": custom_id, "method": "POST", "url": url,
                       "body": {"model": "tiny", "messages": [{"role": "user", "content": custom_id}]}} | extra)


def test_an_input_file_is_read_into_its_lines_blank_lines_skipped():
    raw = "\n".join([_line("a"), "", _line("b"), "   "]).encode()
    lines, errors = parse_input(raw, CHAT, max_lines=10)
    assert errors == [] and [(x.index, x.custom_id) for x in lines] == [(0, "a"), (1, "b")]
    assert lines[1].body["messages"][0]["content"] == "b"


@pytest.mark.parametrize(("raw", "code", "line"), [
    (b"{not json", "invalid_json_line", 1),
    (b"[1, 2]", "invalid_json_line", 1),
    ((_line("a") + "\n" + _line("a")).encode(), "duplicate_custom_id", 2),
    (_line("a", url="/v1/completions").encode(), "mismatched_endpoint", 1),
    (_line("a", method="GET").encode(), "invalid_request", 1),
    (_line("", ).encode(), "invalid_request", 1),
    (_line("a", extra=1).encode(), "invalid_request", 1),
    (b"\xff\xfe", "invalid_file", None),
    (b"\n\n", "empty_file", None),
])
def test_a_file_that_is_not_a_batch_is_refused_naming_the_line(raw, code, line):
    lines, errors = parse_input(raw, CHAT, max_lines=10)
    assert lines == [] or errors
    assert errors[0].code == code and errors[0].line == line and errors[0].message


def test_a_file_over_the_line_limit_is_refused():
    raw = "\n".join(_line(str(i)) for i in range(4)).encode()
    lines, errors = parse_input(raw, CHAT, max_lines=3)
    assert lines == [] and errors[0].code == "too_many_requests"


def test_lines_sharing_a_whole_unit_are_grouped_behind_their_first():
    system = tuple(range(100, 170))  # 70 tokens: one whole unit of 64 shared
    prompts = [system + (1, 2), (5,) * 80, system + (3,), (9, 9), system + (0,), ()]
    groups = prefix_groups(prompts, unit_tokens=64)
    assert sorted(i for g in groups for i in g) == list(range(6))  # every line once
    shared = next(g for g in groups if len(g) > 1)
    assert sorted(shared) == [0, 2, 4] and shared[0] == 4  # sorted by prompt: its first leads
    assert all(len(g) == 1 for g in groups if g is not shared)
    # a prompt whose shared part is only its last token's unit does not join (that token is computed)
    assert len(prefix_groups([tuple(range(64)), tuple(range(64))], 64)) == 2


def test_results_take_openais_output_and_error_line_shapes():
    ok = LineResult(3, "c", 200, {"id": "chatcmpl-1"}, 10, 4, 2)
    bad = LineResult(4, "d", 400, {"error": {"message": "no", "type": "invalid_request_error"}})
    unrun = LineResult(5, "e", 0, {"error": {"message": "too late", "code": "batch_expired"}})
    assert ok.ok and not bad.ok and not unrun.ok
    assert LineResult.decode(ok.encode()) == ok
    line = ok.to_openai("batch_abc")
    assert line["custom_id"] == "c" and line["response"]["status_code"] == 200 and line["error"] is None
    assert line["response"]["body"] == {"id": "chatcmpl-1"} and line["id"] == "batch_req_abc_3"
    assert bad.to_openai("batch_abc")["response"]["status_code"] == 400
    assert unrun.to_openai("batch_abc") == {"id": "batch_req_abc_5", "custom_id": "e", "response": None,
                                            "error": {"code": "batch_expired", "message": "too late"}}


def test_a_job_round_trips_and_reads_as_the_official_clients_batch():
    from openai.types import Batch

    job = BatchJob.new("t", CHAT, "file-1", "24h", 1000, metadata={"k": "v"})
    job.enter(BatchStatus.IN_PROGRESS, 1001)
    job.total = 2
    job.count(LineResult(0, "a", 200, {}, 5, 2, 3))
    job.count(LineResult(1, "b", 400, {}))
    assert BatchJob.decode(job.encode()) == job
    batch = Batch.model_validate(job.to_openai())
    assert batch.status == "in_progress" and batch.in_progress_at == 1001 and batch.expires_at == 1000 + 86400
    assert (batch.request_counts.total, batch.request_counts.completed, batch.request_counts.failed) == (2, 1, 1)
    assert batch.usage.input_tokens == 5 and batch.usage.input_tokens_details.cached_tokens == 2
    assert batch.metadata == {"k": "v"} and batch.id.startswith("batch_")
    assert not BatchStatus.IN_PROGRESS.ended and BatchStatus.CANCELLED.ended

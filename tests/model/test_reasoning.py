"""R1's thought apart from the answer, cut anywhere in the stream."""

from __future__ import annotations

import random

import pytest

from model.reasoning import ReasoningStream, thought_open


def _split(text: str, in_thought: bool, cuts: list[int]) -> tuple[str, str]:
    s, reasoning, content, last = ReasoningStream(in_thought), [], [], 0
    for at in [*cuts, len(text)]:
        r, c = s.feed(text[last:at])
        reasoning.append(r)
        content.append(c)
        last = at
    r, c = s.finish()
    return "".join(reasoning) + r, "".join(content) + c


@pytest.mark.parametrize("text, in_thought, want", [
    ("weigh the options</think>\n\nThe answer is 4.", True, ("weigh the options", "The answer is 4.")),
    ("<think>hmm</think>4", False, ("hmm", "4")),
    ("  <think>hmm</think>\n4\n", False, ("hmm", "4\n")),
    ("Just an answer <think> inside", False, ("", "Just an answer <think> inside")),
    ("still thinking when max_tokens came", True, ("still thinking when max_tokens came", "")),
    ("<thi", False, ("", "<thi")),  # a start that never became the marker is the answer
    ("a</thin", True, ("a</thin", "")),  # an unfinished close is still reasoning
])
def test_reasoning_and_content_whole_and_cut_anywhere(text, in_thought, want):
    rng = random.Random(text)
    assert _split(text, in_thought, []) == want
    for _ in range(50):
        cuts = sorted(rng.sample(range(len(text) + 1), rng.randint(0, min(6, len(text)))))
        assert _split(text, in_thought, cuts) == want, cuts


def test_a_marker_is_never_sent_in_pieces():
    s = ReasoningStream(True)
    assert s.feed("ok </th") == ("ok ", "")  # "</th" waits
    assert s.feed("ink>\n\nyes") == ("", "yes")
    assert s.reasoning == "ok "


def test_the_prompt_leaves_a_thought_open():
    open_id, close_id = 10, 11
    assert thought_open([1, 2, open_id], open_id, close_id)
    assert thought_open([1, open_id, 5, 6], open_id, close_id)
    assert not thought_open([1, open_id, 5, close_id, 7], open_id, close_id)  # V3.1 without thinking
    assert not thought_open([1, 2, 3], open_id, close_id)


def test_reasoning_tokens_count_the_thought_with_its_close():
    from model.reasoning import ReasoningTokens

    count = ReasoningTokens(True, 10, 11)
    count.feed([5, 6])
    count.feed([11, 7, 8])
    assert count.count == 3
    started = ReasoningTokens(False, 10, 11)
    started.feed([10, 5, 11, 7])
    assert started.count == 3
    plain = ReasoningTokens(False, 10, 11)
    plain.feed([5, 10, 11])
    assert plain.count == 0  # a thought may only start the output

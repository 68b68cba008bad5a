"""``tide cache explain``'s classes, from the directory's answer and every node's."""

from __future__ import annotations

from deploy.cache_cli import EXPLAIN_CLASSES, explain_units


def test_each_unit_is_classed_by_what_the_directory_lists_and_what_the_nodes_hold():
    keys = [f"{i:032x}" for i in range(8)]
    info = {"keys": keys, "cacheable": 7, "directory": True,
            "listed": [[("a", "ssd")], [("a", "ssd"), ("b", "ram")], [("b", "ssd")]]}  # the run it found: 3 units
    nodes = {
        "a": {"tiers": ["ssd", "", "", "ssd", "", "", "", "ssd"], "gone": ["", "evicted", "", "", "evicted", "", "", ""]},
        "b": {"tiers": ["", "ram", "", "", "", "", "", ""], "gone": ["", "", "removed", "", "", "removed", "damaged", ""]},
    }
    out = explain_units(info, nodes)
    assert [u["class"] for u in out["units"]] == [
        "found",  # listed on a, a holds it
        "found",  # listed on a and b; b holds it (a evicted it: the directory has yet to hear)
        "stale",  # listed on b, which removed it
        "unlisted",  # a holds it, past the run the directory found
        "evicted", "removed", "damaged"]
    assert out["summary"] == {**dict.fromkeys(EXPLAIN_CLASSES, 0), "found": 2, "stale": 1, "unlisted": 1,
                              "evicted": 1, "removed": 1, "damaged": 1}
    assert out["units"][1]["held"] == {"b": "ram"} and out["units"][2]["gone"] == {"b": "removed"}
    assert out["units"][3]["tokens"] == [192, 256] and out["whole_units"] == 8 and len(out["units"]) == 7


def test_a_unit_nobody_holds_or_dropped_was_never_seen_and_no_directory_lists_nothing():
    info = {"keys": ["00" * 16, "11" * 16], "cacheable": 2, "listed": [], "directory": False}
    nodes = {"a": {"tiers": ["", "ssd"], "gone": ["", ""]}}
    out = explain_units(info, nodes)
    assert [u["class"] for u in out["units"]] == ["never seen", "unlisted"] and out["directory"] is False


def test_found_units_past_the_last_resume_record_are_no_resume_point():
    """A V4 prompt's found run loads only up to its last unit that a resume record follows; the
    found units after it are computed, and say why."""
    keys = [f"{i:032x}" for i in range(4)]
    resume = [f"{i:032x}" for i in range(100, 104)]
    info = {"keys": keys, "cacheable": 4, "directory": True, "resume_keys": resume,
            "listed": [[("a", "ssd")]] * 3}
    nodes = {"a": {"tiers": ["ssd", "ssd", "ssd", "", "", "ram", "", ""], "gone": [""] * 8}}
    out = explain_units(info, nodes)
    assert [u["class"] for u in out["units"]] == ["found", "found", "no resume point", "never seen"]
    assert [u.get("resume_record") for u in out["units"]] == [False, True, False, None]
    assert out["summary"]["found"] == 2 and out["summary"]["no resume point"] == 1

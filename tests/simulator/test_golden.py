"""Replays and plans bit-identical to those recorded before the replay was compiled:
every field of ``SwapPlan`` and ``Replay`` on ~400 (graph, plan, device) cases (tests/replay_golden.py)."""

from __future__ import annotations

import json

import pytest

from tests.replay_golden import EXPECTED, recompute

CASES = json.loads(EXPECTED.read_text())


def test_golden_set_is_broad():
    """The set covers what it must: hundreds of cases, host-room mends, every sync mode, both orders."""
    params = [case["params"] for case in CASES if case["params"] is not None]
    assert len(CASES) >= 300
    assert sum(bool(p["keep_tensors"]) for p in params) >= 20
    assert {p["sync"] for p in params} == {"none", "out", "in", "both"}
    assert {p["order"] for p in params} == {"cto", "memory"}
    assert {p["after_copies_out"] for p in params} == {False, True}


@pytest.mark.parametrize("graph", sorted({case["graph"] for case in CASES}))
def test_replays_match_the_golden_set(graph):
    mismatches = []
    for case in CASES:
        if case["graph"] != graph:
            continue
        now = recompute(case)
        differing = sorted(name for name in case["fields"] if now.get(name) != case["fields"][name])
        if differing:
            mismatches.append((case["batch"], case["device"], case["params"], differing))
    assert not mismatches, f"{len(mismatches)} cases differ, first: {mismatches[0]}"

"""scripts/policy_replay.py: offline scoring of proposer settings against recorded outputs."""

import importlib.util
from pathlib import Path

import pytest

_path = Path(__file__).resolve().parent.parent / "scripts" / "policy_replay.py"
_spec = importlib.util.spec_from_file_location("policy_replay", _path)
replay = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(replay)

CPU = [1.0, 1.58, 1.75, 1.75, 2.26, 2.70, 2.70, 2.85, 3.07, 3.66, 4.61, 4.63, 4.92, 4.92, 4.92,
       4.92, 5.64]


def test_copied_output_replays_faster_than_plain_and_never_beats_the_bound():
    source = [(37 * i + 11) % 500 + 3 for i in range(120)]        # no repeats inside
    prompt, out = [1, 2] + source, source[:100]                   # the answer copies the source
    score = replay.replay_case(prompt, out, CPU, 8, "earliest", replay.KEY_LENGTHS)
    bound = replay.bound_case(prompt, out, CPU, 8, "earliest")
    assert 2.0 < score <= bound + 1e-9


def test_output_with_nothing_to_copy_stays_at_plain_speed():
    prompt, out = [1, 2, 3], [(37 * i + 11) % 500 + 10 for i in range(80)]
    assert replay.replay_case(prompt, out, CPU, 8, "earliest", 4) == pytest.approx(1.0)
    assert replay.bound_case(prompt, out, CPU, 8, "earliest") == pytest.approx(1.0)

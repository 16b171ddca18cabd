"""tools/survival.py: the acceptance prior's predicted survival of a draft against the recorded
outputs, by kind and streak."""

import json
import subprocess
import sys
from pathlib import Path

from tools import replay as rp
from tools import survival as sv

ROOT = Path(__file__).resolve().parents[1]
RECORDING = ROOT / "data" / "recordings" / "policy_plain_zen4.json"


def synthetic(kind, prompt, out):
    return rp.Recorded(f"synthetic-{kind}", kind, prompt, out, [9.0] * len(out), [0.99] * len(out))


def test_a_copy_survives_whole_and_text_that_repeats_nothing_offers_no_proposal():
    source = [(37 * i + 11) % 500 + 3 for i in range(150)]        # no repeats inside
    copy = synthetic("code-edit", [1, 2] + source, source[:120])  # the answer copies the source
    fresh = synthetic("chat", [1, 2, 3], [(41 * i + 7) % 500 + 600 for i in range(80)])
    table = sv.survival_table([copy, fresh], depths=(1, 4, 16))
    assert set(table) == {"code-edit"}          # nothing in the chat recurs: no proposal at all
    cells = table["code-edit"]
    long_runs = [cells[b, j] for b in range(len(sv.STREAKS)) for j in (1, 4, 16) if (b, j) in cells]
    assert long_runs and all(real == n for _, real, n in long_runs)     # every draft passes
    for (b, j), (pred, real, n) in cells.items():
        assert 0.0 < pred / n < 1.0             # p_ceil: nothing is certain
    assert cells[len(sv.STREAKS) - 1, 16][0] / cells[len(sv.STREAKS) - 1, 16][2] > \
        cells[1, 16][0] / cells[1, 16][2]       # a long streak predicts a longer survival


def test_the_recording_shows_code_edits_survive_longer_than_predicted_and_prose_shorter():
    """The finding docs/policy.md ("Survival by kind") records, on the shipped recording: at a
    streak of 5-12 right guesses the prior predicts the same 16-draft survival for an edit and
    for a summary, and the edit's real survival is far above it, the summary's far below."""
    cases = [c for c in rp.load(str(RECORDING)) if c.kind in ("code-edit", "summarize")]
    table = sv.survival_table(cases, depths=(16,))
    mid = next(b for b, (lo, hi) in enumerate(sv.STREAKS) if lo == 5)
    edit, summary = (table[k][mid, 16] for k in ("code-edit", "summarize"))
    assert edit[1] / edit[2] > edit[0] / edit[2] + 0.15
    assert summary[1] / summary[2] < summary[0] / summary[2] - 0.15


def test_the_script_prints_a_table_per_kind_writes_json_and_refuses_bad_arguments(tmp_path):
    script = [sys.executable, str(ROOT / "tools" / "survival.py"), str(RECORDING)]
    out = tmp_path / "s.json"
    ok = subprocess.run(script + ["--kinds", "chat", "--depths", "1,8", "--json", str(out)],
                        capture_output=True, text=True)
    assert ok.returncode == 0, ok.stderr
    assert "chat: predicted / real" in ok.stdout and "code-edit" not in ok.stdout
    assert "| streak | j = 1 | j = 8 |" in ok.stdout
    rows = json.loads(out.read_text())["chat"]
    assert {r["depth"] for r in rows} == {1, 8} and all(0 <= r["real"] <= 1 for r in rows)
    for args, start in ((["--depths", "0,70"], "error: --depths"),
                        (["--weights", "1,2"], "error: --weights: expected 12 numbers"),
                        (["--kinds", "poetry"], "error: no recorded case of those kinds")):
        bad = subprocess.run(script + args, capture_output=True, text=True)
        assert bad.returncode == 1 and bad.stderr.startswith(start), bad.stderr
    missing = subprocess.run([sys.executable, str(ROOT / "tools" / "survival.py"),
                              str(tmp_path / "none.json")], capture_output=True, text=True)
    assert missing.returncode == 1 and "cannot read the recording" in missing.stderr
    assert len(missing.stderr.strip().splitlines()) == 1

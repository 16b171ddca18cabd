"""The soak's short version (issue 65): scripts/bench/soak.py on the tiny FIM model, a few hundred
mixed requests against `serve --http --parallel 4` and `serve --stdio --parallel 2`, with the
kill -9 and restart of the HTTP server in the middle.

Asserted: counts and equality only (no timing): no unexplained outcome, no traceback or refused
file on either server's stderr, every good text equal to its lone run, the restart survived with
its files valid and the document restored from disk, no descriptor (sockets apart) more at the
end than after warm-up, both servers idle and exiting cleanly. Resident memory is reported, not
asserted: this suite's machine is shared and a tiny model's RSS is small enough that allocator
noise moves it by percents (the long run on SmolLM2 holds the 5% target: docs/soak.md).
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_soak_short(tiny_fim_path, tmp_path):
    out = tmp_path / "soak.json"
    run = subprocess.run(
        [sys.executable, str(ROOT / "scripts" / "bench" / "soak.py"), "-m", str(tiny_fim_path),
         "--requests", "300", "--minutes", "4", "--threads", "1", "--timeout", "120",
         "--json", str(out)], capture_output=True, text=True, timeout=900, cwd=ROOT)
    assert out.exists(), run.stderr[-3000:]
    rep = json.loads(out.read_text())
    print(run.stdout)

    assert rep["sent"] == 300
    assert rep["unexplained"] == [], rep["unexplained"]
    assert rep["stderr"] == {"http": [], "stdio": []}
    assert rep["protocol_violations"] == []
    assert rep["texts_compared"] > 100
    assert rep["mismatches"] == [], rep["mismatches"]     # doc texts too (finding 5, fixed)
    # every kind of the mix was sent and ended as it should
    kinds = rep["by_kind"]
    for key in ("http cancel_stream", "http malformed", "http oversized", "http fim",
                "stdio cancel_stream", "stdio malformed", "stdio oversized", "stdio fim"):
        assert key in kinds, sorted(kinds)
    # (an HTTP request in flight at the kill -9 counts as killed, whatever its kind)
    assert "refused" in kinds["http malformed"]
    assert set(kinds["http malformed"]) <= {"refused", "killed"}
    assert set(kinds["stdio oversized"]) == {"refused"}

    restart = rep["restart"]
    assert restart["first_answer_status"] == 200
    assert restart["files_after_kill"]["bad"] == [] and rep["files_at_end"]["bad"] == []
    assert restart["files_after_kill"]["cache_files"] > 0
    assert restart["files_after_kill"]["store_tokens"] > 0
    assert restart["store_not_shrunk"]
    assert restart["doc_reused_from_disk"] > 0 and restart["doc_text_equal"]
    assert rep["files_at_end"]["rejected"] == [] and rep["stdio_files_at_end"]["rejected"] == []

    for pair, g in rep["growth"].items():
        assert g["other_fds"] <= 0, (pair, g)
    assert rep["idle_at_end"] == {"http": {"busy": 0, "queued": 0},
                                  "stdio": {"busy": 0, "queued": 0}}
    assert rep["exits"]["stdio"] == 0 and rep["exits"]["http"] in (0, 130, 143, -15)
    missed = [m for m in rep["missed"] if "RSS" not in m]
    assert missed == [], missed
    assert run.returncode in (0, 1)                 # 1 only for an RSS target, allowed above

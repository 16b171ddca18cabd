"""What a newcomer sees on a first run: the one-time calibration says what it does and that it is
cached, once, on stderr (stdout stays the generated text)."""

from __future__ import annotations

import os
import subprocess
import sys


def test_first_speculative_run_announces_the_cached_calibration_once(tiny_path, tmp_path):
    env = {**os.environ, "LOCALSPEC_HOME": str(tmp_path)}
    cmd = [sys.executable, "-m", "localspec", "generate", "-m", str(tiny_path), "--threads", "1",
           "--proposer", "ngram", "-n", "8", "hello"]
    first = subprocess.run(cmd, capture_output=True, env=env, timeout=180)
    second = subprocess.run(cmd, capture_output=True, env=env, timeout=180)
    assert first.returncode == 0 and second.returncode == 0, first.stderr
    err = first.stderr.decode()
    assert err.count("first speculative run of tiny-target.gguf with 1 thread here") == 1, err
    assert f"cached in {tmp_path / 'calibration'}" in err and "calibrated in" in err
    assert b"calibrat" not in second.stderr                    # cached: not a word the next time
    assert first.stdout == second.stdout and b"calibrat" not in first.stdout

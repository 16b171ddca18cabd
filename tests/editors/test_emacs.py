"""The Emacs package (editors/emacs/localspec.el) in Debian's `emacs --batch` (28+), keys
through Emacs's own key lookup, against a real `localspec serve --stdio`
(tests/editors/emacs_driver.el)."""

from __future__ import annotations

import json
import os
import subprocess

from conftest import need

HERE = os.path.dirname(os.path.abspath(__file__))


def run_emacs(env, scenario: str, **extra) -> dict:
    emacs = need("emacs", "emacs-nox")
    env = {**env, "LOCALSPEC_SCENARIO": scenario, **extra}
    r = subprocess.run([emacs, "--batch", "-Q", "-l", os.path.join(HERE, "emacs_driver.el")],
                       env=env, capture_output=True, timeout=400, stdin=subprocess.DEVNULL)
    with open(env["LOCALSPEC_TEST_OUT"]) as f:
        out = json.load(f)
    assert out.get("error") is None, (out, r.stderr[-2000:])
    assert b"Debugger entered" not in r.stderr and b"backtrace" not in r.stderr.lower()
    return out


def test_completion_overlay_appears_and_tab_inserts_it(editor_env):
    out = run_emacs(editor_env, "ghost")
    assert out["appeared"] and out["ghost"] and "\n" not in out["ghost"]
    assert out["binding"] == "localspec-accept"
    assert out["after_tab"] == "def f(x):\n    return x + 1\n\ndef g(x" + out["ghost"]


def test_a_rewrite_puts_the_servers_text_in_the_buffer_as_one_undo_step(editor_env):
    out = run_emacs(editor_env, "rewrite")
    assert out["started"] and out["result"]
    assert out["text"] == "a = 1\n" + out["result"] + "c = 3\n"
    assert out["after_undo"] == "a = 1\nb = 2\nc = 3\n"
    assert any("rewrote 1 lines" in m for m in out["messages"])


def test_c_g_cancels_a_long_rewrite_and_puts_the_text_back(editor_env):
    out = run_emacs(editor_env, "cancel", LOCALSPEC_TEST_CTX="16384",
                    LOCALSPEC_TEST_REWRITE_MAX="16000")
    assert out["streamed"] and out["during"] != "a = 1\nprompt 54: eeeee\nc = 3\n"
    assert out["binding"] == "localspec-cancel"
    assert out["text"] == "a = 1\nprompt 54: eeeee\nc = 3\n"
    assert out["messages"] == ["localspec: rewrite cancelled; the text is as it was"]


def test_a_missing_executable_is_a_message_not_a_backtrace(editor_env):
    out = run_emacs(editor_env, "missing", LOCALSPEC_CMD="/nonexistent/localspec")
    assert out["complete_ok"] is True and out["rewrite_ok"] is True and out["text"] == "x = 1\n"
    assert out["messages"] and all("`/nonexistent/localspec' was not found" in m
                                   for m in out["messages"])


def test_a_form_feed_does_not_shift_the_rewritten_lines(editor_env):
    """Lines are what "\\n" separates on both sides: line 3 is "beta = 2", not the empty piece
    after the form feed that str.splitlines made of it (issue 43)."""
    out = run_emacs(editor_env, "formfeed")
    assert any("rewrote 1 lines" in m for m in out["messages"]), out["messages"]
    assert out["text"] == "alpha = 1\n\x0c\n" + out["result"] + "gamma = 3\n"


def test_idle_reads_the_buffer_ahead_so_the_first_completion_is_warm(editor_env):
    out = run_emacs(editor_env, "prefill")       # (Emacs reads JSON false as nil: null)
    assert not out["prefill"]["cancelled"] and out["prefill"]["prefill_tokens"] > 500
    st = out["stats"]             # the cursor's line and the chunk before it, twice at most
    assert st["reused_tokens"] > 500 and st["prefill_tokens"] < 2 * (64 + 16), st

"""The Neovim plugin (editors/nvim) in Debian's headless Neovim, keys through the typeahead as
a user types them, against a real `localspec serve --stdio` (tests/editors/nvim_driver.lua)."""

from __future__ import annotations

import json
import os
import subprocess


from conftest import need

HERE = os.path.dirname(os.path.abspath(__file__))


def run_nvim(env, scenario: str, **extra) -> dict:
    nvim = need("nvim", "neovim")
    env = {**env, "LOCALSPEC_SCENARIO": scenario,
           "LOCALSPEC_PLUGIN": os.path.join(env["LOCALSPEC_REPO"], "editors", "nvim"), **extra}
    r = subprocess.run([nvim, "--headless", "-u", "NONE", "-i", "NONE", "-n", "-c",
                        f"luafile {os.path.join(HERE, 'nvim_driver.lua')}"],
                       env=env, capture_output=True, timeout=400, stdin=subprocess.DEVNULL)
    with open(env["LOCALSPEC_TEST_OUT"]) as f:
        out = json.load(f)
    assert out.get("error") is None, (out, r.stderr[-2000:])
    return out


def test_ghost_text_appears_as_you_type_and_tab_inserts_it(editor_env):
    out = run_nvim(editor_env, "ghost")
    assert out["typed"] == "def g(x" and out["mode"] == "i"
    assert out["ghost"] and "\n" not in out["ghost"] and out["extmarks"] == 1   # max_lines 1
    assert out["after_tab"] == ["def f(x):", "    return x + 1", "", "def g(x" + out["ghost"]]


def test_a_rewrite_puts_the_servers_text_in_the_buffer_as_one_undo_step(editor_env):
    out = run_nvim(editor_env, "rewrite")
    assert out["started"] and out["result"]
    assert out["lines"] == ["a = 1"] + out["result"].rstrip("\n").split("\n") + ["c = 3"]
    assert out["after_undo"] == ["a = 1", "b = 2", "c = 3"]
    assert any("rewrote 1 lines" in m["msg"] for m in out["messages"])


def test_cancel_stops_a_long_rewrite_and_restores_the_lines(editor_env):
    out = run_nvim(editor_env, "cancel", LOCALSPEC_TEST_CTX="16384",
                   LOCALSPEC_TEST_REWRITE_MAX="16000")
    assert out["during"] != ["a = 1", "prompt 54: eeeee", "c = 3"]      # it was streaming
    assert out["lines"] == ["a = 1", "prompt 54: eeeee", "c = 3"]
    assert [m["msg"] for m in out["messages"]] == \
        ["localspec: rewrite cancelled; the lines are as they were"]


def test_a_missing_executable_is_a_message_not_a_backtrace(editor_env):
    out = run_nvim(editor_env, "missing", LOCALSPEC_CMD="/nonexistent/localspec")
    assert out["complete_ok"] and out["rewrite_ok"] and out["lines"] == ["x = 1"]
    msgs = [m["msg"] for m in out["messages"]]
    assert msgs and all("'/nonexistent/localspec' was not found" in m for m in msgs)
    assert not any("stack traceback" in m or ".lua:" in m for m in msgs)


def test_a_form_feed_does_not_shift_the_rewritten_lines(editor_env):
    """Lines are what "\\n" separates on both sides: :3LocalspecRewrite rewrites "beta = 2",
    not the empty piece after the form feed that str.splitlines made of it (issue 43)."""
    out = run_nvim(editor_env, "formfeed")
    assert any("rewrote 1 lines" in m["msg"] for m in out["messages"]), out["messages"]
    assert out["lines"] == ["alpha = 1", "\x0c"] + out["result"].rstrip("\n").split("\n") + \
        ["gamma = 3"]


def test_entering_a_buffer_reads_it_ahead_so_the_first_completion_is_warm(editor_env):
    out = run_nvim(editor_env, "prefill")
    assert out["prefill"]["cancelled"] is False and out["prefill"]["prefill_tokens"] > 500
    st = out["stats"]             # the cursor's line and the chunk before it, twice at most
    assert st["reused_tokens"] > 500 and st["prefill_tokens"] < 2 * (64 + 16), st

"""`localspec edit`, the filter: run as a subprocess the way an editor or a script runs it.
stdout must hold the rewritten text or nothing; errors are one `error:` line, exit 1."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from localspec.errors import LocalspecError
from localspec.apps.edit import Region, keep_newlines, parse_region, split_region, strip_reply
from localspec.apps.lines import head_lines, split_lines, tail_lines

SOURCE = "def foo(a, b):\n    return a + b\n\n\nprint(foo(1, 2))\n"


def run_edit(*args, stdin=b"", env=None):
    env = {**os.environ, **(env or {})}
    return subprocess.run([sys.executable, "-m", "localspec", "edit", "--threads", "1", *args],
                          input=stdin, capture_output=True, env=env, timeout=600)


def one_error(r, text: str) -> None:
    assert r.returncode == 1 and r.stdout == b"", (r.returncode, r.stdout, r.stderr)
    lines = r.stderr.decode().strip().splitlines()
    assert lines[-1].startswith("error: ") and text in lines[-1], lines
    assert not any("Traceback" in line for line in lines)


# -- the reply -> the text -----------------------------------------------------------------------
@pytest.mark.parametrize("reply, opened, want", [
    ("x = 1\n```", True, "x = 1\n"),                                  # our fence, closed
    ("x = 1\n```\nThis renames x.", True, "x = 1\n"),                 # commentary after it
    ("x = 1\n", True, "x = 1\n"),                                     # no closing fence
    ("Here it is:\n```python\nx = 1\n```\nDone.", False, "x = 1\n"),  # fenced inside prose
    ("```\nx = 1\n", False, "x = 1\n"),                               # unclosed fence
    ("x = 1\n", False, "x = 1\n"),                                    # plain reply
])
def test_strip_reply_keeps_only_the_text(reply, opened, want):
    assert strip_reply(reply, opened) == want


def test_trailing_newlines_follow_the_original():
    assert keep_newlines("a\n", "b") == "b\n"
    assert keep_newlines("a", "b\n\n") == "b"
    assert keep_newlines("a\n\n", "b\n") == "b\n\n"


def test_region_parsing():
    assert parse_region("3:7") == Region(3, 7)
    for bad in ("3", "7:3", "0:2", "a:b", "3-7"):
        with pytest.raises(ValueError):
            parse_region(bad)


# -- lines are what "\n" separates, as Vim, Emacs and `wc -l` count -------------------------------
FORM_FEED = "alpha = 1\n\x0c\nbeta = 2\ngamma = 3\n"      # issue 43's file: 4 lines


@pytest.mark.parametrize("breaker", ["\x0c", "\x0b", "\x1c", "\x1d", "\x1e", "\x85", "\u2028",
                                     "\u2029", "\r"])
def test_only_newline_breaks_a_line(breaker):
    text = f"a{breaker}b\nc\n"
    assert split_lines(text) == [f"a{breaker}b\n", "c\n"]
    assert split_region(text, Region(2, 2)) == (f"a{breaker}b\n", "c\n", "")
    assert head_lines(text, 1) == (f"a{breaker}b\n", "c\n")
    assert tail_lines(text.rstrip("\n"), 1) == ("c", f"a{breaker}b\n")


def test_region_lines_are_the_editors_lines():
    assert split_region(FORM_FEED, Region(4, 4)) == ("alpha = 1\n\x0c\nbeta = 2\n",
                                                     "gamma = 3\n", "")
    assert split_region(FORM_FEED, Region(3, 3))[1] == "beta = 2\n"
    assert split_region("a\nb", Region(2, 2)) == ("a\n", "b", "")
    with pytest.raises(LocalspecError, match="--region ends at line 5, past the end of the "
                                             r"text \(4 lines\)"):
        split_region(FORM_FEED, Region(5, 5))


def test_a_region_past_a_form_feed_files_end_is_refused(tiny_path, tmp_path):
    f = tmp_path / "ff.py"
    f.write_bytes(FORM_FEED.encode())
    one_error(run_edit("-m", str(tiny_path), "--region", "5:5", "Change the number to 99.",
                       str(f)), "past the end of the text (4 lines)")


# -- bad input: one line, nothing on stdout (no model is loaded for these) ----------------------
def test_an_instruction_of_only_spaces(tiny_path):
    one_error(run_edit("-m", str(tiny_path), "   ", stdin=SOURCE.encode()), "instruction is empty")


def test_non_utf8_and_binary_input(tiny_path, tmp_path):
    one_error(run_edit("-m", str(tiny_path), "fix", stdin=b"caf\xe9\n"), "not valid UTF-8")
    one_error(run_edit("-m", str(tiny_path), "fix", stdin=b"ab\x00cd\n"), "binary file")
    one_error(run_edit("-m", str(tiny_path), "fix", str(tmp_path / "missing.py")), "cannot read")


def test_empty_input_and_empty_region(tiny_path, tmp_path):
    one_error(run_edit("-m", str(tiny_path), "fix", stdin=b""), "nothing to edit")
    f = tmp_path / "a.py"
    f.write_text("x = 1\n\n\ny = 2\n")
    one_error(run_edit("-m", str(tiny_path), "--region", "2:3", "fix", str(f)), "nothing to edit")
    one_error(run_edit("-m", str(tiny_path), "--region", "3:9", "fix", str(f)), "past the end")
    r = run_edit("-m", str(tiny_path), "--region", "9:3", "fix", str(f))
    assert r.returncode == 2 and r.stdout == b"" and b"--region" in r.stderr


def test_a_cut_off_rewrite_writes_nothing(smollm_path):
    r = run_edit("-m", str(smollm_path), "-n", "5", "rename foo to add", stdin=SOURCE.encode())
    one_error(r, "cut off at 5 tokens by -n 5")


def test_stats_go_to_stderr_only(smollm_path, tmp_path):
    f = tmp_path / "one.txt"
    f.write_text("hello\n")
    r = run_edit("-m", str(smollm_path), "--stats", "-n", "400", "Repeat the text exactly.",
                 str(f))
    if r.returncode == 0:          # the small model's answer is whatever it is: check the shape
        assert b"```" not in r.stdout and r.stdout.endswith(b"\n")
        assert not r.stdout.endswith(b"\n\n")
        assert b"tokens in" in r.stderr and b"tokens in" not in r.stdout
    else:
        one_error(r, "")


# -- the default model: a real rewrite -------------------------------------------------------------
@pytest.mark.skipif(not os.environ.get("LOCALSPEC_TEST_QWEN"),
                    reason="the default model (1 GB) runs when LOCALSPEC_TEST_QWEN=1")
def test_default_model_renames_and_keeps_the_file_shape(tmp_path):
    f = tmp_path / "calc.py"
    f.write_text(SOURCE)
    r = run_edit("rename foo to add_numbers", str(f))
    assert r.returncode == 0, r.stderr
    assert r.stdout.decode() == SOURCE.replace("foo", "add_numbers")
    g = tmp_path / "two.py"
    g.write_text("a = 1\nb = 2\nc = 3")                 # no trailing newline: none added
    r = run_edit("--region", "2:2", "change the value to 5", str(g))
    assert r.returncode == 0 and r.stdout.decode() == "a = 1\nb = 5\nc = 3", r.stdout


# -- the protocol's `rewrite`, as the editor plugins call it ---------------------------------------
def test_rewrite_over_stdio_errors_are_readable_and_the_server_goes_on(smollm_path, tmp_path):
    from test_serve import Server

    srv = Server(smollm_path, tmp_path)
    try:
        err = srv.call("rewrite", {"text": SOURCE, "instruction": "  "})["error"]
        assert err["code"] == -32000 and "instruction is empty" in err["message"]
        err = srv.call("rewrite", {"text": SOURCE, "instruction": "x", "region": [2, 1]})["error"]
        assert err["code"] == -32602 and "'region'" in err["message"]
        err = srv.call("rewrite", {"text": "a\n\nb\n", "instruction": "x", "region": [2, 2]})
        assert "nothing to edit" in err["error"]["message"]
        msg, notes = srv.response(srv.send("rewrite", {"text": SOURCE, "max_tokens": 4,
                                                        "instruction": "rename foo to add"}))
        assert "cut off at 4 tokens" in msg["error"]["message"] and len(notes) >= 1
    finally:
        assert srv.close() == 0


@pytest.mark.skipif(not os.environ.get("LOCALSPEC_TEST_QWEN"),
                    reason="the default model (1 GB) runs when LOCALSPEC_TEST_QWEN=1")
def test_default_model_rewrites_a_region_over_stdio(tmp_path):
    from test_serve import Server

    srv = Server("default", tmp_path)
    try:
        msg, notes = srv.response(srv.send("rewrite", {
            "text": SOURCE, "instruction": "rename foo to add_numbers", "region": [5, 5],
            "filename": "calc.py"}), timeout=600)
        assert msg["result"]["text"] == "print(add_numbers(1, 2))\n", msg
        assert "".join(n["params"]["text"] for n in notes).strip() == "print(add_numbers(1, 2))"
    finally:
        assert srv.close() == 0

"""Bad input at the command line: every user mistake is one `error:` line and exit 1, a bug is one
line naming the file with its traceback (exit 70), and nothing ever prints a traceback. Each case
runs the real CLI (`python -m localspec`) as a subprocess on the tiny model.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import click
import pytest

from tinymodel import make_tiny_gguf

BAD = b"caf\xe9 au lait"        # Latin-1, not UTF-8


def cli(*args, stdin: bytes = b"", home: Path, env=None, timeout=180):
    environ = {k: v for k, v in os.environ.items() if k != "LOCALSPEC_LOG"}
    environ.update(LOCALSPEC_HOME=str(home), **(env or {}))
    argv = [sys.executable, "-m", "localspec", *[os.fsencode(a) if isinstance(a, str) else a
                                                  for a in args]]
    return subprocess.run(argv, input=stdin, capture_output=True, env=environ, timeout=timeout)


def one_error(r, *needles, code=1):
    err = r.stderr.decode("utf-8", "replace")
    assert r.returncode == code, (r.returncode, err)
    assert "Traceback" not in err, err
    lines = [ln for ln in err.splitlines() if ln.startswith("error:")]
    assert len(lines) == 1, err
    for needle in needles:
        assert needle in lines[0], lines[0]
    return lines[0]


@pytest.fixture
def home(tmp_path):
    return tmp_path / "home"


@pytest.fixture(scope="module")
def corrupt_path(tmp_path_factory):
    """The tiny model with 16 KB of its tensor data overwritten by 0xFF bytes (NaN floats):
    right size, right header, loads fine, computes garbage."""
    path = make_tiny_gguf(tmp_path_factory.mktemp("corrupt") / "corrupt.gguf", seed=0)
    data = bytearray(path.read_bytes())
    middle = len(data) // 2
    data[middle:middle + 16384] = b"\xff" * 16384
    path.write_bytes(bytes(data))
    return path


def gen(tiny_path, *extra):
    return ["generate", "-m", str(tiny_path), "-n", "4", "--threads", "1", *extra]


# -- text that is not UTF-8 --------------------------------------------------------------------------

def test_invalid_utf8_prompt_in_argv(tiny_path, home):
    one_error(cli(*gen(tiny_path), BAD, home=home), "not valid UTF-8", "0xe9", "offset 3")


def test_invalid_utf8_on_stdin(tiny_path, home):
    one_error(cli(*gen(tiny_path), "-", stdin=BAD, home=home), "stdin", "0xe9", "offset 3")


def test_invalid_utf8_document(tiny_path, home, tmp_path):
    doc = tmp_path / "doc.txt"
    doc.write_bytes(b"ok\n" + BAD)
    one_error(cli(*gen(tiny_path, "--proposer", "ngram", "--k", "2", "--document", str(doc)),
                  "hi", home=home), "--document", "offset 6")


def test_invalid_utf8_stop_and_system(tiny_path, home):
    one_error(cli(*gen(tiny_path, "--stop", BAD), "hi", home=home), "--stop")
    one_error(cli(*gen(tiny_path, "--system", BAD), "hi", home=home), "--system")


@pytest.mark.smollm
def test_chat_survives_a_bad_line(smollm_path, home):
    """Piped chat: the bad line is refused with a message, the next one is answered, exit 0."""
    r = cli("chat", "-m", str(smollm_path), "-n", "4", "--threads", "1", "--proposer", "none",
            stdin=BAD + b"\nSay hi.\n", home=home)
    err = r.stderr.decode()
    assert r.returncode == 0 and "Traceback" not in err, err
    assert "not valid UTF-8" in err and "not sent" in err
    assert r.stdout.strip(), "the good line after the bad one got no reply"


def test_invalid_utf8_workloads_file(tiny_path, home, tmp_path):
    bad = tmp_path / "bad.jsonl"
    bad.write_bytes(b'{"id": "x", "kind": "chat", "instruction": "' + BAD + b'", "max_tokens": 4}\n')
    one_error(cli("bench", "--workloads", str(bad), "-m", str(tiny_path), home=home),
              "workloads file", "not valid UTF-8")


# -- empty and impossible prompts ------------------------------------------------------------------

@pytest.mark.smollm
def test_empty_prompt_on_a_model_without_a_start_token(smollm_path, home):
    r = cli("generate", "-m", str(smollm_path), "-n", "4", "", home=home)
    one_error(r, "prompt is empty")
    r = cli("generate", "-m", str(smollm_path), "-n", "4", "-", stdin=b"", home=home)
    one_error(r, "prompt is empty")


def test_prompt_longer_than_the_context(tiny_path, home):
    one_error(cli(*gen(tiny_path, "--ctx", "64"), "x" * 500, home=home), "raise --ctx")


# -- model files -----------------------------------------------------------------------------------

def test_corrupt_weights_are_named_not_printed_as_empty_output(corrupt_path, home):
    r = cli(*gen(corrupt_path), "hello", home=home)
    one_error(r, "NaN", "corrupt", "models verify")
    assert r.stdout.strip() == b""


@pytest.mark.parametrize("what", ["missing", "directory", "not-gguf", "unknown-name"])
def test_model_argument_mistakes(what, home, tmp_path):
    arg = {"missing": str(tmp_path / "nope.gguf"), "directory": str(tmp_path),
           "unknown-name": "no-such-model"}.get(what)
    if what == "not-gguf":
        arg = str(tmp_path / "text.gguf")
        Path(arg).write_text("hello")
    one_error(cli("generate", "-m", arg, "hi", home=home))


def test_an_empty_model_name_is_named_as_empty(tiny_path, home):
    """Issue 65: `-m ""` read as the current folder (" is a directory; pass the .gguf file
    inside it")."""
    for args in (["-m", ""], ["-m", "  "], ["-m", str(tiny_path), "--draft", ""]):
        line = one_error(cli("generate", *args, "hi", home=home), "name is empty")
        assert "directory" not in line and ("draft model" in line) == ("--draft" in args), line


def test_a_stdout_that_cannot_be_written_is_named_as_stdout(tiny_path, home):
    """Issue 65: `generate > /dev/full` blamed the cache folder (LOCALSPEC_HOME)."""
    environ = {**os.environ, "LOCALSPEC_HOME": str(home)}
    with open("/dev/full", "wb") as full:
        r = subprocess.run([sys.executable, "-m", "localspec", *gen(tiny_path), "hi"],
                           stdout=full, stderr=subprocess.PIPE, env=environ, timeout=180)
    line = one_error(r, "could not write the output (stdout)", "No space left on device")
    assert "LOCALSPEC_HOME" not in line and "Exception ignored" not in r.stderr.decode()


def test_a_chat_whose_stdout_cannot_be_written_names_stdout(tiny_path, home):
    """Issue 65: `chat > /dev/full` blamed the cache folder too (its replies did not go through
    write_out); the first failed write ends the chat with the one line."""
    environ = {**os.environ, "LOCALSPEC_HOME": str(home)}
    with open("/dev/full", "wb") as full:
        r = subprocess.run([sys.executable, "-m", "localspec", "chat", "-m", str(tiny_path),
                            "-n", "4", "--threads", "1"], input=b"hi\nmore\n", stdout=full,
                           stderr=subprocess.PIPE, env=environ, timeout=180)
    line = one_error(r, "could not write the output (stdout)", "No space left on device")
    assert "LOCALSPEC_HOME" not in line and "Exception ignored" not in r.stderr.decode()


def test_models_verify_unknown_and_not_downloaded(home):
    one_error(cli("models", "verify", "no-such-model", home=home), "unknown model")
    one_error(cli("models", "verify", "smollm2-135m", home=home), "not downloaded")


# -- the cache directory and its files ----------------------------------------------------------------

def test_cache_home_that_is_a_file(tiny_path, tmp_path):
    home = tmp_path / "a-file"
    home.write_text("not a directory")
    one_error(cli(*gen(tiny_path, "--proposer", "ngram"), "hi", home=home), "LOCALSPEC_HOME")
    one_error(cli("models", "pull", "smollm2-135m", home=home), "LOCALSPEC_HOME")


def test_damaged_calibration_is_measured_again(tiny_path, home):
    args = gen(tiny_path, "--proposer", "ngram")
    assert cli(*args, "hi", home=home).returncode == 0
    files = list((home / "calibration").glob("*.json"))
    assert files
    for f in files:
        f.write_text(json.dumps({"ratios": "fast", "ms_per_step": [1]}))
    r = cli(*args, "hi", home=home)
    assert r.returncode == 0 and b"Traceback" not in r.stderr
    assert b"damaged; measuring it again" in r.stderr


# -- warnings that name the option ---------------------------------------------------------------------

def test_warnings_for_settings_that_cost_or_mislead(tiny_path, home):
    r = cli(*gen(tiny_path), "hi", home=home, env={"LOCALSPEC_LOG": "chatty"})
    assert r.returncode == 0 and b"unknown LOCALSPEC_LOG level 'chatty'" in r.stderr
    r = cli("generate", "-m", str(tiny_path), "-n", "2", "--threads", "999", "hi", home=home)
    assert r.returncode == 0 and b"--threads 999 is more than" in r.stderr
    r = cli(*gen(tiny_path, "--ctx", "4096"), "hi", home=home)   # trained on 2048
    assert r.returncode == 0 and b"more than" in r.stderr and b"trained on (2048)" in r.stderr


def test_generate_says_when_the_context_stopped_it(tiny_path, home):
    # llama.cpp pads a context to a multiple of 256 tokens: --ctx 64 holds 256
    r = cli("generate", "-m", str(tiny_path), "--ctx", "64", "-n", "400", "--threads", "1",
            "hello", home=home)
    assert r.returncode == 0 and b"stopped at the context limit (256 tokens" in r.stderr


# -- a bug ---------------------------------------------------------------------------------------------

def test_internal_error_is_one_line_and_a_report_file(tmp_path, monkeypatch, capsys):
    from localspec.cli.options import INTERNAL_ERROR_EXIT, run_command

    monkeypatch.setenv("LOCALSPEC_HOME", str(tmp_path / "home"))

    @click.command()
    def broken():
        {}["no such key"]

    with pytest.raises(SystemExit) as exit_info:
        run_command(broken, [])
    assert exit_info.value.code == INTERNAL_ERROR_EXIT == 70
    err = capsys.readouterr().err
    assert "Traceback" not in err and err.count("\n") == 1
    assert err.startswith("error: internal error (KeyError: 'no such key')")
    report = Path(err.split("traceback is in ")[1].split(";")[0])
    assert report.is_file() and "Traceback" in report.read_text()


def test_a_draft_length_over_the_limit_is_a_usage_error(tiny_path, home):
    """--k above K_LIMIT is refused where it enters (click's usage error, exit 2), not capped."""
    r = cli(*gen(tiny_path, "--proposer", "ngram", "--k", "65"), home=home)
    err = r.stderr.decode()
    assert r.returncode == 2 and "--k" in err and "0<=x<=64" in err and r.stdout == b"", err


@pytest.mark.parametrize("option,value", [("-t", "nan"), ("--top-p", "nan"), ("--min-p", "inf"),
                                          ("--repeat-penalty", "-inf"), ("--repeat-penalty", "0"),
                                          ("--cache-mb", "inf"), ("-t", "warm")])
def test_float_options_refuse_what_json_requests_refuse(tiny_path, home, option, value):
    """NaN and infinity are usage errors on the command line as in HTTP and stdio requests (one
    rule, apps.checks.number_problem), never a sampler fed NaN."""
    r = cli(*gen(tiny_path, option, value, "hello"), home=home)
    err = r.stderr.decode()
    assert r.returncode == 2 and option in err and r.stdout == b"", err
    assert "Traceback" not in err


def test_bench_float_options_use_the_same_rule(home):
    r = cli("bench", "--top-p", "nan", home=home)
    err = r.stderr.decode()
    assert r.returncode == 2 and "--top-p" in err and "finite" in err, err


def test_zeroed_weights_are_named_as_damage_not_printed_as_empty_output(tmp_path, home):
    """A model whose output weights are all zero gives every token the same logit: flagged as
    damaged, as NaN weights are, instead of an empty answer at once."""
    zeroed = make_tiny_gguf(tmp_path / "zeroed.gguf", seed=0, logit_scale=0.0)
    r = cli(*gen(zeroed), "hello", home=home)
    one_error(r, "identical logits", "corrupt")
    assert r.stdout.strip() == b""


def test_a_folder_in_the_way_of_a_file_is_one_line_or_a_warning(tiny_path, home, monkeypatch):
    """A folder where the calibration file goes: the run measures, warns, answers (exit 0); a
    folder where a catalog model goes: one error line (exit 1), not a crash report (exit 70)."""
    args = gen(tiny_path, "--proposer", "ngram")
    assert cli(*args, "hi", home=home).returncode == 0
    for f in (home / "calibration").glob("*.json"):
        f.unlink()
        f.mkdir()
    r = cli(*args, "hi", home=home)
    err = r.stderr.decode()
    assert r.returncode == 0 and "could not keep the cost curve" in err and "Traceback" not in err
    from localspec.catalog.models import get_entry, model_path

    monkeypatch.setenv("LOCALSPEC_HOME", str(home))
    where = model_path(get_entry("smollm2-135m"))
    assert str(where).startswith(str(home))
    where.mkdir(parents=True)
    one_error(cli("generate", "-m", "smollm2-135m", "hi", home=home), "in the way")


@pytest.mark.parametrize("command", ["generate", "chat", "serve", "summarize", "bench",
                                     "calibrate", "doctor", "rpc-server", "models"])
def test_every_command_explains_itself(command, home):
    """--help teaches: it runs for every command, with the option types' own metavars."""
    r = cli(command, "--help", home=home)
    assert r.returncode == 0 and b"Usage:" in r.stdout and r.stderr == b"", r.stderr

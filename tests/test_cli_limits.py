"""The command line against hostile or careless input (issue 43): a closed stdout is a quiet
exit 0, a closed stdin one error line, chat names are checked before the chat, --ctx and
--threads have upper bounds, `store clear` neither empties every store on an empty name nor
downloads a model. Each case runs the real CLI as a subprocess on the tiny self-made GGUF, with
stdout and stderr read apart.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from tinymodel import make_tiny_gguf


def run(*args, home: Path, stdin: bytes = b"", stdout=subprocess.PIPE, shell_suffix: str = "",
        env=None, timeout=180):
    """`python -m localspec ARGS`; with shell_suffix (e.g. '<&-') through bash, so that a
    descriptor can be closed the way a user's shell closes it."""
    environ = {**os.environ, "LOCALSPEC_HOME": str(home), **(env or {})}
    environ.pop("LOCALSPEC_LOG", None)
    argv = [sys.executable, "-m", "localspec", *map(str, args)]
    if shell_suffix:
        argv = ["bash", "-c", 'exec "$@" ' + shell_suffix, "bash", *argv]
    return subprocess.run(argv, input=None if shell_suffix else stdin, stdout=stdout,
                          stderr=subprocess.PIPE, env=environ, timeout=timeout)


def to_closed_pipe(*args, home: Path, stdin: bytes = b""):
    """Run with stdout a pipe nobody reads any more (`| head` after head has left): the first
    write fails with EPIPE, every time, whatever the timing."""
    read_end, write_end = os.pipe()
    os.close(read_end)
    try:
        return run(*args, home=home, stdin=stdin, stdout=write_end)
    finally:
        os.close(write_end)


def one_error(r, *needles, code=1) -> str:
    err = r.stderr.decode("utf-8", "replace")
    assert r.returncode == code, (r.returncode, err)
    assert "Traceback" not in err and "internal error" not in err, err
    lines = [ln for ln in err.splitlines() if ln.startswith("error:")]
    assert len(lines) == 1, err
    for needle in needles:
        assert needle in lines[0], lines[0]
    return lines[0]


def usage_error(r, *needles) -> str:
    err = r.stderr.decode("utf-8", "replace")
    assert r.returncode == 2 and r.stdout in (b"", None), (r.returncode, r.stdout, err)
    assert "Traceback" not in err and "Error: " in err, err
    for needle in needles:
        assert needle in err, err
    return err


@pytest.fixture
def home(tmp_path):
    return tmp_path / "home"


def gen(tiny_path, *extra):
    return ["generate", "-m", tiny_path, "--threads", "1", "--ctx", "2048", *extra]


# -- item 4: a closed stdout ---------------------------------------------------------------------

@pytest.mark.parametrize("proposer", ["none", "ngram"])
def test_generate_into_a_closed_pipe_exits_quietly(tiny_path, home, proposer):
    """`localspec generate ... | head -c 20`: exit 0, nothing on stderr about the pipe (click
    made it exit 1 silently; the generator's cleanup ran at exit on a freed context)."""
    r = to_closed_pipe(*gen(tiny_path, "--proposer", proposer, "-n", "40"), "hello", home=home)
    err = r.stderr.decode()
    assert r.returncode == 0, err
    assert "error" not in err and "Broken pipe" not in err and "Exception" not in err, err


def test_chat_into_a_closed_pipe_exits_quietly(tiny_path, home):
    r = to_closed_pipe("chat", "-m", tiny_path, "--threads", "1", "--ctx", "2048", "-n", "8",
                       home=home, stdin=b"hello\nand again\n")
    err = r.stderr.decode()
    assert r.returncode == 0, err
    assert "error" not in err and "Exception" not in err, err


def test_summarize_into_a_closed_pipe_exits_quietly(tiny_path, home, tmp_path):
    """It printed "cannot write None: Broken pipe" for every document and exited 1."""
    docs = [tmp_path / "a.md", tmp_path / "b.md"]
    for doc in docs:
        doc.write_text("The sea is large and the rivers run into it.\n")
    r = to_closed_pipe("summarize", "-m", tiny_path, "--threads", "1", "--ctx", "512", "-n", "8",
                       *docs, home=home)
    err = r.stderr.decode()
    assert r.returncode == 0, err
    assert "cannot write" not in err and "Broken pipe" not in err and "error" not in err, err


# -- item 8: a closed stdin ----------------------------------------------------------------------

@pytest.mark.parametrize("args", [["generate", "-"], ["chat"], ["edit", "fix it", "-"],
                                  ["edit", "fix it"], ["serve", "--stdio"]])
def test_a_closed_stdin_is_one_error_line(tiny_path, home, args):
    """`<&-` leaves Python without sys.stdin: one line saying so, not "internal error" (70)."""
    r = run(*args, "-m", tiny_path, "--threads", "1", home=home, shell_suffix="<&-")
    one_error(r, "stdin is closed")
    assert r.stdout == b""


# -- item 6: chat names checked before the chat ----------------------------------------------------

@pytest.mark.parametrize("option", ["--save", "--resume"])
@pytest.mark.parametrize("name", ["../x", "/etc/passwd", "a/b", "x" * 200, "", "x\n"])
def test_chat_session_names_are_checked_before_the_chat(tiny_path, home, option, name):
    """A name that cannot be saved is a usage error before any message is answered (it ran
    the whole chat and then failed; "" saved nothing, silently)."""
    r = run("chat", "-m", tiny_path, "--threads", "1", option, name, home=home,
            stdin=b"hello there\n")
    usage_error(r, option, "session names are")
    assert not (home / "prompt-cache").exists()       # no engine was made, nothing saved


# -- item 7: upper bounds --------------------------------------------------------------------------

def test_a_context_past_int32_is_refused_not_wrapped(tiny_path, home):
    """4294967360 wrapped to 64 inside llama.cpp."""
    usage_error(run(*gen(tiny_path), "--ctx", "4294967360", "hi", home=home), "--ctx",
                "2147483647")


def test_a_context_far_past_the_training_context_is_refused(tiny_path, home):
    r = run("generate", "-m", tiny_path, "--threads", "1", "--ctx", "20000", "hi", home=home)
    err = usage_error(r, "--ctx", "20000", "2048", "--force-ctx")
    assert "tiny-target.gguf" in err
    r = run("generate", "-m", tiny_path, "--threads", "1", "-n", "2", "--ctx", "20000",
            "--force-ctx", "hi", home=home)
    assert r.returncode == 0 and b"trained on (2048)" in r.stderr, r.stderr   # the warning only


def test_a_context_that_does_not_fit_in_memory_is_refused(home, tmp_path):
    """A model trained on 2^30 tokens: 2e9 tokens pass the training bound, but their KV cache
    (512 bytes a token here, ~1 TB) is more than any test machine has: refused before
    llama.cpp allocates it (it climbed past 5 GB)."""
    roomy = make_tiny_gguf(tmp_path / "roomy.gguf", seed=0, n_ctx_train=2**30)
    r = run("generate", "-m", roomy, "--threads", "1", "--ctx", "2000000000", "hi", home=home)
    usage_error(r, "--ctx", "2000000000", "KV cache", "available", "--force-ctx")


def test_a_rounded_context_is_said(tiny_path, home):
    """--ctx 64 holds 256 tokens (llama.cpp's padding): one line says so."""
    r = run("generate", "-m", tiny_path, "--threads", "1", "-n", "2", "--ctx", "64", "hi",
            home=home)
    assert r.returncode == 0, r.stderr
    assert b"note: --ctx 64 holds 256 tokens" in r.stderr and b"note" not in r.stdout


def test_threads_are_capped_at_the_cores_available(tiny_path, home):
    """--threads 100000 crashed and 4096 hung: capped, with one warning line."""
    usable = len(os.sched_getaffinity(0))
    r = run(*gen(tiny_path, "-n", "2", "--threads", "100000"), "hi", home=home)
    err = r.stderr.decode()
    assert r.returncode == 0, err
    assert f"--threads 100000 is more than the {usable} cores" in err
    assert f"using {usable}" in err and b"threads" not in r.stdout


# -- item 8: store clear ---------------------------------------------------------------------------

def _store_files(home: Path, *names: str) -> list:
    folder = home / "store"
    folder.mkdir(parents=True, exist_ok=True, mode=0o700)
    paths = [folder / name for name in names]
    for path in paths:
        path.write_bytes(b"not read by clear")
    return paths


def test_store_clear_refuses_an_empty_model_name(home):
    """An unset $MODEL gives `-m ""`: that must not mean every model's store."""
    kept = _store_files(home, "a-0123456789abcdef.lsds", "b-0123456789abcdef.lsds")
    usage_error(run("store", "clear", "-m", "", home=home), "-m")
    usage_error(run("store", "clear", "-m", "  ", home=home), "-m")
    assert all(path.exists() for path in kept)


def test_store_clear_of_a_catalog_model_downloads_nothing(home):
    """The store of a catalog model is found by the catalog's file name, without pulling the
    model (it downloaded it first): offline, nothing downloaded, only its file removed."""
    from localspec.catalog.models import get_entry

    stem = Path(get_entry("smollm2-135m").filename).stem
    mine, other = _store_files(home, f"{stem}-0123456789abcdef.lsds",
                               "other-0123456789abcdef.lsds")
    r = run("store", "clear", "-m", "smollm2-135m", home=home, env={"LOCALSPEC_OFFLINE": "1"})
    assert r.returncode == 0 and r.stderr.decode().splitlines()[-1] == "removed 1 store file", \
        r.stderr
    assert not mine.exists() and other.exists()
    assert not (home / "models").exists() or not any((home / "models").iterdir())

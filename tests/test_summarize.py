"""`localspec summarize`: the paragraph splitter, input discovery and validation, atomic outputs,
resume and interruption, and real map-reduce runs on the tiny self-made GGUF (its text is noise;
what is checked is the plumbing: chunks, calls, files, streams and exit codes)."""

from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import sys
import time

import pytest
from click.testing import CliRunner

from localspec.apps import summarize as sm
from localspec.cli import cli
from localspec.errors import LocalspecError
from localspec.apps.summarize import (DocumentError, Source, Summarizer, Summary, discover,
                                 output_path, read_source, run_batch, split_chunks, write_atomic)

FAST = ["--threads", "1", "-n", "8", "--ctx", "512"]


def words_text(seed: int, n_paragraphs: int, sentences: int = 3) -> str:
    rng = random.Random(seed)
    words = "alpha beta gamma delta epsilon zeta eta theta iota kappa lambda mu".split()
    paras = [" ".join(" ".join(rng.choice(words) for _ in range(rng.randint(4, 12))) + "."
                      for _ in range(sentences)) for _ in range(n_paragraphs)]
    return "\n\n".join(paras) + "\n"


def run(*args, input=None):
    return CliRunner().invoke(cli, ["summarize", *args], input=input)


# -- the splitter ----------------------------------------------------------------------------------
def test_split_example_from_the_docstring():
    text = "aaaa bbbb.\n\ncc\n\nddddddddddddddd"
    assert split_chunks(text, 12, len) == ["aaaa bbbb.\n\n", "cc\n\n", "dddddddddddd", "ddd"]


@pytest.mark.parametrize("seed", range(20))
def test_split_respects_budget_and_preserves_text(seed):
    rng = random.Random(seed)
    text = words_text(seed, rng.randint(1, 30), rng.randint(1, 6))
    if seed % 3 == 0:                           # a giant paragraph: lines, then no boundary at all
        text += "\n\n" + "line of text\n" * 40 + "x" * 500 + "\n\nend."
    budget = rng.randint(20, 300)
    chunks = split_chunks(text, budget, len)
    assert "".join(chunks) == text             # in order, nothing lost, nothing added
    assert all(0 < len(c) <= budget for c in chunks)
    # Greedy: no two neighbours would have fitted together.
    assert all(len(a + b) > budget for a, b in zip(chunks, chunks[1:]))


def test_split_prefers_paragraphs_then_lines_then_sentences():
    paras = ["p1 " * 10, "p2 " * 10, "p3 " * 10]
    chunks = split_chunks("\n\n".join(paras), 45, len)
    assert chunks == [paras[0] + "\n\n", paras[1] + "\n\n", paras[2]]
    lines = split_chunks("one line here\ntwo line here\nthree", 16, len)
    assert lines == ["one line here\n", "two line here\n", "three"]
    sentences = split_chunks("First one. Second one. Third.", 12, len)
    assert sentences == ["First one. ", "Second one. ", "Third."]
    assert split_chunks("x" * 25, 10, len) == ["x" * 10, "x" * 10, "x" * 5]


def test_split_with_the_real_tokenizer(tiny_model):
    def count(s):
        return len(tiny_model.tokenize(s, add_special=False))

    text = words_text(7, 12, 5) + "\n\n" + "é€ unicode " * 80 + "\n\n" + "z" * 700
    chunks = split_chunks(text, 150, count)
    assert "".join(chunks) == text and len(chunks) > 5
    assert all(count(c) <= 150 for c in chunks)


# -- inputs ----------------------------------------------------------------------------------------
def test_discover_walks_sorted_with_globs_and_skips_hidden_and_output(tmp_path):
    (tmp_path / "docs" / "sub").mkdir(parents=True)
    (tmp_path / "docs" / ".git").mkdir()
    (tmp_path / "docs" / "out").mkdir()
    for rel in ["b.md", "a.txt", "sub/c.rst", "img.png", ".hidden.md", ".git/x.md", "out/a.md"]:
        (tmp_path / "docs" / rel).write_text("hi")
    srcs = discover([str(tmp_path / "docs")], exclude=tmp_path / "docs" / "out")
    assert [s.rel.as_posix() for s in srcs] == ["a.txt", "b.md", "sub/c.rst"]
    assert all(s.walked and not s.error for s in srcs)
    only_md = discover([str(tmp_path / "docs")], ["*.md"], exclude=tmp_path / "docs" / "out")
    assert [s.rel.as_posix() for s in only_md] == ["b.md"]
    named = discover([str(tmp_path / "docs" / "img.png"), str(tmp_path / "nope.md"), "-"])
    assert [(s.rel.as_posix(), s.error) for s in named] == [
        ("img.png", ""), ("nope.md", "no such file or directory"), ("stdin", "")]
    empty = discover([str(tmp_path / "docs" / "sub")], ["*.md"])
    assert "no files matching *.md" in empty[0].error
    assert sm.parse_globs(["*.md, *.txt", "*.py"]) == ("*.md", "*.txt", "*.py")
    assert sm.parse_globs([]) == sm.DEFAULT_GLOBS


def test_read_source_rejects_binary_non_utf8_empty_and_non_files(tmp_path):
    cases = {"nul.md": b"text\0more", "latin1.md": "caf\xe9".encode("latin-1"),
             "empty.md": b"\n \n"}
    for name, data in cases.items():
        (tmp_path / name).write_bytes(data)
    (tmp_path / "broken.md").symlink_to(tmp_path / "missing-target")
    os.mkfifo(tmp_path / "fifo.md")             # a walk must never block opening a FIFO
    msgs = {s.rel.name: _error(s) for s in discover([str(tmp_path)])}
    assert "NUL" in msgs["nul.md"]
    assert "not UTF-8" in msgs["latin1.md"] and "0xe9" in msgs["latin1.md"]
    assert msgs["empty.md"] == "empty"
    assert msgs["broken.md"] == "broken symbolic link"
    assert msgs["fifo.md"] == "not a regular file"
    (tmp_path / "bom.md").write_bytes("\ufeffhello".encode("utf-8"))
    assert read_source(Source("bom.md", tmp_path / "bom.md", tmp_path / "bom.md")) == "hello"


def _error(src):
    with pytest.raises(DocumentError) as e:
        read_source(src)
    return str(e.value)


# -- outputs, resume, interruption (no model: a fake summarizer) -----------------------------------
class FakeSummarizer:
    def __init__(self, interrupt_on=None):
        self.seen, self.interrupt_on = [], interrupt_on

    def summarize(self, text, on_call=None):
        self.seen.append(text)
        if text == self.interrupt_on:
            raise KeyboardInterrupt
        return Summary(text.upper(), calls=1)


def test_write_atomic_leaves_old_file_or_new_file_never_a_partial_one(tmp_path, monkeypatch):
    target = tmp_path / "d" / "a.summary.md"
    write_atomic(target, "first\n")
    assert target.read_text() == "first\n" and oct(target.stat().st_mode & 0o777) != "0o600"

    def boom(*_):
        raise KeyboardInterrupt
    monkeypatch.setattr(sm.os, "replace", boom)
    with pytest.raises(KeyboardInterrupt):
        write_atomic(target, "second\n")
    assert target.read_text() == "first\n"
    assert os.listdir(target.parent) == ["a.summary.md"]     # the temporary file is gone


def test_interrupted_batch_keeps_complete_outputs_and_resumes(tmp_path):
    for name in "abc":
        (tmp_path / "in" / name).parent.mkdir(exist_ok=True)
        (tmp_path / "in" / f"{name}.md").write_text(f"doc {name}")
    out = tmp_path / "out"
    sources = discover([str(tmp_path / "in")])
    first = FakeSummarizer(interrupt_on="doc b")
    result = run_batch(sources, lambda: first, print, out)
    assert result.interrupted and result.summarized == 1
    assert sorted(os.listdir(out)) == ["a.md.summary.md"]       # nothing partial for b
    second = FakeSummarizer()
    result = run_batch(sources, lambda: second, print, out)
    assert not result.interrupted and result.summarized == 2 and result.skipped == 1
    assert second.seen == ["doc b", "doc c"]
    assert (out / "c.md.summary.md").read_text() == "DOC C\n"
    assert "skipped 1 existing" in result.totals_line()


def test_a_finished_batch_reruns_without_opening_the_model(tmp_path):
    (tmp_path / "a.md").write_text("x")
    write_atomic(output_path(tmp_path / "out", discover([str(tmp_path / "a.md")])[0], "text"), "s")

    def no_model():
        raise AssertionError("the model must not be opened when every output exists")
    result = run_batch(discover([str(tmp_path / "a.md")]), no_model, print, tmp_path / "out")
    assert result.skipped == 1 and result.summarized == 0


# -- real runs on the tiny model -------------------------------------------------------------------
def test_cli_directory_to_output_dir_then_skip_then_force(tiny_path, tmp_path):
    docs = tmp_path / "docs"
    (docs / "sub").mkdir(parents=True)
    (docs / "a.md").write_text(words_text(1, 2))
    (docs / "sub" / "b.txt").write_text(words_text(2, 2))
    (docs / "skip.png").write_bytes(b"\x89PNG\0")
    out = tmp_path / "out"
    r = run(str(docs), "-o", str(out), "-m", str(tiny_path), *FAST)
    assert r.exit_code == 0, r.output
    assert r.stdout == ""
    files = sorted(p.relative_to(out).as_posix() for p in out.rglob("*"))
    assert files == ["a.md.summary.md", "sub", "sub/b.txt.summary.md"]   # no temporary files left
    assert "[2/2] " in r.stderr and "2 documents summarized" in r.stderr
    mtime = (out / "a.md.summary.md").stat().st_mtime_ns

    again = run(str(docs), "-o", str(out), "-m", str(tiny_path), *FAST)
    assert again.exit_code == 0 and "skipped 2 existing" in again.stderr
    assert "0 documents summarized" in again.stderr
    assert (out / "a.md.summary.md").stat().st_mtime_ns == mtime

    forced = run(str(docs), "-o", str(out), "-m", str(tiny_path), "--force", *FAST)
    assert forced.exit_code == 0 and "2 documents summarized" in forced.stderr
    assert "skipped" not in forced.stderr.splitlines()[-1]
    assert (out / "a.md.summary.md").stat().st_mtime_ns != mtime


def test_cli_bad_inputs_are_reported_and_skipped_with_exit_1(tiny_path, tmp_path):
    docs = tmp_path / "docs"
    docs.mkdir()
    (docs / "good1.md").write_text(words_text(3, 1))
    (docs / "nul.md").write_bytes(b"looks like text\0but is not")
    (docs / "latin1.txt").write_bytes("r\xe9sum\xe9 of a caf\xe9".encode("latin-1"))
    (docs / "empty.md").write_text("")
    (docs / "link.md").symlink_to(docs / "gone")
    (docs / "zgood2.md").write_text(words_text(4, 1))
    out = tmp_path / "out"
    r = run(str(docs), str(tmp_path / "missing.md"), "-o", str(out), "-m", str(tiny_path), *FAST)
    assert r.exit_code == 1, r.output
    assert sorted(os.listdir(out)) == ["good1.md.summary.md", "zgood2.md.summary.md"]
    for expect in ["nul.md: binary file", "latin1.txt: not UTF-8", "empty.md: empty",
                   "link.md: broken symbolic link", "missing.md: no such file or directory"]:
        assert expect in r.stderr
    assert r.stderr.splitlines()[-1].endswith("5 failed")
    assert "Traceback" not in r.output


def test_long_document_takes_the_map_reduce_path(tiny_path, tmp_path):
    from localspec.speculative.engine import Engine, EngineConfig
    from localspec.speculative.sampling import SamplingParams

    text = words_text(5, 12, 4)
    with Engine(str(tiny_path), EngineConfig(n_ctx=512, n_threads=1)) as engine:
        calls = []
        real_generate = engine.generate

        def spy(messages, sampling, max_tokens, stop=(), document=None):
            calls.append((len(engine.tokenize_prompt(messages)), messages[0]["content"], document))
            return real_generate(messages, sampling, max_tokens=max_tokens, stop=stop,
                                 document=document)
        engine.generate = spy
        summary = Summarizer(engine, SamplingParams(), 8).summarize(text)
        shared = len(engine.model.tokenize(sm.DEFAULT_INSTRUCTION, add_special=False))
    assert summary.chunks > 2 and summary.calls == len(calls) > summary.chunks
    assert all(n + 8 <= 512 for n, _, _ in calls)               # every prompt fits with its output
    for _, content, document in calls:                           # the body is the lookup document
        assert content.endswith("\n\n" + document)
    maps, reduces = calls[:summary.chunks], calls[summary.chunks:]
    assert " ".join(d for _, _, d in maps).split() == text.split()
    # the instruction comes first in every call, the reduce note after it: the instruction's
    # KV rows are read once and reused by every later call (the prompt-cache issue)
    assert all(c.startswith(sm.DEFAULT_INSTRUCTION + "\n\n" + sm.REDUCE_NOTE) for _, c, _ in reduces)
    assert all(c.startswith(sm.DEFAULT_INSTRUCTION) for _, c, _ in maps)
    assert summary.stats.prompt_tokens == sum(n for n, _, _ in calls)
    assert summary.stats.reused_tokens >= (summary.calls - 1) * shared > 0
    assert summary.stats.generated_tokens <= 8 * summary.calls


def test_cli_jsonl_and_stdin_to_stdout(tiny_path, tmp_path):
    (tmp_path / "long.md").write_text(words_text(6, 12, 4))
    (tmp_path / "short.md").write_text("A short note.")
    r = run(str(tmp_path / "long.md"), str(tmp_path / "short.md"), "--format", "jsonl",
            "-m", str(tiny_path), *FAST)
    assert r.exit_code == 0, r.output
    rows = [json.loads(line) for line in r.stdout.splitlines()]
    assert [row["path"] for row in rows] == [str(tmp_path / "long.md"), str(tmp_path / "short.md")]
    assert rows[0]["chunks"] > 1 and rows[0]["calls"] > rows[0]["chunks"]
    assert rows[1]["chunks"] == rows[1]["calls"] == 1
    assert all(row["stats"]["generated_tokens"] > 0 for row in rows)

    piped = run("-", "-m", str(tiny_path), *FAST, input="Summarize me: stdin works.\n")
    assert piped.exit_code == 0, piped.output
    assert piped.stdout.endswith("\n") and "==>" not in piped.stdout
    assert "1 document summarized" in piped.stderr and "acceptance" in piped.stderr

    both = run("-", str(tmp_path / "short.md"), "-m", str(tiny_path), *FAST, input="From stdin.")
    assert both.stdout.startswith("==> - <==\n")
    assert f"\n\n==> {tmp_path / 'short.md'} <==\n" in both.stdout


def test_cli_ctrl_c_stops_with_a_resume_message(tiny_path, tmp_path, monkeypatch):
    for name in "abc":
        (tmp_path / f"{name}.md").write_text(f"document {name}")
    real = Summarizer.summarize

    def interrupt_b(self, text, on_call=None):
        if text == "document b":
            raise KeyboardInterrupt
        return real(self, text, on_call)
    monkeypatch.setattr(Summarizer, "summarize", interrupt_b)
    args = [str(tmp_path / f"{n}.md") for n in "abc"] + ["-o", str(tmp_path / "out"),
                                                        "-m", str(tiny_path), *FAST]
    r = run(*args)
    assert r.exit_code == 130
    assert "stopped after 1 of 3 documents" in r.stderr and "rerun" in r.stderr
    assert os.listdir(tmp_path / "out") == ["a.md.summary.md"]
    monkeypatch.setattr(Summarizer, "summarize", real)
    r = run(*args)
    assert r.exit_code == 0 and "2 documents summarized" in r.stderr and "skipped 1" in r.stderr


def test_user_errors_are_one_line(tiny_path, tmp_path):
    (tmp_path / "a.md").write_text("hello")
    (tmp_path / "d").mkdir()
    (tmp_path / "d" / "a.md").write_text("hello")
    r = run(str(tmp_path / "a.md"), "-m", str(tiny_path), "--threads", "1", "--ctx", "256",
            "-n", "200")
    assert isinstance(r.exception, LocalspecError) and "raise --ctx" in str(r.exception)
    r = run(str(tmp_path / "a.md"), str(tmp_path / "d"), "-o", str(tmp_path / "o"),
            "-m", str(tiny_path))
    assert isinstance(r.exception, LocalspecError) and "would both write" in str(r.exception)
    assert run("-", "-", "-m", str(tiny_path)).exit_code == 2


def test_real_sigint_stops_cleanly_and_a_rerun_resumes(tiny_path, tmp_path):
    """The real process, through `python -m localspec`: SIGINT once the first output exists, then
    exit codes 130, 1 (a bad input) and 0 from main(), and only complete outputs on disk."""
    docs, out = tmp_path / "docs", tmp_path / "out"
    docs.mkdir()
    for i in range(30):
        (docs / f"d{i:02}.md").write_text(f"Document number {i}.")
    cmd = [sys.executable, "-m", "localspec", "summarize", str(docs), "-o", str(out),
           "-m", str(tiny_path), "--threads", "1", "--ctx", "512", "-n", "200"]
    # SIGINT may be ignored in a background test runner; the child must get Python's handler.
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    deadline = time.monotonic() + 60
    while not (out.exists() and any(out.glob("*.summary.md"))) and time.monotonic() < deadline:
        time.sleep(0.02)
    proc.send_signal(signal.SIGINT)
    stdout, stderr = proc.communicate(timeout=60)
    assert proc.returncode == 130, stderr
    assert stdout == "" and "Traceback" not in stderr
    assert "interrupted: " in stderr and "rerun the same command to resume" in stderr
    done = sorted(os.listdir(out))
    assert 1 <= len(done) < 30 and all(n.endswith(".summary.md") for n in done)  # no temp files

    (docs / "zz-binary.md").write_bytes(b"\0\1\2")
    rerun = subprocess.run(cmd[:-1] + ["8"], capture_output=True, text=True, timeout=120)
    assert rerun.returncode == 1, rerun.stderr
    assert f"skipped {len(done)} existing; 1 failed" in rerun.stderr
    assert len(os.listdir(out)) == 30

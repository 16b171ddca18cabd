"""localspec's files under $LOCALSPEC_HOME (issue 43, items 3, 5 and 8): user data is owner-only
(files 0600, folders 0700, old ones fixed on the next write, said once); a crafted but parseable
file of any format (draft store, prompt-cache entry, saved session, calibration, a temporary
file's name) is one warning and set aside, and the run goes on; a read-only store folder is read,
never reset."""

from __future__ import annotations

import hashlib
import json
import os
import stat
import struct
import time
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest

import localspec.files.private as private
from localspec.cache.disk import DiskFolder
from localspec.cache.format import Entry, write_file
from localspec.cache.prompt_cache import PromptCache
from localspec.errors import LocalspecError
from localspec.files import jsonsafe
from localspec.files.atomic import atomic_write, stale_temp, temp_owner
from localspec.files.container import Rejected, read_container
from localspec.policy import calibrate
from localspec.policy.costmodel import Stability
from localspec.policy.draft_estimate import CostCurve
from localspec.speculative import store_file
from localspec.speculative.learning_store import LearningStore
from localspec.speculative.store import BREAK
from localspec.speculative.store_file import StoreFile, read_store

KEY = "k" * 32


def mode(path) -> int:
    return stat.S_IMODE(os.stat(path).st_mode)


@pytest.fixture
def home(tmp_path, monkeypatch):
    monkeypatch.setenv("LOCALSPEC_HOME", str(tmp_path / "home"))
    monkeypatch.setattr(private, "_said", False)      # "said once per process": per test here
    return tmp_path / "home"


def header_of(tokens=(), payload=b"", **fields) -> dict:
    toks = np.asarray(tokens, "<i4").tobytes()
    return {"key": KEY, "model": "m.gguf", "n_tokens": len(tokens),
            "payload_bytes": len(payload), "sha256": hashlib.sha256(toks + payload).hexdigest(),
            "created": 1.0, "meta": {"store_version": 1}, "clean": [0, 0], **fields}


def container(tokens=(), payload=b"", raw_header=None, **fields) -> bytes:
    """A container file's bytes with a valid checksum: `fields` override the header's, or
    `raw_header` replaces its JSON text (numbers json.dumps cannot write, deep nesting)."""
    raw = raw_header if raw_header is not None else \
        json.dumps(header_of(tokens, payload, **fields)).encode()
    return (struct.pack("<8sII", b"LSPCACHE", 1, len(raw)) + raw +
            np.asarray(tokens, "<i4").tobytes() + payload)


def raw_with(tokens, old: str, new: str, **fields) -> bytes:
    """container() whose header text has `old` replaced by `new` (e.g. a number as 1e999)."""
    text = json.dumps(header_of(tokens, **fields))
    assert old in text
    return container(tokens, raw_header=text.replace(old, new, 1).encode())


# ---- item 3: private files ------------------------------------------------------------------

def test_every_writer_makes_owner_only_files_in_owner_only_folders(home, tiny_model, capsys):
    """A prompt-cache entry, a saved session, a calibration and the store: 0600 in 0700, on a
    fresh home, with nothing said."""
    disk = DiskFolder(home / "prompt-cache", 2**30)
    entry = disk.write(Entry(KEY, np.arange(40, dtype=np.int32), np.zeros(64, np.uint8)),
                       "m.gguf")
    from localspec.llama import Context, ContextParams
    cache = PromptCache(64, disk_dir=home / "prompt-cache")
    with Context(tiny_model, ContextParams(n_ctx=256, n_threads=1)) as ctx:
        ctx.decode(list(range(1, 40)), logits="none")
        session = cache.save_named("mine", ctx, {"turns": []})
    curve = home / "calibration" / "c.json"
    fake = SimpleNamespace(model=SimpleNamespace(path=Path("/m.gguf")), n_threads=2)
    stability = Stability(3, 0.01, 1, 0.02, 0.01, 5.0)
    calibrate._write(curve, fake, CostCurve((1.0, 1.5), 5.0, "", {"stability": stability}), 0)
    store = store_file.store_dir() / "m.lsds"
    assert StoreFile(store, KEY, "m.gguf", 100).save([1, 2, BREAK])
    for path in (entry, session, curve, store):
        assert mode(path) == 0o600, path
        assert mode(path.parent) == 0o700, path.parent
    assert mode(home / "prompt-cache") == 0o700
    assert capsys.readouterr().err == ""


def test_old_files_open_to_others_are_closed_on_the_next_write_said_once(home, capsys):
    root = home / "prompt-cache"
    old = root / KEY / "old.lskv"
    old.parent.mkdir(parents=True)
    old.write_bytes(container([1, 2]))
    for path, m in ((root, 0o755), (old.parent, 0o755), (old, 0o644)):
        os.chmod(path, m)
    calib = home / "calibration"
    calib.mkdir(mode=0o755)
    os.chmod(calib, 0o755)
    (calib / "old.json").write_text("{}")
    os.chmod(calib / "old.json", 0o644)
    DiskFolder(root, 2**30).write(Entry(KEY, np.arange(40, dtype=np.int32),
                                        np.zeros(8, np.uint8)), "m.gguf")
    assert (mode(root), mode(old.parent), mode(old)) == (0o700, 0o700, 0o600)
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "owner-only" in err[0] and str(root) in err[0], err
    atomic_write(calib / "new.json", lambda f: f.write(b"{}"))       # another folder: fixed,
    assert (mode(calib), mode(calib / "old.json")) == (0o700, 0o600)  # not said again
    assert capsys.readouterr().err == ""


def test_a_read_only_store_folder_is_read_never_reset(home, tiny_path, capsys):
    """Item 8: a store folder the user made 0500 keeps its mode and its data; one line says why
    nothing is saved this run (old code silently chmod'ed it back to 0700 and wrote)."""
    path, key = store_file.store_path(tiny_path)
    assert StoreFile(path, key, "tiny.gguf", 1000).save([5, 6, 7, BREAK])
    before = path.read_bytes()
    os.chmod(path.parent, 0o500)
    try:
        store = LearningStore.for_model(tiny_path, "tiny.gguf")
        assert store.memory.tokens().tolist() == [5, 6, 7, BREAK]      # drafts from it
        store.begin_output([1, 2])
        store.add([3, 4])
        store.close()
        assert mode(path.parent) == 0o500 and path.read_bytes() == before
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and "read-only (mode 500)" in err[0] and "not saving" in err[0], err
        assert "cannot replace" in store_file.next_run(path)           # what `store stats` says
    finally:
        os.chmod(path.parent, 0o700)
    assert "moves it to" in store_file.next_run(path)


# ---- item 5: crafted files ------------------------------------------------------------------

DEEP = "[" * 100_000 + "]" * 100_000


@pytest.mark.parametrize("name, data, reason", [
    ("meta a list", container([1, BREAK], meta=[1]), "meta is not an object"),
    ("token below -1", container([1, -5, BREAK]), "token id -5"),
    ("n_tokens 1e999", raw_with([1, BREAK], '"n_tokens": 2', '"n_tokens": 1e999'),
     "header is corrupt"),
    ("header nested 100k deep", raw_with([1, BREAK], '"meta": {', f'"x": {DEEP}, "meta": {{'),
     "nested deeper"),
    ("outside the vocabulary", container([1, 300, BREAK]), "outside the model's vocabulary"),
])
def test_a_crafted_store_file_is_one_warning_set_aside_and_the_run_goes_on(
        home, capsys, name, data, reason):
    path = store_file.store_dir() / "m.lsds"
    path.write_bytes(data)
    f = StoreFile(path, KEY, "m.gguf", 1000, n_vocab=259)
    assert f.load().tolist() == [] and f.load().tolist() == []
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and reason in err[0] and "moved it to m.lsds.rejected" in err[0], err
    assert not path.exists() and path.with_name("m.lsds.rejected").read_bytes() == data
    assert f.save([7, 8, BREAK]) and read_store(path, KEY)[1].tolist() == [7, 8, BREAK]


def test_a_store_of_ids_the_model_lacks_is_refused_where_it_is_loaded(home, tiny_path, capsys):
    """Token ids past the vocabulary would be drafted into every matching prompt's verify batch
    (a decode failure that read "the context may be full"): the model's store refuses them."""
    path, key = store_file.store_path(tiny_path)
    path.write_bytes(container([1, 2, 5000, BREAK], key=key))
    store = LearningStore.for_model(tiny_path, "tiny.gguf", n_vocab=259)
    assert len(store.memory) == 0
    store.close()
    assert "outside the model's vocabulary (259 tokens)" in capsys.readouterr().err


def test_a_temporary_file_named_with_a_huge_pid_is_cleaned_not_fatal(home):
    path = store_file.store_dir() / "m.lsds"
    for pid in ("99999999999999999999", "0", "4194305"):
        tmp = path.with_name(f".m.lsds.{pid}.0badc0de.tmp")
        tmp.write_bytes(b"x")
        os.utime(tmp, (time.time() - 3600, time.time() - 3600))
        assert temp_owner(tmp.name) == 0 and stale_temp(tmp)
        assert StoreFile(path, KEY, "m.gguf", 100).save([1, BREAK])   # old: OverflowError
        assert not tmp.exists()
    assert temp_owner(f".m.lsds.{os.getpid()}.0badc0de.tmp") == os.getpid()


@pytest.mark.parametrize("old, new, reason", [
    ('"n_tokens": 2', '"n_tokens": Infinity', "Infinity is not a number"),
    ('"created": 1.0', '"created": -Infinity', "-Infinity is not a number"),
    ('"meta": {', f'"meta": {{"x": {DEEP}, ', "nested deeper"),
])
def test_a_crafted_prompt_cache_entry_is_one_warning_set_aside(home, capsys, old, new, reason):
    root = home / "prompt-cache"
    path = root / KEY / "e.lskv"
    path.parent.mkdir(parents=True)
    path.write_bytes(raw_with([1, 2], old, new, meta={}))
    disk = DiskFolder(root, 2**30)
    assert disk.scan(KEY) == [] and disk.scan(KEY) == []
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and reason in err[0] and str(path) in err[0], err
    assert not path.exists() and path.with_name("e.lskv.rejected").exists()


def test_a_saved_session_whose_meta_is_a_list_is_set_aside_with_one_line(home, tiny_model):
    from localspec.llama import Context, ContextParams
    cache = PromptCache(64, disk_dir=home / "prompt-cache")
    path = home / "prompt-cache" / "sessions" / "work.lskv"
    path.parent.mkdir(parents=True)
    path.write_bytes(container([1, 2], meta=["turns"]))
    with Context(tiny_model, ContextParams(n_ctx=256, n_threads=1)) as ctx:
        with pytest.raises(LocalspecError, match="meta is not an object.*moved to "
                                                 "work.lskv.rejected"):
            cache.load_named("work", ctx)
        with pytest.raises(LocalspecError, match="no saved session named 'work'"):
            cache.load_named("work", ctx)                    # the next run: gone, not stuck


@pytest.mark.parametrize("text, reason", [
    ('{"ratios": [1.0, 1.5], "ms_per_step": 5.0, "remeasured": 1e999}', "out of range"),
    ('{"ratios": [1.0, 1.5], "ms_per_step": 5.0, "remeasured": 1e300}', "remeasured"),
    ('{"ratios": [1.0, 1.5], "ms_per_step": 5.0, "samples": ' + DEEP + "}", "nested deeper"),
    ('{"ratios": [1.0, 1.5], "ms_per_step": 5.0, "stability": {"rounds": "x"}}', "stability"),
])
def test_a_crafted_calibration_is_one_warning_set_aside_and_measured_again(
        home, capsys, text, reason):
    path = home / "calibration" / "c.json"
    path.parent.mkdir(parents=True)
    path.write_text(text)
    assert calibrate._read_curve(path, 1, "c") is None
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and reason in err[0] and "measuring it again" in err[0], err
    assert not path.exists() and path.with_name("c.json.rejected").exists()
    path.write_text('{"ratios": [1.0, 1.5], "ms_per_step": 5.0, "remeasured": 2}')
    assert calibrate._read_curve(path, 1, "c").ratios == (1.0, 1.5)


def test_json_headers_are_parsed_without_recursion_or_infinities():
    assert jsonsafe.loads('{"a": "[[[[" }') == {"a": "[[[["}
    for bad in ("[" * 5000 + "]" * 5000, '{"n": NaN}', '{"n": 1e999}', '{"n": -Infinity}'):
        with pytest.raises(ValueError):
            jsonsafe.loads(bad)


def test_the_container_refuses_a_header_longer_than_the_file(tmp_path):
    path = tmp_path / "x.lskv"
    data = container([1, 2], payload=b"abc")
    path.write_bytes(data[:8] + struct.pack("<II", 1, 2**31) + data[16:])
    with pytest.raises(Rejected, match="truncated"):
        read_container(path)
    write_file(path, KEY, [1, 2], np.frombuffer(b"abc", np.uint8), "m.gguf", {"a": 1})
    assert read_container(path)[2].tobytes() == b"abc"


def test_files_set_aside_count_against_the_disk_budget_and_go_first(home):
    root = home / "prompt-cache"
    aside = root / KEY / "old.lskv.rejected"
    aside.parent.mkdir(parents=True)
    aside.write_bytes(bytes(4000))
    disk = DiskFolder(root, 3000)
    disk.write(Entry(KEY, np.arange(40, dtype=np.int32), np.zeros(8, np.uint8)), "m.gguf")
    assert not aside.exists() and len(list(root.glob("*/*.lskv"))) == 1


def test_a_crash_report_is_owner_only(home):
    from localspec.files import write_crash_report
    try:
        raise RuntimeError("a prompt quoted in a traceback")
    except RuntimeError as e:
        path = write_crash_report(e)
    assert path.parent == home / "crashes" and mode(path) == 0o600 and mode(path.parent) == 0o700


def test_the_depth_check_is_linear_in_a_crafted_header():
    """A header of one open string and 100k escaped quotes: a regular expression over strings
    would retry at each quote (quadratic); the scan passes once."""
    raw = b'{"a": "' + b'\\"' * 100_000 + b'", "b": [[1]]}'
    assert jsonsafe.nesting_depth(raw) == 3
    assert jsonsafe.loads(raw)["b"] == [[1]]


def test_a_store_of_ids_the_model_lacks_never_reaches_a_verify_batch(home, tiny_path):
    """End to end (the engine builds the store with its target's vocabulary): a store holding
    ids past the tiny model's 259 is one warning, set aside, and generation gives its text."""
    import subprocess
    import sys
    path, key = store_file.store_path(tiny_path)
    args = [sys.executable, "-m", "localspec", "generate", "-m", str(tiny_path), "--proposer",
            "ngram", "--threads", "1", "--ctx", "512", "-n", "24", "--no-learn", "ab ab ab ab"]
    env = {**os.environ, "LOCALSPEC_HOME": str(home)}
    plain = subprocess.run(args[:7] + ["none"] + args[8:], capture_output=True, text=True,
                           env=env, timeout=300)
    path.write_bytes(container([97, 98, 5000, 6000, BREAK], key=key))
    run = subprocess.run(args, capture_output=True, text=True, env=env, timeout=300)
    assert plain.returncode == 0 and run.returncode == 0, plain.stderr + run.stderr
    assert run.stdout == plain.stdout
    assert "outside the model's vocabulary" in run.stderr
    assert path.with_name(path.name + ".rejected").exists()

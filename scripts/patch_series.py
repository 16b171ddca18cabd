#!/usr/bin/env python3
"""localspec's patch series to llama.cpp (patches/llama-cpp-python-VERSION/): apply it to the
pinned llama-cpp-python sdist, refresh the patch files from an edited tree, check it.

The series is a quilt-style folder: `series` lists the patches in order, names the sdist's
sha256 and the patched tree's hash; every patch opens with a header of fixed fields (FIELDS)
and then a -p1 diff against the sdist's root. install.sh applies it with `apply`; a maintainer
rebases it with `apply --git` (one commit per patch), edits with git, and writes it back with
`refresh`; CI's tests and `check` prove it applies without fuzz and gives the named tree.

    python scripts/patch_series.py apply /tmp/llama --git       # work tree, one commit a patch
    (edit; git -C /tmp/llama commit --fixup=<patch's commit>; git rebase -i --autosquash)
    python scripts/patch_series.py refresh /tmp/llama           # rewrite the patch files
    python scripts/patch_series.py check --build                # applies, tree hash, compiles
    python scripts/patch_series.py apply /tmp/vk --backend vulkan   # a Vulkan wheel's source

Exit status: 0 done, 1 a check failed, 2 usage, 3 a patch no longer applies to the sdist.
Standard library only: install.sh runs it before localspec is installed.
"""

from __future__ import annotations

import argparse
import hashlib
import os
import re
import shutil
import subprocess
import sys
import tarfile
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PATCHES = ROOT / "patches"
# Every patch opens with these fields, in this order ("Field: text", continued on lines that
# start with a space), then the diff. They say what a reviewer asks of a kernel patch.
FIELDS = ("Subject", "Changes", "Exact", "Cost", "Tests", "Applies-to", "Forwarded")
GIT = ["git", "-c", "user.name=localspec", "-c", "user.email=localspec@localhost",
       "-c", "commit.gpgsign=false", "-c", "core.autocrlf=false"]


class SeriesError(Exception):
    """A check failed or an input is wrong: one line for the user; `code` is the exit status."""

    def __init__(self, message: str, code: int = 1):
        super().__init__(message)
        self.code = code


def series_dir(args) -> Path:
    """patches/llama-cpp-python-VERSION/, the only one there unless a version is named."""
    patches, version = Path(args.patches), args.version
    found = sorted(patches.glob("llama-cpp-python-*/series"))
    if version:
        found = [s for s in found if s.parent.name == f"llama-cpp-python-{version}"]
    if len(found) != 1:
        raise SeriesError(f"expected one series under {patches} (found {len(found)}); "
                          "name it with --version", 2)
    return found[0].parent


def read_series(folder: Path) -> tuple[list[str], dict[str, str]]:
    """The patch names in order, and the `# key: value` facts (sdist-sha256, tree)."""
    names, facts = [], {}
    for line in (folder / "series").read_text().splitlines():
        fact = re.match(r"#\s*([\w-]+):\s*(\S+)\s*$", line)
        if fact:
            facts[fact.group(1)] = fact.group(2)
        elif line.strip() and not line.startswith("#"):
            names.append(line.strip())
    on_disk = sorted(p.name for p in folder.glob("*.patch"))
    if sorted(names) != on_disk:
        raise SeriesError(f"{folder / 'series'} lists {sorted(names)} but the folder holds "
                          f"{on_disk}: add or remove the names")
    return names, facts


def version_of(folder: Path) -> str:
    return folder.name.removeprefix("llama-cpp-python-")


def header_of(text: str) -> dict[str, str]:
    """A patch's header fields (FIELDS), from the text before its first diff."""
    head = re.split(r"^(?:diff --git |--- a/)", text, maxsplit=1, flags=re.M)[0]
    fields: dict[str, str] = {}
    key = None
    for line in head.splitlines():
        m = re.match(r"([A-Z][\w-]*):\s?(.*)$", line)
        if m and not line.startswith(" "):
            key = m.group(1)
            fields[key] = m.group(2)
        elif key and line.startswith(" "):
            fields[key] += "\n" + line[1:]
    return fields


def check_header(name: str, text: str) -> None:
    fields = header_of(text)
    missing = [f for f in FIELDS if not fields.get(f, "").strip()]
    if missing or list(fields)[:len(FIELDS)] != list(FIELDS):
        raise SeriesError(f"{name}: the header needs the fields {', '.join(FIELDS)} in that "
                          f"order, each non-empty (missing or empty: "
                          f"{', '.join(missing) or 'none'})")


def cache_dir() -> Path:
    """install.sh's cache folder: $LOCALSPEC_HOME, else $XDG_CACHE_HOME/localspec."""
    home = os.environ.get("LOCALSPEC_HOME")
    if home:
        return Path(home)
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "localspec"


def sha256_file(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def sdist(folder: Path, given: str | None) -> Path:
    """The pinned sdist: --sdist, else the cached copy, else pip downloads it into the cache.
    Its sha256 must be the one `series` names."""
    version = version_of(folder)
    want = read_series(folder)[1].get("sdist-sha256")
    path = Path(given) if given else cache_dir() / "sdist" / f"llama_cpp_python-{version}.tar.gz"
    if not path.exists() and not given:
        path.parent.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryDirectory(dir=path.parent) as tmp:
            run([sys.executable, "-m", "pip", "download", "--no-deps", "--no-binary", ":all:",
                 "--no-cache-dir", "-d", tmp, f"llama-cpp-python=={version}"], quiet=True)
            got = list(Path(tmp).glob("llama_cpp_python-*.tar.gz"))
            if len(got) != 1:
                raise SeriesError(f"pip download gave no llama-cpp-python {version} sdist")
            os.replace(got[0], path)
    if not path.exists():
        raise SeriesError(f"{path}: no such sdist", 2)
    if want and sha256_file(path) != want:
        raise SeriesError(f"{path} is not llama-cpp-python {version}'s sdist (sha256 differs "
                          f"from {folder / 'series'}); delete it to download it again")
    return path


def run(cmd: list[str], cwd: Path | None = None, quiet: bool = False, stdin: str | None = None):
    """cmd's result; its output captured when quiet or fed stdin, and its last lines in the
    error when it fails."""
    captured = quiet or stdin is not None
    done = subprocess.run(cmd, cwd=cwd, input=stdin, text=True, capture_output=captured)
    if done.returncode != 0:
        tail = (done.stderr or done.stdout or "").strip().splitlines()[-3:] if captured else []
        raise SeriesError(f"{' '.join(cmd[:4])}... failed" + (": " + " | ".join(tail) if tail else ""))
    return done


def unpack(archive: Path, source: str | None, into: Path) -> None:
    """The sdist's tree (or a copy of --source, an unpacked tree) at `into`, a new path."""
    if into.exists():
        raise SeriesError(f"{into} exists: apply makes a new tree", 2)
    if source:
        shutil.copytree(source, into, symlinks=True)
        return
    with tempfile.TemporaryDirectory(dir=into.parent) as tmp, tarfile.open(archive) as tar:
        if hasattr(tarfile, "data_filter"):     # Python 3.12+, and 3.11.4+
            tar.extractall(tmp, filter="tar")
        else:
            tar.extractall(tmp)
        tops = list(Path(tmp).iterdir())
        if len(tops) != 1:
            raise SeriesError(f"{archive}: expected one top folder")
        os.replace(tops[0], into)


def apply_one(tree: Path, patch: Path) -> None:
    """One patch, exactly (no fuzz); exit 3 with one line when it no longer applies."""
    text = patch.read_text()
    if shutil.which("patch"):
        dry = ["patch", "-p1", "--forward", "--batch", "--fuzz=0", "--no-backup-if-mismatch",
               "--dry-run", "-s", "-d", str(tree)]
        real = [c for c in dry if c != "--dry-run"]
    else:
        dry = ["git", "-C", str(tree), "apply", "-p1", "--check"]
        real = ["git", "-C", str(tree), "apply", "-p1"]
    try:
        run(dry, stdin=text)
    except SeriesError:
        raise SeriesError(f"{patch} no longer applies to this llama-cpp-python source; rebase "
                          "the series (docs/build.md, 'The patch series')", 3) from None
    run(real, stdin=text)


def backend_patches(folder: Path, names: list[str], backend: str) -> list[str]:
    """The patches of the series that touch only one GPU backend's sources (ggml/src/ggml-NAME/,
    e.g. vulkan): what install.sh applies to that backend's wheel build."""
    prefix = f"vendor/llama.cpp/ggml/src/ggml-{backend}/"
    return [n for n in names if all(p.startswith(prefix) for p in touched(folder, [n]))]


def apply(args) -> None:
    folder = series_dir(args)
    names, _ = read_series(folder)
    if args.backend:
        names = backend_patches(folder, names, args.backend)
    into = Path(args.dir).resolve()
    unpack(None if args.source else sdist(folder, args.sdist), args.source, into)
    if args.git:
        shutil.rmtree(into / ".git", ignore_errors=True)   # the sdist ships upstream's .git
        run(GIT + ["init", "-q"], cwd=into)
        run(GIT + ["add", "-A", "-f", "vendor"], cwd=into)
        run(GIT + ["commit", "-q", "-m", f"llama-cpp-python {version_of(folder)} (sdist)"],
            cwd=into)
    upto = len(names) if args.upto is None else args.upto
    for name in names[:upto]:
        apply_one(into, folder / name)
        if args.git:
            header = re.split(r"^(?:diff --git |--- a/)", (folder / name).read_text(), 1, re.M)[0]
            run(GIT + ["add", "-A", "-f", "vendor"], cwd=into)
            run(GIT + ["commit", "-q", "--cleanup=verbatim", "-F", "-"], cwd=into,
                stdin=name.removesuffix(".patch") + "\n\n" + header.rstrip("\n") + "\n")
    print(f"{into}: llama-cpp-python {version_of(folder)} with {upto} of {len(names)} patches"
          + (" (git: one commit a patch)" if args.git else ""), file=sys.stderr)


def key(args) -> None:
    folder = series_dir(args)
    names, _ = read_series(folder)
    if args.backend:
        names = backend_patches(folder, names, args.backend)
    digest = hashlib.sha256()
    for name in names:
        digest.update((folder / name).read_bytes())
    print(digest.hexdigest()[:12] if names else "")


def touched(folder: Path, names: list[str]) -> list[str]:
    paths = set()
    for name in names:
        paths.update(re.findall(r"^\+\+\+ b/(\S+)", (folder / name).read_text(), re.M))
    return sorted(paths)


def tree_hash(tree: Path, paths: list[str]) -> str:
    """sha256 over every patched file's path and content, in path order."""
    digest = hashlib.sha256()
    for rel in paths:
        digest.update(f"{rel}\0{sha256_file(tree / rel)}\n".encode())
    return digest.hexdigest()


def write_series(folder: Path, names: list[str], facts: dict[str, str]) -> None:
    lines = [line for line in (folder / "series").read_text().splitlines()
             if line.startswith("#") and not re.match(r"#\s*(sdist-sha256|tree):", line)]
    lines += [f"# {k}: {v}" for k, v in facts.items()] + names
    (folder / "series").write_text("\n".join(lines) + "\n")


def refresh(args) -> None:
    """The patch files from a tree made by `apply --git`: one per commit after the sdist's,
    named by the commit message's first line, the rest of the message as its header."""
    folder = series_dir(args)
    tree = Path(args.dir).resolve()
    _, facts = read_series(folder)
    log = run(GIT + ["log", "--reverse", "--format=%H", "HEAD"], cwd=tree,
              quiet=True).stdout.split()
    if len(log) < 2:
        raise SeriesError(f"{tree}: no commits after the sdist's (make it with apply --git)", 2)
    written = []
    for parent, commit in zip(log, log[1:]):
        message = run(GIT + ["log", "-1", "--format=%B", commit], cwd=tree, quiet=True).stdout
        stem, _, header = message.partition("\n")
        if not re.fullmatch(r"\d{4}-[\w.+-]+", stem):
            raise SeriesError(f"commit {commit[:10]}: its first line must be the patch name, "
                              f"NNNN-topic (got {stem!r})", 2)
        diff = run(GIT + ["diff", "--no-color", "--no-ext-diff", "--no-renames", "-U3",
                          parent, commit, "--", "vendor"], cwd=tree, quiet=True).stdout
        text = header.strip("\n") + "\n\n" + diff
        check_header(stem, text)
        written.append(stem + ".patch")
        (folder / written[-1]).write_text(text)
    for old in folder.glob("*.patch"):
        if old.name not in written:
            old.unlink()
    facts["tree"] = tree_hash(tree, touched(folder, written))
    write_series(folder, written, facts)
    print(f"{folder}: {len(written)} patches written from {tree}; tree {facts['tree'][:16]}",
          file=sys.stderr)


def check(args) -> None:
    """Applies without fuzz to the pinned sdist, every header complete, the tree hash the
    series names; with --build, ggml-cpu compiles with install.sh's flags."""
    folder = series_dir(args)
    names, facts = read_series(folder)
    for name in names:
        check_header(name, (folder / name).read_text())
    with tempfile.TemporaryDirectory() as tmp:
        tree = Path(tmp) / "tree"
        unpack(sdist(folder, args.sdist), None, tree)
        for name in names:
            apply_one(tree, folder / name)
        got = tree_hash(tree, touched(folder, names))
        if got != facts.get("tree"):
            raise SeriesError(f"the patched tree's hash is {got}, {folder / 'series'} names "
                              f"{facts.get('tree')}: refresh the series or fix the patches")
        print(f"ok: {len(names)} patches apply without fuzz; tree {got[:16]} as named",
              file=sys.stderr)
        if args.build:
            flags = run([sys.executable, str(ROOT / "localspec/llama/buildflags.py")],
                        quiet=True).stdout.split()
            build = Path(tmp) / "build"
            jobs = str(os.cpu_count() or 2)
            run(["cmake", "-S", str(tree), "-B", str(build), "-DCMAKE_BUILD_TYPE=Release",
                 "-DLLAVA_BUILD=OFF", *flags], quiet=True)
            run(["cmake", "--build", str(build), "--target", "ggml-cpu", "-j", jobs], quiet=True)
            print(f"ok: ggml-cpu builds with {' '.join(flags)}", file=sys.stderr)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="patch_series.py", description=__doc__.split("\n\n")[0],
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog="examples:\n" + __doc__.split("\n\n")[2] + "\n\nThe series, its header "
        "fields and how to rebase it onto a new llama-cpp-python: docs/build.md.")
    parser.add_argument("--version", help="llama-cpp-python version of the series "
                        "(default: the one folder under patches/)")
    parser.add_argument("--patches", default=str(PATCHES), help="the folder that holds the "
                        "series folders (default: the checkout's patches/)")
    sub = parser.add_subparsers(dest="command", required=True)
    p = sub.add_parser("apply", help="unpack the sdist into DIR and apply the series")
    p.add_argument("dir", help="the new tree (must not exist)")
    p.add_argument("--git", action="store_true", help="make DIR a git tree, one commit a patch")
    p.add_argument("--upto", type=int, help="apply only the first N patches")
    p.add_argument("--sdist", help="the sdist .tar.gz (default: cached, else pip downloads it)")
    p.add_argument("--source", help="copy this unpacked source tree instead of the sdist")
    p.add_argument("--backend", help="apply only the patches that touch nothing but this GPU "
                   "backend's sources (vulkan, cuda): a GPU wheel's build")
    p.set_defaults(run=apply)
    p = sub.add_parser("key", help="a hash of the patches apply would apply (install.sh's cache "
                       "key); empty when none")
    p.add_argument("--backend", help="as for apply")
    p.set_defaults(run=key)
    p = sub.add_parser("refresh", help="rewrite the patch files from DIR's commits")
    p.add_argument("dir", help="a tree made by apply --git, edited with git")
    p.set_defaults(run=refresh)
    p = sub.add_parser("check", help="applies without fuzz, headers complete, tree hash")
    p.add_argument("--build", action="store_true", help="also compile ggml-cpu with "
                   "install.sh's flags (2-5 min on 2 cores)")
    p.add_argument("--sdist", help="the sdist .tar.gz (default: cached, else pip downloads it)")
    p.set_defaults(run=check)
    args = parser.parse_args(argv)
    try:
        args.run(args)
    except SeriesError as e:
        print(f"patch_series.py: error: {e}", file=sys.stderr)
        return e.code
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""llama.cpp's stock binaries, built once per machine: `llama-speculative-simple` for the
llamacpp-* bench modes and, on demand, `llama-server` for scripts/bench/bench_parallel.py. From the
vendored llama.cpp of the installed llama-cpp-python's sdist, with the CMake flags install.sh
builds the wheel with (localspec/llama/buildflags.py), cached beside the wheel under
$LOCALSPEC_HOME/llamacpp-bin/llama-cpp-python-VERSION-KEY/ (KEY: install.sh's wheel key, so one
flag set, one folder, both binaries). Only the target asked for and what it links are compiled,
statically, with nothing downloaded (no curl, no OpenSSL, no web UI assets for the server).

    python -m localspec.bench.llamacpp_build                        # or scripts/llamacpp_tools.sh
    python -m localspec.bench.llamacpp_build --target llama-server  # the HTTP server too
    python -m localspec.bench.llamacpp_build --path [--target T]    # where it is (built or not)
    python -m localspec.bench.llamacpp_build --linked               # the tool on the wheel's libs

`--linked` builds the tool alone against shared llama.cpp libraries, with no backend and no
CPU-specific flags, into llama-cpp-python-VERSION-linked/: it runs on the installed wheel's own
libllama and libggml (LD_LIBRARY_PATH), so on a GPU machine it computes with the very CUDA or
Vulkan library localspec runs on, with no second GPU build (a CUDA one takes minutes), and it
can be built on another machine of the same platform and carried there (the GPU recipe does).
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import os
import platform
import re
import shutil
import subprocess
import sys
import tarfile
import tempfile
import time
from pathlib import Path
from typing import Callable, Optional

from ..errors import LocalspecError
from ..files import localspec_home

TOOL = "llama-speculative-simple"
SERVER = "llama-server"
TARGETS = (TOOL,)                                 # what build() makes unless told otherwise
BUILD_COMMAND = "scripts/llamacpp_tools.sh"      # = python -m localspec.bench.llamacpp_build
# Standalone llama.cpp builds its tests, tools and server by default; none are needed here.
# Static: one self-contained binary to cache. OpenSSL/curl: nothing is downloaded.
FIXED_ARGS = ("-DCMAKE_BUILD_TYPE=Release", "-DBUILD_SHARED_LIBS=OFF", "-DLLAMA_BUILD_COMMON=ON",
              "-DLLAMA_BUILD_EXAMPLES=ON", "-DLLAMA_BUILD_TESTS=OFF", "-DLLAMA_BUILD_TOOLS=OFF",
              "-DLLAMA_BUILD_SERVER=OFF", "-DLLAMA_BUILD_APP=OFF", "-DLLAMA_OPENSSL=OFF",
              "-DLLAMA_CURL=OFF")
# Parts of the vendored tree this configuration never reads (vocabularies, docs, Python, media,
# the tools and tests it does not build: 170 of its 180 MB).
SKIP_DIRS = ("models", "docs", "media", "gguf-py", "tests", "tools", ".git", ".github", "benches",
             "conversion", "skills", "app")
# What a target needs beyond that. llama-server lives in tools/ (tools/CMakeLists.txt adds
# tools/server, tools/ui and tools/cli only under LLAMA_BUILD_SERVER, and every other tool's
# folder with them, so the whole of tools/ is unpacked). Its web UI: tools/ui/CMakeLists.txt
# runs scripts/ui-assets.cmake, which would npm-build it (LLAMA_BUILD_UI) or download it from a
# Hugging Face bucket (LLAMA_USE_PREBUILT_UI, on by default); with both off and no tools/ui/dist
# in the sdist it embeds an empty table: the API is served, the browser page is not.
EXTRA_ARGS = {SERVER: ("-DLLAMA_BUILD_TOOLS=ON", "-DLLAMA_BUILD_SERVER=ON",
                       "-DLLAMA_BUILD_UI=OFF", "-DLLAMA_USE_PREBUILT_UI=OFF")}
NEEDS_DIRS = {SERVER: ("tools",)}
# The one edit to the stock source, for the tool only: llama.cpp leaks its logger on purpose
# (common_log_main, ggml-org/llama.cpp#22142), so the lines its worker thread has not written when
# main() returns are lost. On a loaded machine that was the run's summary ("encoded N tokens",
# which the bench reads): the tool now drains its log before it returns. Its stamp in BUILD tells
# a binary built with the edit from one built before it.
DRAIN_AT = ('    LOG("\\n\\n");\n\n    return 0;\n}')
DRAIN_WITH = ('    LOG("\\n\\n");\n\n    common_log_pause(common_log_main()); // localspec: drain the log\n'
              '\n    return 0;\n}')
DRAIN_FILE = "examples/speculative-simple/speculative-simple.cpp"
DRAIN_STAMP = "edit: the tool drains its log before it returns"
# Measured: the server 15.6 CPU-minutes (25.5 min wall, 2 jobs, niced, on a loaded 2-vCPU Xeon).
BUILD_MINUTES = {TOOL: "9 CPU-minutes", SERVER: "16 CPU-minutes"}
# The linked tool: shared libraries (only their sonames matter: the wheel's own are loaded at run
# time), no backend, no -march (the binary travels), no run path (LD_LIBRARY_PATH decides).
LINKED_ARGS = ("-DBUILD_SHARED_LIBS=ON", "-DGGML_NATIVE=OFF", "-DCMAKE_SKIP_RPATH=ON")
LINKED_STAMP = "linked: runs on the installed wheel's libllama and libggml"
# What the linked tool needs that no wheel has: llama.cpp's common code, a shared library of its
# own in a shared build (its soname: one number after .so), kept beside the tool.
LINKED_OWN_LIB = re.compile(r"^libllama-common\.so\.\d+$")

Say = Callable[[str], None]


def version() -> str:
    """The installed llama-cpp-python's version: the binaries must match the wheel localspec
    runs on."""
    from importlib.metadata import PackageNotFoundError, version as v
    try:
        return v("llama-cpp-python")
    except PackageNotFoundError:
        raise LocalspecError("llama-cpp-python is not installed here; run ./install.sh first.") \
            from None


def cmake_args() -> list:
    """The wheel's flags, from the one place that decides them."""
    from ..llama.buildflags import host_plan
    return list(host_plan().args)


def flag_key(ver: str, args: list) -> str:
    """install.sh's wheel key: sha256 of "VERSION SYSTEM MACHINE FLAGS", 12 hex digits.

    Example: ("0.3.36", ["-DGGML_RPC=ON"]) on Linux x86_64 -> sha256("0.3.36 Linux x86_64
    -DGGML_RPC=ON")[:12]."""
    text = f"{ver} {platform.system()} {platform.machine()} {' '.join(args)}"
    return hashlib.sha256(text.encode()).hexdigest()[:12]


def bin_dir(ver: Optional[str] = None, args: Optional[list] = None) -> Path:
    ver = ver or version()
    args = cmake_args() if args is None else args
    return localspec_home() / "llamacpp-bin" / f"llama-cpp-python-{ver}-{flag_key(ver, args)}"


def linked_dir(ver: Optional[str] = None) -> Path:
    return localspec_home() / "llamacpp-bin" / f"llama-cpp-python-{ver or version()}-linked"


def tool_path(name: str = TOOL) -> Path:
    return bin_dir() / name


def is_linked(tool: Path) -> bool:
    """Whether `tool` is the linked build, which needs the wheel's libraries at run time."""
    stamp = tool.parent / "BUILD"
    return stamp.is_file() and LINKED_STAMP in stamp.read_text()


def tool_env(tool: Path) -> dict:
    """The environment to run `tool` in: the linked build finds the installed wheel's libllama
    and libggml first, then its own libllama-common beside it (its run path is empty)."""
    env = dict(os.environ)
    if is_linked(tool):
        from ..llama.libs import package_lib_dir
        lib = package_lib_dir()
        if lib is None:
            raise LocalspecError("llama-cpp-python is not installed here; run ./install.sh "
                                 "first.")
        env["LD_LIBRARY_PATH"] = os.pathsep.join(
            [str(lib), str(tool.parent)] +
            [p for p in env.get("LD_LIBRARY_PATH", "").split(os.pathsep) if p])
    return env


def build_command(name: str = TOOL) -> str:
    return BUILD_COMMAND if name == TOOL else f"{BUILD_COMMAND} --target {name}"


def require_tool(name: str = TOOL) -> Path:
    """The built binary (this flag set's own, else the linked tool), or a one-line error saying
    how to build it."""
    path = tool_path(name)
    if not path.is_file() and name == TOOL and built(linked_dir(), TOOL):
        return linked_dir() / TOOL
    if not path.is_file():
        raise LocalspecError(f"llama.cpp's {name} is not built for this flag set "
                             f"({path.parent.name}); build it once "
                             f"({BUILD_MINUTES.get(name, 'minutes')}): {build_command(name)}")
    if not built(path.parent, name):
        raise LocalspecError(f"llama.cpp's {name} in {path.parent} was built before the bench's "
                             f"log edit (its summary can be lost at exit); rebuild it once "
                             f"({BUILD_MINUTES.get(name, 'minutes')}): {build_command(name)}")
    return path


def fixed_args(targets, more: tuple = ()) -> list:
    """FIXED_ARGS with what the targets add, and `more` (the linked build's; a later -D of the
    same name wins in CMake, but one of each keeps the BUILD note readable)."""
    extra = [a for t in targets for a in EXTRA_ARGS.get(t, ())] + list(more)
    names = {a.split("=", 1)[0] for a in extra}
    return [a for a in FIXED_ARGS if a.split("=", 1)[0] not in names] + extra


# -- the source ------------------------------------------------------------------------------------
def sdist(ver: str, say: Say) -> Path:
    """llama-cpp-python's sdist, from the cache install.sh's GPU bundle shares, else PyPI."""
    folder = localspec_home() / "sdist"
    path = folder / f"llama_cpp_python-{ver}.tar.gz"
    if path.is_file():
        return path
    folder.mkdir(parents=True, exist_ok=True)
    say(f"downloading llama-cpp-python {ver}'s source (77 MB)...")
    # --no-binary for this package only: ':all:' would build its build tools from source too.
    r = subprocess.run([sys.executable, "-m", "pip", "download", "-q", "--no-deps",
                        "--no-binary", "llama-cpp-python", "-d", str(folder),
                        f"llama-cpp-python=={ver}"], capture_output=True, text=True)
    if r.returncode != 0 or not path.is_file():
        raise LocalspecError(f"could not download llama-cpp-python {ver}'s source (no package "
                             f"index?): {(r.stderr.strip().splitlines() or ['?'])[-1]}")
    return path


def unpack_vendored(archive: Path, dest: Path, keep: tuple = ()) -> Path:
    """vendor/llama.cpp of the sdist into dest, without the parts the build never reads (but
    those of SKIP_DIRS named in `keep`)."""
    skip = set(SKIP_DIRS) - set(keep)
    with tarfile.open(archive) as tar:
        members = []
        for m in tar.getmembers():
            parts = Path(m.name).parts
            if len(parts) < 3 or parts[1:3] != ("vendor", "llama.cpp"):
                continue
            if len(parts) > 3 and parts[3] in skip:
                continue
            members.append(m)
        tar.extractall(dest, members=members, filter="data")
    return dest / Path(members[0].name).parts[0] / "vendor" / "llama.cpp"


def source_tree(ver: str, work: Path, say: Say, keep: tuple = ()) -> Path:
    """LOCALSPEC_LLAMA_SRC (an unpacked llama-cpp-python tree, as install.sh takes) or the sdist."""
    given = os.environ.get("LOCALSPEC_LLAMA_SRC")
    if given:
        tree = Path(given) / "vendor" / "llama.cpp"
        if not (tree / "CMakeLists.txt").is_file():
            raise LocalspecError(f"LOCALSPEC_LLAMA_SRC={given} has no vendor/llama.cpp.")
        missing = [d for d in keep if not (tree / d).is_dir()]
        if missing:
            raise LocalspecError(f"LOCALSPEC_LLAMA_SRC={given} has no vendor/llama.cpp/"
                                 f"{missing[0]} (a trimmed tree?).")
        # A copy: the tool's edit (DRAIN_AT) never touches the caller's tree.
        skip = set(SKIP_DIRS) - set(keep)
        copy = work / "llama.cpp"
        shutil.copytree(tree, copy, symlinks=True,
                        ignore=lambda d, names: [n for n in names if n in skip] if d == str(tree)
                        else [])
        return copy
    return unpack_vendored(sdist(ver, say), work, keep)


def drain_log_at_exit(tree: Path) -> None:
    """The tool's one edit (DRAIN_AT); a source whose main() does not end as expected is a
    one-line error, not a binary that loses its summary."""
    path = tree / DRAIN_FILE
    text = path.read_text()
    if text.count(DRAIN_AT) != 1:
        raise LocalspecError(f"{DRAIN_FILE} does not end as llama-cpp-python 0.3.36's does; "
                             "the bench's log edit needs updating for this version.")
    path.write_text(text.replace(DRAIN_AT, DRAIN_WITH))


def built(out: Path, target: str) -> bool:
    """The target's binary is there, and the tool's was built with its edit (and, linked, has
    its libllama-common beside it)."""
    if not (out / target).is_file():
        return False
    stamp = out / "BUILD"
    if target != TOOL:
        return True
    note = stamp.read_text() if stamp.is_file() else ""
    return DRAIN_STAMP in note and (LINKED_STAMP not in note or
                                    any(LINKED_OWN_LIB.match(p.name) for p in out.iterdir()))


# -- the build -------------------------------------------------------------------------------------
_PROGRESS = re.compile(r"^\[\s*(\d+)%\]|^\[(\d+)/(\d+)\]")


def _run_logged(cmd: list, log, say: Say, what: str) -> None:
    """Run cmd with its output appended to `log`; a progress line on stderr every 10% (make's
    "[ 42%]", ninja's "[12/80]") or every 60 s."""
    log.write(f"$ {' '.join(cmd)}\n")
    log.flush()
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            errors="replace")
    shown, last = -10, time.monotonic()
    for line in proc.stdout:
        log.write(line)
        m = _PROGRESS.match(line)
        if m:
            pct = int(m.group(1)) if m.group(1) else 100 * int(m.group(2)) // int(m.group(3))
            if pct >= shown + 10 or time.monotonic() - last > 60:
                shown, last = pct, time.monotonic()
                say(f"  {what}: {pct}%")
    if proc.wait() != 0:
        raise subprocess.CalledProcessError(proc.returncode, cmd)


@contextlib.contextmanager
def _lock(path: Path, say: Say):
    """One build per flag set at a time; a second caller waits, then finds it built."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w") as f:
        try:
            fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            say("waiting for another build of llama.cpp's tools to finish...")
            fcntl.flock(f, fcntl.LOCK_EX)
        yield


def build(say: Say = lambda s: print(s, file=sys.stderr), jobs: Optional[int] = None,
          targets: tuple = TARGETS, linked: bool = False) -> Path:
    """Build (or find built) the targets; their folder. Targets already there are kept, so
    llama-server joins llama-speculative-simple in one folder. `linked`: the tool alone, on
    shared libraries (LINKED_ARGS, linked_dir). A failure is one LocalspecError line naming the
    build log."""
    unknown = [t for t in targets if t not in (TOOL, SERVER)]
    if unknown or (linked and tuple(targets) != (TOOL,)):
        raise LocalspecError(f"unknown target {(unknown or targets)[0]!r}; known: {TOOL}, "
                             f"{SERVER} ({TOOL} alone when linked).")
    ver = version()
    args = [] if linked else cmake_args()
    out = linked_dir(ver) if linked else bin_dir(ver, args)
    if all(built(out, t) for t in targets):
        return out
    missing = [t for t in ("cmake", "c++") if not shutil.which(t)]
    if missing:
        raise LocalspecError(f"building llama.cpp's tools needs {' and '.join(missing)} "
                             "(e.g. apt-get install cmake g++, or pip install cmake).")
    with _lock(out.parent / f"{out.name}.lock", say):
        todo = tuple(t for t in targets if not built(out, t))
        if not todo:
            return out
        jobs = jobs or os.cpu_count() or 2
        out.parent.mkdir(parents=True, exist_ok=True)
        # One log per target set: building the server later keeps the tool's log.
        tag = "" if todo == (TOOL,) else "." + "+".join(todo)
        log_path = out.parent / f"{out.name}{tag}.build.log"
        fixed = fixed_args(todo, LINKED_ARGS if linked else ())
        keep = tuple(d for t in todo for d in NEEDS_DIRS.get(t, ()))
        cost = " + ".join(BUILD_MINUTES.get(t, "minutes") for t in todo)
        t0 = time.monotonic()
        how = "linked to the installed wheel's libraries" if linked else \
            "with install.sh's flags"
        say(f"building llama.cpp's {', '.join(todo)} from llama-cpp-python {ver}'s vendored "
            f"source {how} ({jobs} jobs; {cost}; log: {log_path})")
        with tempfile.TemporaryDirectory(prefix="llamacpp-build-") as work, \
                open(log_path, "w") as log:
            work = Path(work)
            try:
                tree = source_tree(ver, work, say, keep)
                if TOOL in todo:
                    drain_log_at_exit(tree)
                _run_logged(["cmake", "-S", str(tree), "-B", str(work / "build"), *fixed,
                             *args], log, say, "configure")
                _run_logged(["cmake", "--build", str(work / "build"), "--config", "Release",
                             "-j", str(jobs), "--target", *todo], log, say, "compile")
            except (subprocess.CalledProcessError, OSError) as e:
                raise LocalspecError(f"building llama.cpp's tools failed ({e}); log: "
                                     f"{log_path}") from None
            found = {}
            for t in todo:
                found[t] = next((p for p in (work / "build").rglob(t) if p.is_file()), None)
                if found[t] is None:
                    raise LocalspecError(f"the build made no {t}; log: {log_path}")
            # Into the folder (made whole first, then each binary renamed into place), beside
            # whatever an earlier build left there.
            tmp = out.with_name(out.name + ".tmp")
            shutil.rmtree(tmp, ignore_errors=True)
            tmp.mkdir()
            for t, path in found.items():
                shutil.copy2(path, tmp / t)
            if linked:
                own = [p for p in (work / "build").rglob("lib*.so.*")
                       if LINKED_OWN_LIB.match(p.name)]
                if not own:
                    raise LocalspecError(f"the linked build made no libllama-common; log: "
                                         f"{log_path}")
                for lib in own:
                    shutil.copy2(lib, tmp / lib.name)        # the file, not the link
            note = (f"llama-cpp-python {ver}: {', '.join(todo)}\n{' '.join(fixed)}\n"
                    f"{' '.join(args)}\n" + (f"{TOOL} {DRAIN_STAMP}\n" if TOOL in todo else "")
                    + (f"{LINKED_STAMP}\n" if linked else ""))
            if out.is_dir():
                for f in tmp.iterdir():        # the targets (and the linked tool's library)
                    os.replace(f, out / f.name)
                with open(out / "BUILD", "a") as f:
                    f.write(note)
                shutil.rmtree(tmp, ignore_errors=True)
            else:
                (tmp / "BUILD").write_text(note)
                os.replace(tmp, out)
        say(f"built {', '.join(todo)} in {(time.monotonic() - t0) / 60:.1f} min: {out}")
    return out


def main(argv: list) -> int:
    import argparse
    ap = argparse.ArgumentParser(prog=BUILD_COMMAND, description="Build llama.cpp's stock "
                                 "binaries from the wheel's vendored source and flags, once.")
    ap.add_argument("--target", choices=(TOOL, SERVER), default=TOOL,
                    help=f"which binary (default {TOOL}; {SERVER} for "
                         "scripts/bench/bench_parallel.py)")
    ap.add_argument("--path", action="store_true", help="print where it is, built or not")
    ap.add_argument("-j", "--jobs", type=int, default=None, help="compile jobs (default: cores)")
    ap.add_argument("--linked", action="store_true",
                    help=f"{TOOL} on shared libraries, run on the installed wheel's own (no "
                         "backend of its own: on a GPU build it computes with the wheel's GPU "
                         "library; portable to another machine of this platform)")
    a = ap.parse_args(argv)
    try:
        if a.path:
            print((linked_dir() if a.linked else bin_dir()) / a.target)
            return 0
        print(build(jobs=a.jobs, targets=(a.target,), linked=a.linked) / a.target)
    except LocalspecError as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))

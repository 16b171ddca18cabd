"""The native guard (csrc/native_guard.c, in localspec._ngram_c): what llama.cpp's threads call
instead of Python. Its log goes to a bounded C ring that Python drains after each call; ggml's
abort hook and the fatal signals (SIGSEGV, SIGBUS, SIGILL, SIGFPE, SIGABRT) write one line
prepared here beforehand, e.g.

    error: crashed (SIGSEGV) in llama.cpp while loading smollm2.gguf onto CUDA0 (try
    --gpu-layers 0, or LOCALSPEC_BACKEND=cpu ./install.sh); report: ~/.cache/localspec/crashes/...

then a report (native stack, llama.cpp's last log messages, Python's faulthandler stack) and
exit with CRASH_EXIT. Nothing here runs inside a native call.

For diagnosing a crash (the GPU recipe's matrix):
  LOCALSPEC_LOG_SINK=stderr   leave llama.cpp's log on its own default (printed to stderr by
                              llama.cpp itself, no sink, nothing filtered); default "c".
  LOCALSPEC_CRASH_GUARD=0     install no signal handler or abort hook (a debugger, or the bare
                              signal, sees the crash); default on.
"""

from __future__ import annotations

import datetime
import faulthandler
import os
import tempfile
from contextlib import contextmanager
from pathlib import Path
from typing import Iterator, Optional

from .._ngram_c import ffi, lib
from ..errors import LocalspecError
from ..files import cache_dir

CRASH_EXIT = 86
"""Exit status after a crash inside native code (1: user error, 2: usage, 70: internal error,
130: Ctrl-C; 128 + N is what a shell shows for a bare signal N, which this replaces)."""
SINK_ENV, GUARD_ENV = "LOCALSPEC_LOG_SINK", "LOCALSPEC_CRASH_GUARD"
IDLE = "in localspec, outside any llama.cpp call"
_MSG_CAP = 4097
_state: dict = {"buf": None, "level": ffi.new("int *"), "guard": None, "report": None}


def sink_wanted() -> bool:
    """LOCALSPEC_LOG_SINK: "c" (default) routes llama.cpp's log through the C sink; "stderr"
    leaves it on llama.cpp's own default."""
    word = os.environ.get(SINK_ENV, "c").strip().lower()
    if word not in ("c", "stderr"):
        raise LocalspecError(f"{SINK_ENV}={word!r}: use c (the default) or stderr.")
    return word == "c"


def guard_wanted() -> bool:
    return os.environ.get(GUARD_ENV, "1").strip().lower() not in ("0", "false", "no", "off")


def address(name: str) -> int:
    """The address of one of native_guard's C functions, for llama.cpp's setters."""
    return int(ffi.cast("uintptr_t", ffi.addressof(lib, name)))


# -- log ----------------------------------------------------------------------------------------
def configure_log(min_level: int, keep: tuple = ()) -> None:
    """Keep messages at `min_level` or above, and any that contains one of `keep`."""
    if lib.lsn_log_configure(min_level, "\n".join(keep).encode()) != 0:
        raise ValueError("native log: too many keep patterns")


def drain() -> list:
    """[(level, text)] of what llama.cpp logged since the last drain, oldest first; a
    continuation (level 5) carries the level of the message it continues."""
    if _state["buf"] is None:
        _state["buf"] = ffi.new("char[]", _MSG_CAP)
    buf, level, out = _state["buf"], _state["level"], []
    last = 4
    while True:
        n = lib.lsn_log_pop(level, buf, _MSG_CAP)
        if n < 0:
            break
        lv = last if level[0] == 5 else level[0]
        out.append((lv, ffi.string(buf).decode("utf-8", "replace")))
        last = lv
    dropped = lib.lsn_log_dropped()
    if dropped:
        out.append((3, f"localspec: {dropped} llama.cpp log messages were dropped (the log "
                       "buffer was full).\n"))
    return out


# -- the crash guard ----------------------------------------------------------------------------
def crash_dir() -> Path:
    """Where crash reports go: <home>/crashes (files.py's write_crash_report uses the same
    folder) when a file can be created there, else the system's temporary folder. The folder
    may exist and still refuse files (a read-only home that has it): a report path there would
    be lost at the crash, when the C handler can only try it, so it is tried now."""
    try:
        folder = cache_dir("crashes")
        fd, probe = tempfile.mkstemp(prefix=".localspec-probe-", dir=folder)
        os.close(fd)
        os.unlink(probe)
        return folder
    except (OSError, LocalspecError):
        return Path(tempfile.gettempdir())


def install_guard() -> Optional[Path]:
    """Install the fatal-signal handlers (once per process) and return where a crash report
    would go; None when LOCALSPEC_CRASH_GUARD=0. Python's stack comes from faulthandler, enabled
    here on a private temporary file that the handler copies into the report."""
    if not guard_wanted():
        return None
    if _state["guard"] is None:
        stamp = datetime.datetime.now().strftime("%Y%m%d-%H%M%S")
        report = crash_dir() / f"localspec-native-crash-{stamp}-{os.getpid()}.txt"
        stack_file = tempfile.TemporaryFile(prefix="localspec-stack-")
        # The guard first, then faulthandler: faulthandler keeps the guard as the handler it
        # hands each signal on to, and puts it back when Python finalises.
        if lib.lsn_guard_install(str(report).encode(), stack_file.fileno(), CRASH_EXIT) != 0:
            stack_file.close()
            return None
        faulthandler.enable(stack_file, all_threads=True)
        _state["guard"], _state["report"] = stack_file, report   # both live as long as the process
        set_phase(IDLE)
    return _state["report"]


def uninstall_guard() -> None:
    """Give the fatal signals back to the handlers found at install (the process then dies of
    the bare signal). The abort hook stays set: rpc.py's caller clears it with ggml."""
    lib.lsn_guard_uninstall()
    _state["report"] = None


def report_path() -> Optional[Path]:
    return _state["report"]


def encode_phase(text: str) -> bytes:
    return text.encode("utf-8", "replace")


def set_phase(text) -> None:
    """What the crash line says localspec is doing (`text` str, or bytes from encode_phase)."""
    lib.lsn_guard_set_phase(text if isinstance(text, bytes) else encode_phase(text))


@contextmanager
def phase(text: str) -> Iterator[None]:
    """`text` is the crash line's phase during the block, IDLE after it."""
    set_phase(text)
    try:
        yield
    finally:
        set_phase(IDLE)


def crash_hint(on_gpu: bool, gpu_build: bool) -> str:
    """What to try after a crash, e.g. "(try --gpu-layers 0, or LOCALSPEC_BACKEND=cpu
    ./install.sh)"."""
    if on_gpu:
        return "(try --gpu-layers 0, or LOCALSPEC_BACKEND=cpu ./install.sh)"
    if gpu_build:
        return "(try LOCALSPEC_BACKEND=cpu ./install.sh, or LOCALSPEC_EXACT=0)"
    return "(try LOCALSPEC_EXACT=0, or rerun ./install.sh)"


# -- ggml's abort hook while RPC servers are attached --------------------------------------------
def set_lost(line: str, hint: str, interrupted: str, wait_ms: int) -> None:
    """From now on ggml's abort means a lost server: "error: LINE (reason)HINT", or
    "error: INTERRUPTED (reason)." after interrupted(); exit 1 (130) after at most wait_ms."""
    lib.lsn_abort_set_lost(line.encode(), hint.encode(), interrupted.encode(), wait_ms)


def interrupted() -> None:
    lib.lsn_abort_interrupted(1)


def lost_pending() -> Optional[str]:
    """ggml's reason once the abort hook has reported a lost server, else None."""
    buf = ffi.new("char[]", 512)
    return ffi.string(buf).decode("utf-8", "replace") if lib.lsn_abort_pending(buf, 512) else None


def release() -> None:
    lib.lsn_abort_release()


def test_crash(how: int = 0) -> None:
    """Tests only: crash inside native code (0 SIGSEGV, 1 SIGABRT, 2 the abort hook)."""
    lib.lsn_test_crash(how)

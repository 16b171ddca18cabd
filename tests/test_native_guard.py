"""The native guard (csrc/native_guard.c, localspec/llama/native.py) and native lifetimes: the C log
sink, a crash inside a native call as one line + a report + exit 86, a CPU-only load that opens
no device and makes no probe, and handles that are never touched after their owner closed them
(issue 41 items 1-3, issue 43 item 4)."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import tempfile
import textwrap
from pathlib import Path

import pytest

from localspec.errors import LocalspecError
from localspec.llama import Context, ContextParams, Model, ModelParams, backend, native
from localspec.llama.native import CRASH_EXIT


def python(code: str, home: Path, **env) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", textwrap.dedent(code)], capture_output=True,
                          text=True, timeout=300,
                          env={**os.environ, "LOCALSPEC_HOME": str(home), **env})


# -- the log sink --------------------------------------------------------------------------------
def test_the_sink_keeps_what_the_filter_says_continuations_follow_and_it_is_bounded():
    from localspec._ngram_c import ffi, lib
    native.drain()                                   # whatever llama.cpp said before
    try:
        native.configure_log(3, ("using device ",))
        for level, text in [(2, b"info, not shown\n"), (5, b"its continuation\n"),
                            (2, b"load: using device CUDA0\n"), (4, b"an error\n"),
                            (5, b"and its end\n"), (3, b"a warning\n")]:
            lib.lsn_log_sink(level, text, ffi.NULL)
        assert native.drain() == [(2, "load: using device CUDA0\n"), (4, "an error\n"),
                                  (4, "and its end\n"), (3, "a warning\n")]
        for _ in range(5000):                         # 5000 x 100 bytes > the 256 KiB ring
            lib.lsn_log_sink(4, b"x" * 99 + b"\n", ffi.NULL)
        kept = native.drain()
        assert 2000 < len(kept) < 5000 and "were dropped" in kept[-1][1]
        assert native.drain() == []
    finally:
        backend.set_log_level()


def test_the_sink_takes_messages_from_many_threads_at_once():
    """cffi drops the GIL around each call, so these threads log concurrently, as llama.cpp's
    do: every message arrives whole, none twice."""
    import threading
    from localspec._ngram_c import ffi, lib
    native.drain()
    try:
        native.configure_log(1)

        def log(n):
            for i in range(2000):
                lib.lsn_log_sink(4, f"thread {n} message {i}\n".encode(), ffi.NULL)
        threads = [threading.Thread(target=log, args=(n,)) for n in range(4)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        got = [text for _, text in native.drain()]
        assert sorted(got) == sorted(f"thread {n} message {i}\n" for n in range(4)
                                     for i in range(2000))
    finally:
        backend.set_log_level()


def test_llama_cpp_logs_through_the_c_sink_not_a_python_callback(tiny_path):
    """What llama.cpp logs while it loads is in the ring (the placement lines are kept), and the
    pointer llama.cpp calls is native_guard's C function."""
    import ctypes
    with Model(tiny_path):
        pass
    C = backend.C
    fn, user = C.llama_log_callback(), ctypes.c_void_p()
    C.llama_log_get(ctypes.byref(fn), ctypes.byref(user))
    assert ctypes.cast(fn, ctypes.c_void_p).value == native.address("lsn_log_sink")


def test_a_file_llama_cpp_refuses_is_one_line_with_its_reason(tmp_path):
    bad = tmp_path / "bad.gguf"
    bad.write_bytes(b"GGUF" + b"\x03\x00\x00\x00" + b"\xff" * 64)
    with pytest.raises(LocalspecError) as e:
        Model(bad)
    assert "could not load" in str(e.value) and "\n" not in str(e.value)
    assert native.drain() == []                       # drained into the message, not left over


# -- a crash inside a native call ----------------------------------------------------------------
CRASH = """
    from localspec.llama import backend, native
    backend._ensure_backend()
    native.set_phase("in llama.cpp while decoding a batch of 9 tokens with m.gguf on CPU (try x)")
    def inside_a_native_call():
        native.test_crash({how})
    inside_a_native_call()
"""


@pytest.mark.parametrize("how, what", [(0, "crashed (SIGSEGV)"), (1, "crashed (SIGABRT)"),
                                       (2, "aborted (a test abort)")])
def test_a_crash_is_one_line_a_report_with_both_stacks_and_exit_86(tmp_path, how, what):
    r = python(CRASH.format(how=how), tmp_path)
    assert r.returncode == CRASH_EXIT, r.stderr
    (line,) = r.stderr.splitlines()
    assert line.startswith(f"error: {what} in llama.cpp while decoding a batch of 9 tokens "
                           "with m.gguf on CPU (try x); report: "), line
    report = Path(line.split("; report: ")[1])
    assert report.parent == tmp_path / "crashes" and oct(report.stat().st_mode & 0o777) == "0o600"
    text = report.read_text()
    native_stack = text.split("native stack")[1].split("Python stack")[0]
    assert native_stack.count("[0x") >= 3 and "_ngram_c" in native_stack   # backtrace_symbols_fd
    assert "Python stack" in text and "inside_a_native_call" in text       # faulthandler's


def test_a_crashes_folder_that_refuses_files_sends_the_report_to_the_temp_folder(tmp_path):
    """Issue 65: a home that has crashes/ but cannot write into it (read-only) lost the report:
    exit 86 and the line, no `report:`, no file. Root writes into a read-only folder, so for
    root the folder is a link to one the kernel refuses files in (/proc/self/fdinfo)."""
    (tmp_path / "home").mkdir()
    crashes = tmp_path / "home" / "crashes"
    if os.geteuid() == 0:
        crashes.symlink_to("/proc/self/fdinfo")
    else:
        crashes.mkdir(mode=0o500)
    r = python(CRASH.format(how=0), tmp_path / "home")
    assert r.returncode == CRASH_EXIT, r.stderr
    (line,) = r.stderr.splitlines()
    assert "; report: " in line, line
    report = Path(line.split("; report: ")[1])
    try:
        assert report.parent == Path(tempfile.gettempdir()) and "native stack" in report.read_text()
    finally:
        report.unlink(missing_ok=True)


def test_without_the_guard_the_signal_is_bare(tmp_path):
    r = python(CRASH.format(how=0), tmp_path, LOCALSPEC_CRASH_GUARD="0")
    assert r.returncode == -11 and not (tmp_path / "crashes").exists()


def test_doctor_reports_a_crash_of_its_child_and_goes_on(tiny_path):
    from localspec.apps.doctor import probe_in_child
    found, crash = probe_in_child([str(tiny_path)], 0, crash_test=0)
    assert found is None and crash.startswith("crashed (SIGSEGV) in llama.cpp while testing "
                                              f"the crash guard with {tiny_path.name} on CPU")
    assert Path(crash.split("; report: ")[1]).is_file()
    found, crash = probe_in_child([str(tiny_path)], 0)
    assert crash is None and found["target"][-1].endswith("on CPU: ok")


# -- a CPU-only load opens no device and probes nothing ------------------------------------------
def test_a_cpu_load_passes_llama_cpp_an_empty_device_list(tiny_path, monkeypatch):
    """devices = a NULL-terminated list holding only the NULL (NULL itself means every
    device): llama.cpp then opens no GPU for --gpu-layers 0."""
    import ctypes
    seen = []
    load = backend.C.llama_model_load_from_file

    def spy(path, params):
        seen.append(params.devices)
        if params.devices:
            seen.append(ctypes.cast(params.devices, ctypes.POINTER(ctypes.c_void_p))[0])
        return load(path, params)

    monkeypatch.setattr(backend.C, "llama_model_load_from_file", spy)
    with Model(tiny_path, ModelParams(n_gpu_layers=0)) as m:
        assert m.device == "CPU"
    assert seen[0] and seen[1] is None


PROBES = """
    import llama_cpp
    from localspec.llama import backend
    calls = []
    info = llama_cpp.llama_print_system_info
    def counted(*a):
        calls.append("llama_print_system_info")
        return info(*a)
    llama_cpp.llama_print_system_info = counted
    function = backend.ggml_function
    def looked_up(name, *a):
        calls.append(name)
        return function(name, *a)
    backend.ggml_function = looked_up
    from localspec.speculative.engine import Engine, EngineConfig
    with Engine({path!r}, EngineConfig(proposer="none", n_ctx=256)) as engine:
        engine.ctx.decode(engine.model.tokenize("hello"))
    print(sorted(set(calls)))
"""


def test_the_load_path_makes_no_probe(tiny_path, tmp_path):
    """No llama_print_system_info (it asks every backend) and no ggml_backend_dev_memory (it
    creates a GPU's context) from loading an engine to its first decode; counted through thin
    wrappers in a fresh process (system_info is read once per process)."""
    r = python(PROBES.format(path=str(tiny_path)), tmp_path)
    assert r.returncode == 0, r.stderr
    calls = r.stdout.strip()
    assert "llama_print_system_info" not in calls and "ggml_backend_dev_memory" not in calls
    assert "ggml_backend_reg_by_name" in calls            # the CPU backend's features, alone


# -- explicit lifetimes --------------------------------------------------------------------------
def test_closing_a_model_frees_its_contexts_and_both_refuse_afterwards(tiny_path):
    model = Model(tiny_path)
    ctx = Context(model, ContextParams(n_ctx=128, n_batch=32))
    ctx.decode(model.tokenize("hello"))
    model.close()
    assert ctx.closed and model.closed
    for call in (lambda: ctx.decode([1]), ctx.rows_held, ctx.reconcile, lambda: ctx.truncate(0),
                 ctx.clear, ctx.state_size, model.describe, lambda: model.tokenize("x"),
                 lambda: Context(model)):
        with pytest.raises(LocalspecError, match="closed"):
            call()
    ctx.close(), model.close()                         # idempotent


def test_closing_the_engine_ends_its_open_request_first(tiny_path):
    from localspec.speculative.engine import Engine, EngineConfig
    engine = Engine(str(tiny_path), EngineConfig(proposer="ngram", n_ctx=256))
    gen = engine.generate("hello hello hello", max_tokens=64)
    next(iter(gen))
    engine.close()                      # the generator's cleanup ran on the live context
    assert gen.stats.stop_reason == "cancelled" and engine.ctx.closed
    assert list(gen) == []              # nothing left to run, nothing touches freed memory


def test_a_new_request_ends_the_one_still_open(tiny_path):
    from localspec.speculative.engine import Engine, EngineConfig
    with Engine(str(tiny_path), EngineConfig(proposer="none", n_ctx=256)) as engine:
        first = engine.generate("hello", max_tokens=64)
        next(iter(first))
        second = engine.generate("hello", max_tokens=4)
        assert first.stats.stop_reason == "cancelled"
        assert engine.ctx.n_past <= len(first.tokens) + 8      # its rows were reconciled
        assert second.complete_tokens()


def test_generate_into_a_closed_pipe_ends_without_a_signal(tiny_path, tmp_path):
    """`localspec generate ... | head -c 20` segfaulted at exit: the generator's finally ran
    at interpreter teardown on a freed context. Now no signal and no crash report."""
    proc = subprocess.Popen([sys.executable, "-m", "localspec", "generate", "-m", str(tiny_path),
                             "-n", "400", "hello"], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE,
                            env={**os.environ, "LOCALSPEC_HOME": str(tmp_path)})
    assert proc.stdout.read(20)
    proc.stdout.close()
    err = proc.stderr.read().decode()
    code = proc.wait(timeout=300)
    assert code >= 0 and code != CRASH_EXIT, err
    assert not re.search(r"crashed|Segmentation|Fatal Python", err), err


def test_a_model_too_large_for_the_device_is_one_line_that_says_what_to_lower():
    from localspec.llama.model import _load_error
    log = ("ggml_backend_cuda_buffer_type_alloc_buffer: allocating 81234.00 MiB on device 0: "
           "cudaMalloc failed: out of memory\nllama_model_load: error loading model: unable to "
           "allocate CUDA0 buffer\n")
    line = _load_error(Path("big.gguf"), "unable to allocate CUDA0 buffer", log, -1)
    assert "not enough device memory" in line and "--gpu-layers" in line and "\n" not in line
    line = _load_error(Path("m.gguf"), "", "", 0)
    assert "truncated, corrupt or unsupported" in line


def test_a_model_closed_under_a_running_request_leaves_its_cleanup_nothing_to_touch(tiny_path):
    """The teardown order of `generate | head` before the fix: the context freed first (here by
    closing the model the engine was handed), the generator's cleanup after it."""
    from localspec.speculative.engine import Engine, EngineConfig
    model = Model(tiny_path)
    engine = Engine(model, EngineConfig(proposer="ngram", n_ctx=256))
    gen = engine.generate("hello hello hello", max_tokens=64)
    next(iter(gen))
    model.close()                       # frees the engine's context first
    assert engine.ctx.closed
    gen.close()                         # the cleanup sees a closed context: it touches nothing
    engine.close()
    assert gen.stats.stop_reason == "cancelled"

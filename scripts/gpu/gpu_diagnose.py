"""Why does a model load crash on this machine? One load per process, each case adding one suspect.

    python scripts/gpu/gpu_diagnose.py CASE MODEL.gguf [--layers -1] [--tokens 8]   # one case, here
    python scripts/gpu/gpu_diagnose.py matrix MODEL.gguf [--layers -1] [--json out.json]
                                       [--cases a,b] [--case-timeout 40] [--budget 150] [--gdb N]

`matrix` runs every case in a child process of its own (`python -X faulthandler`), in the order
below, and writes the JSON after each one: a run cut short keeps what it finished. A case that
dies on a signal is run once more under `cuda-gdb --batch -ex run -ex bt` where cuda-gdb (or gdb)
is on the PATH, for a native stack (at most --gdb of them, 2 by default). The last line printed
is a verdict naming the cause, when the cases name one.

The cases (each is also a subcommand, runnable by hand):

  control      llama_cpp.Llama(path, n_gpu_layers=L, verbose=False) and a completion: what the
               bindings' own high-level class does (its log callback, stderr muted during load)
  door         localspec itself: `python -m localspec generate -m MODEL --gpu-layers L -n T`
  door-cpu     the same with --gpu-layers 0 (a CPU-only request on a GPU build)
  doctor       `python -m localspec doctor MODEL --gpu-layers L`: the report a user runs first
  raw          the low-level load with nothing else: llama_backend_init, llama_model_load_from_file
               with Llama's parameters (n_gpu_layers L), a context, a prompt decoded, T greedy
               tokens, context and model freed. llama.cpp's own C logger (llama_log_set(NULL)),
               no probes, nothing imported before llama_cpp but the standard library
  raw-intmax   raw with n_gpu_layers 0x7FFFFFFF for -1, as Llama passes it
  raw-quiet    raw with fds 1 and 2 pointed at /dev/null during init and load, as Llama does
  raw-logcb    raw + a Python ctypes log callback (llama_log_set) that keeps every line, as
               localspec's door did: Python called from llama.cpp's own (CUDA) threads
  raw-probes   raw + llama_print_system_info and ggml_backend_dev_memory of every device before
               the load (the device context created before llama.cpp creates it)
  raw-imports  raw with numpy, cffi, click and localspec's C module imported before llama_cpp
  raw-numpy    raw with numpy alone imported before llama_cpp
  raw-stdcxx   raw-imports, with libstdc++.so.6 loaded RTLD_GLOBAL before llama_cpp (what the
               door does since the first H200 run: libllama's C++ calls bind to the real runtime,
               not to a copy libggml-cuda carries)
  raw-freed    raw, then a generator suspended mid-decode whose `finally` touches the context
               after it was freed, run at interpreter teardown (a use after free: crashes or not)
  raw-all      raw-logcb + raw-probes + raw-imports together

Each case prints "stage: ..." lines on stderr as it goes (the last one names where a crash
happened) and "OK <case>: <tokens>" on stdout when it finishes. Standard library and llama_cpp
only (localspec only where a case names it), so the matrix stays valid whatever the door becomes.
"""

from __future__ import annotations

import argparse
import ctypes
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

CASES = ("control", "door", "door-cpu", "doctor", "raw", "raw-intmax", "raw-quiet", "raw-logcb",
         "raw-probes", "raw-imports", "raw-numpy", "raw-stdcxx", "raw-freed", "raw-all")
SUSPECTS = {       # a raw-* case: what it adds to raw
    "raw-intmax": "n_gpu_layers 0x7FFFFFFF instead of -1",
    "raw-quiet": "stdout/stderr muted during the load (what Llama does)",
    "raw-logcb": "a Python log callback called from llama.cpp's threads",
    "raw-probes": "llama_print_system_info + ggml_backend_dev_memory before the load",
    "raw-imports": "numpy, cffi, click, localspec._ngram_c imported before llama_cpp",
    "raw-numpy": "numpy alone imported before llama_cpp",
    "raw-freed": "a generator's finally touching a freed context at teardown",
    "raw-all": "the Python log callback, the probes and the imports together",
}
PROMPT = "The capital of France is"
GUARD_EXIT = 86      # localspec's fatal-signal guard exits with this (localspec/llama/native.py)
REPO = Path(__file__).resolve().parents[2]


def stage(what: str) -> None:
    print(f"stage: {what}", file=sys.stderr, flush=True)


# ---------------------------------------------------------------------------------------------
# The cases


def case_control(model: str, layers: int, tokens: int) -> str:
    stage("import llama_cpp")
    import llama_cpp
    stage("Llama() load")
    llm = llama_cpp.Llama(model, n_gpu_layers=layers, n_ctx=512, verbose=False)
    stage("completion")
    out = llm.create_completion(PROMPT, max_tokens=tokens, temperature=0.0)
    stage("close")
    llm.close()
    return repr(out["choices"][0]["text"])


def case_door(model: str, layers: int, tokens: int, doctor: bool = False) -> None:
    """Replaces this process with localspec's CLI: the door exactly as a user meets it."""
    args = (["doctor", model, "--gpu-layers", str(layers)] if doctor else
            ["generate", "-m", model, "--gpu-layers", str(layers), "-n", str(tokens), PROMPT])
    stage(f"exec python -m localspec {args[0]} --gpu-layers {layers}")
    os.chdir(REPO)
    os.execv(sys.executable, [sys.executable, "-X", "faulthandler", "-m", "localspec", *args])


_keep = []     # ctypes callbacks and generators that must outlive their functions


def _log_callback(llama_cpp) -> None:
    lines = []

    def on_log(level, text, _user):          # Python on llama.cpp's threads, every line kept
        if text:
            lines.append(text.decode("utf-8", "replace"))
            if level >= 4 and level != 5:    # errors still shown, as the door did
                sys.stderr.write(lines[-1])
    cb = llama_cpp.llama_log_callback(on_log)
    _keep.extend([cb, lines])
    llama_cpp.llama_log_set(cb, ctypes.c_void_p(0))


def _probes(llama_cpp) -> None:
    stage("probe: llama_print_system_info")
    print(llama_cpp.llama_print_system_info().decode("utf-8", "replace").strip()[:300],
          file=sys.stderr)
    lib = llama_cpp.llama_cpp._lib

    def fn(name, restype, *argtypes):
        f = lib[name]
        f.restype, f.argtypes = restype, list(argtypes)
        return f
    count = fn("ggml_backend_dev_count", ctypes.c_size_t)
    get = fn("ggml_backend_dev_get", ctypes.c_void_p, ctypes.c_size_t)
    name = fn("ggml_backend_dev_name", ctypes.c_char_p, ctypes.c_void_p)
    memory = fn("ggml_backend_dev_memory", None, ctypes.c_void_p,
                ctypes.POINTER(ctypes.c_size_t), ctypes.POINTER(ctypes.c_size_t))
    for i in range(count()):
        dev = get(i)
        free, total = ctypes.c_size_t(), ctypes.c_size_t()
        stage(f"probe: ggml_backend_dev_memory({name(dev).decode()})")
        memory(dev, ctypes.byref(free), ctypes.byref(total))
        print(f"  {name(dev).decode()}: {free.value >> 20} MiB free of {total.value >> 20}",
              file=sys.stderr)


class _Muted:
    """fds 1 and 2 to /dev/null, as llama_cpp._utils.suppress_stdout_stderr does."""

    def __enter__(self):
        sys.stdout.flush(), sys.stderr.flush()
        self.saved = [os.dup(1), os.dup(2)]
        null = os.open(os.devnull, os.O_WRONLY)
        os.dup2(null, 1), os.dup2(null, 2)
        os.close(null)

    def __exit__(self, *exc):
        os.dup2(self.saved[0], 1), os.dup2(self.saved[1], 2)
        for fd in self.saved:
            os.close(fd)


def case_raw(model: str, layers: int, tokens: int, case: str = "raw") -> str:
    import contextlib
    adds = {"raw-all": ("raw-logcb", "raw-probes", "raw-imports"),
            "raw-stdcxx": ("raw-stdcxx", "raw-imports")}.get(case, (case,))
    if "raw-numpy" in adds:
        stage("import numpy")
        import numpy  # noqa: F401
    if "raw-imports" in adds:
        stage("import numpy, cffi, click, localspec._ngram_c")
        import numpy  # noqa: F401
        import cffi  # noqa: F401
        import click  # noqa: F401
        sys.path.insert(0, str(REPO))
        try:
            import localspec._ngram_c  # noqa: F401
        except ImportError as e:
            print(f"  (localspec._ngram_c not importable: {e})", file=sys.stderr)
    if "raw-stdcxx" in adds:
        stage("libstdc++.so.6 loaded RTLD_GLOBAL")
        ctypes.CDLL("libstdc++.so.6", mode=os.RTLD_GLOBAL | os.RTLD_NOW)
    stage("import llama_cpp")
    import llama_cpp
    stage("llama_log_set")
    if "raw-logcb" in adds:
        _log_callback(llama_cpp)
    else:       # llama_cpp's import set its own Python callback: back to llama.cpp's C logger
        llama_cpp.llama_log_set(llama_cpp.llama_log_callback(), ctypes.c_void_p(0))
    muted = _Muted if "raw-quiet" in adds else contextlib.nullcontext
    stage("llama_backend_init")
    with muted():
        llama_cpp.llama_backend_init()
    if "raw-probes" in adds:
        _probes(llama_cpp)
    mp = llama_cpp.llama_model_default_params()
    mp.n_gpu_layers = 0x7FFFFFFF if "raw-intmax" in adds and layers == -1 else layers
    mp.load_mode = llama_cpp.LLAMA_LOAD_MODE_MMAP
    stage(f"llama_model_load_from_file (n_gpu_layers {mp.n_gpu_layers})")
    with muted():
        m = llama_cpp.llama_model_load_from_file(model.encode(), mp)
    if not m:
        raise SystemExit("llama_model_load_from_file returned NULL")
    vocab = llama_cpp.llama_model_get_vocab(m)
    cp = llama_cpp.llama_context_default_params()
    cp.n_ctx, cp.n_batch, cp.n_ubatch = 512, 512, 512
    stage("llama_init_from_model")
    ctx = llama_cpp.llama_init_from_model(m, cp)
    if not ctx:
        raise SystemExit("llama_init_from_model returned NULL")
    buf = (llama_cpp.llama_token * 256)()
    n = llama_cpp.llama_tokenize(vocab, PROMPT.encode(), len(PROMPT.encode()), buf, 256, True,
                                 False)
    n_vocab = llama_cpp.llama_vocab_n_tokens(vocab)

    def greedy():
        """Decodes the prompt, then one token at a time; yields each token."""
        toks = list(buf[:n])
        try:
            while True:
                arr = (llama_cpp.llama_token * len(toks))(*toks)
                stage(f"llama_decode ({len(toks)} tokens)")
                if llama_cpp.llama_decode(ctx, llama_cpp.llama_batch_get_one(arr, len(toks))):
                    raise SystemExit("llama_decode failed")
                logits = llama_cpp.llama_get_logits_ith(ctx, -1)
                tok = max(range(n_vocab), key=lambda i: logits[i])
                toks = [tok]
                yield tok
        finally:           # what an engine's generator does: reset the context's memory
            stage("generator finally: llama_memory_clear on the context")
            llama_cpp.llama_memory_clear(llama_cpp.llama_get_memory(ctx), True)

    gen = greedy()
    out = [next(gen) for _ in range(tokens)]
    if case == "raw-freed":
        _keep.append(gen)          # left suspended: its finally runs at interpreter teardown
        stage("llama_free + llama_model_free with the generator suspended")
        llama_cpp.llama_free(ctx)
        llama_cpp.llama_model_free(m)
        stage("exit: teardown runs the generator's finally on the freed context")
        return " ".join(map(str, out))
    gen.close()
    stage("llama_free, llama_model_free")
    llama_cpp.llama_free(ctx)
    llama_cpp.llama_model_free(m)
    stage("exit")
    return " ".join(map(str, out))


def run_case(case: str, model: str, layers: int, tokens: int) -> None:
    if case == "control":
        result = case_control(model, layers, tokens)
    elif case in ("door", "door-cpu", "doctor"):
        case_door(model, 0 if case == "door-cpu" else layers, tokens, doctor=case == "doctor")
        return
    else:
        result = case_raw(model, layers, tokens, case)
    print(f"OK {case}: {result}", flush=True)


# ---------------------------------------------------------------------------------------------
# The matrix


def signal_name(rc: int) -> str:
    """A child's return code as subprocess reports it (-11) or a shell does (139)."""
    num = -rc if rc < 0 else rc - 128 if rc > 128 else None
    try:
        return signal.Signals(num).name if num else ""
    except ValueError:
        return f"signal {num}"


def classify(rc, stdout: str, timed_out: bool) -> str:
    """ok, crashed (SIGSEGV), hung (killed at the timeout) or failed (exit N)."""
    if timed_out:
        return "hung"
    if rc == 0:
        return "ok"
    sig = signal_name(rc)
    if sig:
        return f"crashed ({sig})"
    if rc == GUARD_EXIT:
        return f"crashed (caught by localspec's crash guard, exit {rc})"
    return f"failed (exit {rc})"


def last_stage(stderr: str) -> str:
    stages = [line[7:] for line in stderr.splitlines() if line.startswith("stage: ")]
    return stages[-1] if stages else ""


def crash_dir() -> Path:
    """Where localspec's crash guard writes its reports: <LOCALSPEC_HOME>/crashes."""
    home = os.environ.get("LOCALSPEC_HOME") or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"), "localspec")
    return Path(home) / "crashes"


def reports() -> set:
    try:
        return set(crash_dir().iterdir())
    except OSError:
        return set()


def find_debugger():
    for name in ("cuda-gdb", "gdb"):
        path = shutil.which(name) or (f"/usr/local/cuda/bin/{name}"
                                      if os.access(f"/usr/local/cuda/bin/{name}", os.X_OK) else None)
        if path:
            return path
    return None


def verdict(results: dict) -> str:
    """One line naming what crashed, from the cases that ran."""
    def bad(c):
        return c in results and results[c]["status"] != "ok"

    def good(c):
        return c in results and results[c]["status"] == "ok"
    ran = list(results)
    if not ran:
        return "no case ran"
    if all(good(c) for c in ran):
        return f"no case crashed ({len(ran)} ran): localspec and the raw load both run here"
    if bad("control"):
        return ("llama_cpp.Llama itself fails here (control " + results["control"]["status"]
                + "): the build or the device, not localspec")
    if bad("raw") and good("control"):
        extra = ("; with 0x7FFFFFFF layers (as Llama passes -1) it runs: pass that"
                 if good("raw-intmax") else "")
        extra += ("; with stderr muted during the load it runs" if good("raw-quiet") else "")
        return ("the bare low-level load fails (raw " + results["raw"]["status"] + " at "
                + results["raw"]["stage"] + ") where Llama runs: a difference in parameters or "
                "order" + extra)
    culprits = [c for c in SUSPECTS if c not in ("raw-all", "raw-freed") and bad(c)
                and good("raw")]
    door = [c for c in ("door", "door-cpu", "doctor") if bad(c)]
    parts = []
    if culprits:
        parts.append("suspects that crash alone: " + "; ".join(
            f"{c} ({SUSPECTS[c]}): {results[c]['status']} at {results[c]['stage']}"
            for c in culprits))
    elif bad("raw-all") and good("raw"):
        parts.append("no single suspect crashes, all of them together do (raw-all "
                     + results["raw-all"]["status"] + ")")
    if "raw-stdcxx" in results and (bad("raw-imports") or bad("raw-numpy")):
        parts.append("with libstdc++ loaded RTLD_GLOBAL first the same imports "
                     + ("run (raw-stdcxx ok): the door's fix holds here" if good("raw-stdcxx")
                        else "still crash (raw-stdcxx " + results["raw-stdcxx"]["status"] + ")"))
    if door:
        parts.append("localspec's door: " + ", ".join(
            f"{c} {results[c]['status']} at {results[c]['stage'] or '?'}" for c in door))
        if not culprits and good("raw") and not bad("raw-all"):
            parts.append("no raw case crashes: the cause is elsewhere in the door")
    elif good("door"):
        parts.append("localspec's door runs here")
    if bad("raw-freed"):       # a use after free by design: it names the exit-time pattern
        parts.append("a context touched after it was freed (raw-freed) "
                     + results["raw-freed"]["status"] + " here: nothing may run a generator's "
                     "finally on a closed engine")
    return "; ".join(parts) or "some cases did not finish: " + ", ".join(
        f"{c} {results[c]['status']}" for c in ran if not good(c))


def cxx_copies() -> dict:
    """Which of llama_cpp's libraries define C++ runtime code of their own (libstdc++'s stream
    and locale functions, in the dynamic table or only in the symbol table): a copy there is
    what libllama's `stream << int` ran in when the first H200 run crashed. nm from binutils;
    {} where it or the package is missing."""
    nm = shutil.which("nm")
    try:
        import importlib.util
        spec = importlib.util.find_spec("llama_cpp")
    except (ImportError, ValueError):
        spec = None
    if nm is None or spec is None or not spec.submodule_search_locations:
        return {}
    out = {}
    pattern = ("_ZNSo9_M_insert", "codecvt", "_ZNSt6locale", "ios_base4Init")
    for lib in sorted(Path(list(spec.submodule_search_locations)[0], "lib").glob("lib*.so")):
        row = {}
        for table, flags in (("dynamic", ["-D", "--defined-only"]), ("all", ["--defined-only"])):
            try:
                text = subprocess.run([nm, *flags, str(lib)], capture_output=True, text=True,
                                      timeout=60).stdout
            except (OSError, subprocess.TimeoutExpired):
                continue
            hits = [line.split()[-1] for line in text.splitlines() if any(p in line for p in pattern)]
            row[table] = {"count": len(hits), "first": hits[:6]}
        out[lib.name] = row
    return out


def matrix(model: str, layers: int, tokens: int, cases, case_timeout: float, budget: float,
           gdb_runs: int, json_path, env=None) -> dict:
    t0 = time.monotonic()
    env = dict(os.environ if env is None else env, PYTHONUNBUFFERED="1", PYTHONFAULTHANDLER="1")
    debugger = find_debugger()
    out = {"model": Path(model).name, "layers": layers, "debugger": debugger or "",
           "cases": {}, "skipped": [], "verdict": "", "cxx_copies": cxx_copies()}

    def save():
        out["verdict"] = verdict(out["cases"])
        if json_path:
            Path(json_path).write_text(json.dumps(out, indent=1))

    def child(case):
        return [sys.executable, "-X", "faulthandler", str(Path(__file__).resolve()), case, model,
                "--layers", str(layers), "--tokens", str(tokens)]
    for case in cases:
        left = budget - (time.monotonic() - t0)
        if left < 5:
            out["skipped"].append(case)
            continue
        t = time.monotonic()
        timed_out = False
        before = reports()
        try:
            p = subprocess.run(child(case), capture_output=True, text=True, env=env,
                               timeout=min(case_timeout, left), errors="replace")
            rc, so, se = p.returncode, p.stdout, p.stderr
        except subprocess.TimeoutExpired as e:
            timed_out, rc = True, None
            so = e.stdout.decode("utf-8", "replace") if isinstance(e.stdout, bytes) else e.stdout or ""
            se = e.stderr.decode("utf-8", "replace") if isinstance(e.stderr, bytes) else e.stderr or ""
        r = {"status": classify(rc, so, timed_out), "rc": rc, "seconds": round(time.monotonic() - t, 2),
             "stage": last_stage(se), "adds": SUSPECTS.get(case, ""),
             "stdout": so.strip().splitlines()[-3:], "stderr_tail": se.strip().splitlines()[-30:]}
        new = sorted(reports() - before)
        if new:      # the door's crash guard wrote a report: its head says what and where
            r["crash_report"] = {"path": str(new[-1]), "head": new[-1].read_text(
                errors="replace").splitlines()[:60]}
        out["cases"][case] = r
        print(f"{case:12} {r['status']:20} {r['seconds']:6.1f} s  last stage: {r['stage']}",
              file=sys.stderr, flush=True)
        save()
    crashed = [c for c, r in out["cases"].items() if r["status"].startswith("crashed")]
    for case in crashed[:gdb_runs]:     # the door first (it is first in CASES), then raw cases
        left = budget - (time.monotonic() - t0)
        r = out["cases"][case]
        if not debugger:
            r["native_stack"] = "no cuda-gdb or gdb on this machine"
            continue
        if left < 15:
            r["native_stack"] = "skipped: out of time"
            continue
        cmd = [debugger, "--batch", "-ex", "set pagination off", "-ex", "set confirm off", "-ex",
               "run", "-ex", "bt", "-ex", "info threads", "--args", *child(case)]
        try:
            p = subprocess.run(cmd, capture_output=True, text=True, env=env,
                               timeout=min(case_timeout * 3, left), errors="replace")
            text = p.stdout + p.stderr
        except subprocess.TimeoutExpired as e:
            text = "timed out\n" + (e.stdout.decode("utf-8", "replace")
                                    if isinstance(e.stdout, bytes) else e.stdout or "")
        lines = [line for line in text.splitlines() if line.strip()]
        keep = [i for i, line in enumerate(lines) if "signal SIG" in line or line.startswith("#")]
        start = max(0, keep[0] - 5) if keep else max(0, len(lines) - 80)
        r["native_stack"] = lines[start:start + 80]
        print(f"{case}: native stack ({debugger}):\n  " + "\n  ".join(
            line for line in r["native_stack"] if line.startswith(("#", "Thread", "Program")))[:3000],
            file=sys.stderr, flush=True)
        save()
    save()
    print(f"verdict: {out['verdict']}", file=sys.stderr, flush=True)
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("case", choices=("matrix",) + CASES)
    ap.add_argument("model")
    ap.add_argument("--layers", type=int, default=-1)
    ap.add_argument("--tokens", type=int, default=8)
    ap.add_argument("--json")
    ap.add_argument("--cases", default=",".join(CASES))
    ap.add_argument("--case-timeout", type=float, default=40)
    ap.add_argument("--budget", type=float, default=150)
    ap.add_argument("--gdb", type=int, default=2, help="native stacks of at most this many cases")
    a = ap.parse_args(argv)
    if a.case != "matrix":
        run_case(a.case, a.model, a.layers, a.tokens)
        return 0
    cases = [c.strip() for c in a.cases.split(",") if c.strip()]
    unknown = set(cases) - set(CASES)
    if unknown:
        ap.error(f"unknown cases {sorted(unknown)}; known: {', '.join(CASES)}")
    out = matrix(a.model, a.layers, a.tokens, cases, a.case_timeout, a.budget, a.gdb, a.json)
    return 0 if all(r["status"] == "ok" for r in out["cases"].values()) else 1


if __name__ == "__main__":
    sys.exit(main())

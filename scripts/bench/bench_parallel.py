"""Concurrent serving (issue 42, item 5): localspec's HTTP server one request at a time and with
`--parallel N` slots, against llama.cpp's own `llama-server -np N` with its n-gram speculation,
driven over HTTP on localhost by the openai Python client (FIM by httpx: the SDK has no route for
llama.cpp's /infill). Same model file, threads, context per slot, greedy sampling.

Scenarios, run on each configuration, in rounds (A B C D, A B C D, ...; a fresh server for
every configuration of every round, so no cache outlives its turn):

  fim         editor completions (llama.cpp's /infill shape: prefix and suffix cut from a
              stdlib module, the cursor moving two lines down per request): time to first
              token, first on the idle server (one request after another), then while a long
              chat reply streams (a prompt that makes the model write code, --chat-tokens),
              one request every --fim-every seconds from the reply's first token on. Reported:
              p50 / p90 of both and the ratio loaded / idle.
  throughput  --clients clients at once, each sending the same cases (held-out code edits and
              chats, rotated so that the clients start on different ones), greedy, at most
              --max-tokens each: generated tokens / wall time, and the ratio over the first
              localspec one-at-a-time configuration.

Every greedy text of a localspec configuration with slots is compared with the same request's
text from `localspec-1` in the same round: they must all be equal (one slot's text does not
depend on the others). llama-server's chat and throughput texts are compared with it too, for
information (llama.cpp's kernels part at near-ties).

Configurations (--configs): localspec-N (N slots; `--parallel N` is passed only when N > 1),
llama-server-N[-mod|-simple|-plain] (-np N; mod: `--spec-default`, llama.cpp's own default
speculation config, ngram-mod; simple: `--spec-type ngram-simple` at its defaults; plain: no
speculation). llama-server is built on demand: scripts/llamacpp_tools.sh --target llama-server.

Usage (repository root, its .venv; a quiet machine):
  .venv/bin/python scripts/bench/bench_parallel.py --threads 2 --rounds 2 --json out.json
  .venv/bin/python scripts/bench/bench_parallel.py --quick -m smollm2-135m   # a functional check

A Markdown summary goes to stdout, progress to stderr, every raw number to --json (rewritten
after every configuration's turn, so a stopped run keeps what it measured). Servers are killed
at exit, Ctrl-C included; their logs are kept in --log-dir (default: a temporary folder).
"""

from __future__ import annotations

import argparse
import atexit
import inspect
import json
import os
import re
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass
from datetime import datetime, timezone
from pathlib import Path
from typing import Optional

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

clock = time.perf_counter

DEFAULT_CONFIGS = "localspec-1,localspec-2,localspec-4,llama-server-4"
DEFAULT_WORKLOADS = ROOT / "data" / "workloads" / "heldout-workloads.jsonl"
DEFAULT_CASES = ("ho-edit-rgb-to-hsv-hints,ho-edit-indent-rename,ho-chat-process-thread,"
                 "ho-chat-tcp-udp")
CHAT_PROMPT = ("Write a complete Python module that implements an in-memory key-value store with "
               "per-key expiry: a class with get, set, delete, keys and cleanup methods, type "
               "hints and docstrings everywhere, error handling, a small command-line interface "
               "with argparse, and a unittest test suite covering every method at the end. "
               "Reply with the code only, in one block.")
FIM_SOURCE = "argparse"            # a stdlib module: its text is on every machine that runs this
LLAMA_SPEC = {"mod": ["--spec-default"], "simple": ["--spec-type", "ngram-simple"], "plain": []}
SIMD_FLAGS = ("avx", "avx2", "fma", "f16c", "bmi2", "avx_vnni", "avx512f", "avx512dq", "avx512bw",
              "avx512vl", "avx512ifma", "avx512vbmi", "avx512_vbmi2", "avx512_vnni",
              "avx512_bf16", "amx_tile", "amx_int8", "amx_bf16")

QUICK = dict(rounds=1, chat_tokens=32, fim_every=0.4, fim_count=3, fim_tokens=8, prefix_lines=12,
             suffix_lines=4, cases="ho-edit-shuffle-comments,ho-chat-limerick", max_tokens=16,
             clients=2, ctx=1024, configs="localspec-1,localspec-2")


def say(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


class Failure(Exception):
    """A one-line reason the run cannot go on."""


# -- configurations --------------------------------------------------------------------------------
@dataclass(frozen=True)
class Config:
    name: str
    server: str          # "localspec" or "llama-server"
    parallel: int
    spec: str = ""       # llama-server: mod, simple or plain


def parse_configs(text: str) -> list:
    """ "localspec-1,llama-server-4" -> [Config("localspec-1", "localspec", 1), Config(...,
    "llama-server", 4, "mod")]."""
    out = []
    for item in filter(None, (s.strip() for s in text.split(","))):
        m = re.fullmatch(r"localspec-(\d+)", item)
        if m:
            out.append(Config(item, "localspec", int(m.group(1))))
            continue
        m = re.fullmatch(r"llama-server-(\d+)(?:-(mod|simple|plain))?", item)
        if m:
            out.append(Config(item, "llama-server", int(m.group(1)), m.group(2) or "mod"))
            continue
        raise Failure(f"unknown configuration {item!r}: expected localspec-N or "
                      "llama-server-N[-mod|-simple|-plain]")
    if not out or len({c.name for c in out}) != len(out):
        raise Failure("--configs needs distinct configurations")
    if any(c.parallel < 1 for c in out):
        raise Failure("a configuration needs at least one slot")
    return out


def localspec_has_parallel() -> bool:
    r = subprocess.run([sys.executable, "-m", "localspec", "serve", "--help"],
                       capture_output=True, text=True, cwd=ROOT)
    return "--parallel" in r.stdout


def llama_server_path() -> Path:
    from localspec.bench import llamacpp_build as lb
    return lb.tool_path(lb.SERVER)


# -- servers ---------------------------------------------------------------------------------------
LIVE: set = set()


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Server:
    """One server process in its own process group, its output in a log file."""

    def __init__(self, cfg: Config, cmd: list, port: int, log_path: Path, env: dict):
        self.cfg, self.cmd, self.port, self.log_path, self.env = cfg, cmd, port, log_path, env
        self.proc: Optional[subprocess.Popen] = None
        self.base = f"http://127.0.0.1:{port}"
        self.model_id = None

    def start(self, timeout: float) -> float:
        t0 = clock()
        with open(self.log_path, "w") as log:
            log.write("$ " + " ".join(self.cmd) + "\n")
            log.flush()
            self.proc = subprocess.Popen(self.cmd, stdout=log, stderr=subprocess.STDOUT,
                                         stdin=subprocess.DEVNULL, env=self.env, cwd=ROOT,
                                         start_new_session=True, preexec_fn=_die_with_parent)
        LIVE.add(self)
        import httpx
        while True:
            if self.proc.poll() is not None:
                raise Failure(f"{self.cfg.name} exited ({self.proc.returncode}) before it served; "
                              f"its log: {self.log_path}: {self.log_tail()}")
            try:
                if httpx.get(self.base + "/health", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            if clock() - t0 > timeout:
                raise Failure(f"{self.cfg.name} did not answer /health within {timeout:.0f} s; "
                              f"its log: {self.log_path}")
            time.sleep(0.25)
        models = httpx.get(self.base + "/v1/models", timeout=10).json()
        self.model_id = models["data"][0]["id"]
        return clock() - t0

    def log_tail(self, n: int = 3) -> str:
        try:
            lines = [x for x in self.log_path.read_text(errors="replace").splitlines() if x.strip()]
        except OSError:
            return "?"
        return " | ".join(lines[-n:])

    def stop(self) -> None:
        """SIGTERM to the server's process group, SIGKILL after 15 s."""
        if self.proc is None:
            return
        if self.proc.poll() is None:
            try:
                os.killpg(self.proc.pid, signal.SIGTERM)
                self.proc.wait(15)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait()
            except ProcessLookupError:
                pass
        LIVE.discard(self)


def _die_with_parent() -> None:
    """In the child, before exec: SIGTERM when this script dies, even by SIGKILL (Linux)."""
    if sys.platform.startswith("linux"):
        import ctypes
        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGTERM)     # PR_SET_PDEATHSIG


def stop_all() -> None:
    for s in list(LIVE):
        try:
            s.stop()
        except Exception:                       # noqa: BLE001 - best effort at exit
            pass


def fresh_home(home: Path) -> Path:
    """`home` made a LOCALSPEC_HOME that shares the real one's models, calibrations and builds
    (links) but has no draft store and no prompt cache of its own yet."""
    from localspec.files import localspec_home
    real = localspec_home()
    real.mkdir(parents=True, exist_ok=True)
    for entry in real.iterdir():
        if entry.name not in ("store", "prompt-cache"):
            (home / entry.name).symlink_to(entry)
    return home


def server_command(cfg: Config, a, model: Path, port: int, home: Path) -> tuple:
    """(argv, env) for one configuration. The context: --ctx per slot, times the slots (both
    servers split their total context equally between slots). `home`: an empty folder for this
    turn's localspec home."""
    env = dict(os.environ)
    total = str(a.ctx * cfg.parallel)
    if cfg.server == "localspec":
        # Both servers learn across the turn's requests and start it knowing nothing: llama-
        # server's ngram-mod keeps one table of every prompt's and output's 24-token windows
        # for all slots (common/speculative.cpp: begin() adds, nothing clears it per request),
        # localspec its draft store, empty in a fresh home. --no-store: localspec's off. The
        # disk cache would bring earlier servers' prompts: off, every turn cold.
        env["LOCALSPEC_HOME"] = str(fresh_home(home))
        if not a.store:
            env["LOCALSPEC_STORE_MB"] = "0"
        cmd = [sys.executable, "-m", "localspec", "serve", "--http", f"127.0.0.1:{port}",
               "-m", str(model), "--threads", str(a.threads), "--ctx", total,
               "--queue", "256", "--no-disk-cache", "--learn" if a.store else "--no-learn"]
        if cfg.parallel > 1:
            cmd += ["--parallel", str(cfg.parallel)]
        return cmd, env
    # llama-server: flash attention off and 512-row micro-batches as localspec's contexts;
    # per-slot (non-unified) KV as localspec's slots; no memory fitting; chats rendered by
    # llama.cpp's built-in template matcher (llama_chat_apply_template), as localspec renders
    # them: its jinja engine would add the template's default system prompt (SmolLM2's, Qwen's),
    # and the two servers would read different prompts.
    cmd = [str(llama_server_path()), "-m", str(model), "--host", "127.0.0.1", "--port", str(port),
           "-np", str(cfg.parallel), "-c", total, "--no-kv-unified", "-t", str(a.threads),
           "-tb", str(a.threads), "-ngl", "0", "-fa", "off", "-ub", "512", "-fit", "off",
           "--no-jinja", "--no-webui", *LLAMA_SPEC[cfg.spec]]
    return cmd, env


# -- requests --------------------------------------------------------------------------------------
def openai_client(server: Server):
    from openai import OpenAI
    return OpenAI(base_url=server.base + "/v1", api_key="local", max_retries=0, timeout=1800)


def fim_windows(a, region: float, count: int) -> list:
    """`count` + 1 (prefix, suffix) pairs from FIM_SOURCE: a fixed start at `region` of the file,
    the cursor at the start of a line, two lines further for each request (the first pair is
    the warm-up), the line under the cursor left for the model to fill."""
    lines = inspect.getsource(__import__(FIM_SOURCE)).splitlines(keepends=True)
    first = int(len(lines) * region)
    start = max(0, first - a.prefix_lines)
    out = []
    for i in range(count + 1):
        cursor = first + 2 * i
        out.append(("".join(lines[start:cursor]),
                    "".join(lines[cursor + 1:cursor + 1 + a.suffix_lines])))
    return out


class FimRoute:
    """/infill where the model has FIM tokens; else (a chat model such as SmolLM2, in --quick)
    a streamed /v1/completions of the prefix, so the scenario still runs. Decided by the first
    request of the run, the same for every configuration."""
    route: Optional[str] = None


def fim_request(server: Server, prefix: str, suffix: str, n: int) -> dict:
    """One streamed completion; time to its first piece of text."""
    import httpx
    t0 = clock()
    if FimRoute.route != "completions":
        body = {"input_prefix": prefix, "input_suffix": suffix, "input_extra": [],
                "n_predict": n, "temperature": 0, "stream": True, "cache_prompt": True}
        first, pieces, final = None, [], {}
        with httpx.stream("POST", server.base + "/infill", json=body, timeout=1800) as r:
            if r.status_code in (400, 501) and FimRoute.route is None:
                r.read()
                FimRoute.route = "completions"
                say(f"  /infill refused ({r.status_code}: {r.text[:120]}); FIM goes through "
                    "/v1/completions of the prefix in this run")
                return fim_request(server, prefix, suffix, n)
            if r.status_code != 200:
                r.read()
                raise Failure(f"{server.cfg.name}: /infill answered {r.status_code}: "
                              f"{r.text[:200]}")
            for line in r.iter_lines():
                if not line.startswith("data: "):
                    continue
                event = json.loads(line[6:])
                text = event.get("content") or ""
                if text:
                    pieces.append(text)
                    if first is None:
                        first = clock()
                if event.get("stop"):
                    final = event
        FimRoute.route = "infill"
        end = clock()
        tokens = final.get("tokens_predicted")
    else:
        client = openai_client(server)
        first, pieces, tokens = None, [], None
        stream = client.completions.create(model=server.model_id, prompt=prefix, max_tokens=n,
                                           temperature=0, stream=True)
        for chunk in stream:
            text = chunk.choices[0].text if chunk.choices else ""
            if text:
                pieces.append(text)
                if first is None:
                    first = clock()
        end = clock()
    return {"t_send": t0, "ttft_ms": 1000 * ((first or end) - t0), "total_ms": 1000 * (end - t0),
            "empty": first is None, "text": "".join(pieces), "tokens": tokens}


def chat_stream(server: Server, max_tokens: int, out: dict, started: threading.Event) -> None:
    """The long reply, streamed; its timings into `out`; `started` set at its first token."""
    client = openai_client(server)
    t0 = clock()
    out["t_send"] = t0
    pieces, tokens = [], None
    try:
        stream = client.chat.completions.create(
            model=server.model_id, messages=[{"role": "user", "content": CHAT_PROMPT}],
            max_tokens=max_tokens, temperature=0, stream=True,
            stream_options={"include_usage": True})
        for chunk in stream:
            if chunk.usage is not None:
                tokens = chunk.usage.completion_tokens
            if chunk.choices and chunk.choices[0].delta.content:
                pieces.append(chunk.choices[0].delta.content)
                if "t_first" not in out:
                    out["t_first"] = clock()
                    started.set()
    except Exception as e:                        # noqa: BLE001 - reported by the caller
        out["error"] = f"{type(e).__name__}: {e}"
    finally:
        out["t_end"] = clock()
        out.setdefault("t_first", out["t_end"])
        started.set()
    out.update(text="".join(pieces), tokens=tokens, ttft_ms=1000 * (out["t_first"] - t0),
               total_ms=1000 * (out["t_end"] - t0))
    if tokens and tokens > 1 and out["t_end"] > out["t_first"]:
        out["decode_tps"] = (tokens - 1) / (out["t_end"] - out["t_first"])


def run_fim(server: Server, a) -> dict:
    """Idle FIM, one after another, then FIM every --fim-every s while the long reply streams."""
    idle_w = fim_windows(a, 0.45, a.fim_count)
    load_w = fim_windows(a, 0.70, a.fim_count)
    fim_request(server, *idle_w[0], a.fim_tokens)          # warm-ups: the region's start cached
    fim_request(server, *load_w[0], a.fim_tokens)
    idle = []
    for i, (p, s) in enumerate(idle_w[1:]):
        r = fim_request(server, p, s, a.fim_tokens)
        idle.append(dict(r, i=i))
    chat, started = {}, threading.Event()
    t_chat = threading.Thread(target=chat_stream, args=(server, a.chat_tokens, chat, started),
                              daemon=True)
    t_chat.start()
    started.wait()
    loaded, threads = [None] * a.fim_count, []
    t_first = chat.get("t_first", clock())

    def one(i, p, s):
        try:
            loaded[i] = dict(fim_request(server, p, s, a.fim_tokens), i=i)
        except Exception as e:                    # noqa: BLE001
            loaded[i] = {"i": i, "error": f"{type(e).__name__}: {e}"}

    for i, (p, s) in enumerate(load_w[1:]):
        delay = t_first + i * a.fim_every - clock()
        if delay > 0:
            time.sleep(delay)
        th = threading.Thread(target=one, args=(i, p, s), daemon=True)
        th.start()
        threads.append(th)
    for th in threads:
        th.join()
    t_chat.join()
    errors = [r["error"] for r in loaded if "error" in r] + ([chat["error"]] if "error" in chat
                                                              else [])
    if errors:
        raise Failure(f"{server.cfg.name}: a request failed under load: {errors[0]}")
    for r in loaded:
        r["under_load"] = r["t_send"] < chat["t_end"]
        r["sent_after_chat_first_ms"] = 1000 * (r["t_send"] - t_first)
    base = chat["t_send"]
    for r in idle + loaded:
        r["t_send"] -= base
    for k in ("t_first", "t_end"):
        chat[k] -= base
    chat["t_send"] = 0.0
    return {"route": FimRoute.route, "idle": idle, "loaded": loaded, "chat": chat}


def run_throughput(server: Server, a, cases: list) -> dict:
    """--clients threads, each through every case (rotated), non-streamed chat completions."""
    results, errors = [], []
    lock = threading.Lock()
    barrier = threading.Barrier(a.clients)
    t_base = clock()

    def client_loop(c):
        client = openai_client(server)
        order = cases[c % len(cases):] + cases[:c % len(cases)]
        barrier.wait()
        for case in order:
            t0 = clock()
            try:
                r = client.chat.completions.create(
                    model=server.model_id, messages=case.messages(), temperature=0,
                    max_tokens=min(case.max_tokens, a.max_tokens))
            except Exception as e:               # noqa: BLE001
                with lock:
                    errors.append(f"{case.id}: {type(e).__name__}: {e}")
                return
            t1 = clock()
            with lock:
                results.append({"client": c, "case": case.id, "t_send": t0 - t_base,
                                "t_end": t1 - t_base, "tokens": r.usage.completion_tokens,
                                "prompt_tokens": r.usage.prompt_tokens,
                                "finish_reason": r.choices[0].finish_reason,
                                "text": r.choices[0].message.content or ""})

    threads = [threading.Thread(target=client_loop, args=(c,), daemon=True)
               for c in range(a.clients)]
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    if errors:
        raise Failure(f"{server.cfg.name}: a throughput request failed: {errors[0]}")
    wall = max(r["t_end"] for r in results) - min(r["t_send"] for r in results)
    tokens = sum(r["tokens"] for r in results)
    results.sort(key=lambda r: (r["client"], r["t_send"]))
    return {"requests": results, "tokens": tokens, "wall_s": wall, "tokens_per_s": tokens / wall}


def warm_up(server: Server) -> None:
    """A short chat: pages the weights in (and lets localspec settle its cost curve)."""
    openai_client(server).chat.completions.create(
        model=server.model_id, messages=[{"role": "user", "content": "Say hello."}],
        max_tokens=8, temperature=0)


# -- the machine -----------------------------------------------------------------------------------
def cpu_info() -> dict:
    fields = {}
    try:
        out = subprocess.run(["lscpu"], capture_output=True, text=True, timeout=20).stdout
        for line in out.splitlines():
            k, _, v = line.partition(":")
            fields[k.strip()] = v.strip()
    except (OSError, subprocess.SubprocessError):
        pass
    model, flags = fields.get("Model name"), fields.get("Flags", "").split()
    if not model or not flags:
        try:
            for line in Path("/proc/cpuinfo").read_text().splitlines():
                k, _, v = line.partition(":")
                if k.strip() == "model name" and not model:
                    model = v.strip()
                if k.strip() == "flags" and not flags:
                    flags = v.split()
        except OSError:
            pass
    return {"model": model or "unknown", "cpus": fields.get("CPU(s)") or str(os.cpu_count()),
            "hypervisor": fields.get("Hypervisor vendor"),
            "simd": [f for f in SIMD_FLAGS if f in flags],
            "lscpu": {k: fields[k] for k in ("Architecture", "Vendor ID", "CPU family", "Model",
                                             "Thread(s) per core", "Core(s) per socket",
                                             "L2 cache", "L3 cache") if k in fields}}


def git_head() -> str:
    try:
        head = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True,
                              text=True, cwd=ROOT).stdout.strip()
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"],
                               capture_output=True, text=True, cwd=ROOT).stdout.strip()
        return head + ("+dirty" if dirty else "")
    except OSError:
        return "?"


# -- the summary -----------------------------------------------------------------------------------
def pct(xs: list, q: float) -> Optional[float]:
    """The q-quantile by linear interpolation between order statistics ([] -> None)."""
    if not xs:
        return None
    xs = sorted(xs)
    pos = q * (len(xs) - 1)
    lo = int(pos)
    hi = min(lo + 1, len(xs) - 1)
    return xs[lo] + (xs[hi] - xs[lo]) * (pos - lo)


def identity(rounds: list) -> dict:
    """Every text of localspec-N (N > 1) against localspec-1's for the same request in the same
    round; llama-server's chat and throughput texts against it too, for information."""
    def keyed(res: dict) -> dict:
        out = {}
        if "fim" in res:
            out[("chat",)] = [res["fim"]["chat"]["text"]]
            for part in ("idle", "loaded"):
                for r in res["fim"][part]:
                    out[(f"fim-{part}", r["i"])] = [r["text"]]
        if "throughput" in res:
            for r in res["throughput"]["requests"]:
                out.setdefault(("tp", r["case"]), []).append(r["text"])
        return out

    ident = {"compared": 0, "identical": 0, "requests": 0, "mismatches": []}
    llama = {"compared": 0, "identical": 0}
    self_ = {"compared": 0, "identical": 0}
    for rnd in rounds:
        ref_res = rnd["results"].get("localspec-1")
        ref = keyed(ref_res) if ref_res else {}
        for texts in ref.values():                      # localspec-1's clients among themselves
            self_["compared"] += len(texts) - 1
            self_["identical"] += sum(t == texts[0] for t in texts[1:])
        for name, res in rnd["results"].items():
            cfg = parse_configs(name)[0]
            if name == "localspec-1" or "error" in res:
                continue
            for key, texts in keyed(res).items():
                if cfg.server == "localspec":
                    ident["requests"] += len(texts)
                if key not in ref:
                    continue
                for t in texts:
                    same = t == ref[key][0]
                    if cfg.server == "localspec":
                        ident["compared"] += 1
                        ident["identical"] += same
                        if not same:
                            at = next((i for i, (x, y) in enumerate(zip(t, ref[key][0]))
                                       if x != y), min(len(t), len(ref[key][0])))
                            ident["mismatches"].append({"round": rnd["round"], "config": name,
                                                        "request": list(key), "at_char": at})
                    elif key[0] != "fim-idle" and key[0] != "fim-loaded":
                        llama["compared"] += 1
                        llama["identical"] += same
    return {"localspec": ident, "llama_server_vs_localspec_1": llama,
            "localspec_1_clients": self_}


def summarise(configs: list, rounds: list) -> dict:
    base = next((c.name for c in configs if c.name == "localspec-1"), configs[0].name)
    out = {"baseline": base, "configs": {}}
    for cfg in configs:
        runs = [r["results"][cfg.name] for r in rounds
                if cfg.name in r["results"] and "error" not in r["results"][cfg.name]]
        s = {"rounds": len(runs)}
        fims = [r["fim"] for r in runs if "fim" in r]
        if fims:
            idle = [x["ttft_ms"] for f in fims for x in f["idle"]]
            loaded = [x["ttft_ms"] for f in fims for x in f["loaded"] if x["under_load"]]
            s["fim"] = {"idle_p50_ms": pct(idle, .5), "idle_p90_ms": pct(idle, .9),
                        "loaded_p50_ms": pct(loaded, .5), "loaded_p90_ms": pct(loaded, .9),
                        "n_idle": len(idle), "n_loaded": len(loaded),
                        "n_sent_after_chat": sum(not x["under_load"] for f in fims
                                                 for x in f["loaded"]),
                        "chat_tokens": [f["chat"].get("tokens") for f in fims],
                        "chat_decode_tps": [f["chat"].get("decode_tps") for f in fims]}
            f = s["fim"]
            for q in ("p50", "p90"):
                i, lo = f[f"idle_{q}_ms"], f[f"loaded_{q}_ms"]
                f[f"ratio_{q}"] = lo / i if i and lo is not None else None
            f["ratio_p50_by_round"] = []
            for x in fims:
                i = pct([y["ttft_ms"] for y in x["idle"]], .5)
                lo = pct([y["ttft_ms"] for y in x["loaded"] if y["under_load"]], .5)
                f["ratio_p50_by_round"].append(lo / i if i and lo is not None else None)
        tps = [r["throughput"]["tokens_per_s"] for r in runs if "throughput" in r]
        if tps:
            ratios = []
            for rnd in rounds:
                mine, ref = rnd["results"].get(cfg.name, {}), rnd["results"].get(base, {})
                if "throughput" in mine and "throughput" in ref:
                    ratios.append(mine["throughput"]["tokens_per_s"]
                                  / ref["throughput"]["tokens_per_s"])
            s["throughput"] = {"tokens_per_s": tps, "median_tokens_per_s": statistics.median(tps),
                               "tokens": [r["throughput"]["tokens"] for r in runs
                                          if "throughput" in r],
                               "wall_s": [r["throughput"]["wall_s"] for r in runs
                                          if "throughput" in r],
                               "x_baseline": ratios,
                               "median_x_baseline": statistics.median(ratios) if ratios else None}
        out["configs"][cfg.name] = s
    out["identical"] = identity(rounds)
    return out


def fmt(x, spec=".0f", none="-") -> str:
    return none if x is None else format(x, spec)


def markdown(meta: dict, summary: dict) -> str:
    cpu = meta["cpu"]
    lines = [f"## Concurrent requests: localspec against llama-server ({meta['date']})", "",
             f"CPU: {cpu['model']} ({cpu['cpus']} CPUs"
             + (f", {cpu['hypervisor']} guest" if cpu.get("hypervisor") else "")
             + f"; {' '.join(cpu['simd']) or 'no AVX'}), {meta['threads']} threads, "
             f"model {Path(meta['model']).name}, {meta['ctx_per_slot']} tokens of context per "
             f"slot, greedy, {meta['rounds']} round(s) of {', '.join(meta['configs'])}; "
             f"load average {meta['load_start']} at the start, {meta.get('load_end', '?')} at "
             f"the end; commit {meta['commit']}; localspec's draft store "
             + ("on, empty at each server's start." if meta.get("store") else "off."), ""]
    cfgs = summary["configs"]
    if any("fim" in s for s in cfgs.values()):
        lines += [f"FIM time to first token (ms; route {meta.get('fim_route')}, "
                  f"{meta['fim_tokens']} tokens each), idle and while a {meta['chat_tokens']}-"
                  f"token chat reply streams (one every {meta['fim_every']} s):", "",
                  "| config | idle p50 | idle p90 | loaded p50 | loaded p90 | loaded / idle p50 "
                  "| loaded / idle p90 | FIMs idle / loaded | chat tok/s under load |",
                  "|---|---|---|---|---|---|---|---|---|"]
        for name, s in cfgs.items():
            f = s.get("fim")
            if not f:
                continue
            tps = [x for x in f["chat_decode_tps"] if x]
            lines.append(f"| {name} | {fmt(f['idle_p50_ms'])} | {fmt(f['idle_p90_ms'])} | "
                         f"{fmt(f['loaded_p50_ms'])} | {fmt(f['loaded_p90_ms'])} | "
                         f"{fmt(f['ratio_p50'], '.2f')} | {fmt(f['ratio_p90'], '.2f')} | "
                         f"{f['n_idle']} / {f['n_loaded']} | "
                         f"{fmt(statistics.median(tps) if tps else None, '.1f')} |")
        lines.append("")
    if any("throughput" in s for s in cfgs.values()):
        lines += [f"Aggregate throughput, {meta['clients']} clients x {len(meta['cases'])} cases "
                  f"(at most {meta['max_tokens']} tokens each), generated tokens / wall time; "
                  f"ratios per round over {summary['baseline']}:", "",
                  "| config | tokens | wall s | tok/s (median) | x " + summary["baseline"]
                  + " (median) | range |", "|---|---|---|---|---|---|"]
        for name, s in cfgs.items():
            t = s.get("throughput")
            if not t:
                continue
            rs = t["x_baseline"]
            lines.append(f"| {name} | {statistics.median(t['tokens']):.0f} | "
                         f"{statistics.median(t['wall_s']):.1f} | "
                         f"{t['median_tokens_per_s']:.2f} | "
                         f"{fmt(t['median_x_baseline'], '.3f')} | "
                         + (f"{min(rs):.3f}-{max(rs):.3f}" if rs else "-") + " |")
        lines.append("")
    ident = summary["identical"]
    li, ll = ident["localspec"], ident["llama_server_vs_localspec_1"]
    lines.append(f"Identical texts: localspec with slots against localspec-1, {li['identical']}/"
                 f"{li['compared']} ({li['requests']} requests); localspec-1's clients among "
                 f"themselves {ident['localspec_1_clients']['identical']}/"
                 f"{ident['localspec_1_clients']['compared']}; llama-server's chat and "
                 f"throughput texts equal to localspec-1's (information only) "
                 f"{ll['identical']}/{ll['compared']}.")
    return "\n".join(lines) + "\n"


# -- the run ---------------------------------------------------------------------------------------
def one_turn(cfg: Config, a, model: Path, cases: list, log_dir: Path, rnd: int) -> dict:
    port = free_port()
    home = Path(tempfile.mkdtemp(prefix="localspec-bench-home-"))
    atexit.register(shutil.rmtree, home, True)
    cmd, env = server_command(cfg, a, model, port, home)
    server = Server(cfg, cmd, port, log_dir / f"round{rnd}-{cfg.name}.log", env)
    res = {"command": cmd, "port": port, "log": str(server.log_path),
           "load_start": os.getloadavg()[0]}
    try:
        res["start_s"] = server.start(a.start_timeout)
        warm_up(server)
        if "fim" in a.scenarios:
            res["fim"] = run_fim(server, a)
        if "throughput" in a.scenarios:
            res["throughput"] = run_throughput(server, a, cases)
    finally:
        server.stop()
        shutil.rmtree(home, ignore_errors=True)
    res["load_end"] = os.getloadavg()[0]
    return res


def build_args(argv: Optional[list] = None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("-m", "--model", default="default",
                    help="catalog name or .gguf path (default: the catalog's default model)")
    ap.add_argument("--threads", type=int, default=os.cpu_count() or 1)
    ap.add_argument("--rounds", type=int, default=None, help="default 2 (--quick: 1)")
    ap.add_argument("--configs", default=None, help=f"default {DEFAULT_CONFIGS}")
    ap.add_argument("--scenarios", default="fim,throughput",
                    help="what to measure, comma-separated: fim (time to first token, idle and "
                         "beside a streaming chat), throughput (clients at once); default both")
    ap.add_argument("--ctx", type=int, default=None, help="context per slot (default 2048)")
    ap.add_argument("--chat-tokens", type=int, default=None, help="the long reply (default 900)")
    ap.add_argument("--fim-every", type=float, default=None, help="seconds (default 2)")
    ap.add_argument("--fim-count", type=int, default=None,
                    help="FIM requests, idle and under load (default 15)")
    ap.add_argument("--fim-tokens", type=int, default=None, help="per FIM (default 32)")
    ap.add_argument("--prefix-lines", type=int, default=None, help="default 40")
    ap.add_argument("--suffix-lines", type=int, default=None, help="default 10")
    ap.add_argument("--workloads", type=Path, default=DEFAULT_WORKLOADS)
    ap.add_argument("--cases", default=None, help=f"default {DEFAULT_CASES}")
    ap.add_argument("--max-tokens", type=int, default=None, help="cap per case (default 256)")
    ap.add_argument("--clients", type=int, default=None, help="default 4")
    ap.add_argument("--store", action=argparse.BooleanOptionalAction, default=True,
                    help="localspec's draft store on, empty at each server's start, as "
                         "llama-server's ngram-mod table is (default); --no-store: off, as "
                         "runs 1-4 had it")
    ap.add_argument("--json", type=Path, default=None, help="every raw number, texts included")
    ap.add_argument("--log-dir", type=Path, default=None, help="the servers' logs")
    ap.add_argument("--start-timeout", type=float, default=900,
                    help="seconds for a server to answer /health (a first localspec run "
                         "measures its cost curve)")
    ap.add_argument("--skip-missing", action="store_true",
                    help="drop configurations this checkout cannot run (no llama-server built, "
                         "no serve --parallel) with a warning, instead of stopping")
    ap.add_argument("--quick", action="store_true",
                    help="tiny settings for a functional check: " + ", ".join(
                        f"{k}={v}" for k, v in QUICK.items()))
    a = ap.parse_args(argv)
    full = dict(rounds=2, chat_tokens=900, fim_every=2.0, fim_count=15, fim_tokens=32,
                prefix_lines=40, suffix_lines=10, cases=DEFAULT_CASES, max_tokens=256,
                clients=4, ctx=2048, configs=DEFAULT_CONFIGS)
    for k, v in (QUICK if a.quick else full).items():
        if getattr(a, k) is None:
            setattr(a, k, v)
    a.scenarios = [s for s in a.scenarios.split(",") if s]
    if set(a.scenarios) - {"fim", "throughput"} or not a.scenarios:
        ap.error("--scenarios: fim and/or throughput")
    return a


def check_configs(configs: list, a) -> list:
    """The configurations this checkout can run; the others stop the run with one line each
    (or are dropped with --skip-missing)."""
    problems = {}
    if any(c.server == "localspec" and c.parallel > 1 for c in configs) \
            and not localspec_has_parallel():
        for c in configs:
            if c.server == "localspec" and c.parallel > 1:
                problems[c.name] = ("this localspec has no `serve --parallel` yet (issue 42); "
                                    "run localspec-1 only")
    if any(c.server == "llama-server" for c in configs) and not llama_server_path().is_file():
        for c in configs:
            if c.server == "llama-server":
                problems[c.name] = (f"llama.cpp's llama-server is not built for this flag set "
                                    f"({llama_server_path()}); build it once: "
                                    "scripts/llamacpp_tools.sh --target llama-server")
    for name, why in problems.items():
        say(f"{'skipping' if a.skip_missing else 'cannot run'} {name}: {why}")
    if problems and not a.skip_missing:
        raise Failure(f"{len(problems)} configuration(s) cannot run here (--skip-missing drops "
                      "them)")
    kept = [c for c in configs if c.name not in problems]
    if not kept:
        raise Failure("no configuration left to run")
    return kept


def main(argv: Optional[list] = None) -> int:
    a = build_args(argv)
    from localspec.bench.workloads import load_workloads
    from localspec.catalog.models import resolve_model
    from localspec.errors import LocalspecError
    try:
        configs = check_configs(parse_configs(a.configs), a)
        model = resolve_model(a.model)
        cases = load_workloads(a.workloads, ids=[c for c in a.cases.split(",") if c])
    except (Failure, LocalspecError) as e:
        say(f"error: {e}")
        return 2
    log_dir = a.log_dir or Path(tempfile.mkdtemp(prefix="bench-parallel-"))
    log_dir.mkdir(parents=True, exist_ok=True)
    meta = {"date": datetime.now(timezone.utc).strftime("%Y-%m-%d %H:%M UTC"), "cpu": cpu_info(),
            "threads": a.threads, "model": str(model), "ctx_per_slot": a.ctx, "rounds": a.rounds,
            "configs": [c.name for c in configs], "scenarios": a.scenarios,
            "store": a.store,
            "chat_tokens": a.chat_tokens, "chat_prompt": CHAT_PROMPT, "fim_every": a.fim_every,
            "fim_count": a.fim_count, "fim_tokens": a.fim_tokens, "fim_source": FIM_SOURCE,
            "prefix_lines": a.prefix_lines, "suffix_lines": a.suffix_lines,
            "workloads": str(a.workloads), "cases": [c.id for c in cases],
            "max_tokens": a.max_tokens, "clients": a.clients, "commit": git_head(),
            "python": sys.version.split()[0], "argv": sys.argv[1:],
            "load_start": " ".join(f"{x:.2f}" for x in os.getloadavg()), "log_dir": str(log_dir)}
    build_note = llama_server_path().parent / "BUILD"
    if any(c.server == "llama-server" for c in configs) and build_note.is_file():
        meta["llama_server_build"] = build_note.read_text()
    rounds: list = []

    def save(done: bool = False) -> dict:
        summary = summarise(configs, rounds)
        meta["fim_route"] = FimRoute.route
        if done:
            meta["load_end"] = " ".join(f"{x:.2f}" for x in os.getloadavg())
        if a.json:
            tmp = a.json.with_name(a.json.name + ".tmp")
            tmp.write_text(json.dumps({"meta": meta, "summary": summary, "rounds": rounds},
                                      indent=1) + "\n")
            os.replace(tmp, a.json)
        return summary

    say(f"bench_parallel: {meta['cpu']['model']}, {a.threads} threads, {model.name}, "
        f"{len(configs)} configurations x {a.rounds} round(s); logs in {log_dir}")
    try:
        for rnd in range(1, a.rounds + 1):
            rounds.append({"round": rnd, "results": {}})
            for cfg in configs:
                t0 = clock()
                say(f"round {rnd}/{a.rounds}: {cfg.name}...")
                res = one_turn(cfg, a, model, cases, log_dir, rnd)
                rounds[-1]["results"][cfg.name] = res
                bits = [f"{clock() - t0:.0f} s"]
                if "fim" in res:
                    f = res["fim"]
                    idle = pct([x["ttft_ms"] for x in f["idle"]], .5)
                    loaded = pct([x["ttft_ms"] for x in f["loaded"] if x["under_load"]], .5)
                    bits.append(f"FIM TTFT p50 idle {fmt(idle)} ms, loaded {fmt(loaded)} ms")
                if "throughput" in res:
                    bits.append(f"{res['throughput']['tokens_per_s']:.2f} tok/s aggregate")
                say(f"  {cfg.name}: " + ", ".join(bits))
                save()
        summary = save(done=True)
    except KeyboardInterrupt:
        stop_all()
        save()
        say("interrupted; servers stopped" + (f"; partial results in {a.json}" if a.json else ""))
        return 130
    except Failure as e:
        stop_all()
        save()
        say(f"error: {e}")
        return 1
    print(markdown(meta, summary), end="")
    return 0


def _terminate(signum, _frame):
    raise KeyboardInterrupt                   # the same clean-up as Ctrl-C


if __name__ == "__main__":
    atexit.register(stop_all)
    signal.signal(signal.SIGTERM, _terminate)
    signal.signal(signal.SIGINT, _terminate)   # also where a shell started it with SIGINT ignored
    sys.exit(main())

"""The prompt cache's numbers for issue 13, measured end to end (a benchmark, not a test):

1. An editor session over `localspec serve --stdio` (a real subprocess, pipes): three documents,
   four requests each, alternating A B C A B C ...; time to first token (request sent -> first
   `generate/progress` line) of each document's first request (cold) and of the repeated ones,
   the server's RSS against the cache budget, and the disk entries' size per 1k tokens.
2. `chat --resume`: the time to the first token of a new message after a restart, restoring the
   saved conversation, against re-reading the same conversation (Python API, same engine settings).

    python scripts/bench/prompt_cache_session.py [-m default] [--threads 2] [--json out.json]
"""

from __future__ import annotations

import argparse
import inspect
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

DOCS = ["json.decoder:JSONObject", "textwrap:TextWrapper._wrap_chunks", "shlex:shlex.read_token"]
QUESTIONS = ["Summarize what this code does in two sentences.", "Is there any bug here?",
             "List the names it defines.", "What would you rename, and why?"]


def source(spec: str) -> str:
    import importlib
    module, _, qualname = spec.partition(":")
    obj = importlib.import_module(module)
    for part in qualname.split("."):
        obj = getattr(obj, part)
    return inspect.getsource(obj)


class Stdio:
    def __init__(self, args, env):
        self.proc = subprocess.Popen([sys.executable, "-m", "localspec", "serve", "--stdio", *args],
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE, env=env)
        self.n = 0

    def send(self, method, params):
        self.n += 1
        line = json.dumps({"jsonrpc": "2.0", "id": self.n, "method": method, "params": params})
        self.proc.stdin.write(line.encode() + b"\n")
        self.proc.stdin.flush()
        return self.n

    def generate(self, params):
        """(seconds to the first progress line, final result)."""
        t0 = time.perf_counter()
        rid = self.send("generate", params)
        first = None
        while True:
            msg = json.loads(self.proc.stdout.readline())
            if msg.get("method") == "generate/progress" and first is None:
                first = time.perf_counter() - t0
            if msg.get("id") == rid:
                return first if first is not None else time.perf_counter() - t0, msg["result"]

    def rss_mb(self) -> float:
        with open(f"/proc/{self.proc.pid}/status") as f:
            return next(int(x.split()[1]) for x in f if x.startswith("VmRSS:")) / 1024

    def close(self):
        self.proc.stdin.close()
        return self.proc.wait(timeout=120)


def editor_session(a, home: Path) -> dict:
    env = {**os.environ, "LOCALSPEC_HOME": str(home)}
    server = Stdio(["-m", a.model, "--threads", str(a.threads)], env)
    info = server.send("initialize", {})
    json.loads(server.proc.stdout.readline())
    rss_start = server.rss_mb()
    docs = [source(s) for s in DOCS]
    rows = []
    for r, question in enumerate(QUESTIONS):
        for name, doc in zip(DOCS, docs):
            messages = [{"role": "user", "content": f"```python\n{doc}```\n\n{question}"}]
            ttft, res = server.generate({"messages": messages, "max_tokens": 8, "stream": True})
            st = res["stats"]
            rows.append({"round": r, "doc": name, "ttft_s": round(ttft, 3),
                         "prompt": st["prompt_tokens"], "evaluated": st["prefill_tokens"],
                         "reused": st["reused_tokens"], "source": st["reuse_source"],
                         "restore_ms": st["restore_ms"]})
            print(f"round {r} {name:36s} ttft {ttft:7.2f} s  prompt {st['prompt_tokens']:5d}  "
                  f"evaluated {st['prefill_tokens']:5d}  reused {st['reused_tokens']:5d} "
                  f"({st['reuse_source'] or '-'})", file=sys.stderr)
    rss_end = server.rss_mb()
    assert server.close() == 0 and info
    from localspec.cache.format import SUFFIX, read_header

    files = list((home / "prompt-cache").rglob("*" + SUFFIX))
    cold = [x["ttft_s"] for x in rows if x["round"] == 0]
    warm = [x["ttft_s"] for x in rows if x["round"] > 0]
    per_1k = []
    for f in files:
        with open(f, "rb") as fh:
            per_1k.append(1000 * f.stat().st_size / max(1, len(read_header(fh)[1])))
    from localspec.catalog.models import resolve_model
    from localspec.llama import Model
    from localspec.cache.prompt_cache import default_budget_mb

    with Model(resolve_model(a.model)) as model:
        budget = default_budget_mb(model, 4096)
    return {"rows": rows, "cold_ttft_s": cold, "repeated_ttft_s": warm, "budget_mb": budget,
            "repeated_over_cold": round(sorted(warm)[len(warm) // 2] / sorted(cold)[1], 4),
            "rss_mb_start": round(rss_start, 1), "rss_mb_end": round(rss_end, 1),
            "disk_files": len(files), "disk_mb": round(sum(f.stat().st_size for f in files) / 2**20, 1),
            "disk_mb_per_1k_tokens": round(sorted(per_1k)[len(per_1k) // 2] / 2**20, 2)
            if per_1k else None}


def resume_vs_reread(a, home: Path) -> dict:
    from localspec.apps.chat import ChatConfig, ChatSession
    from localspec.speculative.engine import Engine, EngineConfig

    os.environ["LOCALSPEC_HOME"] = str(home)
    config = EngineConfig(proposer="none", n_threads=a.threads, cache_disk=True)
    first = [f"Here is some code:\n```python\n{source(DOCS[0])}```\nWhat does it do?",
             "Now explain the error handling.", "And the return value?"]
    with Engine(a.model, config) as engine:
        chat = ChatSession(engine, config=ChatConfig(max_tokens=48))
        for msg in first:
            chat.send(msg)
        turns = list(chat.turns)
        chat.save("bench-resume")
    out = {}
    for how in ("resume", "reread", "resume", "reread"):     # interleaved, twice each
        with Engine(a.model, config) as engine:
            chat = ChatSession(engine, config=ChatConfig(max_tokens=4))
            t0 = time.perf_counter()
            if how == "resume":
                chat.resume("bench-resume")
            else:
                chat.turns = list(turns)
            reply = chat.send("Thanks. One more question: is it thread-safe?")
            ttft = time.perf_counter() - t0 - (reply.stats.total_ms - reply.stats.prefill_ms) / 1000
            out.setdefault(how, []).append(round(ttft, 3))
            print(f"{how:7s} time to first token {ttft:6.2f} s (prompt "
                  f"{reply.stats.prompt_tokens}, evaluated {reply.stats.prefill_tokens})",
                  file=sys.stderr)
    out["resume_over_reread"] = round(min(out["resume"]) / min(out["reread"]), 4)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("-m", "--model", default="default")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--json", default=None)
    a = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        home = Path(tmp)
        calib = Path(os.environ.get("LOCALSPEC_HOME", Path.home() / ".cache/localspec"))
        (home / "models").symlink_to(calib / "models")    # the pulled models, not a new pull
        if (calib / "calibration").is_dir():               # the cached cost curves: no re-timing
            shutil.copytree(calib / "calibration", home / "calibration")
        result = {"load_before": os.getloadavg(), "editor": editor_session(a, home)}
        result["chat"] = resume_vs_reread(a, home)
        result["load_after"] = os.getloadavg()
    print(json.dumps({k: v for k, v in result.items() if k != "editor"} |
                     {"editor": {k: v for k, v in result["editor"].items() if k != "rows"}},
                     indent=1))
    if a.json:
        Path(a.json).write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()

"""Editor-side numbers for docs/editors.md (issue 33), in three short pieces to run under
`flock -x /work/machine.lock` one at a time:

  latency  keypress to first ghost-text token over real pipes (`serve --stdio`, `complete`
           with stream on) for a 300-line Python buffer: cold (a buffer the server has not
           seen) and warm (one more character typed on the cursor's line), p50/p90.
  fim      tokens/s of speculative over plain FIM on 10 completions cut from real code (a
           function's body, whose neighbours look alike), interleaved case by case.
  rewrite  one realistic rewrite through `rewrite`-equivalent code: time to first token and
           decode speed, speculative and plain, interleaved.

           With --prefill, each new buffer is first sent as a `prefill` (what the plugins do
           when a buffer is entered or idle) and "cold" is the first completion after it.

Usage: python scripts/bench/fim_bench.py latency|fim|rewrite [-m MODEL] [--threads 2] [--cold N]
       [--warm N] [--prefill] [--out FILE.json]
"""

from __future__ import annotations

import argparse
import ast
import json
import os
import queue
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from localspec.apps.lines import split_lines  # noqa: E402  (the editors' line rule)

ROOT = Path(__file__).resolve().parents[2]
SOURCES = ["localspec/apps/checks.py", "localspec/apps/openai_api.py", "localspec/speculative/stats.py",
           "localspec/apps/completion.py", "localspec/cache/disk.py"]


def buffer_300() -> str:
    """A 300-line Python buffer: localspec's own code, made up to 300 lines."""
    lines = []
    for name in SOURCES:
        lines += [line.rstrip("\n") for line in split_lines((ROOT / name).read_text())]
    return "\n".join(lines[:300]) + "\n"


def pct(xs, q):
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(round(q * (len(xs) - 1))))]


class Stdio:
    def __init__(self, model, threads, home):
        env = {**os.environ, "LOCALSPEC_HOME": home} if home else dict(os.environ)
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "localspec", "serve", "--stdio", "-m", model, "--threads",
             str(threads), "--no-disk-cache"], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
            stderr=subprocess.DEVNULL, env=env)
        self.q: queue.Queue = queue.Queue()
        threading.Thread(target=lambda: [self.q.put(json.loads(x)) for x in self.proc.stdout],
                         daemon=True).start()
        self.n = 0

    def complete(self, params, method="complete") -> tuple:
        """(seconds to the first streamed piece, seconds to the answer, result)."""
        self.n += 1
        t0 = time.perf_counter()
        self.proc.stdin.write(json.dumps({"jsonrpc": "2.0", "id": self.n, "method": method,
                                          "params": params}).encode() + b"\n")
        self.proc.stdin.flush()
        first = None
        while True:
            msg = self.q.get(timeout=600)
            if msg.get("method") and first is None:
                first = time.perf_counter() - t0
            if msg.get("id") == self.n:
                total = time.perf_counter() - t0
                return first if first is not None else total, total, msg.get("result", msg)

    def close(self):
        self.proc.stdin.close()
        self.proc.wait(60)


def latency(args) -> dict:
    buf = split_lines(buffer_300())
    srv = Stdio(args.model, args.threads, None)
    srv.complete({"prefix": "x = ", "max_tokens": 1})          # model loaded, calibrated
    cold, warm = [], []
    for i in range(args.cold):
        # a buffer the server has not seen: the cursor at another line of a rotated copy
        rot = buf[37 * (i + 1):] + buf[:37 * (i + 1)]
        row = 150
        prefix, suffix = "".join(rot[:row]) + "    x", "\n" + "".join(rot[row:])
        params = {"prefix": prefix, "suffix": suffix, "max_tokens": 16, "max_lines": 1}
        if args.prefill:            # the buffer was entered (or sat idle) before the keypress
            _, took, p = srv.complete({**params, "prefix": prefix[:-1]}, "prefill")
            print(f"prefill {took:.2f}s read {p['prefill_tokens']}", file=sys.stderr)
        first, _, r = srv.complete(params)
        cold.append(first)
        for j in range(args.warm // max(1, args.cold)):
            prefix += "_y"[j % 2]                                  # one more keypress
            first, _, r = srv.complete({**params, "prefix": prefix})
            warm.append(first)
            print(f"warm {first:.2f}s reused {r['stats']['reused_tokens']}/"
                  f"{r['stats']['prompt_tokens']}", file=sys.stderr)
        print(f"cold {cold[-1]:.2f}s prompt {r['stats']['prompt_tokens']}", file=sys.stderr)
    srv.close()
    return {"cold_s": cold, "warm_s": warm,
            "cold_p50": statistics.median(cold), "cold_p90": pct(cold, 0.9),
            "warm_p50": statistics.median(warm), "warm_p90": pct(warm, 0.9)}


def fim_cases(n=10) -> list:
    """(name, prefix, suffix, indent) for n function bodies whose neighbours look alike."""
    cases = []
    for name in SOURCES:
        text = (ROOT / name).read_text()
        lines = split_lines(text)
        for node in ast.walk(ast.parse(text)):
            if isinstance(node, ast.FunctionDef) and 3 <= len(node.body) and \
                    node.end_lineno - node.lineno <= 20 and ast.get_docstring(node):
                body = node.body[1]                                 # after the docstring
                start = body.lineno - 1
                indent = len(lines[start]) - len(lines[start].lstrip())
                cases.append((f"{name}:{node.name}", "".join(lines[:start]) + " " * indent,
                              "".join(lines[node.end_lineno:]), indent))
    return cases[::max(1, len(cases) // n)][:n]


def fim(args) -> dict:
    from localspec.llama import set_log_level
    from localspec.speculative.engine import Engine, EngineConfig
    from localspec.apps.fim import FimRequest, infill

    set_log_level()
    rows = []
    with Engine(args.model, EngineConfig(proposer="ngram", n_threads=args.threads)) as engine:
        for name, prefix, suffix, indent in fim_cases():
            req = FimRequest(prefix=prefix, suffix=suffix, max_tokens=96, min_indent=indent)
            row = {"case": name}
            for mode in ("spec", "plain", "spec2", "plain2"):
                done = infill(engine, req, speculate=mode.startswith("spec"))
                done.complete()
                st = done.stats
                row[mode] = {"tokens": st.generated_tokens, "tok_s": st.decode_tokens_per_s,
                             "accepted": st.accepted, "drafted": st.drafted,
                             "finish": done.finish_reason}
            row["text"] = done.text
            sp = (row["spec"]["tok_s"] + row["spec2"]["tok_s"]) / 2
            pl = (row["plain"]["tok_s"] + row["plain2"]["tok_s"]) / 2
            row["speedup"] = sp / pl if pl else 0
            print(f"{name}: {row['spec']['tokens']} tokens, spec {sp:.1f} plain {pl:.1f} tok/s "
                  f"= {row['speedup']:.2f}x, accepted {row['spec']['accepted']}/"
                  f"{row['spec']['drafted']}", file=sys.stderr)
            rows.append(row)
    ratios = [r["speedup"] for r in rows if r["speedup"] > 0]
    geo = statistics.geometric_mean(ratios) if ratios else 0
    return {"cases": rows, "geomean_speedup": geo, "worst": min(ratios) if ratios else 0}


def rewrite(args) -> dict:
    from localspec.apps.edit import Rewrite
    from localspec.llama import set_log_level
    from localspec.speculative.engine import Engine, EngineConfig

    set_log_level()
    text = (ROOT / "localspec/apps/completion.py").read_text()
    out = {}
    with Engine(args.model, EngineConfig(proposer="ngram", n_threads=args.threads)) as engine:
        for mode in ("spec", "plain", "spec2", "plain2"):
            t0 = time.perf_counter()
            rw = Rewrite(engine, "add a one-line comment above each function saying what it "
                         "returns", text, name="completion.py",
                         speculate=mode.startswith("spec"))
            first = None
            for _ in rw:
                if first is None:
                    first = time.perf_counter() - t0
            try:
                rw.result()
                ok = True
            except Exception as e:       # a cut-off rewrite still times its tokens
                ok = str(e)
            st = rw.stats
            out[mode] = {"first_token_s": first, "tokens": st.generated_tokens,
                         "tok_s": st.decode_tokens_per_s, "prefill_ms": st.prefill_ms,
                         "reused": st.reused_tokens, "accepted": st.accepted,
                         "drafted": st.drafted, "ok": ok}
            print(mode, out[mode], file=sys.stderr)
    sp = (out["spec"]["tok_s"] + out["spec2"]["tok_s"]) / 2
    pl = (out["plain"]["tok_s"] + out["plain2"]["tok_s"]) / 2
    out["speedup"] = sp / pl if pl else 0
    return out


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("what", choices=["latency", "fim", "rewrite"])
    ap.add_argument("-m", "--model", default="default")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--cold", type=int, default=3)
    ap.add_argument("--warm", type=int, default=12)
    ap.add_argument("--prefill", action="store_true", help="latency: prefill each new buffer "
                                                            "first, as the plugins do")
    ap.add_argument("--out")
    args = ap.parse_args()
    result = {"what": args.what, "model": args.model, "threads": args.threads,
              **globals()[args.what](args)}
    text = json.dumps(result, indent=1)
    if args.out:
        Path(args.out).write_text(text + "\n")
    print(text)


if __name__ == "__main__":
    main()

"""A soak under load (issue 65, part 2): nothing leaks, nothing is lost, no text changes.

Starts `localspec serve --http --parallel 4` and `localspec serve --stdio --parallel 2` on one
model in a fresh LOCALSPEC_HOME (models and calibrations linked from yours; no prompt cache and
no draft store yet), loopback only, and sends them a bounded mix of requests from several client
threads (HTTP through the `openai` package, raw sockets for malformed requests, httpx for
/infill; stdio through the editor protocol over pipes):

  good      chat / text completions, streamed and not; fill-in-the-middle (/infill, `complete`);
            seeded sampling (temperature 0.8, a fixed seed); a document prompt twice with two
            questions (the prompt cache's case); "huge" max_tokens (10**6: capped by the context)
  bad       cancelled mid-stream (the client closes the stream; stdio: `cancel`), disconnected
            or cancelled while queued, malformed JSON / wrong fields / unknown names / wrong
            method or path / a body over --max-body, prompts longer than the context

Every good request is deterministic (greedy, or seeded) and its text must equal its lone run:
each distinct request is first sent alone, one at a time, to the same server before the load,
and that text is kept. Halfway the HTTP server is killed with SIGKILL under load and started
again on the same home; its prompt-cache files and its draft store (both servers --learn)
must validate as written (the readers the servers use), the restarted server must load them
without refusing any, answer, and restore the document from the disk cache. Each server has a
home of its own (--shared-home: one for both, see there).

Measured at start (after warm-up: every distinct request alone, then a concurrent burst),
middle (before the kill) and end, each with the clients paused and the servers idle: resident
memory (VmRSS), threads and open descriptors (/proc/PID). Targets, each a non-zero exit when
missed: 0 unexplained errors (a 500, an answer that is not the documented one, a traceback or
a refused file on a server's stderr, a request past its timeout, a connection dropped that was
not asked for), 100% of good texts equal to their lone run, RSS growth after warm-up under 5%
per server process, descriptors other than sockets not growing, the kill/restart survived, the
requested count sent within the wall-clock limit.

  .venv/bin/python scripts/bench/soak.py                               # smollm2-135m, 2000
  .venv/bin/python scripts/bench/soak.py -m tiny.gguf --requests 300 --minutes 5 --json out.json

A report goes to stdout, progress to stderr, every figure to --json. The servers' logs are kept
in --log-dir (default: the run's temporary folder, removed at exit unless --keep).
"""

from __future__ import annotations

import argparse
import atexit
import json
import os
import random
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Optional

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))
clock = time.monotonic
HUGE = 10 ** 6
STDERR_BAD = re.compile(r"Traceback|Exception in|^ERROR|internal error|ignoring .*moved it|"
                        r"rejected|Segmentation|Aborted|failed to decode|inconsistent sequence|"
                        r"prompt cache: could not",
                        re.I)


def say(msg: str) -> None:
    print(f"[soak {time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


# -- the requests ----------------------------------------------------------------------------------
QUESTIONS = ["What is the capital of France?", "Name three primary colors.",
             "Write a haiku about the sea.", "Give me one tip for writing clear Python.",
             "What is 2 + 2?", "Translate 'good morning' into Spanish."]
TEXTS = ["def fibonacci(n):", "The capital of France is", "Once upon a time",
         "import numpy as np\n\n", "Emoji party: \U0001f389\U0001f389\U0001f389"]
FIMS = [("def add(a, b):\n    return ", "\n\ndef sub(a, b):\n    return a - b\n"),
        ("def sub(a, b):\r\n    ret", "\r\n"), ("a = 1\r\nb = ", "\r\n"),
        ("for i in range(10):\n    ", "\nprint('done')\n")]


def document(chars: int) -> str:
    """Stable text for the prompt cache's case (one document, two questions): `chars`
    characters of a stdlib function, at most a byte-vocabulary model's tokens for its slot."""
    import inspect
    import statistics
    return inspect.getsource(statistics.median)[:chars]


def build_specs(max_tokens: int, slot_ctx: int) -> dict:
    """id -> a distinct good request: {mode: chat|text|fim, body fields}; every one
    deterministic (greedy, or seeded sampling)."""
    specs = {}
    for i, q in enumerate(QUESTIONS):
        specs[f"chat{i}"] = dict(mode="chat", messages=[{"role": "user", "content": q}],
                                 max_tokens=max_tokens)
    for i, t in enumerate(TEXTS):
        specs[f"text{i}"] = dict(mode="text", prompt=t, max_tokens=max_tokens)
    doc = document(int(0.55 * slot_ctx))
    for i, q in enumerate(["What does this function return?", "Rewrite it without sorted()."]):
        specs[f"doc{i}"] = dict(mode="text", prompt=f"{doc}\n# Question: {q}\n# Answer:",
                                max_tokens=max_tokens)
    for i in range(3):
        specs[f"seeded{i}"] = dict(mode="chat", messages=[{"role": "user", "content":
                                   QUESTIONS[i]}], max_tokens=max_tokens, temperature=0.8,
                                   seed=1000 + i)
    for i, (p, s) in enumerate(FIMS):
        specs[f"fim{i}"] = dict(mode="fim", prefix=p, suffix=s, max_tokens=max_tokens)
    specs["huge0"] = dict(mode="chat", messages=[{"role": "user", "content": "Say OK."}],
                          max_tokens=HUGE)
    specs["huge1"] = dict(mode="text", prompt="1, 2, 3, 4,", max_tokens=HUGE)
    return specs


def oversized_prompt(n_ctx: int) -> str:
    return "word " * (2 * n_ctx + 64)


# Malformed HTTP requests: (method, path, body, accepted statuses). `None` as a status: the
# connection may be closed without an answer (not HTTP at all).
def http_malformed(max_body: int) -> list:
    chat = "/v1/chat/completions"
    msgs = '"messages": [{"role": "user", "content": "hi"}]'
    return [
        ("POST", chat, b'{"messages": [{"role": "user", "content": "hi"}', {400}),
        ("POST", chat, b"", {400}),
        ("POST", chat, b"[1, 2]", {400}),
        ("POST", chat, ("{" + msgs + ', "max_token": 5}').encode(), {400}),
        ("POST", chat, ("{" + msgs + ', "max_tokens": "5"}').encode(), {400}),
        ("POST", chat, ("{" + msgs + ', "temperature": NaN}').encode(), {400}),
        ("POST", chat, ("{" + msgs + ', "n": 3}').encode(), {400}),
        ("POST", chat, b'{"messages": [{"role": "x", "content": "hi"}]}', {400}),
        ("POST", chat, ("{" + msgs + ', "stop": [""]}').encode(), {400}),
        ("POST", chat, ("{" + msgs + ', "model": "gpt-4o"}').encode(), {404}),
        ("POST", "/v1/completions", b'{"prompt": "\xff\xfe"}', {400}),
        ("POST", "/v1/completions", b'{"prompt": ' + b"[" * 200 + b"]" * 200 + b"}", {400}),
        ("POST", "/v1/completions", b'{"prompt": "x", "localspec": {"k": 99}}', {400}),
        ("POST", "/v1/completions", b'{"prompt": "x", "max_tokens": 0}', {400}),
        ("POST", "/infill", b'{"input_prefix": 5}', {400}),
        ("POST", "/infill", b'{"input_suffix": "x"}', {400}),
        ("GET", chat, b"", {405}),
        ("POST", "/v1/nothing", b"{}", {404}),
        ("POST", chat, b'{"prompt": "' + b"a" * (max_body + 10) + b'"}', {413}),
        ("JUNK", "not a path", b"", {400, None}),
    ]


# Malformed protocol lines: (line or object, expected error code, answered with id null).
def stdio_malformed(i: int) -> list:
    gen = lambda **p: {"jsonrpc": "2.0", "id": f"m{i}", "method": "generate", "params": p}  # noqa
    return [
        ('{"jsonrpc": "2.0", "id": 7, "method": ', -32700, True),
        ("[" * 150 + "]" * 150, -32700, True),
        ('[{"jsonrpc": "2.0", "id": 1, "method": "status"}]', -32600, True),
        ({"jsonrpc": "2.0", "id": f"m{i}"}, -32600, False),
        ({"jsonrpc": "2.0", "id": f"m{i}", "method": "completion", "params": {}}, -32601, False),
        (gen(prompt="x", top_p=1.5), -32602, False),
        (gen(prompt="x", max_token=5), -32602, False),
        (gen(prompt="x", messages=[{"role": "user", "content": "x"}]), -32602, False),
        (gen(messages=[{"role": "x", "content": "hi"}], max_tokens=4), -32602, False),
        (gen(prompt="x", stop=[""], max_tokens=4), -32602, False),
        ({"jsonrpc": "2.0", "id": f"m{i}", "method": "complete", "params": {"prefix": "a\0b"}},
         -32602, False),
    ]


# -- servers ---------------------------------------------------------------------------------------
def fresh_home(home: Path) -> Path:
    """A LOCALSPEC_HOME sharing the real one's models and calibrations (links), with no draft
    store, prompt cache or crash reports of its own yet."""
    from localspec.files import localspec_home
    real = localspec_home()
    real.mkdir(parents=True, exist_ok=True)
    for entry in real.iterdir():
        if entry.name not in ("store", "prompt-cache", "crashes"):
            (home / entry.name).symlink_to(entry)
    return home


def _die_with_parent() -> None:
    if sys.platform.startswith("linux"):
        import ctypes
        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL)     # PR_SET_PDEATHSIG


def proc_figures(pid: int) -> dict:
    """VmRSS (kB), threads and open descriptors (sockets apart) of a live process."""
    status = Path(f"/proc/{pid}/status").read_text()
    field = lambda name: int(re.search(rf"^{name}:\s+(\d+)", status, re.M).group(1))  # noqa
    fds = sockets = 0
    for fd in os.listdir(f"/proc/{pid}/fd"):
        fds += 1
        try:
            sockets += os.readlink(f"/proc/{pid}/fd/{fd}").startswith("socket:")
        except OSError:
            pass
    return {"rss_kb": field("VmRSS"), "threads": field("Threads"), "fds": fds,
            "socket_fds": sockets, "other_fds": fds - sockets}


class Server:
    """One `localspec serve` process in its own process group, stderr to a log file."""

    def __init__(self, name: str, argv: list, env: dict, log: Path, stdio: bool):
        self.name, self.argv, self.env, self.log, self.stdio = name, argv, env, log, stdio
        self.proc: Optional[subprocess.Popen] = None
        self.log_offset = 0

    def spawn(self) -> None:
        """Start the process (from the main thread: PR_SET_PDEATHSIG follows the thread that
        forked, so a child forked by a short-lived thread would die with it)."""
        LIVE.add(self)
        with open(self.log, "a") as f:
            f.write("$ " + " ".join(self.argv) + "\n")
            self.log_offset = f.tell()
            self.proc = subprocess.Popen(
                self.argv, stdin=subprocess.PIPE if self.stdio else subprocess.DEVNULL,
                stdout=subprocess.PIPE if self.stdio else f, stderr=f, env=self.env, cwd=ROOT,
                start_new_session=True, preexec_fn=_die_with_parent)

    def log_text(self) -> str:
        return self.log.read_text(errors="replace")

    def kill9(self) -> None:
        os.killpg(self.proc.pid, signal.SIGKILL)
        self.proc.wait(30)


    def start(self, timeout: float) -> None:
        self.spawn()
        self.ready(timeout)


LIVE: set = set()


def stop_all() -> None:
    """At exit, whatever happened: no server outlives the soak."""
    for srv in list(LIVE):
        if srv.proc is not None and srv.proc.poll() is None:
            try:
                os.killpg(srv.proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass


class HttpServer(Server):
    def ready(self, timeout: float) -> None:
        t0 = clock()
        while clock() - t0 < timeout:
            if self.proc.poll() is not None:
                raise SystemExit(f"soak: {self.name} exited ({self.proc.returncode}) before "
                                 f"serving; its log: {self.log}")
            m = re.search(r"serving .* at http://127\.0\.0\.1:(\d+)/v1",
                          self.log_text()[self.log_offset:])
            if m:
                self.port = int(m.group(1))
                self.base = f"http://127.0.0.1:{self.port}"
                return
            time.sleep(0.2)
        raise SystemExit(f"soak: {self.name} did not start within {timeout:.0f} s: {self.log}")


class StdioServer(Server):
    """The protocol over pipes: a reader thread routes responses by id and progress
    notifications to their request; answers with id null (parse errors) go to one queue."""

    def ready(self, timeout: float) -> None:
        import queue
        self.lock, self.pending, self.null_q = threading.Lock(), {}, queue.Queue()
        self.null_lock = threading.Lock()
        self.violations: list = []
        threading.Thread(target=self._read, daemon=True).start()
        init = self.call({"jsonrpc": "2.0", "id": "init", "method": "initialize"}, timeout)
        if "result" not in init:
            raise SystemExit(f"soak: {self.name}: initialize failed: {init}; log: {self.log}")
        self.info = init["result"]

    def _read(self) -> None:
        for raw in self.proc.stdout:
            try:
                msg = json.loads(raw)
            except ValueError:
                self.violations.append(f"stdout line that is not JSON: {raw[:200]!r}")
                continue
            if msg.get("method") == "generate/progress":
                req = self.pending.get(msg["params"]["id"])
                if req is not None:
                    req["pieces"].append(msg["params"]["text"])
                    req["progress"].set()
            elif "id" in msg and msg["id"] is None:
                self.null_q.put(msg)
            elif msg.get("id") in self.pending:
                self.pending[msg["id"]]["answer"] = msg
                self.pending[msg["id"]]["done"].set()
            else:
                self.violations.append(f"an answer to no request: {raw[:200]!r}")
        for req in list(self.pending.values()):    # EOF: nothing more will come
            req["done"].set()

    def send(self, line) -> None:
        data = (line if isinstance(line, str) else json.dumps(line)) + "\n"
        with self.lock:
            self.proc.stdin.write(data.encode())
            self.proc.stdin.flush()

    def open(self, msg: dict) -> dict:
        req = {"pieces": [], "progress": threading.Event(), "done": threading.Event(),
               "answer": None}
        self.pending[msg["id"]] = req
        self.send(msg)
        return req

    def close_request(self, rid) -> None:
        self.pending.pop(rid, None)

    def call(self, msg: dict, timeout: float) -> Optional[dict]:
        req = self.open(msg)
        req["done"].wait(timeout)
        self.close_request(msg["id"])
        return req["answer"]


# -- one request of each kind ----------------------------------------------------------------------
class Outcome(Exception):
    """A request's end that is not a good text: explained or not."""

    def __init__(self, outcome: str, detail: str = "", explained: bool = True):
        super().__init__(detail)
        self.outcome, self.detail, self.explained = outcome, detail, explained


def http_good(srv: HttpServer, client, spec: dict, stream: bool, timeout: float) -> str:
    """The text of one good HTTP request (openai SDK; /infill through httpx)."""
    import httpx
    opts = {k: spec[k] for k in ("max_tokens", "temperature", "seed") if k in spec}
    if spec["mode"] == "fim":
        body = {"input_prefix": spec["prefix"], "input_suffix": spec["suffix"],
                "n_predict": spec["max_tokens"], "stream": stream,
                **{k: spec[k] for k in ("temperature", "seed") if k in spec}}
        if not stream:
            r = httpx.post(srv.base + "/infill", json=body, timeout=timeout)
            if r.status_code != 200:
                raise Outcome("error", f"/infill {r.status_code}: {r.text[:300]}", False)
            return r.json()["content"]
        pieces, final = [], None
        with httpx.stream("POST", srv.base + "/infill", json=body, timeout=timeout) as r:
            if r.status_code != 200:
                raise Outcome("error", f"/infill {r.status_code}: {r.read()[:300]!r}", False)
            for line in r.iter_lines():
                if line.startswith("data: "):
                    event = json.loads(line[6:])
                    if "error" in event:
                        raise Outcome("error", f"/infill in-band error {event}", False)
                    pieces.append(event["content"])
                    final = event if event.get("stop") else final
        if final is None:
            raise Outcome("error", "/infill stream ended without its final event", False)
        return "".join(pieces)
    if spec["mode"] == "chat":
        create, args = client.chat.completions.create, {"messages": spec["messages"]}
    else:
        create, args = client.completions.create, {"prompt": spec["prompt"]}
    reply = create(model=srv.model_id, stream=stream, timeout=timeout, **args, **opts)
    if not stream:
        c = reply.choices[0]
        return c.message.content if spec["mode"] == "chat" else c.text
    pieces, finished = [], False
    for chunk in reply:
        if chunk.choices:
            c = chunk.choices[0]
            pieces.append((c.delta.content if spec["mode"] == "chat" else c.text) or "")
            finished = finished or c.finish_reason is not None
    if not finished:
        raise Outcome("error", "stream ended without a finish_reason", False)
    return "".join(pieces)


def http_cancel_stream(srv: HttpServer, client, spec: dict, rng, timeout: float) -> None:
    """Stream, read 1-3 chunks, close the stream: the server must free the slot quietly."""
    args = ({"messages": spec["messages"]} if spec["mode"] == "chat" else
            {"prompt": spec["prompt"]})
    create = (client.chat.completions.create if spec["mode"] == "chat" else
              client.completions.create)
    stream = create(model=srv.model_id, stream=True, max_tokens=200, timeout=timeout, **args)
    want = rng.randint(1, 3)
    for i, _ in enumerate(stream):
        if i + 1 >= want:
            break
    stream.close()
    raise Outcome("cancelled")


def raw_http(port: int, method: str, path: str, body: bytes, timeout: float,
             close_after: Optional[float] = None) -> tuple:
    """(status or None, body) of one request on a fresh socket; with close_after, the client
    hangs up that many seconds after sending (a client that leaves while queued)."""
    head = (f"{method} {path} HTTP/1.1\r\nHost: 127.0.0.1:{port}\r\nContent-Type: "
            f"application/json\r\nContent-Length: {len(body)}\r\nConnection: close\r\n\r\n")
    with socket.create_connection(("127.0.0.1", port), timeout=timeout) as s:
        s.sendall(head.encode() + body)
        if close_after is not None:
            time.sleep(close_after)
            return None, b""
        data = b""
        while True:
            try:
                part = s.recv(65536)
            except ConnectionResetError:
                break
            if not part:
                break
            data += part
    if not data:
        return None, b""
    status = int(data.split(b" ", 2)[1])
    return status, data.partition(b"\r\n\r\n")[2]


def http_malformed_one(srv: HttpServer, case: tuple, timeout: float) -> None:
    method, path, body, want = case
    try:
        status, answer = raw_http(srv.port, method, path, body, timeout)
    except (ConnectionResetError, BrokenPipeError):
        if None in want or 413 in want:     # a far larger body may be refused mid-send
            raise Outcome("refused")
        raise
    if status is None and None not in want:
        raise ConnectionAbortedError("the connection closed without an answer")  # killed?
    if status not in want:
        raise Outcome("error", f"{method} {path} {body[:80]!r}: {status} (expected {want}) "
                      f"{answer[:200]!r}", False)
    if status is not None and status != 405 and method != "JUNK":
        err = json.loads(answer).get("error", {})
        if not {"message", "type", "param", "code"} <= set(err):
            raise Outcome("error", f"{path}: an error body without OpenAI's shape: "
                          f"{answer[:200]!r}", False)
    raise Outcome("refused")


def http_oversized(srv: HttpServer, client, n_ctx: int, rng, timeout: float) -> None:
    import openai
    try:
        if rng.random() < 0.5:
            client.completions.create(model=srv.model_id, prompt=oversized_prompt(n_ctx),
                                      max_tokens=4, timeout=timeout)
        else:
            client.chat.completions.create(
                model=srv.model_id, max_tokens=4, timeout=timeout, stream=True,
                messages=[{"role": "user", "content": oversized_prompt(n_ctx)}])
    except openai.BadRequestError as e:
        if (e.body or {}).get("code") == "context_length_exceeded":
            raise Outcome("refused")
        raise Outcome("error", f"oversized prompt: {e}", False)
    raise Outcome("error", "a prompt longer than the context was answered", False)


def stdio_params(spec: dict, rid, stream: bool) -> dict:
    p = {k: spec[k] for k in ("max_tokens", "temperature", "seed") if k in spec}
    if spec["mode"] == "fim":
        p.update(prefix=spec["prefix"], suffix=spec["suffix"])
        method = "complete"
    else:
        p.update({"messages": spec["messages"]} if spec["mode"] == "chat" else
                 {"prompt": spec["prompt"]})
        method = "generate"
    return {"jsonrpc": "2.0", "id": rid, "method": method, "params": {**p, "stream": stream}}


def stdio_good(srv: StdioServer, spec: dict, rid, stream: bool, timeout: float) -> str:
    req = srv.open(stdio_params(spec, rid, stream))
    try:
        if not req["done"].wait(timeout):
            raise Outcome("hang", f"{rid}: no answer within {timeout:.0f} s", False)
    finally:
        srv.close_request(rid)
    ans = req["answer"]
    if ans is None:
        raise Outcome("error", f"{rid}: the server exited without answering", False)
    if "error" in ans:
        raise Outcome("error", f"{rid}: {ans['error']}", False)
    res = ans["result"]
    if res["finish_reason"] == "cancelled" and spec["mode"] == "fim":
        raise Outcome("superseded")     # a later `complete` (another client's) cancels it
    if stream and "".join(req["pieces"]) != res["text"]:
        raise Outcome("error", f"{rid}: the streamed pieces are not the result's text", False)
    return res["text"]


def stdio_cancel(srv: StdioServer, spec: dict, rid, queued: bool, timeout: float) -> None:
    """Cancel mid-stream (after the first piece) or at once (usually still queued)."""
    msg = stdio_params(spec, rid, True)
    msg["params"]["max_tokens"] = 200
    req = srv.open(msg)
    if not queued:
        req["progress"].wait(timeout)
    cancel = srv.open({"jsonrpc": "2.0", "id": f"{rid}c", "method": "cancel",
                       "params": {"id": rid}})
    try:
        if not (req["done"].wait(timeout) and cancel["done"].wait(timeout)):
            raise Outcome("hang", f"{rid}: no answer after cancel within {timeout:.0f} s", False)
    finally:
        srv.close_request(rid)
        srv.close_request(f"{rid}c")
    ans, cans = req["answer"], cancel["answer"]
    if ans is None or "error" in ans or cans is None or "error" in cans:
        raise Outcome("error", f"{rid}: cancel answered {cans}, the request {ans}", False)
    # `cancelled: true` with another finish_reason: the last step was under way (protocol.md)
    raise Outcome("cancelled" if ans["result"]["finish_reason"] == "cancelled" else
                  "finished-first")


def stdio_malformed_one(srv: StdioServer, case: tuple, timeout: float) -> None:
    line, code, null_id = case
    if null_id:
        with srv.null_lock:         # answers with id null cannot be routed: one at a time
            srv.send(line)
            try:
                ans = srv.null_q.get(timeout=timeout)
            except Exception:                       # noqa: BLE001 - queue.Empty
                raise Outcome("hang", f"no answer to {line[:60]!r}", False)
    else:
        ans = srv.call(line, timeout)
        if ans is None:
            raise Outcome("hang", f"no answer to {json.dumps(line)[:120]}", False)
    got = ans.get("error", {}).get("code")
    if got == code:
        raise Outcome("refused")
    if "result" in ans and line.get("params", {}) and (
            line["params"].get("stop") == [""] or
            line["params"].get("messages", [{}])[0].get("role") == "x"):
        raise Outcome("known", "accepted (issue 65: the protocol's validator is not HTTP's)")
    raise Outcome("error", f"{json.dumps(line)[:120]}: answered {json.dumps(ans)[:200]} "
                  f"(expected {code})", False)


# -- the run ---------------------------------------------------------------------------------------
HTTP_KINDS = {"chat": 10, "chat_stream": 10, "text": 8, "text_stream": 6, "doc": 4, "seeded": 6,
              "fim": 6, "fim_stream": 3, "huge": 0.7, "cancel_stream": 6, "disconnect_queued": 5,
              "malformed": 20, "oversized": 5}
STDIO_KINDS = {"chat": 10, "chat_stream": 10, "text": 6, "text_stream": 6, "doc": 4,
               "seeded": 6, "fim": 8, "huge": 0.7, "cancel_stream": 6, "cancel_queued": 5,
               "malformed": 20, "oversized": 5}
POOLS = {"chat": "chat", "text": "text", "doc": "doc", "seeded": "seeded", "fim": "fim",
         "huge": "huge", "disconnect_queued": "text"}     # the rest: a chat


class Soak:
    def __init__(self, a, specs: dict, http: HttpServer, stdio: StdioServer):
        self.a, self.specs, self.http, self.stdio = a, specs, http, stdio
        self.lock = threading.Lock()
        self.records: list = []
        self.lone: dict = {}
        self.sent = 0
        self.deadline = clock() + 60 * a.minutes
        self.epoch = 0                                  # the HTTP process's; +1 at the kill
        self.gates = {"http": threading.Event(), "stdio": threading.Event()}
        self.inflight = {"http": 0, "stdio": 0}
        self.idle = threading.Condition(self.lock)
        self.clients: dict = {}                         # thread -> (epoch, openai client)

    # requests --------------------------------------------------------------------------------
    def client(self):
        from openai import OpenAI
        key = threading.get_ident()
        epoch, c = self.clients.get(key, (None, None))
        if epoch != self.epoch:
            c = OpenAI(base_url=self.http.base + "/v1", api_key="soak", max_retries=0,
                       timeout=self.a.timeout)
            self.clients[key] = (self.epoch, c)
        return c

    def pick(self, kind: str, rng) -> str:
        pool = POOLS.get(kind.replace("_stream", ""), "chat")
        return rng.choice([s for s in self.specs if s.startswith(pool)])

    def one(self, surface: str, kind: str, rng, phase: str, spec_id: Optional[str] = None,
            n: int = 0) -> dict:
        """Send one request; record its outcome (and its text, compared later)."""
        import httpx
        import openai
        spec_id = spec_id or self.pick(kind, rng)
        spec = self.specs.get(spec_id)
        if spec["mode"] == "fim" and not self.fim:
            kind = "fim_refused"            # a model without FIM tokens: the documented refusal
        timeout = self.a.timeout * (4 if kind == "huge" else 1)
        rec = {"surface": surface, "kind": kind, "spec": spec_id, "phase": phase,
               "epoch": self.epoch, "t0": round(clock(), 3)}
        with self.lock:
            self.inflight[surface] += 1
        try:
            stream = kind.endswith("_stream") and kind != "cancel_stream"
            rid = f"{phase}{n}-{threading.get_ident() % 10000}-{rng.randrange(10**9)}"
            if surface == "http":
                rec["text"] = self.http_kind(kind, spec, rng, stream, timeout)
            else:
                rec["text"] = self.stdio_kind(kind, spec, rid, rng, stream, timeout)
            rec["outcome"] = "ok"
        except Outcome as e:
            rec["outcome"], rec["explained"] = e.outcome, e.explained
            if e.detail:
                rec["detail"] = e.detail
        except (openai.APITimeoutError, httpx.TimeoutException, socket.timeout) as e:
            rec.update(outcome="hang", explained=False, detail=f"{type(e).__name__}: {e}")
        except (openai.APIError, httpx.HTTPError, OSError, ValueError, KeyError) as e:
            if surface == "http" and (self.epoch != rec["epoch"] or not self.gates["http"].is_set()):
                rec.update(outcome="killed", explained=True)     # in flight at the kill -9
            else:
                rec.update(outcome="error", explained=False, detail=f"{type(e).__name__}: {e}"[:400])
        finally:
            with self.lock:
                self.inflight[surface] -= 1
                self.idle.notify_all()
        rec["s"] = round(clock() - rec["t0"], 3)
        with self.lock:
            self.records.append(rec)
        return rec

    def http_kind(self, kind, spec, rng, stream, timeout):
        import httpx
        srv, c = self.http, self.client()
        if kind == "cancel_stream":
            return http_cancel_stream(srv, c, spec, rng, timeout)
        if kind == "disconnect_queued":
            body = json.dumps({"prompt": spec["prompt"] if "prompt" in spec else "Hello",
                               "max_tokens": 64}).encode()
            raw_http(srv.port, "POST", "/v1/completions", body, timeout,
                     close_after=rng.uniform(0.0, 0.3))
            raise Outcome("disconnected")
        if kind == "malformed":
            return http_malformed_one(srv, rng.choice(http_malformed(self.a.max_body)), timeout)
        if kind == "oversized":
            return http_oversized(srv, c, self.n_ctx, rng, timeout)
        if kind == "fim_refused":
            r = httpx.post(srv.base + "/infill", json={"input_prefix": spec["prefix"]},
                           timeout=timeout)
            if r.status_code == 400 and "error" in r.json():
                raise Outcome("refused")
            raise Outcome("error", f"/infill without FIM tokens: {r.status_code} {r.text[:200]}",
                          False)
        return http_good(srv, c, spec, stream, timeout)

    def stdio_kind(self, kind, spec, rid, rng, stream, timeout):
        srv = self.stdio
        if kind in ("cancel_stream", "cancel_queued"):
            return stdio_cancel(srv, spec, rid, kind == "cancel_queued", timeout)
        if kind == "malformed":
            return stdio_malformed_one(srv, rng.choice(stdio_malformed(rid)), timeout)
        if kind == "fim_refused":
            ans = srv.call({"jsonrpc": "2.0", "id": rid, "method": "complete",
                            "params": {"prefix": spec["prefix"]}}, timeout)
            if ans and ans.get("error", {}).get("code") == -32000:
                raise Outcome("refused")
            if ans and ans.get("result", {}).get("finish_reason") == "cancelled":
                raise Outcome("superseded")     # another client's `complete`, while queued
            raise Outcome("error", f"complete without FIM tokens: {str(ans)[:200]}", False)
        if kind == "oversized":
            ans = srv.call({"jsonrpc": "2.0", "id": rid, "method": "generate", "params": {
                "prompt": oversized_prompt(self.n_ctx), "max_tokens": 4}}, timeout)
            if ans and ans.get("error", {}).get("code") == -32000:
                raise Outcome("refused")
            raise Outcome("error", f"oversized prompt answered {str(ans)[:200]}", False)
        return stdio_good(srv, spec, rid, stream, timeout)

    # the load --------------------------------------------------------------------------------
    def take(self) -> Optional[int]:
        with self.lock:
            if self.sent >= self.a.requests or clock() > self.deadline:
                return None
            self.sent += 1
            return self.sent

    def client_loop(self, surface: str, seed: int) -> None:
        rng = random.Random(seed)
        kinds = HTTP_KINDS if surface == "http" else STDIO_KINDS
        names, weights = list(kinds), list(kinds.values())
        while True:
            while not self.gates[surface].wait(1.0):
                if clock() > self.deadline:
                    return
            n = self.take()
            if n is None:
                return
            kind = rng.choices(names, weights)[0]
            try:
                self.one(surface, kind, rng, "load", n=n)
            except Exception as e:                  # noqa: BLE001 - a bug of the soak itself
                with self.lock:
                    self.records.append({"surface": surface, "kind": kind, "spec": None,
                                         "phase": "load", "outcome": "soak-error",
                                         "explained": False, "detail": repr(e)[:300]})
            if n % 100 == 0:
                say(f"{n} requests sent ({self.summary_line()})")

    def summary_line(self) -> str:
        with self.lock:
            bad = sum(1 for r in self.records if r.get("explained") is False)
        return f"{bad} unexplained so far"

    def pause(self, surfaces=("http", "stdio")) -> None:
        """Close the gates and wait until no request of these surfaces is in flight."""
        for s in surfaces:
            self.gates[s].clear()
        with self.lock:
            self.idle.wait_for(lambda: all(self.inflight[s] == 0 for s in surfaces),
                               timeout=6 * self.a.timeout)
        time.sleep(1.0)     # let keep-alive sockets and finished slots settle

    def resume(self, surfaces=("http", "stdio")) -> None:
        for s in surfaces:
            self.gates[s].set()

    def busy(self, surface: str) -> int:
        import httpx
        if surface == "http":
            return httpx.get(self.http.base + "/health", timeout=30).json()["busy"]
        ans = self.stdio.call({"jsonrpc": "2.0", "id": f"busy-{clock()}", "method": "status"},
                              30)
        return (ans or {}).get("result", {}).get("busy", 0)

    def figures(self, point: str) -> dict:
        return {s.name: {"point": point, "pid": s.proc.pid, **proc_figures(s.proc.pid)}
                for s in (self.http, self.stdio)}

    # phases ----------------------------------------------------------------------------------
    def served_specs(self) -> list:
        """The distinct good requests each server gets alone (FIM only where the model has it)."""
        return [s for s in self.specs if self.fim or self.specs[s]["mode"] != "fim"]

    def lone_runs(self, surface: str) -> None:
        """Each distinct good request alone, one at a time: the texts every later run must
        give."""
        rng = random.Random(0)
        for sid in self.served_specs():
            rec = self.one(surface, "lone", rng, "lone", spec_id=sid)
            if rec["outcome"] != "ok":
                say(f"the lone run of {sid} on {surface} failed: {rec}")
                return
            self.lone[(surface, sid)] = rec["text"]

    def rewarm(self, surface: str, phase: str) -> None:
        """A restarted server warmed as the first was before its baseline: every distinct good
        request once, one at a time (their texts are checked against the lone runs like any
        later run's). Without it the restart's baseline came after one burst only, and the
        RAM prompt cache and arenas the lone runs fill showed as growth (+7.13%, docs/soak.md)."""
        rng = random.Random(0)
        for sid in self.served_specs():
            self.one(surface, "lone", rng, phase, spec_id=sid)

    def burst(self, surface: str, n: int, phase: str, slots: int = 0) -> None:
        """n good requests at once (every slot busy, some queued): warms what only
        concurrency allocates (per-thread arenas). With `slots`, first that many requests
        that run to the end of the context at once: llama.cpp's KV buffer is resident only
        where it was written, so each slot's is filled once before the baseline (else its
        first long request shows as growth)."""
        kinds = ["chat", "chat_stream", "text", "text_stream", "fim", "seeded", "doc"]
        fill = [threading.Thread(target=self.one, args=(surface, "huge", random.Random(i),
                                                        phase, "huge1")) for i in range(slots)]
        threads = fill + [threading.Thread(target=self.one, args=(
            surface, kinds[i % len(kinds)], random.Random(i), phase)) for i in range(n)]
        for t in fill:
            t.start()
        t0 = clock()                # the fills on every slot first, then the rest queue
        while fill and all(t.is_alive() for t in fill) and self.busy(surface) < slots \
                and clock() - t0 < 60:
            time.sleep(0.1)
        for t in threads[len(fill):]:
            t.start()
        for t in threads:
            t.join()


def check_files(home: Path) -> dict:
    """Every prompt-cache entry and draft-store file under `home`, read and checked by the
    servers' own readers (magic, version, header, size, checksum; the store's version and ids)."""
    from localspec.files.container import Rejected, read_container
    from localspec.speculative.store_file import SUFFIX, read_store
    out = {"cache_files": 0, "cache_tokens": 0, "store_tokens": 0, "bad": [],
           "rejected": [str(p.relative_to(home)) for p in home.rglob("*.rejected")],
           "temp_files": [str(p.relative_to(home)) for p in home.rglob(".*.tmp")]}
    for path in sorted((home / "prompt-cache").rglob("*.lskv")):
        try:
            header, _, _ = read_container(path)
        except FileNotFoundError:
            continue                                # evicted meanwhile by the other server
        except Rejected as e:
            out["bad"].append(f"{path.relative_to(home)}: {e}")
            continue
        out["cache_files"] += 1
        out["cache_tokens"] += header["n_tokens"]
    for path in sorted((home / "store").glob("*" + SUFFIX)):
        try:
            _, tokens = read_store(path, None)
            out["store_tokens"] += int(tokens.size)
        except (Rejected, FileNotFoundError) as e:
            out["bad"].append(f"{path.relative_to(home)}: {e}")
    return out


def kill_and_restart(soak: Soak, a, home: Path) -> dict:
    """SIGKILL the HTTP server under load, check its files, start it again on the same home
    and port, and check that it loads them and restores the document from the disk cache."""
    import httpx
    http = soak.http
    # Leave the document's state on disk: doc0 read alone, then one short prompt on every
    # slot at once, so that the slot holding doc0 saves its rows before reading another prompt
    # (a slot's live state is saved to disk only then, or at a clean exit; never by kill -9).
    soak.one("http", "doc", random.Random(1), "restart", spec_id="doc0")
    others = [threading.Thread(target=soak.one, args=("http", "text", random.Random(i),
                                                       "restart", f"text{i}")) for i in range(4)]
    for t in others:
        t.start()
    for t in others:
        t.join()
    # The load runs again; kill it mid-work: a few more requests sent and HTTP ones in flight.
    soak.resume(["http"])
    target, t0 = soak.sent + max(4, a.requests // 40), clock()
    while clock() - t0 < a.timeout and not (soak.sent >= target and soak.inflight["http"] > 1):
        time.sleep(0.05)
    before = check_files(home)
    with soak.lock:
        busy = soak.inflight["http"]
        soak.gates["http"].clear()
        soak.epoch += 1
    t0 = clock()
    http.kill9()
    say(f"killed the HTTP server (SIGKILL, {busy} requests in flight); restarting it")
    after_kill = check_files(home)
    http.argv[http.argv.index("--http") + 1] = f"127.0.0.1:{http.port}"
    http.start(a.start_timeout)
    soak.models(http)
    restart_s = clock() - t0
    answer = httpx.post(http.base + "/v1/completions", timeout=a.timeout, json={
        "prompt": soak.specs["doc1"]["prompt"], "max_tokens": soak.specs["doc1"]["max_tokens"]})
    body = answer.json()
    stats = body.get("localspec", {})
    text = body["choices"][0]["text"] if answer.status_code == 200 else None
    return {"in_flight_at_kill": busy, "restart_s": round(restart_s, 1),
            "files_before_kill": before, "files_after_kill": after_kill,
            "first_answer_status": answer.status_code,
            "doc_reused_from_disk": stats.get("reused_by_source", {}).get("disk", 0),
            "doc_reuse": {k: stats.get(k) for k in ("prompt_tokens", "reused_tokens",
                                                     "reused_by_source", "prefill_tokens")},
            "doc_text_equal": text == soak.lone[("http", "doc1")],
            "store_not_shrunk": after_kill["store_tokens"] >= before["store_tokens"]}


def stderr_findings(srv: Server) -> list:
    return [line for line in srv.log_text().splitlines() if STDERR_BAD.search(line)]


def growth(first: dict, last: dict) -> dict:
    return {"rss_pct": round(100.0 * (last["rss_kb"] - first["rss_kb"]) / first["rss_kb"], 2),
            "other_fds": last["other_fds"] - first["other_fds"],
            "socket_fds": last["socket_fds"] - first["socket_fds"],
            "threads": last["threads"] - first["threads"]}


def run(a) -> dict:
    import httpx
    work = Path(tempfile.mkdtemp(prefix="localspec-soak-"))
    (work / "home").mkdir()
    home = fresh_home(work / "home")
    # Each server its own home unless --shared-home (one home for both: their prompt caches
    # then share a folder; docs/soak.md, finding 3).
    stdio_home = home
    if not a.shared_home:
        (work / "stdio-home").mkdir()
        stdio_home = fresh_home(work / "stdio-home")
    logs = Path(a.log_dir) if a.log_dir else work
    logs.mkdir(parents=True, exist_ok=True)
    env = {**os.environ, "LOCALSPEC_HOME": str(home)}
    common = ["-m", a.model, "--threads", str(a.threads), "--learn"]
    http = HttpServer("http", [sys.executable, "-m", "localspec", "serve", "--http",
                               "127.0.0.1:0", "--parallel", "4", "--ctx", str(4 * a.slot_ctx),
                               "--max-body", str(a.max_body), "--queue", "64", *common],
                      env, logs / "http.log", stdio=False)
    stdio = StdioServer("stdio", [sys.executable, "-m", "localspec", "serve", "--stdio",
                                  "--parallel", "2", "--ctx", str(2 * a.slot_ctx), *common],
                        {**env, "LOCALSPEC_HOME": str(stdio_home)}, logs / "stdio.log",
                        stdio=True)
    say(f"home {home}; logs {logs}; starting both servers on {a.model}")
    atexit.register(stop_all)
    http.spawn()
    stdio.spawn()
    http.ready(a.start_timeout)
    stdio.ready(a.start_timeout)
    soak = Soak(a, build_specs(a.max_tokens, a.slot_ctx), http, stdio)
    soak.models = lambda srv: setattr(srv, "model_id", httpx.get(
        srv.base + "/v1/models", timeout=30).json()["data"][0]["id"])
    soak.models(http)
    soak.n_ctx = stdio.info["model"]["n_ctx"]
    soak.resume()
    report = {"model": a.model, "requests_asked": a.requests, "slot_ctx": soak.n_ctx,
              "fim": stdio.info["capabilities"]["complete"]}
    soak.fim = report["fim"]
    say(f"lone runs: {len(soak.specs)} distinct requests on each server, one at a time")
    lone = [threading.Thread(target=soak.lone_runs, args=(s,)) for s in ("http", "stdio")]
    for t in lone:
        t.start()
    for t in lone:
        t.join()
    if len(soak.lone) != 2 * len(soak.served_specs()):
        raise SystemExit("soak: the lone runs did not finish; see the messages above")
    say("warm-up bursts")
    warm = [threading.Thread(target=soak.burst, args=(surface, 3 * slots, "warm-up", slots))
            for surface, slots in (("http", 4), ("stdio", 2))]
    for t in warm:
        t.start()
    for t in warm:
        t.join()
    soak.pause()
    points = [soak.figures("start")]
    soak.resume()
    say(f"load: {a.requests} requests from {a.http_clients} HTTP and {a.stdio_clients} stdio "
        f"clients, at most {a.minutes:g} min")
    t_load = clock()
    clients = ([threading.Thread(target=soak.client_loop, args=("http", 100 + i), daemon=True)
                for i in range(a.http_clients)] +
               [threading.Thread(target=soak.client_loop, args=("stdio", 200 + i), daemon=True)
                for i in range(a.stdio_clients)])
    for t in clients:
        t.start()
    while soak.sent < a.requests // 2 and clock() < soak.deadline - 30 * a.minutes:
        time.sleep(0.5)
    soak.pause()
    points.append(soak.figures("middle"))
    soak.resume(["stdio"])
    report["restart"] = kill_and_restart(soak, a, home)
    soak.rewarm("http", "warm-up-2")
    soak.burst("http", 12, "warm-up-2", 4)
    soak.pause()
    points.append({"http": soak.figures("restart")["http"]})
    soak.resume()
    for t in clients:
        t.join(max(0.0, soak.deadline - clock()) + 6 * a.timeout)
    load_s = clock() - t_load
    soak.pause()
    points.append(soak.figures("end"))
    health = httpx.get(http.base + "/health", timeout=30).json()
    status = stdio.call({"jsonrpc": "2.0", "id": "status-end", "method": "status"}, 30)
    report["idle_at_end"] = {"http": {k: health.get(k) for k in ("busy", "queued")},
                             "stdio": {k: (status or {}).get("result", {}).get(k)
                                       for k in ("busy", "queued")}}
    say("stopping: shutdown over stdio, SIGTERM to the HTTP server")
    shut = stdio.call({"jsonrpc": "2.0", "id": "bye", "method": "shutdown"}, 60)
    os.killpg(http.proc.pid, signal.SIGTERM)
    exits = {}
    for srv in (stdio, http):
        try:
            exits[srv.name] = srv.proc.wait(60)
        except subprocess.TimeoutExpired:
            exits[srv.name] = "hung at exit"
            os.killpg(srv.proc.pid, signal.SIGKILL)
    report.update(load_s=round(load_s, 1), sent=soak.sent, exits=exits,
                  shutdown_answered=bool(shut and "result" in shut),
                  files_at_end=check_files(home), figures=points, shared_home=a.shared_home,
                  stdio_files_at_end=check_files(stdio_home),
                  stderr={s.name: stderr_findings(s) for s in (http, stdio)},
                  protocol_violations=stdio.violations, lone_texts=len(soak.lone))
    report.update(tally(soak))
    if not a.keep and not a.log_dir:
        shutil.rmtree(work, ignore_errors=True)
    else:
        report["work"] = str(work)
    return report


def tally(soak: Soak) -> dict:
    """Requests by surface, kind and outcome; unexplained ones; texts against the lone runs."""
    by, unexplained, mismatches, compared = {}, [], [], 0
    for r in soak.records:
        if r["phase"] == "load":
            key = f"{r['surface']} {r['kind']}"
            by.setdefault(key, {}).setdefault(r["outcome"], 0)
            by[key][r["outcome"]] += 1
        if r.get("explained") is False:
            unexplained.append({k: r.get(k) for k in ("surface", "kind", "spec", "phase",
                                                        "outcome", "detail")})
        if r["outcome"] == "ok" and r["phase"] != "lone":
            compared += 1
            want = soak.lone[(r["surface"], r["spec"])]
            if r["text"] != want:
                at = next((i for i, (x, y) in enumerate(zip(want, r["text"])) if x != y),
                          min(len(want), len(r["text"])))
                mismatches.append({**{k: r[k] for k in ("surface", "kind", "spec", "phase",
                                                         "epoch", "t0", "s")},
                                   "lone_chars": len(want), "got_chars": len(r["text"]),
                                   "first_diff": at, "lone": want[max(0, at - 40):at + 80],
                                   "got": r["text"][max(0, at - 40):at + 80]})
    known = [r.get("detail") for r in soak.records if r["outcome"] == "known"]
    return {"by_kind": dict(sorted(by.items())), "unexplained": unexplained,
            "texts_compared": compared, "texts_equal": compared - len(mismatches),
            "mismatches": mismatches, "known_issues": sorted(set(known))}


def verdict(rep: dict) -> list:
    """The targets missed (empty: all held)."""
    missed = []
    if rep["unexplained"]:
        missed.append(f"{len(rep['unexplained'])} unexplained request outcomes")
    for name, lines in rep["stderr"].items():
        if lines:
            missed.append(f"{len(lines)} bad lines on the {name} server's stderr")
    if rep["protocol_violations"]:
        missed.append(f"{len(rep['protocol_violations'])} protocol violations on stdout")
    if rep["mismatches"] or not rep["texts_compared"]:
        missed.append(f"texts equal {rep['texts_equal']} of {rep['texts_compared']}")
    pts = {p_name: pt for pt in rep["figures"] for p_name in [pt[next(iter(pt))]["point"]]}
    pairs = [("http", "start", "middle"), ("http", "restart", "end"), ("stdio", "start", "end")]
    rep["growth"] = {}
    for srv, first, last in pairs:
        g = growth(pts[first][srv], pts[last][srv])
        rep["growth"][f"{srv} {first}->{last}"] = g
        if g["rss_pct"] >= rep["rss_target_pct"]:
            missed.append(f"{srv} RSS grew {g['rss_pct']}% ({first} -> {last})")
        if g["other_fds"] > 0:
            missed.append(f"{srv} holds {g['other_fds']} more non-socket descriptors ({first} -> "
                          f"{last})")
    r = rep["restart"]
    for what, ok in [("the restarted server answered", r["first_answer_status"] == 200),
                     ("cache and store files valid after the kill",
                      not r["files_after_kill"]["bad"] and not rep["files_at_end"]["bad"]
                      and not rep["stdio_files_at_end"]["bad"]),
                     ("no file refused", not rep["files_at_end"]["rejected"] and
                      not rep["stdio_files_at_end"]["rejected"]),
                     ("prompt-cache files on disk", r["files_after_kill"]["cache_files"] > 0),
                     ("draft store on disk", r["files_after_kill"]["store_tokens"] > 0),
                     ("the document restored from the disk cache", r["doc_reused_from_disk"] > 0),
                     ("its text equal to the lone run", r["doc_text_equal"]),
                     ("the store not shrunk by the kill", r["store_not_shrunk"])]:
        if not ok:
            missed.append(f"restart: not {what}")
    if rep["sent"] < rep["requests_asked"]:
        missed.append(f"only {rep['sent']} of {rep['requests_asked']} requests sent within "
                      f"the wall-clock limit")
    if rep["exits"].get("stdio") != 0 or rep["exits"].get("http") not in (0, 130, 143, -15):
        missed.append(f"exit statuses {rep['exits']}")
    if any(v not in (0, None) for s in rep["idle_at_end"].values() for v in s.values()):
        missed.append(f"not idle at the end: {rep['idle_at_end']}")
    return missed


def print_report(rep: dict, missed: list) -> None:
    out = [f"# Soak: {rep['model']}, {rep['sent']} of {rep['requests_asked']} requests in "
           f"{rep['load_s']:.0f} s (slots of {rep['slot_ctx']} tokens)", "",
           "| surface kind | outcomes |", "|---|---|"]
    for key, outcomes in rep["by_kind"].items():
        out.append(f"| {key} | " + ", ".join(f"{k} {v}" for k, v in sorted(outcomes.items()))
                   + " |")
    out += ["", f"Texts equal to their lone run: {rep['texts_equal']} of {rep['texts_compared']}"
            f" ({len(rep['mismatches'])} differ; {rep['lone_texts']} lone texts)"]
    for m in rep["mismatches"][:10]:
        out.append(f"  DIFFERS {m['surface']} {m['kind']} {m['spec']} ({m['phase']}): "
                   f"{m['lone_chars']} / {m['got_chars']} chars, from char {m['first_diff']}: "
                   f"lone ...{m['lone']!r} got ...{m['got']!r}")
    out += ["", "| server | point | pid | RSS MB | threads | fds (sockets) |", "|---|---|---|---|---|---|"]
    for pt in rep["figures"]:
        for name, f in pt.items():
            out.append(f"| {name} | {f['point']} | {f['pid']} | {f['rss_kb'] / 1024:.1f} | "
                       f"{f['threads']} | {f['fds']} ({f['socket_fds']}) |")
    out.append("")
    for pair, g in rep["growth"].items():
        out.append(f"Growth {pair}: RSS {g['rss_pct']:+.2f}% (target < {rep['rss_target_pct']}%),"
                   f" non-socket fds {g['other_fds']:+d}, sockets {g['socket_fds']:+d}, "
                   f"threads {g['threads']:+d}")
    r = rep["restart"]
    out += ["", f"kill -9 with {r['in_flight_at_kill']} HTTP requests in flight; serving again "
            f"after {r['restart_s']} s; first answer {r['first_answer_status']}; document "
            f"restored from disk: {r['doc_reused_from_disk']} tokens, text equal: "
            f"{r['doc_text_equal']}",
            f"Files before the kill: {json.dumps(r['files_before_kill'])}",
            f"Files after the kill:  {json.dumps(r['files_after_kill'])}",
            f"Files at the end:      {json.dumps(rep['files_at_end'])}",
            f"stdio's files at the end{' (the same home)' if rep['shared_home'] else ''}: "
            f"{json.dumps(rep['stdio_files_at_end'])}",
            f"Idle at the end: {rep['idle_at_end']}; exits {rep['exits']}"]
    for k in rep["known_issues"]:
        out.append(f"Known issue seen: {k}")
    for u in rep["unexplained"][:30]:
        out.append(f"UNEXPLAINED {json.dumps(u)[:400]}")
    for name, lines in rep["stderr"].items():
        for line in lines[:10]:
            out.append(f"STDERR {name}: {line[:300]}")
    for v in rep["protocol_violations"][:10]:
        out.append(f"PROTOCOL {v}")
    out += ["", "All targets held." if not missed else "Targets missed:"]
    out += [f"  - {m}" for m in missed]
    print("\n".join(out), flush=True)


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], epilog=__doc__.split(
        "\n", 2)[2], formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("-m", "--model", default="smollm2-135m",
                   help="catalog name or .gguf path (default: smollm2-135m, already pulled)")
    p.add_argument("--requests", type=int, default=2000,
                   help="requests of the load, both servers together (default 2000)")
    p.add_argument("--minutes", type=float, default=45.0,
                   help="wall-clock limit of the load; requests not sent by then are a missed "
                        "target (default 45)")
    p.add_argument("--http-clients", type=int, default=6, help="HTTP client threads (6)")
    p.add_argument("--stdio-clients", type=int, default=3, help="stdio client threads (3)")
    p.add_argument("--slot-ctx", type=int, default=512,
                   help="context of one slot, both servers (--ctx is this times the slots)")
    p.add_argument("--max-tokens", type=int, default=8, help="max_tokens of a good request")
    p.add_argument("--threads", type=int, default=os.cpu_count() or 2,
                   help="--threads of each server")
    p.add_argument("--timeout", type=float, default=240.0,
                   help="seconds a request may take before it counts as a hang (x4 for huge)")
    p.add_argument("--start-timeout", type=float, default=600.0,
                   help="seconds a server may take to start (a first calibration included)")
    p.add_argument("--max-body", type=int, default=65536, help="the HTTP server's --max-body")
    p.add_argument("--rss-target", type=float, default=5.0, help="RSS growth target, percent")
    p.add_argument("--json", metavar="FILE", help="write every figure here")
    p.add_argument("--log-dir", help="keep the servers' logs here")
    p.add_argument("--keep", action="store_true", help="keep the run's home and logs")
    p.add_argument("--shared-home", action="store_true",
                   help="both servers on one LOCALSPEC_HOME: one draft store file and one "
                        "prompt-cache folder written by two processes (default: a home each)")
    return p.parse_args(argv)


def main(argv=None) -> int:
    a = parse_args(argv)
    rep = run(a)
    rep["rss_target_pct"] = a.rss_target
    missed = verdict(rep)
    rep["missed"] = missed
    print_report(rep, missed)
    if a.json:
        Path(a.json).write_text(json.dumps(rep, indent=1, default=str) + "\n")
    return 1 if missed else 0


if __name__ == "__main__":
    sys.exit(main())

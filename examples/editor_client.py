"""A minimal editor-side client for `localspec serve --stdio`: the pattern to copy into a plugin.

It starts the server as a subprocess, initializes, streams a completion that uses the open file as
the n-gram proposer's document, cancels a long generation, and shuts down. Spec: docs/protocol.md.

    python examples/editor_client.py -m smollm2-135m
    python examples/editor_client.py -m path/to/model.gguf --threads 4

Arguments are passed to `localspec serve --stdio` unchanged.
"""

from __future__ import annotations

import itertools
import json
import queue
import subprocess
import sys
import threading


class LocalspecClient:
    """JSON-RPC over the server's pipes. One reader thread routes each stdout line: responses to
    the queue of the request that asked, `generate/progress` notifications to the same queue."""

    def __init__(self, *server_args: str):
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "localspec", "serve", "--stdio", *server_args],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=None,  # server logs: our stderr
            text=True, encoding="utf-8", bufsize=1)
        self._ids = itertools.count(1)
        self._waiting: dict[int, queue.Queue] = {}
        self._lock = threading.Lock()
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        for line in self.proc.stdout:
            msg = json.loads(line)
            rid = msg["params"]["id"] if msg.get("method") == "generate/progress" else msg.get("id")
            with self._lock:
                q = self._waiting.get(rid)
            if q is not None:
                q.put(msg)
        with self._lock:                           # server gone: wake everyone
            for q in self._waiting.values():
                q.put(None)

    def start(self, method: str, params: dict | None = None) -> tuple[int, queue.Queue]:
        """Send a request; its progress notifications and response arrive on the returned queue."""
        rid, q = next(self._ids), queue.Queue()
        with self._lock:
            self._waiting[rid] = q
        self.proc.stdin.write(json.dumps({"jsonrpc": "2.0", "id": rid, "method": method,
                                          "params": params or {}}) + "\n")
        self.proc.stdin.flush()
        return rid, q

    def wait(self, rid: int, q: queue.Queue, on_text=None, timeout: float = 300.0) -> dict:
        """Block until the response to `rid`, calling on_text(piece) for each streamed piece."""
        while True:
            msg = q.get(timeout=timeout)
            if msg is None:
                raise RuntimeError("the server exited")
            if "method" in msg:
                if on_text:
                    on_text(msg["params"]["text"])
                continue
            with self._lock:
                del self._waiting[rid]
            if "error" in msg:
                raise RuntimeError(f"{msg['error']['message']} ({msg['error']['code']})")
            return msg["result"]

    def call(self, method: str, params: dict | None = None) -> dict:
        return self.wait(*self.start(method, params))

    def close(self) -> int:
        self.call("shutdown")
        self.proc.stdin.close()
        return self.proc.wait(timeout=30)


def edit_messages(document: str, instruction: str, system: str = "") -> list:
    """A chat prompt built stable-first: system text, then the document, then the instruction.
    Every request about the same document then shares the document's KV rows (the server's
    prompt cache restores them), so only the instruction is read again."""
    head = [{"role": "system", "content": system}] if system else []
    return head + [{"role": "user", "content": f"{document}\n\n{instruction}"}]


def main() -> None:
    client = LocalspecClient(*sys.argv[1:])
    info = client.call("initialize", {"client": {"name": "editor_client.py"}})
    print(f"model: {info['model']['description']} (n_ctx {info['model']['n_ctx']}), "
          f"proposers: {info['capabilities']['proposers']}", file=sys.stderr)

    # 1. A streamed edit: the open file is the document, so copied spans are drafted for free.
    buffer = "def area(width, height):\n    return width * height\n\n\nprint(area(3, 4))\n"
    messages = edit_messages(buffer, "Rename width to w and height to h in the code above.")
    params = {"messages": messages, "max_tokens": 120, "document": buffer, "stop": ["\n\n\n"]}
    if not info["model"]["chat_template"]:
        params = {"prompt": buffer + "# the same function with short names:\n", "max_tokens": 120,
                  "document": buffer}
    result = client.wait(*client.start("generate", params),
                         on_text=lambda piece: print(piece, end="", flush=True))
    s = result["stats"]
    print(f"\n[{result['finish_reason']}: {s['generated_tokens']} tokens, "
          f"{s['decode_tokens_per_s']} tok/s, accepted {s['accepted']}/{s['drafted']}, "
          f"prompt {s['prompt_tokens']} ({s['reused_tokens']} reused)]", file=sys.stderr)

    # 2. The user typed again: cancel the in-flight request. Its response still comes, with
    #    finish_reason "cancelled" and the text so far.
    rid, q = client.start("generate", {"prompt": "Once upon a time", "max_tokens": 100000})
    first = q.get(timeout=300)                     # wait until it is really generating
    if first is not None and "method" in first:
        print("cancel ->", client.call("cancel", {"id": rid}), file=sys.stderr)
    else:
        q.put(first)                               # it already ended; let wait() read it
    result = client.wait(rid, q)
    print(f"[{result['finish_reason']} after {result['stats']['generated_tokens']} tokens]",
          file=sys.stderr)

    print(f"server exited with {client.close()}", file=sys.stderr)


if __name__ == "__main__":
    main()

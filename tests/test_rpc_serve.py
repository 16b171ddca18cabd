"""`serve --stdio --rpc` and `serve --http --rpc` outlive their RPC server: the request that was
running when it died gets an error, requests while it is gone get an error, and once a server
runs again at that address the next request is served, by the same server process.
Real processes throughout: `localspec rpc-server`, the servers, the openai client."""

from __future__ import annotations

import os
import signal
import time

import openai
import pytest

from test_http import KEY, LONG_PROMPT, Server as HttpServer
from test_rpc import free_port, start_server
from test_serve import Server as StdioServer

PROMPT = "hello world"


@pytest.fixture
def rpc(tmp_path):
    """A port with an RPC server on it; .kill() and .start() it again at the same port."""
    class Rpc:
        port = free_port()
        proc = log = None

        def start(self):
            self.proc, self.log = start_server(tmp_path, self.port)

        def kill(self):
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait()
            self.log.close()

    r = Rpc()
    r.start()
    yield r
    if r.proc.poll() is None:
        r.kill()


def test_stdio_server_answers_with_errors_and_recovers(tiny_path, tmp_path, rpc):
    srv = StdioServer(tiny_path, tmp_path, "--rpc", f"127.0.0.1:{rpc.port}", "--ctx", "8192")
    try:
        done = srv.call("generate", {"prompt": PROMPT, "max_tokens": 8})
        assert "result" in done, done
        text = done["result"]["text"]
        running = srv.send("generate", {"prompt": LONG_PROMPT, "max_tokens": 100000,
                                        "stream": True})
        assert srv.recv()["method"] == "generate/progress"      # it runs, layers remote
        rpc.kill()
        lost, _ = srv.response(running)
        assert lost["error"]["code"] == -32003 and f"127.0.0.1:{rpc.port}" in \
            lost["error"]["message"], lost
        gone = srv.call("generate", {"prompt": PROMPT, "max_tokens": 8})  # nothing there now
        assert gone["error"]["code"] == -32003 and "cannot reach" in gone["error"]["message"]
        assert srv.proc.poll() is None
        rpc.start()
        again = srv.call("generate", {"prompt": PROMPT, "max_tokens": 8})
        assert again["result"]["text"] == text, again
        assert srv.call("shutdown") == {"jsonrpc": "2.0", "id": srv.next_id, "result": None}
        assert srv.proc.wait(timeout=30) == 0
    finally:
        if srv.proc.poll() is None:
            srv.proc.kill()
    assert "Traceback" not in srv.err(), srv.err()


def test_a_deeply_nested_line_is_answered_and_the_supervisor_goes_on(tiny_path, tmp_path, rpc):
    """The supervisor reads each line for its id: 5000 '[' ended it with exit 70 (issue 43)."""
    srv = StdioServer(tiny_path, tmp_path, "--rpc", f"127.0.0.1:{rpc.port}")
    try:
        srv.send_raw(b"[" * 5000 + b"\n")
        msg = srv.recv()
        assert msg["id"] is None and msg["error"]["code"] == -32700, msg
        assert "result" in srv.call("generate", {"prompt": PROMPT, "max_tokens": 4})
        assert "Traceback" not in srv.err(), srv.err()
    finally:
        assert srv.close() == 0


def test_stdio_server_that_never_served_ends_with_the_error(tiny_path, tmp_path):
    srv = StdioServer(tiny_path, tmp_path, "--rpc", f"127.0.0.1:{free_port()}")
    srv.send("generate", {"prompt": PROMPT})
    assert srv.proc.wait(timeout=60) == 1
    err = srv.err()
    assert err.count("error:") == 1 and "cannot reach RPC server" in err, err


def test_http_server_answers_with_errors_and_recovers(tiny_path, tmp_path, rpc):
    srv = HttpServer(tiny_path, tmp_path, "--rpc", f"127.0.0.1:{rpc.port}", "--ctx", "8192",
                     "--api-key", KEY)
    try:
        client = srv.client()
        first = client.completions.create(model=tiny_path.stem, prompt=PROMPT, max_tokens=8,
                                          temperature=0)
        stream = client.completions.create(model=tiny_path.stem, prompt=LONG_PROMPT, max_tokens=100000,
                                           temperature=0, stream=True)
        pieces = iter(stream)
        next(pieces)                                 # it runs, layers remote
        rpc.kill()
        with pytest.raises(openai.APIError, match=f"127.0.0.1:{rpc.port}"):
            for _ in pieces:
                pass
        status, body, headers = srv.post("/v1/completions", {"prompt": PROMPT, "max_tokens": 8})
        assert status == 503 and body["error"]["code"] == "backend_unavailable", body
        assert int(headers["Retry-After"]) >= 1
        rpc.start()
        deadline = time.monotonic() + 120            # a hang guard: backoff is at most 30 s
        while True:
            status, body, _ = srv.post("/v1/completions", {"prompt": PROMPT, "max_tokens": 8,
                                                           "temperature": 0})
            if status == 200 or time.monotonic() > deadline:
                break
            time.sleep(0.5)
        assert status == 200 and body["choices"][0]["text"] == first.choices[0].text, body
        assert srv.proc.poll() is None
    finally:
        code = srv.close()
    assert code in (0, 130), srv.err()
    assert "Traceback" not in srv.err(), srv.err()

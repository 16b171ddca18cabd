"""`localspec serve --http` as clients use it: the real server as a subprocess on loopback (tiny
model), driven by the real `openai` client and by raw HTTP. Reads time out instead of hanging.
"""

from __future__ import annotations

import http.client
import json
import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time

import httpx
import openai
import pytest

from test_serve import Server as StdioServer

KEY = "test-key-123"
LONG_PROMPT = "prompt 54: eeeee"      # tiny-model greedy run that goes on for thousands of tokens
HERE = os.path.dirname(__file__)

# Starts the server with a failure injected into every generation whose prompt says RAISE, to
# check that an exception inside a generation is a 500 and the server goes on serving.
FAULTY = r"""
import sys
from localspec.speculative import engine
from localspec.cli import main
real = engine.Engine.generate
def generate(self, prompt, *args, **kw):
    gen = real(self, prompt, *args, **kw)
    if b"RAISE" in b"".join(self.model.token_piece(t) for t in prompt):
        inner = gen._run
        def failing():
            try:
                yield next(inner)
            finally:
                inner.close()
            raise RuntimeError("injected failure")
        gen._run = failing()
    return gen
engine.Engine.generate = generate
sys.argv[0] = "localspec"
main()
"""


class Server:
    """The server process, its port (read from its stderr) and its stderr kept in a file."""

    def __init__(self, model, home, *args, code=None):
        self.log = open(home / f"stderr-{time.monotonic_ns()}.txt", "w+b")
        env = {**os.environ, "LOCALSPEC_HOME": str(home)}
        env.pop("LOCALSPEC_API_KEY", None)
        head = [sys.executable, "-c", code] if code else [sys.executable, "-m", "localspec"]
        self.proc = subprocess.Popen(
            head + ["serve", "--http", "127.0.0.1:0", "-m", str(model), "--threads", "1", *args],
            stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=env,
            # a runner started in the background of a script ignores SIGINT, and so would the
            # child: give it the default disposition, as a terminal's Ctrl-C finds it
            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
        self.port = None
        ready = threading.Event()
        threading.Thread(target=self._pump, args=(ready,), daemon=True).start()
        if not ready.wait(120) or self.port is None:
            self.proc.kill()
            raise AssertionError(f"server did not start; stderr: {self.err()}")
        self.base = f"http://127.0.0.1:{self.port}"

    def _pump(self, ready):
        for line in self.proc.stderr:
            self.log.write(line)
            self.log.flush()
            m = re.search(rb"serving .* at http://127\.0\.0\.1:(\d+)/v1", line)
            if m:
                self.port = int(m.group(1))
                ready.set()
        ready.set()

    def client(self, key=KEY, **kw) -> openai.OpenAI:
        return openai.OpenAI(base_url=self.base + "/v1", api_key=key, max_retries=0,
                             timeout=120, **kw)

    def post(self, path, body, key=KEY, headers=None, timeout=60):
        """Raw POST: (status, parsed JSON body, headers). `body` bytes are sent as they are."""
        data = body if isinstance(body, bytes) else json.dumps(body).encode()
        conn = http.client.HTTPConnection("127.0.0.1", self.port, timeout=timeout)
        try:
            hdrs = {"Content-Type": "application/json", **(headers or {})}
            if key:
                hdrs["Authorization"] = f"Bearer {key}"
            conn.request("POST", path, data, hdrs)
            resp = conn.getresponse()
            return resp.status, json.loads(resp.read()), resp.headers
        finally:
            conn.close()

    def open_stream(self, body, key=KEY, wait_for_data=True):
        """A raw socket carrying a streaming POST; with wait_for_data, returns once five SSE
        events have arrived (the generation is running)."""
        data = json.dumps({**body, "stream": True}).encode()
        sock = socket.create_connection(("127.0.0.1", self.port), timeout=60)
        sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: localhost\r\n"
                     b"Content-Type: application/json\r\nAuthorization: Bearer " +
                     key.encode() + b"\r\nContent-Length: " + str(len(data)).encode() +
                     b"\r\n\r\n" + data)
        seen = b""
        while wait_for_data and seen.count(b"data: ") < 5:
            got = sock.recv(4096)
            assert got, seen
            seen += got
        assert not wait_for_data or seen.startswith(b"HTTP/1.1 200") and \
            b"text/event-stream" in seen
        return sock

    def wait_idle(self, timeout=60):
        """Until nothing runs or waits; a generation nobody cancelled would run for minutes."""
        deadline = time.monotonic() + timeout
        while True:
            q = self.get("/health")[1]["queue"]
            if not q["running"] and not q["waiting"]:
                return
            assert time.monotonic() < deadline, f"still busy: {q}"
            time.sleep(0.05)

    def get(self, path, key=KEY):
        headers = {"Authorization": f"Bearer {key}"} if key else {}
        r = httpx.get(self.base + path, headers=headers, timeout=60)
        return r.status_code, r.json()

    def rss_kb(self) -> int:
        with open(f"/proc/{self.proc.pid}/status") as f:
            return next(int(line.split()[1]) for line in f if line.startswith("VmRSS:"))

    def err(self) -> str:
        with open(self.log.name, "rb") as f:
            return f.read().decode(errors="replace")[-3000:]

    def close(self) -> int:
        """Ctrl-C, as a user stops it; returns the exit status."""
        self.proc.send_signal(signal.SIGINT)
        try:
            return self.proc.wait(timeout=30)
        finally:
            if self.proc.poll() is None:
                self.proc.kill()


@pytest.fixture(scope="module")
def home(tmp_path_factory):
    return tmp_path_factory.mktemp("http-home")      # shared: the calibration is measured once


@pytest.fixture(scope="module")
def server(tiny_path, home):
    srv = Server(tiny_path, home, "--api-key", KEY, "--max-body", "65536", "--ctx", "8192")
    yield srv
    assert srv.close() == 130 and "interrupted" in srv.err()
    assert "Traceback" not in srv.err(), srv.err()


def model_id(tiny_path):
    return tiny_path.stem


def chat(client, tiny_path, content, **kw):
    return client.chat.completions.create(
        model=model_id(tiny_path), messages=[{"role": "user", "content": content}], **kw)


def test_models_health_and_a_chat_with_the_openai_client(server, tiny_path):
    client = server.client()
    assert [m.id for m in client.models.list()] == [model_id(tiny_path)]
    assert server.get("/health", key=None)[1]["status"] == "ok"      # no key needed for health
    msgs = [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "hi"}]
    first = client.chat.completions.create(model=model_id(tiny_path), messages=msgs,
                                           max_tokens=12, temperature=0)
    choice = first.choices[0]
    assert choice.message.role == "assistant" and isinstance(choice.message.content, str)
    assert choice.finish_reason in ("stop", "length")
    assert first.object == "chat.completion" and first.id.startswith("chatcmpl-")
    assert 0 < first.usage.completion_tokens <= 12
    assert first.usage.total_tokens == first.usage.prompt_tokens + first.usage.completion_tokens
    stats = first.model_extra["localspec"]          # speculation statistics, ignored by clients
    assert stats["generated_tokens"] == first.usage.completion_tokens and "drafted" in stats
    # The same system prompt again: its KV rows are reused (the prompt cache across requests).
    again = client.chat.completions.create(
        model=model_id(tiny_path), max_tokens=12, temperature=0,
        messages=msgs[:1] + [{"role": "user", "content": "hello"}])
    assert again.usage.prompt_tokens_details.cached_tokens > 0


@pytest.mark.parametrize("kind", ["chat", "text"])
def test_streamed_pieces_concatenate_to_the_non_streamed_text(server, tiny_path, kind):
    client = server.client()
    args = dict(model=model_id(tiny_path), max_tokens=40, temperature=0)
    if kind == "chat":
        args["messages"] = [{"role": "user", "content": "def add(a, b):"}]
        make = client.chat.completions.create
        text_of = lambda r: r.choices[0].message.content
        piece_of = lambda c: c.choices[0].delta.content or ""
    else:
        args["prompt"] = "def add(a, b):"
        make = client.completions.create
        text_of = lambda r: r.choices[0].text
        piece_of = lambda c: c.choices[0].text
    whole = make(**args)
    chunks = list(make(**args, stream=True, stream_options={"include_usage": True}))
    pieces = [piece_of(c) for c in chunks if c.choices]
    assert len(pieces) > 2 and "".join(pieces) == text_of(whole)
    finish = [c.choices[0].finish_reason for c in chunks if c.choices and
              c.choices[0].finish_reason]
    assert finish == [whole.choices[0].finish_reason]
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == \
        whole.usage.completion_tokens                       # the usage chunk comes last


def test_max_tokens_inside_a_character_holds_the_character_back(server, tiny_path):
    """Issue 65: a cap that cut a character's byte tokens ended the text with U+FFFD. The tiny
    model's byte vocabulary answers "caf" with e3 90 a1 ("\u3421") d4 ...: 4 tokens end
    inside the second character, which is held back (docs/http.md)."""
    client = server.client()
    args = dict(model=model_id(tiny_path), prompt="caf", max_tokens=4, temperature=0)
    whole = client.completions.create(**args)
    streamed = "".join(c.choices[0].text for c in
                       client.completions.create(**args, stream=True) if c.choices)
    assert whole.choices[0].text == streamed == "\u3421", whole.choices[0].text
    assert whole.usage.completion_tokens == 4 and whole.choices[0].finish_reason == "length"


def test_stop_strings_string_and_list(server, tiny_path):
    client = server.client()
    full = client.completions.create(model=model_id(tiny_path), prompt="hello", max_tokens=48,
                                     temperature=0).choices[0].text
    stop = full[12:15]
    expected = full[:full.index(stop)]
    for value in (stop, [stop, "\u2603never"]):
        r = client.completions.create(model=model_id(tiny_path), prompt="hello", max_tokens=48,
                                      temperature=0, stop=value)
        assert (r.choices[0].text, r.choices[0].finish_reason) == (expected, "stop")
        streamed = client.completions.create(model=model_id(tiny_path), prompt="hello",
                                             max_tokens=48, temperature=0, stop=value, stream=True)
        assert "".join(c.choices[0].text for c in streamed) == expected


def test_extension_fields_document_and_fixed_k(server, tiny_path):
    client = server.client()
    base = dict(model=model_id(tiny_path), prompt="abcabcabcabcabcabc", max_tokens=24)
    fixed = client.completions.create(**base, extra_body={"localspec": {"k": 3}})
    plain = client.completions.create(**base, extra_body={"localspec": {"speculate": False}})
    assert fixed.model_extra["localspec"]["drafted"] > 0
    assert plain.model_extra["localspec"]["drafted"] == 0
    assert fixed.choices[0].text == plain.choices[0].text          # lossless
    doc = client.completions.create(**base, extra_body={"localspec": {"document": "xyz" * 50}})
    assert doc.choices[0].text == plain.choices[0].text


def test_output_equals_localspec_generate(server, tiny_path, home):
    env = {**os.environ, "LOCALSPEC_HOME": str(home)}
    client = server.client()
    for chat_mode in (False, True):
        cmd = [sys.executable, "-m", "localspec", "generate", "-m", str(tiny_path), "--threads",
               "1", "-n", "40", *(["--chat"] if chat_mode else []), "The capital of France is"]
        cli = subprocess.run(cmd, capture_output=True, env=env, timeout=120)
        assert cli.returncode == 0, cli.stderr
        if chat_mode:
            served = chat(client, tiny_path, "The capital of France is", max_tokens=40)
            text = served.choices[0].message.content
        else:
            text = client.completions.create(model=model_id(tiny_path), max_tokens=40,
                                             prompt="The capital of France is").choices[0].text
        assert cli.stdout.decode() == text + "\n"


def test_a_client_that_disconnects_mid_stream_cancels_its_generation(server, tiny_path):
    sock = server.open_stream({"prompt": LONG_PROMPT, "max_tokens": 1_000_000})
    assert server.get("/health")[1]["queue"]["running"] is True
    sock.close()
    server.wait_idle()          # without the cancel it would run for minutes
    r = server.client().completions.create(model=model_id(tiny_path), prompt="next",
                                           max_tokens=4)
    assert r.usage.completion_tokens >= 1


BAD_BODIES = [
    (b"this is not json", 400, None),
    (b'{"prompt": "a", ', 400, None),
    (b"\xff\xfe not utf-8", 400, None),
    (b'{"prompt": "a", "max_tokens": NaN}', 400, None),
    (b"", 400, None),
    (b"[]", 400, None),
    (b'"a string"', 400, None),
    (b"[" * 50000, 400, None),
    ({"prompt": 5}, 400, "prompt"),
    ({"prompt": ["a", "b"]}, 400, "prompt"),
    ({"prompt": [1, 2, 99999]}, 400, "prompt"),
    ({"prompt": "\ud800"}, 400, "prompt"),
    ({"prompt": "a", "max_tokens": "10"}, 400, "max_tokens"),
    ({"prompt": "a", "max_tokens": 0}, 400, "max_tokens"),
    ({"prompt": "a", "temperature": 5}, 400, "temperature"),
    ({"prompt": "a", "top_p": -1}, 400, "top_p"),
    ({"prompt": "a", "seed": 1.5}, 400, "seed"),
    ({"prompt": "a", "stop": 5}, 400, "stop"),
    ({"prompt": "a", "stop": [""]}, 400, "stop"),
    ({"prompt": "a", "n": 2}, 400, "n"),
    ({"prompt": "a", "echo": True}, 400, "echo"),
    ({"prompt": "a", "stream": "yes"}, 400, "stream"),
    ({"prompt": "a", "stream_options": {"include_usage": True}}, 400, "stream_options"),
    ({"prompt": "a", "max_token": 5}, 400, "max_token"),
    ({"prompt": "a", "localspec": {"k": 99}}, 400, "localspec.k"),
    ({"prompt": "a", "localspec": {"documnt": "x"}}, 400, "localspec.documnt"),
    ({"prompt": "a", "model": "gpt-4o"}, 404, "model"),
    ({"prompt": "a", "model": 3}, 400, "model"),
]


@pytest.mark.parametrize("body, status, param", BAD_BODIES,
                         ids=[str(i) for i in range(len(BAD_BODIES))])
def test_bad_completion_bodies_get_openai_errors(server, body, status, param):
    got, reply, _ = server.post("/v1/completions", body)
    assert got == status, reply
    err = reply["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["message"]
    assert err["type"] == "invalid_request_error" and err["param"] == param


@pytest.mark.parametrize("body, param", [
    ({"messages": "hi"}, "messages"),
    ({"messages": []}, "messages"),
    ({"messages": [{"role": "tool", "content": "x"}]}, "messages[0].role"),
    ({"messages": [{"role": "user", "content": 3}]}, "messages[0].content"),
    ({"messages": [{"role": "user", "content": [{"type": "image_url"}]}]},
     "messages[0].content[0]"),
    ({"messages": [{"role": "user", "content": "x"}], "logprobs": True}, "logprobs"),
    ({"messages": [{"role": "user", "content": "x"}], "tools": [{"type": "function"}]}, "tools"),
    ({"messages": [{"role": "user", "content": "x"}], "presence_penalty": 0.5},
     "presence_penalty"),
])
def test_bad_chat_bodies_name_the_field(server, body, param):
    status, reply, _ = server.post("/v1/chat/completions", body)
    assert status == 400 and reply["error"]["param"] == param, reply


SHARED_REFUSALS = [
    {"messages": [{"role": "x", "content": "hi"}]},
    {"messages": []},
    {"messages": [{"role": "user"}]},
    {"messages": [{"role": ["user"], "content": "hi"}]},
    {"messages": [{"role": "user", "content": [{"type": "image_url"}]}]},
    {"prompt": "hi", "stop": [""]},
    {"prompt": "hi", "stop": ["x"] * 17},
    {"prompt": "hi", "stop": [1]},
    {"prompt": "hi", "stop": 3},
    {"prompt": "hi", "max_tokens": 0},
    {"prompt": "hi", "top_p": 2},
    {"prompt": "hi", "min_p": -0.1},
    {"prompt": "hi", "seed": "x"},
]


def test_http_and_the_editor_protocol_refuse_the_same_requests_in_the_same_words(
        server, tiny_path, tmp_path):
    """Issue 65: the protocol took role "x" and stop [""], which HTTP refuses. One validator
    (apps/checks.py) now serves both: the same bad field gets the same message on each."""
    stdio = StdioServer(tiny_path, tmp_path)
    try:
        for params in SHARED_REFUSALS:
            path = "/v1/chat/completions" if "messages" in params else "/v1/completions"
            status, reply, _ = server.post(path, params)
            rpc = stdio.call("generate", params)
            assert status == 400 and rpc["error"]["code"] == -32602, (params, reply, rpc)
            assert reply["error"]["message"] == rpc["error"]["message"], params
    finally:
        assert stdio.close() == 0


def test_deeply_nested_bodies_are_400_and_the_server_goes_on(server, tiny_path):
    nested = b'{"prompt": "a", "stop": ' + b"[" * 150 + b"]" * 150 + b"}"
    for body in (b"[" * 5000, nested):
        status, reply, _ = server.post("/v1/completions", body)
        assert status == 400 and reply["error"]["code"] == "invalid_json", reply
        assert "nested deeper than" in reply["error"]["message"]
    r = httpx.post(server.base + "/v1/chat/completions", content=b"[" * 5000, timeout=60,
                   headers={"Authorization": f"Bearer {KEY}"})
    assert r.status_code == 400
    assert server.post("/v1/completions", {"prompt": "a", "max_tokens": 2})[0] == 200


def test_harmless_openai_parameters_are_accepted(server, tiny_path):
    r = server.client().chat.completions.create(
        model=model_id(tiny_path), messages=[{"role": "user", "content": [
            {"type": "text", "text": "hi"}]}], max_completion_tokens=3, n=1, user="someone",
        presence_penalty=0, frequency_penalty=0, logprobs=False, seed=7, top_p=1,
        response_format={"type": "text"}, metadata={"a": "b"}, store=False)
    assert r.usage.completion_tokens <= 3


def test_unknown_routes_methods_and_a_too_large_body(server):
    assert server.get("/v1/nothing")[0] == 404
    status, reply = server.get("/v1/chat/completions")
    assert status == 405 and reply["error"]["type"] == "invalid_request_error"
    # Declared far too large: refused from the headers alone, before any of the body is sent.
    conn = http.client.HTTPConnection("127.0.0.1", server.port, timeout=60)
    conn.putrequest("POST", "/v1/completions")
    conn.putheader("Authorization", f"Bearer {KEY}")
    conn.putheader("Content-Length", str(1 << 30))
    conn.endheaders()
    resp = conn.getresponse()
    assert resp.status == 413 and json.loads(resp.read())["error"]["code"] == "request_too_large"
    conn.close()
    # Sent in chunks with no length: counted as it arrives.
    big = {"prompt": "a", "localspec": {"document": "x" * 100_000}}
    status, reply, _ = server.post("/v1/completions", json.dumps(big).encode())
    assert status == 413, reply
    chunks = (json.dumps(big)[i:i + 8192].encode() for i in range(0, 100_100, 8192))
    r = httpx.post(server.base + "/v1/completions", content=chunks, timeout=60,
                   headers={"Authorization": f"Bearer {KEY}"})
    assert r.status_code == 413


def test_api_key_is_required(server, tiny_path):
    with pytest.raises(openai.AuthenticationError):
        server.client(key="wrong").models.list()
    for key in (None, "wrong", KEY + "x"):
        status, reply, headers = server.post("/v1/completions", {"prompt": "a"}, key=key)
        assert status == 401 and reply["error"]["code"] == "invalid_api_key"
    assert server.get("/v1/models", key=None)[0] == 401
    assert server.get("/v1/models")[0] == 200


def test_8_clients_x_25_requests_in_order_without_memory_growth(server, tiny_path, tiny_model):
    def run(c, rounds, out):
        client = server.client()
        for i in range(rounds):
            prompt = f"client {c}: " + "ab" * i        # longer each time: order shows in usage
            r = client.completions.create(model=model_id(tiny_path), prompt=prompt, max_tokens=2)
            out.append((len(tiny_model.tokenize(prompt)), r.usage.prompt_tokens,
                        r.usage.completion_tokens))

    def round_of(rounds):
        results = [[] for _ in range(8)]
        threads = [threading.Thread(target=run, args=(c, rounds, results[c])) for c in range(8)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(300)
        return results

    round_of(3)                                         # warm-up: allocator and caches settle
    before = server.rss_kb()
    results = round_of(25)
    after = server.rss_kb()
    for per_client in results:
        assert len(per_client) == 25                    # every request answered
        assert [want for want, got, _ in per_client] == [got for _, got, _ in per_client]
        assert all(1 <= n <= 2 for _, _, n in per_client)
    growth = (after - before) / before
    print(f"VmRSS before 200 requests: {before} kB, after: {after} kB ({100 * growth:+.2f}%)")
    assert growth < 0.05


def test_a_queued_request_whose_client_left_is_not_counted_as_waiting(server):
    """Issue 65: /health went on counting a queued request whose client had disconnected
    until its turn came (and it held a --queue place until then)."""
    long = {"prompt": LONG_PROMPT, "max_tokens": 1_000_000}
    running = server.open_stream(long)
    queued = server.open_stream(long, wait_for_data=False)
    deadline = time.monotonic() + 30
    while server.get("/health")[1]["queued"] < 1:
        assert time.monotonic() < deadline
        time.sleep(0.05)
    queued.close()
    deadline = time.monotonic() + 10
    while (health := server.get("/health")[1])["queued"] > 0:
        assert time.monotonic() < deadline, health
        time.sleep(0.05)
    assert health["busy"] == 1 and health["queue"]["waiting"] == 0    # the other one runs on
    running.close()
    server.wait_idle()


@pytest.fixture(scope="module")
def faulty(tiny_path, home):
    srv = Server(tiny_path, home, "--queue", "1", "--ctx", "8192", code=FAULTY)
    yield srv
    srv.close()


def test_an_exception_inside_a_generation_is_a_500_and_serving_goes_on(faulty, tiny_path):
    status, reply, _ = faulty.post("/v1/completions", {"prompt": "RAISE now", "max_tokens": 8})
    assert status == 500 and reply["error"]["type"] == "server_error", reply
    assert "injected failure" in reply["error"]["message"]
    client = faulty.client()
    with pytest.raises(openai.APIError):
        for _ in client.completions.create(model=model_id(tiny_path), prompt="RAISE again",
                                           max_tokens=8, stream=True):
            pass
    ok = client.completions.create(model=model_id(tiny_path), prompt="hello", max_tokens=8,
                                   temperature=0)
    fresh = faulty.client().completions.create(model=model_id(tiny_path), prompt="hello",
                                               max_tokens=8, temperature=0)
    assert ok.choices[0].text == fresh.choices[0].text and ok.usage.completion_tokens >= 1
    assert "RuntimeError: injected failure" in faulty.err()      # the traceback is on stderr


def test_a_full_queue_answers_503_with_retry_after(faulty, tiny_path):
    long = {"prompt": LONG_PROMPT, "max_tokens": 1_000_000}
    running = faulty.open_stream(long)             # runs
    waiting = faulty.open_stream(long, wait_for_data=False)   # waits: the queue (1) is full
    deadline = time.monotonic() + 30
    while faulty.get("/health")[1]["queue"]["waiting"] < 1:
        assert time.monotonic() < deadline
        time.sleep(0.05)
    status, reply, headers = faulty.post("/v1/completions", {"prompt": "x", "max_tokens": 2})
    assert status == 503 and reply["error"]["code"] == "queue_full"
    assert int(headers["Retry-After"]) >= 1
    running.close()
    waiting.close()
    faulty.wait_idle()          # both clients left: the running one is cancelled, the other skipped
    assert faulty.post("/v1/completions", {"prompt": "x", "max_tokens": 2})[0] == 200


@pytest.mark.parametrize("key", ["", "   "])
def test_an_empty_api_key_is_refused_before_anything_loads(tiny_path, home, key):
    env = {**os.environ, "LOCALSPEC_HOME": str(home)}
    env.pop("LOCALSPEC_API_KEY", None)
    r = subprocess.run([sys.executable, "-m", "localspec", "serve", "--http", "127.0.0.1:0",
                        "-m", str(tiny_path), "--api-key", key],
                       capture_output=True, env=env, timeout=60)
    err = r.stderr.decode()
    assert r.returncode == 2 and "--api-key" in err and "empty key" in err, err
    assert "serving" not in err and "Traceback" not in err


@pytest.mark.parametrize("key, why", [
    (" key", "spaces around it"), ("key\t", "spaces around it"), ("kéy", "printable ASCII"),
    ("k\x07y", "printable ASCII"), (b"k\xffy", "not valid UTF-8"),
])
def test_a_key_no_client_could_send_is_refused_at_start(tiny_path, home, key, why):
    """Accepted before, such a key then let no client in (issue 43): one line, no model load."""
    env = {**os.environ, "LOCALSPEC_HOME": str(home)}
    env.pop("LOCALSPEC_API_KEY", None)
    env = {k.encode(): v.encode() for k, v in env.items()}
    env[b"LOCALSPEC_API_KEY"] = key if isinstance(key, bytes) else key.encode()
    r = subprocess.run([sys.executable, "-m", "localspec", "serve", "--http", "127.0.0.1:0",
                        "-m", str(tiny_path)], capture_output=True, env=env, timeout=60)
    err = r.stderr.decode(errors="replace")
    assert r.returncode == 2 and why in err and "LOCALSPEC_API_KEY" in err, err
    assert "serving" not in err and "Traceback" not in err and "llama" not in err, err


def test_the_api_key_rule_holds_for_any_caller_of_the_server():
    from localspec.apps.openai_api import HttpSettings, api_key_problem
    from localspec.errors import LocalspecError

    assert api_key_problem(None) is None and api_key_problem("s3cret-Key_1.~") is None
    for bad in (" k", "k ", "é", "k\udcff", ""):
        assert api_key_problem(bad)
        with pytest.raises(LocalspecError):
            HttpSettings(api_key=bad)


def read_to_end(sock, timeout=60) -> bytes:
    sock.settimeout(timeout)
    data = b""
    while True:
        got = sock.recv(65536)
        if not got:
            return data
        data += got


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT])
def test_stopping_the_server_ends_every_request_as_its_client_can_tell(tiny_path, home, sig):
    """At SIGTERM/Ctrl-C a running stream ends with an in-band error (not a finish_reason of
    "stop" on a cut answer), a running non-streamed request returns its text so far with
    stop_reason "cancelled" (issue 65: it was a 503 that threw the text away), and a queued
    request gets 503."""
    srv = Server(tiny_path, home, "--api-key", KEY, "--queue", "2", "--ctx", "8192",
                 "--parallel", "2")
    try:
        long = {"prompt": LONG_PROMPT, "max_tokens": 1_000_000, "temperature": 0}
        running = srv.open_stream(long)
        answer = []
        whole = threading.Thread(target=lambda: answer.append(
            srv.post("/v1/completions", long, timeout=120)))
        whole.start()
        deadline = time.monotonic() + 30
        while srv.get("/health")[1]["busy"] < 2:
            assert time.monotonic() < deadline
            time.sleep(0.05)
        queued = srv.open_stream(long, wait_for_data=False)
        while srv.get("/health")[1]["queue"]["waiting"] < 1:
            assert time.monotonic() < deadline
            time.sleep(0.05)
        time.sleep(1.0)                 # the non-streamed request has text by now
        srv.proc.send_signal(sig)
        stream, waited = read_to_end(running), read_to_end(queued)
        whole.join(60)
        assert b"server_shutting_down" in stream and b'"finish_reason":"stop"' not in stream \
            and b"[DONE]" not in stream, stream[-600:]
        assert waited.startswith(b"HTTP/1.1 503") and b"server_shutting_down" in waited, waited
        status, body, _ = answer[0]
        assert status == 200, body
        assert body["choices"][0]["finish_reason"] == "stop" and body["choices"][0]["text"]
        assert body["localspec"]["stop_reason"] == "cancelled"
        assert body["usage"]["completion_tokens"] > 0
        srv.proc.wait(timeout=30)
        assert "Traceback" not in srv.err(), srv.err()
    finally:
        if srv.proc.poll() is None:
            srv.proc.kill()


def test_the_same_greedy_request_gives_the_same_text_cached_or_not(smollm_path, home):
    """Issue 31's report: "Tell me a story about a robot." at temperature 0 gave text A after an
    unrelated request and text B when repeated (its prefix from the prompt cache), A, B, A, B.
    Every answer must be `localspec generate --chat`'s."""
    env = {**os.environ, "LOCALSPEC_HOME": str(home)}
    story = "Tell me a story about a robot."
    want = subprocess.run([sys.executable, "-m", "localspec", "generate", "-m", str(smollm_path),
                           "--chat", "--threads", "1", "-n", "48", "--proposer", "none", story],
                          capture_output=True, env=env, timeout=300).stdout.decode()
    srv = Server(smollm_path, home, "--api-key", KEY, "--proposer", "none")
    try:
        client = srv.client()
        texts = []
        for content in ["What is the capital of France? Answer in one sentence.", story, story,
                        "Name three colours.", story, story]:
            reply = client.chat.completions.create(
                model=smollm_path.stem, messages=[{"role": "user", "content": content}],
                max_tokens=48, temperature=0)
            texts.append(reply.choices[0].message.content)
    finally:
        srv.close()
    assert want.strip() and [texts[i] for i in (1, 2, 4, 5)] == [want.rstrip("\n")] * 4, texts

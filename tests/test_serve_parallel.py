"""`serve --parallel N` and `summarize --parallel N` as clients use them (issue 42): real servers
as subprocesses, driven by the `openai` client, raw HTTP and stdio pipes. Requests that run
together each get the text of their lone run (a `--parallel 1` server's), a queued request
waits for a slot and completes, a client that leaves frees its slot, one request's failure or
cancel leaves the others intact, and bad --parallel values are one-line usage errors.
"""

from __future__ import annotations

import os
import queue
import threading
import time

import pytest
from click.testing import CliRunner

from localspec.cli import cli
from test_http import FAULTY, KEY, LONG_PROMPT, Server as HttpServer, model_id
from test_serve import Server as StdioServer

TINY_CTX = "16384"      # 8192 tokens a slot at --parallel 2: LONG_PROMPT runs ~7600 tokens


def wait_for(predicate, what: str, timeout: float = 60.0):
    deadline = time.monotonic() + timeout
    while True:
        value = predicate()
        if value:
            return value
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.05)


def read_more(sock, n_events: int) -> None:
    """Read until `n_events` more SSE events arrived on a raw streaming socket."""
    seen = b""
    while seen.count(b"data: ") < n_events:
        got = sock.recv(4096)
        assert got, seen
        seen += got


# -- HTTP ---------------------------------------------------------------------------------------
STORY = [{"role": "user", "content": "Write a long story about a lighthouse keeper and a storm."}]
SAMPLED = dict(prompt="The three best things about autumn are", max_tokens=24,
               temperature=0.9, seed=11)


def story_and_completion(server: HttpServer, smollm_path, overlap: bool) -> dict:
    """A long greedy streamed chat and a seeded sampled streamed completion; with `overlap`
    the completion is sent after the chat's third piece, else after the chat has ended.
    Returns both texts and the times of the chat's end and the completion's first piece."""
    client, name = server.client(), model_id(smollm_path)
    out: dict = {"chat": [], "completion": []}
    third = threading.Event()

    def chat():
        for c in client.chat.completions.create(model=name, messages=STORY, max_tokens=160,
                                                stream=True):
            if c.choices and c.choices[0].delta.content:
                out["chat"].append(c.choices[0].delta.content)
                if len(out["chat"]) == 3:
                    third.set()
        out["chat_end"] = time.monotonic()
        third.set()

    runner = threading.Thread(target=chat)
    runner.start()
    if not overlap:
        runner.join(300)
    assert third.wait(300)
    for c in client.completions.create(model=name, stream=True, **SAMPLED):
        if c.choices and c.choices[0].text:
            out.setdefault("first_piece", time.monotonic())
            out["completion"].append(c.choices[0].text)
    runner.join(300)
    return {"chat": "".join(out["chat"]), "completion": "".join(out["completion"]),
            "chat_end": out["chat_end"], "first_piece": out["first_piece"]}


def test_two_slots_answer_together_with_the_texts_of_lone_runs(smollm_path, _test_home):
    parallel = HttpServer(smollm_path, _test_home, "--parallel", "2", "--ctx", "4096",
                          "--api-key", KEY)
    try:
        together = story_and_completion(parallel, smollm_path, overlap=True)
        health = parallel.get("/health")[1]
        assert health["slots"] == 2 and health["busy"] == 0 and health["queued"] == 0
    finally:
        assert parallel.close() == 130
    assert "Traceback" not in parallel.err(), parallel.err()
    # the completion's first piece came while the chat was still streaming
    assert together["first_piece"] < together["chat_end"], together
    lone = HttpServer(smollm_path, _test_home, "--ctx", "2048", "--api-key", KEY)
    try:
        alone = story_and_completion(lone, smollm_path, overlap=False)
        assert lone.get("/health")[1]["slots"] == 1
    finally:
        lone.close()
    assert len(together["chat"]) > 100 and together["completion"]
    assert together["chat"] == alone["chat"]
    assert together["completion"] == alone["completion"]


@pytest.fixture(scope="module")
def tiny_pair(tiny_path, _test_home):
    srv = HttpServer(tiny_path, _test_home, "--parallel", "2", "--ctx", TINY_CTX,
                     "--queue", "1", "--api-key", KEY)
    yield srv
    assert srv.close() == 130
    assert "Traceback" not in srv.err(), srv.err()


def test_health_shows_busy_slots_and_the_queue_and_a_leaving_client_frees_its_slot(
        tiny_pair, tiny_path):
    server = tiny_pair
    streams = [server.open_stream({"prompt": LONG_PROMPT, "max_tokens": 1_000_000})
               for _ in range(2)]
    queued = {"prompt": "a queued one", "max_tokens": 16}
    third: dict = {}
    waiter = threading.Thread(
        target=lambda: third.update(reply=server.post("/v1/completions", queued, timeout=120)))
    waiter.start()
    health = wait_for(lambda: (lambda h: h if h["queued"] == 1 else None)(
        server.get("/health", key=None)[1]), "the third request to queue")
    assert health["slots"] == 2 and health["busy"] == 2
    assert health["queue"] == {"running": True, "waiting": 1, "max": 1}
    # a fourth finds the queue full: 503, and a Retry-After spread over the two slots
    status, body, headers = server.post("/v1/completions", queued)
    assert status == 503 and body["error"]["code"] == "queue_full"
    assert 1 <= int(headers["Retry-After"]) <= 60
    assert waiter.is_alive()                    # both slots run endless streams
    streams[0].close()                          # its client leaves: the slot is freed
    waiter.join(120)
    status, reply, _ = third["reply"]
    assert status == 200 and reply["usage"]["completion_tokens"] >= 1
    read_more(streams[1], 5)                    # the other stream went on meanwhile
    streams[1].close()
    server.wait_idle()
    # the queued request's text is its lone run's
    status, again, _ = server.post("/v1/completions", queued)
    assert again["choices"][0]["text"] == reply["choices"][0]["text"]
    health = server.get("/health", key=None)[1]
    assert (health["busy"], health["queued"]) == (0, 0)


def test_a_context_too_long_for_a_slot_names_parallel(tiny_pair):
    status, body, _ = tiny_pair.post("/v1/completions", {"prompt": "x" * 9000, "max_tokens": 2})
    assert status == 400 and body["error"]["code"] == "context_length_exceeded"
    assert "--parallel" in body["error"]["message"]


def test_a_failing_request_leaves_the_other_slot_running(tiny_path, _test_home):
    server = HttpServer(tiny_path, _test_home, "--parallel", "2", "--ctx", TINY_CTX,
                        "--api-key", KEY, code=FAULTY)
    try:
        stream = server.open_stream({"prompt": LONG_PROMPT, "max_tokens": 1_000_000})
        status, body, _ = server.post("/v1/completions", {"prompt": "RAISE", "max_tokens": 8})
        assert status == 500 and "injected failure" in body["error"]["message"]
        read_more(stream, 20)
        assert server.get("/health", key=None)[1]["busy"] == 1
        stream.close()
        server.wait_idle()
    finally:
        server.close()


# -- stdio --------------------------------------------------------------------------------------
GREEDY = {"prompt": "hello", "max_tokens": 200}
SAMPLED_RAW = {"prompt": "prompt 35: ", "max_tokens": 200, "temperature": 0.8, "seed": 5}


def until(server: StdioServer, ids: list) -> tuple:
    """Read until every request in `ids` is answered: ({id: response}, the notifications)."""
    answers, notes = {}, []
    while len(answers) < len(ids):
        msg = server.recv()
        if msg.get("id") in ids:
            answers[msg["id"]] = msg
        elif "id" not in msg:
            notes.append(msg)
    return answers, notes


def texts(server: StdioServer, *params) -> list:
    """Send every request at once; the texts of their answers, in the order sent."""
    ids = [server.send("generate", p) for p in params]
    answers, _ = until(server, ids)
    return [answers[i]["result"]["text"] for i in ids]


@pytest.fixture(scope="module")
def lone_texts(tiny_path, tmp_path_factory, _test_home):
    srv = StdioServer(tiny_path, tmp_path_factory.mktemp("lone"), "--ctx", "8192",
                      env={"LOCALSPEC_HOME": str(_test_home)})
    try:
        return [texts(srv, p)[0] for p in (GREEDY, SAMPLED_RAW)]
    finally:
        assert srv.close() == 0


def test_stdio_runs_two_generates_at_once_each_as_alone_and_cancels_one(
        tiny_path, tmp_path_factory, _test_home, lone_texts):
    srv = StdioServer(tiny_path, tmp_path_factory.mktemp("par"), "--parallel", "2",
                      "--ctx", TINY_CTX, env={"LOCALSPEC_HOME": str(_test_home)})
    try:
        caps = srv.call("initialize")["result"]
        assert caps["capabilities"]["slots"] == 2 and caps["model"]["n_ctx"] == 8192
        assert texts(srv, GREEDY, SAMPLED_RAW) == lone_texts
        # a long generate and a short one together: cancel the long one, the short one ends
        # as alone
        long_id = srv.send("generate", {"prompt": LONG_PROMPT, "max_tokens": 1_000_000})
        first = srv.recv()
        assert first["method"] == "generate/progress" and first["params"]["id"] == long_id
        short_id = srv.send("generate", GREEDY)
        status_id = srv.send("status")
        answers, notes = until(srv, [status_id])
        status = answers[status_id]["result"]
        assert status["slots"] == 2 and long_id in status["running"]
        assert status["busy"] + status["queued"] == 2
        assert {long_id, short_id} == set(status["running"]) | set(status["waiting"])
        cancel_id = srv.send("cancel", {"id": long_id})
        answers, more = until(srv, [cancel_id, long_id, short_id])
        assert answers[cancel_id]["result"] == {"cancelled": True}
        assert answers[long_id]["result"]["finish_reason"] == "cancelled"
        assert answers[short_id]["result"]["text"] == lone_texts[0]
        assert "".join(n["params"]["text"] for n in notes + more
                       if n["params"]["id"] == short_id) == lone_texts[0]
        idle = srv.call("status")["result"]
        assert idle["busy"] == 0 and idle["queued"] == 0 and idle["waiting"] == []
    finally:
        assert srv.close() == 0


def test_stdio_shutdown_ends_running_and_queued_work_then_answers_last(tiny_path,
                                                                        tmp_path_factory):
    srv = StdioServer(tiny_path, tmp_path_factory.mktemp("stop"), "--parallel", "2",
                      "--ctx", TINY_CTX)
    ids = [srv.send("generate", {"prompt": LONG_PROMPT, "max_tokens": 1_000_000})
           for _ in range(3)]
    srv.recv()                                              # work is running
    stop = srv.send("shutdown")
    answered = []
    while True:
        msg = srv.recv()
        if "id" in msg:
            answered.append(msg["id"])
            if msg["id"] == stop:
                break
            assert msg["result"]["finish_reason"] == "cancelled"
    assert sorted(answered[:-1]) == sorted(ids) and answered[-1] == stop
    assert srv.close() == 0


# -- the command line ---------------------------------------------------------------------------
@pytest.mark.parametrize("args, needle", [
    (["--parallel", "0"], "1<=x<=16"),
    (["--parallel", "-2"], "1<=x<=16"),
    (["--parallel", "17"], "1<=x<=16"),
    (["--parallel", "4", "--ctx", "512"], "at least 1024 tokens"),
    (["--parallel", "2", "--proposer", "hybrid"], "n-gram lookup or plain decoding"),
])
@pytest.mark.parametrize("command", [["serve", "--stdio"], ["summarize", "x.md"]])
def test_bad_parallel_values_are_one_line_usage_errors(command, args, needle, tmp_path):
    r = CliRunner().invoke(cli, [*command, "-m", str(tmp_path / "never-loaded.gguf"), *args])
    assert r.exit_code == 2, r.output
    errors = [line for line in r.output.splitlines() if line.startswith("Error:")]
    assert len(errors) == 1 and "--parallel" in errors[0] and needle in errors[0], r.output


def test_parallel_is_one_option_with_a_help_that_teaches():
    shared = [next(p for p in cli.commands[c].params if p.name == "parallel")
              for c in ("serve", "summarize")]
    assert len({(tuple(p.opts), p.help, p.default, repr(p.type)) for p in shared}) == 1
    assert "--ctx" in shared[0].help and "alone" in shared[0].help


def test_summarize_n_files_at_a_time_keeps_the_order_and_the_lone_texts(tiny_path, tmp_path):
    names = [f"doc{i}.md" for i in range(5)]
    for i, name in enumerate(names):
        (tmp_path / name).write_text(f"Document {i}: " + "alpha beta gamma. " * (3 + i))
    args = ["summarize", *(str(tmp_path / n) for n in names), "-m", str(tiny_path),
            "--threads", "1", "-n", "24", "--no-learn"]
    lone = CliRunner().invoke(cli, [*args, "--ctx", "1024"])
    together = CliRunner().invoke(cli, [*args, "--ctx", "2048", "--parallel", "2"])
    assert lone.exit_code == 0 and together.exit_code == 0, together.output
    assert together.stdout == lone.stdout
    assert [f"[{i}/5]" in together.stderr for i in range(1, 6)] == [True] * 5


def test_summarize_in_parallel_stops_on_ctrl_c_and_keeps_finished_outputs(tmp_path):
    """run_parallel on fake summarizers: an interrupt in one slot stops the batch; every output
    already finished is written, none partial, and a rerun resumes."""
    from localspec.apps.summarize import Summary, discover
    from localspec.apps.summarize_parallel import run_parallel

    class Fake:
        def __init__(self, cancel, stop_on=None):
            self.cancel, self.stop_on = cancel, stop_on

        def summarize(self, text, on_call=None):
            if text == self.stop_on:
                raise KeyboardInterrupt
            return Summary(text.upper(), calls=1)

    for name in "abcd":
        (tmp_path / "in").mkdir(exist_ok=True)
        (tmp_path / "in" / f"{name}.md").write_text(f"doc {name}")
    sources, out = discover([str(tmp_path / "in")]), tmp_path / "out"
    result = run_parallel(sources, lambda cancel: [Fake(cancel, "doc c"), Fake(cancel, "doc c")],
                          print, out)
    assert result.interrupted
    done = sorted(os.listdir(out))
    assert "c.md.summary.md" not in done and {"a.md.summary.md", "b.md.summary.md"} <= set(done)
    result = run_parallel(sources, lambda cancel: [Fake(cancel), Fake(cancel)], print, out)
    assert not result.interrupted and result.summarized + result.skipped == 4
    assert (out / "c.md.summary.md").read_text() == "DOC C\n"
    emitted = queue.Queue()
    result = run_parallel(sources, lambda cancel: [Fake(cancel), Fake(cancel)], emitted.put)
    assert [emitted.get_nowait() for _ in range(4)] == [
        f"==> {s.display} <==\nDOC {n.upper()}\n" + ("\n" if n != "d" else "")
        for s, n in zip(sources, "abcd")]

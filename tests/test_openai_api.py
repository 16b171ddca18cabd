"""Pure parts of the HTTP server and the RPC client: request parsing, response shapes, addresses,
and the RPC handshake check against listeners that are not RPC servers. No model needed."""

from __future__ import annotations

import socket
import threading

import pytest

from localspec.apps.openai_api import model_names
from localspec.cli.http import is_loopback, parse_bind
from localspec.errors import LocalspecError
from localspec.apps.openai_api import (ApiError, chunk, closing_chunks, full_response, parse_chat,
                                  parse_completion)
from localspec.llama.rpc import parse_servers, probe
from localspec.speculative.stats import GenerationStats

NAMES = ["tiny", "/models/tiny.gguf", "tiny.gguf"]
USER = [{"role": "user", "content": "hi"}]


def test_chat_request_maps_every_field():
    req = parse_chat({"model": "tiny", "messages": USER + [
        {"role": "developer", "content": [{"type": "text", "text": "a"},
                                          {"type": "text", "text": "b"}]},
        {"role": "assistant", "content": None}],
        "max_completion_tokens": 9, "temperature": 0.5, "top_p": 0.9, "seed": 3,
        "stop": "\n\n", "stream": True, "stream_options": {"include_usage": True},
        "top_k": 5, "min_p": 0.1, "repeat_penalty": 1.1, "user": "x", "n": 1,
        "prediction": {"type": "content", "content": "def f(): pass"},
        "localspec": {"speculate": False, "k": 2}}, NAMES)
    assert req.prompt == [{"role": "user", "content": "hi"}, {"role": "system", "content": "ab"},
                          {"role": "assistant", "content": ""}]
    s = req.sampling
    assert (s.temperature, s.top_p, s.seed, s.top_k, s.min_p, s.repeat_penalty) == \
        (0.5, 0.9, 3, 5, 0.1, 1.1)
    assert (req.max_tokens, req.stop, req.stream, req.include_usage) == (9, ("\n\n",), True, True)
    assert (req.document, req.speculate, req.fixed_k) == ("def f(): pass", False, 2)


def test_defaults_are_the_cli_defaults_greedy_and_unbounded():
    req = parse_chat({"messages": USER}, NAMES)          # no model: the one served
    assert req.sampling.temperature == 0.0 and req.max_tokens is None and req.speculate
    assert parse_completion({"prompt": [[5, 6]]}, NAMES, 259).prompt == [5, 6]


@pytest.mark.parametrize("body, status, param", [
    ({"messages": USER, "n": True}, 400, "n"),                  # True is not 1
    ({"messages": USER, "presence_penalty": 0.0, "frequency_penalty": 0.1}, 400,
     "frequency_penalty"),
    ({"messages": USER, "max_tokens": 5, "max_completion_tokens": 6}, 400,
     "max_completion_tokens"),
    ({"messages": USER, "temperature": float("inf")}, 400, "temperature"),
    ({"messages": USER, "response_format": {"type": "json_object"}}, 400, "response_format"),
    ({"messages": USER, "stream": True, "stream_options": {"x": 1}}, 400, "stream_options.x"),
    ({"messages": USER, "prediction": {"type": "other"}}, 400, "prediction"),
    ({"messages": [{"role": "user", "content": "x", "tool_calls": [{}]}]}, 400,
     "messages[0].tool_calls"),
    ({"messages": USER, "model": "other"}, 404, "model"),
    ({"messages": USER, "localspec": {"k": 65}}, 400, "localspec.k"),      # over K_LIMIT
    ({"messages": USER, "localspec": {"k": -1}}, 400, "localspec.k"),
    ({"messages": USER, "localspec": []}, 400, "localspec"),
])
def test_bad_chat_requests(body, status, param):
    with pytest.raises(ApiError) as e:
        parse_chat(body, NAMES)
    assert (e.value.status, e.value.param) == (status, param)
    assert set(e.value.body()["error"]) == {"message", "type", "param", "code"}


def test_response_and_chunk_shapes():
    st = GenerationStats(prompt_tokens=7, prefill_tokens=3, generated_tokens=4, stop_reason="eos")
    full = full_response("chat", "chatcmpl-1", 10, "tiny", "hey", st, 1.5)
    assert full["choices"][0]["message"]["content"] == "hey"
    assert full["choices"][0]["finish_reason"] == "stop"
    assert full["usage"] == {"prompt_tokens": 7, "completion_tokens": 4, "total_tokens": 11,
                             "prompt_tokens_details": {"cached_tokens": 4}}
    assert full["localspec"]["stop_reason"] == "eos" and full["localspec"]["queued_ms"] == 1.5
    first = chunk("chat", "c", 1, "tiny", "", first=True, with_usage=True)
    assert first["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    assert first["usage"] is None and first["object"] == "chat.completion.chunk"
    st.stop_reason = "context"
    last, usage = closing_chunks("text", "c", 1, "tiny", st, 0.0, include_usage=True)
    assert last["choices"][0]["finish_reason"] == "length" and "localspec" in last
    assert usage["choices"] == [] and usage["usage"]["completion_tokens"] == 4


def test_bind_addresses_and_model_names():
    assert parse_bind("8080") == ("127.0.0.1", 8080)
    assert parse_bind("0.0.0.0:0") == ("0.0.0.0", 0)
    assert parse_bind("[::1]:9000") == ("::1", 9000)
    for bad in ("", "host:", "x:99999", "localhost:http"):
        with pytest.raises(ValueError):
            parse_bind(bad)
    assert is_loopback("127.0.0.5") and is_loopback("::1") and is_loopback("localhost")
    assert not is_loopback("0.0.0.0") and not is_loopback("example.com")
    from pathlib import Path
    assert model_names("smollm2-135m", Path("/c/smollm2.gguf"))[0] == "smollm2-135m"
    assert model_names("/m/tiny.gguf", Path("/m/tiny.gguf")) == ["tiny", "/m/tiny.gguf",
                                                                 "tiny.gguf"]


def test_rpc_server_lists():
    assert parse_servers("a:1, 10.0.0.2:50052") == ("a:1", "10.0.0.2:50052")
    for bad in ("a", "a:0", "a:b", "::1:5"):
        with pytest.raises(LocalspecError):
            parse_servers(bad)


def _listener(reply: bytes):
    """A loopback listener that answers every connection with `reply` and closes it."""
    srv = socket.socket()
    srv.bind(("127.0.0.1", 0))
    srv.listen(4)

    def serve():
        while True:
            try:
                conn, _ = srv.accept()
            except OSError:
                return
            with conn:
                conn.recv(64)
                conn.sendall(reply)

    threading.Thread(target=serve, daemon=True).start()
    return srv


def test_rpc_probe_refuses_what_is_not_an_rpc_server_instead_of_aborting():
    closed = socket.socket()
    closed.bind(("127.0.0.1", 0))
    port = closed.getsockname()[1]
    closed.close()
    with pytest.raises(LocalspecError, match="cannot reach"):
        probe(f"127.0.0.1:{port}", timeout=5)
    for reply in (b"HTTP/1.1 400 Bad Request\r\n\r\n", b""):
        srv = _listener(reply)
        with srv, pytest.raises(LocalspecError, match="does not answer as a ggml RPC server"):
            probe(f"127.0.0.1:{srv.getsockname()[1]}", timeout=5)
    old = (28).to_bytes(8, "little") + bytes([3, 0, 0, 0]) + bytes(24)   # protocol 3.0.0
    srv = _listener(old)
    with srv, pytest.raises(LocalspecError, match="speaks protocol 3.0.0"):
        probe(f"127.0.0.1:{srv.getsockname()[1]}", timeout=5)

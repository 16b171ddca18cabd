"""llama.cpp's RPC backend end to end: `localspec rpc-server` on loopback as a subprocess, and
`localspec generate --rpc` against it, which must write what local generation writes (tiny model).
Every run is a subprocess: attaching RPC servers is process-wide in llama.cpp."""

from __future__ import annotations

import os
import signal
import socket
import struct
import subprocess
import sys
import time

import pytest

from localspec.errors import LocalspecError
from localspec.llama.rpc import probe

PROMPT = "hello world"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def localspec(*args, home, timeout=180, env=None) -> subprocess.CompletedProcess:
    env = {**os.environ, "LOCALSPEC_HOME": str(home), **(env or {})}
    return subprocess.run([sys.executable, "-m", "localspec", *args], capture_output=True,
                          env=env, timeout=timeout)


@pytest.fixture(scope="module")
def home(tmp_path_factory):
    return tmp_path_factory.mktemp("rpc-home")


@pytest.fixture(scope="module")
def rpc_port(home):
    port = free_port()
    log = open(home / "rpc-server.txt", "w+b")
    proc = subprocess.Popen([sys.executable, "-m", "localspec", "rpc-server", "--port", str(port),
                             "--threads", "1"], stdout=log, stderr=subprocess.STDOUT,
                            env={**os.environ, "LOCALSPEC_HOME": str(home)},
                            # SIGINT as a terminal delivers it, even under a background runner
                            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    deadline = time.monotonic() + 60
    while True:                          # ready once it answers the protocol's handshake
        try:
            probe(f"127.0.0.1:{port}", timeout=5)
            break
        except LocalspecError:
            assert proc.poll() is None and time.monotonic() < deadline, log_text(log)
            time.sleep(0.2)
    yield port
    proc.send_signal(signal.SIGINT)
    assert proc.wait(timeout=20) == 130
    text = log_text(log)
    assert "unauthenticated" in text and "interrupted" in text, text
    log.close()


def log_text(log) -> str:
    log.seek(0)
    return log.read().decode(errors="replace")


@pytest.mark.parametrize("proposer", ["none", "ngram"])
def test_generation_over_rpc_equals_local_generation(tiny_path, rpc_port, home, proposer):
    args = ["generate", "-m", str(tiny_path), "--threads", "1", "-n", "48", "--proposer",
            proposer, "--stats", PROMPT]
    local = localspec(*args, home=home)
    remote = localspec(*args, "--rpc", f"127.0.0.1:{rpc_port}", home=home)
    assert local.returncode == 0 and remote.returncode == 0, remote.stderr
    # Every layer ran on the server (not merely connected to it), and the text is the same.
    assert f"layers on RPC0 (127.0.0.1:{rpc_port})".encode() in remote.stderr, remote.stderr
    assert b"layers on" not in local.stderr
    assert len(local.stdout) > 10 and remote.stdout == local.stdout


def test_unreachable_or_wrong_rpc_servers_are_one_line_errors(tiny_path, home):
    r = localspec("generate", "-m", str(tiny_path), "--rpc", f"127.0.0.1:{free_port()}", "x",
                  home=home)
    err = r.stderr.decode()
    assert r.returncode == 1 and err.startswith("error: cannot reach RPC server") and \
        err.count("\n") == 1, err
    r = localspec("generate", "-m", str(tiny_path), "--rpc", "nohost", "x", home=home)
    assert r.returncode == 2 and b"HOST:PORT" in r.stderr


def test_rpc_server_refuses_a_non_loopback_host_and_a_taken_port(home, rpc_port):
    r = localspec("rpc-server", "--host", "0.0.0.0", "--port", str(free_port()), home=home)
    err = r.stderr.decode()
    assert r.returncode == 1 and "refusing" in err and "unauthenticated" in err, err
    r = localspec("rpc-server", "--port", str(rpc_port), home=home)
    assert r.returncode == 1 and "cannot listen" in r.stderr.decode()
    helptext = localspec("rpc-server", "--help", home=home).stdout.decode()
    assert "unauthenticated" in helptext and "--allow-remote" in helptext


def start_server(home, port):
    """A server in its own process group, so that the test can stop it and its worker at once."""
    log = open(home / f"rpc-server-{port}.txt", "w+b")
    proc = subprocess.Popen([sys.executable, "-m", "localspec", "rpc-server", "--port", str(port),
                             "--threads", "1"], stdout=log, stderr=subprocess.STDOUT,
                            env={**os.environ, "LOCALSPEC_HOME": str(home)},
                            start_new_session=True)
    deadline = time.monotonic() + 60
    while True:
        try:
            probe(f"127.0.0.1:{port}", timeout=5)
            return proc, log
        except LocalspecError:
            assert proc.poll() is None and time.monotonic() < deadline, log_text(log)
            time.sleep(0.2)


def send_frame(port: int, cmd: int, payload: bytes) -> bytes:
    """HELLO, then one command frame (cmd byte, u64 size, payload); what came back."""
    with socket.create_connection(("127.0.0.1", port), timeout=10) as s:
        s.sendall(bytes([14]) + struct.pack("<Q", 24) + bytes(24))
        s.recv(256)
        s.sendall(bytes([cmd]) + struct.pack("<Q", len(payload)) + payload)
        try:
            return s.recv(256)
        except OSError:
            return b""


def test_a_malformed_frame_costs_one_connection_not_the_server(tiny_path, rpc_port, home):
    """GRAPH_COMPUTE naming a node that no tensor defines crashes ggml's server (upstream input
    checking): the worker is restarted and the next client is served as before."""
    send_frame(rpc_port, 10, struct.pack("<IIQI", 0, 1, 0, 0))     # device 0, node id 0, no tensors
    deadline = time.monotonic() + 30
    while True:
        try:
            probe(f"127.0.0.1:{rpc_port}", timeout=5)
            break
        except LocalspecError:
            assert time.monotonic() < deadline
            time.sleep(0.2)
    assert "serving again" in (home / "rpc-server.txt").read_text(errors="replace")
    args = ["generate", "-m", str(tiny_path), "--threads", "1", "-n", "16", PROMPT]
    remote = localspec(*args, "--rpc", f"127.0.0.1:{rpc_port}", home=home)
    assert remote.returncode == 0 and remote.stdout == localspec(*args, home=home).stdout


def test_a_server_killed_mid_request_is_one_error_line(tiny_path, home):
    port = free_port()
    server, log = start_server(home, port)
    client = subprocess.Popen([sys.executable, "-m", "localspec", "generate", "-m", str(tiny_path),
                               "--threads", "1", "-n", "100000", "--rpc", f"127.0.0.1:{port}",
                               "prompt 54: eeeee"], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                              env={**os.environ, "LOCALSPEC_HOME": str(home)})
    try:
        assert client.stdout.read(20)                # generating, its layers on the server
        server.kill()                                # and its worker with it (PR_SET_PDEATHSIG)
        _, err = client.communicate(timeout=60)
    finally:
        for p in (client, server):
            if p.poll() is None:
                p.kill()
        log.close()
    text = err.decode(errors="replace")
    assert client.returncode == 1, text
    lines = [ln for ln in text.splitlines() if ln.startswith("error:")]
    assert len(lines) == 1 and f"RPC server 127.0.0.1:{port}" in lines[0], text
    assert "Traceback" not in text and "gdb" not in text and "backtrace" not in text, text


def generating_client(tiny_path, home, port, **env):
    """`generate --rpc` writing until stopped; returns once it has written, its layers remote."""
    client = subprocess.Popen([sys.executable, "-m", "localspec", "generate", "-m", str(tiny_path),
                               "--threads", "1", "-n", "100000", "--rpc", f"127.0.0.1:{port}",
                               "prompt 54: eeeee"], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                              env={**os.environ, "LOCALSPEC_HOME": str(home), **env},
                              preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    assert client.stdout.read(20)
    return client


def stalled(server, client, interrupt: bool) -> str:
    """Stop the server (SIGSTOP: it keeps its sockets but answers nothing), optionally press
    Ctrl-C at the client, and return what the client wrote on stderr after it ended."""
    os.killpg(server.pid, signal.SIGSTOP)
    try:
        if interrupt:
            time.sleep(1)                            # inside a call that waits on the server
            client.send_signal(signal.SIGINT)
        _, err = client.communicate(timeout=90)      # a hang guard, not a speed limit
    finally:
        os.killpg(server.pid, signal.SIGCONT)
        for p in (client, server):
            if p.poll() is None:
                p.kill()
                p.wait()
    return err.decode(errors="replace")


def one_error_line(text: str, *needles: str) -> bool:
    lines = [ln for ln in text.splitlines() if ln.startswith("error:")]
    clean = "Traceback" not in text and "gdb" not in text and "backtrace" not in text
    return clean and len(lines) == 1 and all(n in lines[0] for n in needles)


def test_a_stalled_server_is_one_error_line_after_the_timeout(tiny_path, home):
    port = free_port()
    server, log = start_server(home, port)
    client = generating_client(tiny_path, home, port, LOCALSPEC_RPC_TIMEOUT="2")
    text = stalled(server, client, interrupt=False)
    log.close()
    assert client.returncode == 1, text
    assert one_error_line(text, f"RPC server 127.0.0.1:{port}", "silent (2 s"), text


def test_ctrl_c_ends_a_client_stuck_on_a_stalled_server(tiny_path, home):
    """Without a timeout in sight (the default 120 s), Ctrl-C must still end the client: the
    main thread is inside llama.cpp, so Python's handler cannot run; the watcher exits."""
    port = free_port()
    server, log = start_server(home, port)
    client = generating_client(tiny_path, home, port)
    text = stalled(server, client, interrupt=True)
    log.close()
    assert client.returncode == 130, text
    assert one_error_line(text, f"RPC server 127.0.0.1:{port}", "interrupted"), text


@pytest.mark.parametrize("value", ["0", "-3", "nan", "soon"])
def test_a_bad_rpc_timeout_is_one_line(tiny_path, home, rpc_port, value):
    out = localspec("generate", "-m", str(tiny_path), "-n", "2", "--rpc", f"127.0.0.1:{rpc_port}",
                    PROMPT, home=home, env={"LOCALSPEC_RPC_TIMEOUT": value})
    text = out.stderr.decode()
    assert out.returncode == 1 and one_error_line(text, "LOCALSPEC_RPC_TIMEOUT"), text

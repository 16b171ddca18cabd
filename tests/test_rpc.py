"""llama.cpp's RPC backend end to end: `localspec rpc-server` on loopback as a subprocess, and
`localspec generate --rpc` against it, which must write what local generation writes (tiny model).
Every run is a subprocess: attaching RPC servers is process-wide in llama.cpp."""

from __future__ import annotations

import os
import signal
import socket
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


def localspec(*args, home, timeout=180) -> subprocess.CompletedProcess:
    env = {**os.environ, "LOCALSPEC_HOME": str(home)}
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

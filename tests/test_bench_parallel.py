"""scripts/bench/bench_parallel.py end to end in its --quick mode on SmolLM2: real servers on
loopback, the openai client, every scenario; localspec one at a time and with two slots (and
llama.cpp's llama-server where it is built: it is built only on demand). What is asserted is the
JSON's shape and that every text of the two-slot server equals the one-slot server's; no timings.
SmolLM2 has no FIM tokens, so the FIM requests take the script's /v1/completions route."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "scripts" / "bench" / "bench_parallel.py"
pytestmark = pytest.mark.smollm


def _run(args, timeout=900):
    return subprocess.run([sys.executable, str(SCRIPT), *args], capture_output=True, text=True,
                          cwd=ROOT, timeout=timeout)


def _has_parallel() -> bool:
    r = subprocess.run([sys.executable, "-m", "localspec", "serve", "--help"],
                       capture_output=True, text=True, cwd=ROOT)
    return "--parallel" in r.stdout


def _llama_server_built(home: Path) -> bool:
    """Whether the user's cache holds llama-server for this flag set; if so the suite's home
    links that folder (as tests/test_bench_llamacpp.py does)."""
    from localspec.bench import llamacpp_build as lb
    real = (home / "models").resolve().parent
    name = lb.bin_dir().name
    if not (real / "llamacpp-bin" / name / lb.SERVER).is_file():
        return False
    if not (home / "llamacpp-bin").exists():
        (home / "llamacpp-bin").symlink_to(real / "llamacpp-bin", target_is_directory=True)
    return (home / "llamacpp-bin" / name / lb.SERVER).is_file()


def test_quick_run_writes_every_number_and_slots_change_no_text(smollm_path, _test_home,
                                                               tmp_path):
    configs = ["localspec-1"]
    if _has_parallel():
        configs.append("localspec-2")
    else:                                       # issue 42's --parallel not in this checkout
        r = _run(["--quick", "-m", str(smollm_path), "--configs", "localspec-1,localspec-2"])
        assert r.returncode == 2 and "no `serve --parallel` yet" in r.stderr
    if _llama_server_built(_test_home):
        configs.append("llama-server-2")
    out = tmp_path / "out.json"
    r = _run(["--quick", "-m", str(smollm_path), "--threads", "1", "--configs", ",".join(configs),
              "--json", str(out), "--log-dir", str(tmp_path / "logs")])
    assert r.returncode == 0, r.stderr[-3000:]
    d = json.loads(out.read_text())
    meta, summary = d["meta"], d["summary"]
    assert meta["configs"] == configs and meta["cpu"]["model"] and meta["threads"] == 1
    assert meta["fim_route"] == "completions"            # SmolLM2: no FIM tokens
    (rnd,) = d["rounds"]
    for name in configs:
        res = rnd["results"][name]
        fim, tp = res["fim"], res["throughput"]
        assert len(fim["idle"]) == len(fim["loaded"]) == meta["fim_count"]
        assert all(x["ttft_ms"] > 0 and "under_load" in x for x in fim["loaded"])
        assert fim["chat"]["tokens"] and fim["chat"]["text"]
        assert len(tp["requests"]) == meta["clients"] * len(meta["cases"])
        assert tp["tokens"] == sum(x["tokens"] for x in tp["requests"]) > 0
        assert tp["wall_s"] > 0 and tp["tokens_per_s"] > 0
        s = summary["configs"][name]
        assert s["fim"]["idle_p50_ms"] > 0 and s["throughput"]["x_baseline"]
    assert summary["configs"]["localspec-1"]["throughput"]["median_x_baseline"] == 1.0
    ident = summary["identical"]["localspec"]
    if "localspec-2" in configs:
        res = rnd["results"]["localspec-2"]
        n = 1 + 2 * meta["fim_count"] + len(res["throughput"]["requests"])  # chat, FIMs, clients
        assert ident["requests"] == ident["compared"] == ident["identical"] == n, \
            ident["mismatches"]
    assert summary["identical"]["localspec_1_clients"]["identical"] == \
        summary["identical"]["localspec_1_clients"]["compared"]
    assert "| localspec-1 |" in r.stdout and "Identical texts" in r.stdout
    for name in configs:                                  # every server was stopped
        log = Path(rnd["results"][name]["log"])
        assert log.is_file()
    assert not _listening(rnd)


def _listening(rnd) -> bool:
    """Whether any server's port still answers."""
    import socket
    for res in rnd["results"].values():
        with socket.socket() as s:
            s.settimeout(1)
            if s.connect_ex(("127.0.0.1", res["port"])) == 0:
                return True
    return False


def test_bad_configurations_are_one_line():
    r = _run(["--quick", "--configs", "localspec-1,vllm-4"])
    assert r.returncode == 2 and r.stderr.strip().startswith("error: unknown configuration")
    from localspec.bench import llamacpp_build as lb
    if not lb.tool_path(lb.SERVER).is_file():          # not built for the suite's home
        r = _run(["--quick", "--configs", "llama-server-2"])
        assert r.returncode == 2
        assert "scripts/llamacpp_tools.sh --target llama-server" in r.stderr


def _script():
    import importlib.util
    spec = importlib.util.spec_from_file_location("bench_parallel", SCRIPT)
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod                   # its dataclasses look their module up
    spec.loader.exec_module(mod)
    return mod


def test_fim_takes_the_infill_route_on_a_model_with_fim_tokens(tiny_fim_path, _test_home,
                                                               tmp_path):
    """The real measurement's FIM path (/infill, streamed) on the tiny FIM model: the route is
    /infill, the time to first token is read, two slots give the one slot's texts; llama-server
    answers the same request shape where it is built."""
    bp = _script()
    a = bp.build_args(["--quick", "--threads", "1", "--ctx", "2048", "--prefix-lines", "4",
                       "--suffix-lines", "1"])      # a byte vocabulary: ~40 tokens a line
    configs = ["localspec-1"] + (["localspec-2"] if _has_parallel() else [])
    if _llama_server_built(_test_home):
        configs.append("llama-server-1")
    windows = bp.fim_windows(a, 0.45, 2)
    texts = {}
    try:
        for cfg in bp.parse_configs(",".join(configs)):
            port = bp.free_port()
            home = tmp_path / f"{cfg.name}-home"
            home.mkdir()
            cmd, env = bp.server_command(cfg, a, tiny_fim_path, port, home)
            server = bp.Server(cfg, cmd, port, tmp_path / f"{cfg.name}.log", env)
            server.start(300)
            try:
                got = [bp.fim_request(server, p, s, 6) for p, s in windows]
            finally:
                server.stop()
            assert bp.FimRoute.route == "infill", cfg.name
            assert all(0 < r["ttft_ms"] <= r["total_ms"] for r in got), cfg.name
            texts[cfg.name] = [r["text"] for r in got]
    finally:
        bp.stop_all()
    assert any(t for t in texts["localspec-1"])
    if "localspec-2" in texts:
        assert texts["localspec-2"] == texts["localspec-1"]

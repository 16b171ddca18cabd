"""One source per option (issue 40): every command that loads a model declares -m/--model, the
placement options and the sampler through the decorators of localspec/cli/options.py, so an
option means the same everywhere; each command decides whether its outputs join the draft
store (`edit` too, unless --no-learn)."""

from __future__ import annotations

import os
import subprocess
import sys

import click
import pytest

from localspec.cli import cli

LOADS_A_MODEL = ["generate", "chat", "edit", "summarize", "serve", "bench", "calibrate"]
SAMPLES = ["generate", "chat", "edit", "summarize", "bench"]
PLACEMENT = ["model", "n_ctx", "force_ctx", "threads", "gpu_layers", "rpc", "exact"]
SAMPLER = ["temperature", "top_k", "top_p", "min_p", "repeat_penalty"]


def options(command: str) -> dict:
    return {p.name: p for p in cli.commands[command].params if isinstance(p, click.Option)}


def described(option: click.Option) -> tuple:
    """What a user sees of an option, and what it reads."""
    kind = option.type
    return (tuple(option.opts), tuple(option.secondary_opts), option.help, option.default,
            option.envvar, type(kind).__name__, repr(sorted(vars(kind).items())))


@pytest.mark.parametrize("name", PLACEMENT + SAMPLER)
def test_every_command_that_loads_a_model_takes_the_same_option(name):
    commands = LOADS_A_MODEL if name in PLACEMENT else SAMPLES
    seen = {command: described(options(command)[name]) for command in commands}
    assert len(set(seen.values())) == 1, seen


def test_bench_m_is_model_as_everywhere():
    assert options("bench")["model"].opts == ["-m", "--model"]
    assert "target" not in options("bench")


def test_gpu_layers_is_declared_once():
    """doctor words its help for what it does, but the option is the shared one."""
    mine, shared = options("doctor")["gpu_layers"], options("generate")["gpu_layers"]
    assert (mine.opts, mine.default, str(mine.type)) == (shared.opts, shared.default,
                                                         str(shared.type))


@pytest.mark.parametrize("command", LOADS_A_MODEL + ["doctor"])
def test_help_teaches_with_examples(command):
    assert "Examples:" in cli.commands[command].help


def test_rpc_alone_means_every_layer():
    from localspec.cli.options import gpu_layers

    assert gpu_layers({"rpc": ("127.0.0.1:50052",), "gpu_layers": 0}) == -1
    assert gpu_layers({"rpc": ("127.0.0.1:50052",), "gpu_layers": 3}) == 3
    assert gpu_layers({"rpc": (), "gpu_layers": 0}) == 0


def test_bench_settings_are_the_engine_config_every_command_builds():
    """bench's shared options become the EngineConfig generate would build; each mode sets
    only its proposer, store, policy and a cold prompt cache on it."""
    from localspec.bench import parse_modes
    from localspec.cli.bench import bench_settings
    from localspec.cli.options import engine_config

    ctx = click.Context(cli.commands["bench"])
    kw = {name: p.get_default(ctx) for name, p in options("bench").items()}
    kw.update(n_ctx=2048, threads=1, rpc=("127.0.0.1:50052",), draft=None)
    with ctx:
        settings = bench_settings(kw, parse_modes("plain,ngram,hybrid"), rounds=2)
        plain = engine_config(kw, learn=False)
    assert settings.engine.n_gpu_layers == -1 and settings.engine.rpc == plain.rpc
    assert settings.engine.draft == "default-draft" and settings.rounds == 2
    hybrid = settings.mode_config(parse_modes("hybrid")[0])
    assert (hybrid.proposer, hybrid.cache_mb, hybrid.learn, hybrid.n_ctx) == \
        ("hybrid", 0, False, 2048)


# -- learning: explicit per command --------------------------------------------------------------

def _edit(tiny_path, home, *extra):
    env = {**os.environ, "LOCALSPEC_HOME": str(home)}
    return subprocess.run([sys.executable, "-m", "localspec", "edit", "-m", str(tiny_path),
                           "--threads", "1", "--ctx", "2048", "-n", "12", *extra, "rename x",
                           "-"], input=b"def f(x):\n    return x + 1\n", capture_output=True,
                          env=env, timeout=180)


def test_edit_learns_like_the_other_commands_unless_told_not_to(tiny_path, tmp_path):
    """`localspec store --help` says every command that generates adds its outputs: edit did
    not (it had no --learn, and learning was "learn" in its options)."""
    quiet, learning = tmp_path / "quiet", tmp_path / "learning"
    r = _edit(tiny_path, quiet, "--no-learn")
    assert b"Traceback" not in r.stderr, r.stderr
    assert not list(quiet.glob("store/*.lsds"))
    r = _edit(tiny_path, learning)
    assert b"Traceback" not in r.stderr, r.stderr
    assert len(list(learning.glob("store/*.lsds"))) == 1

"""Options shared by every command that generates text, and the objects they build.

stdout carries only generated data; progress, statistics and errors go to stderr.
"""

from __future__ import annotations

import click

from .engine import Engine, EngineConfig
from .errors import LocalspecError
from .policy import PolicyConfig
from .sampling import SamplingParams


def parse_rpc_option(_ctx, _param, value) -> tuple:
    from .rpc import parse_servers

    try:
        return parse_servers(value) if value else ()
    except LocalspecError as e:
        raise click.BadParameter(str(e)) from None


def model_options(default_proposer: str = "ngram"):
    """-m/--model, --proposer and the device/context knobs."""

    def wrap(f):
        opts = [
            click.option("-m", "--model", default="default", show_default=True,
                         envvar="LOCALSPEC_MODEL",
                         help="Catalog name (see `localspec models list`) or path to a .gguf "
                              "file. Env: LOCALSPEC_MODEL."),
            click.option("--proposer", type=click.Choice(["ngram", "draft", "hybrid", "none"]),
                         default=default_proposer, show_default=True,
                         help="Where draft tokens come from: ngram = prompt lookup (free, wins "
                              "when the output repeats the input); draft = the --draft model; "
                              "hybrid = ngram, then the draft model where lookup finds nothing; "
                              "none = plain decoding."),
            click.option("--draft", default=None, envvar="LOCALSPEC_DRAFT",
                         help="Draft model for --proposer draft/hybrid: catalog name (e.g. "
                              "default-draft) or .gguf path; must share the target's tokenizer. "
                              "Where its cost curve says it cannot pay (a small CPU), it is "
                              "dropped with a one-line note unless --k forces drafting. "
                              "Env: LOCALSPEC_DRAFT."),
            click.option("--k", "fixed_k", type=click.IntRange(0, 32), default=None,
                         help="Draft exactly this many tokens per step (default: adaptive, "
                              "from the measured cost curve and running acceptance)."),
            click.option("--exact", is_flag=True, envvar="LOCALSPEC_EXACT",
                         help="Batch-invariant CPU kernels: speculative output is bit-for-bit "
                              "plain decoding's, at the cost of weight repacking (~20-40% slower). "
                              "Env: LOCALSPEC_EXACT=1."),
            click.option("--ctx", "n_ctx", type=click.IntRange(64), default=4096,
                         show_default=True, help="Context size in tokens (prompt + output)."),
            click.option("--threads", type=click.IntRange(1), default=None,
                         help="CPU threads (default: all cores this process may use)."),
            click.option("--gpu-layers", type=int, default=0, show_default=True,
                         help="Layers to offload to the GPU (CUDA/Metal builds) or the --rpc "
                              "servers; -1 = all."),
            click.option("--rpc", default=None, metavar="HOST:PORT[,HOST:PORT]",
                         callback=parse_rpc_option, envvar="LOCALSPEC_RPC",
                         help="Put the model's layers on these `localspec rpc-server`s (llama.cpp's "
                              "RPC backend; all layers unless --gpu-layers says how many). The "
                              "protocol is unauthenticated: trusted networks only. "
                              "Env: LOCALSPEC_RPC."),
        ]
        for opt in reversed(opts):
            f = opt(f)
        return f

    return wrap


def sampling_options(f):
    """--temperature and the rest of the sampler chain, plus --max-tokens and --stop."""
    opts = [
        click.option("-n", "--max-tokens", type=click.IntRange(1), default=256, show_default=True,
                     help="Stop after this many generated tokens."),
        click.option("-t", "--temperature", type=click.FloatRange(0.0), default=0.0,
                     show_default=True, help="0 = greedy (deterministic); > 0 samples."),
        click.option("--top-k", type=click.IntRange(0), default=40, show_default=True,
                     help="Keep the k most likely tokens (0 = off)."),
        click.option("--top-p", type=click.FloatRange(0.0, 1.0), default=0.95,
                     show_default=True, help="Nucleus sampling mass (1.0 = off)."),
        click.option("--min-p", type=click.FloatRange(0.0, 1.0), default=0.05,
                     show_default=True, help="Drop tokens below this fraction of the top "
                                             "probability (0 = off)."),
        click.option("--repeat-penalty", type=click.FloatRange(0.0), default=1.0,
                     show_default=True, help="Penalty for recently seen tokens (1.0 = off)."),
        click.option("--seed", type=int, default=None,
                     help="Random seed: the same seed gives the same text, with or without "
                          "speculation."),
        click.option("--stop", multiple=True, help="Stop string (repeatable); not printed."),
    ]
    for opt in reversed(opts):
        f = opt(f)
    return f


def build_sampling(kw: dict) -> SamplingParams:
    return SamplingParams(temperature=kw["temperature"], top_k=kw["top_k"], top_p=kw["top_p"],
                          min_p=kw["min_p"], repeat_penalty=kw["repeat_penalty"], seed=kw["seed"])


def open_engine(kw: dict) -> Engine:
    proposer = kw["proposer"]
    ctx = click.get_current_context(silent=True)
    chosen = ctx is not None and ctx.get_parameter_source("proposer") not in (
        None, click.core.ParameterSource.DEFAULT)
    if kw.get("draft") and not chosen:
        proposer = "hybrid"   # --draft without --proposer means: use the draft model too
    layers = kw["gpu_layers"]
    if kw.get("rpc") and layers == 0:
        layers = -1           # --rpc alone: every layer on the RPC servers (0 would use none)
    config = EngineConfig(proposer=proposer, draft=kw.get("draft"), n_ctx=kw["n_ctx"],
                          exact=kw.get("exact", False),
                          n_threads=kw["threads"],
                          n_gpu_layers=layers, rpc=kw.get("rpc") or (),
                          policy=PolicyConfig(fixed_k=kw["fixed_k"]))
    return Engine(kw["model"], config, progress=lambda msg: click.echo(msg, err=True))


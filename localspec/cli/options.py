"""Options shared by every command that generates text, and the objects they build. Defaults come
from the dataclasses they fill (SamplingParams, EngineConfig), so they live once.

stdout carries only generated data; progress, statistics and errors go to stderr.
"""

from __future__ import annotations

import sys

import click

from ..apps.checks import number_problem
from ..speculative.config import PROPOSERS, EngineConfig
from ..speculative.engine import Engine
from ..llama import default_threads
from ..errors import LocalspecError
from ..files import internal_error_line, system_error_line
from ..text import check_utf8, decode_utf8
from ..policy.config import K_LIMIT, PolicyConfig
from ..llama.rpc import parse_servers
from ..speculative.sampling import SamplingParams

COMMAND = {"help_option_names": ["-h", "--help"], "max_content_width": 100}
INTERNAL_ERROR_EXIT = 70         # sysexits.h EX_SOFTWARE: not the user's mistake
SAMPLING = SamplingParams()      # the defaults every sampling option shows
ENGINE = EngineConfig()


class Number(click.ParamType):
    """A float option checked by the rule JSON requests use (apps.checks.number_problem):
    finite, in range. click's FloatRange lets nan and inf through."""

    name = "number"

    def __init__(self, lo=None, hi=None, lo_open=False):
        self.lo, self.hi, self.lo_open = lo, hi, lo_open

    def convert(self, value, param, ctx):
        if isinstance(value, float):
            v = value
        else:
            try:
                v = float(value)
            except ValueError:
                self.fail(f"{value!r} is not a number.", param, ctx)
        problem = number_problem(v, self.lo, self.hi, lo_open=self.lo_open)
        if problem:
            self.fail(f"{problem}, got {value}.", param, ctx)
        return v

    def get_metavar(self, param, ctx=None):
        lo = "" if self.lo is None else f"{self.lo}{'<' if self.lo_open else '<='}"
        hi = "" if self.hi is None else f"<={self.hi}"
        return f"FLOAT {lo}x{hi}" if lo or hi else "FLOAT"


def parse_rpc_option(_ctx, _param, value) -> tuple:
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
            click.option("--proposer", type=click.Choice(list(PROPOSERS)),
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
            click.option("--k", "fixed_k", type=click.IntRange(0, K_LIMIT), default=None,
                         help=f"Draft exactly this many tokens per step, at most {K_LIMIT} "
                              "(default: adaptive, from the measured cost curve and running "
                              "acceptance)."),
            click.option("--exact", is_flag=True, envvar="LOCALSPEC_EXACT",
                         help="Insist on batch-invariant CPU kernels (speculative output "
                              "bit-for-bit plain decoding's): localspec's patched ggml-cpu, "
                              "which install.sh builds and every run loads by default, at "
                              "llama.cpp's own speed (docs/exactness.md). With this flag a "
                              "missing library is one error line instead of a fallback to "
                              "llama.cpp's own kernels and the near-tie guard "
                              "(LOCALSPEC_EXACT=0 chooses those). Env: LOCALSPEC_EXACT=1."),
            click.option("--ctx", "n_ctx", type=click.IntRange(64), default=ENGINE.n_ctx,
                         show_default=True, help="Context size in tokens (prompt + output)."),
            click.option("--threads", type=click.IntRange(1), default=None,
                         help="CPU threads (default: all cores this process may use)."),
            click.option("--gpu-layers", type=int, default=ENGINE.n_gpu_layers, show_default=True,
                         help="Layers to offload to the GPU (CUDA/Metal builds) or the --rpc "
                              "servers; -1 = all."),
            click.option("--cache-mb", type=Number(0), default=None,
                         help="RAM for saved prompt states (KV rows) that later requests with "
                              "the same beginning reuse instead of re-reading (default: two "
                              "full contexts' worth, e.g. 224 MB for the 1.5B model at 4096 "
                              "tokens; 0 turns the prompt cache off)."),
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


def learn_option(default, note: str = ""):
    """--learn/--no-learn: whether this run's outputs join the draft store (speculative/store.py).
    `default` per command (None: the command decides, e.g. serve by its transport)."""
    shown = "" if default is None else f" [default: {'learn' if default else 'no-learn'}]"
    return click.option(
        "--learn/--no-learn", default=default,
        help="Keep this run's outputs in the draft store, a file per model under "
             "$LOCALSPEC_HOME/store (owner-only), so later requests and runs draft what was "
             "written before: faster, never different text. --no-learn writes nothing and "
             "still drafts from what is stored; LOCALSPEC_STORE_MB=0 turns the store off, "
             "`localspec store clear` empties it." + (f" {note}" if note else "") + shown)


def sampling_options(f):
    """--temperature and the rest of the sampler chain, plus --max-tokens and --stop."""
    opts = [
        click.option("-n", "--max-tokens", type=click.IntRange(1), default=256, show_default=True,
                     help="Stop after this many generated tokens."),
        click.option("-t", "--temperature", type=Number(0.0), default=SAMPLING.temperature,
                     show_default=True, help="0 = greedy (deterministic); > 0 samples."),
        click.option("--top-k", type=click.IntRange(0), default=SAMPLING.top_k, show_default=True,
                     help="Keep the k most likely tokens (0 = off)."),
        click.option("--top-p", type=Number(0.0, 1.0), default=SAMPLING.top_p,
                     show_default=True, help="Nucleus sampling mass (1.0 = off)."),
        click.option("--min-p", type=Number(0.0, 1.0), default=SAMPLING.min_p,
                     show_default=True, help="Drop tokens below this fraction of the top "
                                             "probability (0 = off)."),
        click.option("--repeat-penalty", type=Number(0.0, lo_open=True),
                     default=SAMPLING.repeat_penalty, show_default=True, help="Penalty for recently seen tokens (1.0 = off)."),
        click.option("--seed", type=int, default=None,
                     help="Random seed: the same seed gives the same text, with or without "
                          "speculation."),
        click.option("--stop", multiple=True, callback=_utf8_values,
                     help="Stop string (repeatable); not printed."),
    ]
    for opt in reversed(opts):
        f = opt(f)
    return f


def _utf8_values(_ctx, param, values):
    return tuple(check_utf8(v, f"--{param.name}") for v in values)


def text_arg(value: str, what: str) -> str:
    """A text argument checked for bytes that are not UTF-8; `-` reads all of stdin."""
    if value == "-":
        return decode_utf8(sys.stdin.buffer.read(), "stdin")
    return check_utf8(value, what)


def build_sampling(kw: dict) -> SamplingParams:
    return SamplingParams(temperature=kw["temperature"], top_k=kw["top_k"], top_p=kw["top_p"],
                          min_p=kw["min_p"], repeat_penalty=kw["repeat_penalty"], seed=kw["seed"])


def engine_config(kw: dict) -> EngineConfig:
    """The engine's one typed config, from the options of model_options() (and serve's
    cache_disk): everything below the command line receives this, never the options dict."""
    proposer = kw["proposer"]
    ctx = click.get_current_context(silent=True)
    chosen = ctx is not None and ctx.get_parameter_source("proposer") not in (
        None, click.core.ParameterSource.DEFAULT)
    if kw.get("draft") and not chosen:
        proposer = "hybrid"   # --draft without --proposer means: use the draft model too
    usable = default_threads()
    if kw["threads"] and kw["threads"] > usable:
        click.echo(f"warning: --threads {kw['threads']} is more than the {usable} cores this "
                   "process may use; llama.cpp's threads then wait on each other and decoding "
                   f"slows down many times over (try --threads {usable}).", err=True)
    layers = kw["gpu_layers"]
    if kw.get("rpc") and layers == 0:
        layers = -1           # --rpc alone: every layer on the RPC servers (0 would use none)
    return EngineConfig(proposer=proposer, draft=kw.get("draft"), n_ctx=kw["n_ctx"],
                        exact=kw.get("exact", False), n_threads=kw["threads"],
                        n_gpu_layers=layers, rpc=kw.get("rpc") or (),
                        cache_mb=kw.get("cache_mb"), cache_disk=kw.get("cache_disk", False),
                        store="learn" in kw, learn=bool(kw.get("learn")),
                        policy=PolicyConfig(fixed_k=kw["fixed_k"]))


def open_engine(kw: dict) -> Engine:
    """The engine for -m/--model and the options, with progress lines on stderr."""
    return Engine(kw["model"], engine_config(kw), progress=lambda msg: click.echo(msg, err=True))


def run_command(command: click.Command, argv=None, prog_name=None) -> None:
    """Run a click command with localspec's rules: user errors are one line on stderr (exit 1),
    Ctrl-C is "interrupted" (exit 130), a bug is one line naming the file that holds its
    traceback (exit 70, EX_SOFTWARE): never a traceback on the terminal."""
    try:
        code = command.main(argv, prog_name=prog_name, standalone_mode=False)
        sys.exit(code if isinstance(code, int) else 0)   # a command's ctx.exit(n) returns n
    except click.exceptions.Exit as e:
        sys.exit(e.exit_code)
    except click.ClickException as e:
        e.show()
        sys.exit(e.exit_code)
    except click.exceptions.Abort:
        click.echo("interrupted", err=True)
        sys.exit(130)
    except LocalspecError as e:
        click.echo(f"error: {e}", err=True)
        sys.exit(1)
    except KeyboardInterrupt:
        click.echo("\ninterrupted", err=True)
        sys.exit(130)
    except BrokenPipeError:
        sys.exit(0)
    except OSError as e:              # the machine's answer (disk full...) is no bug of ours
        line = system_error_line(e)
        click.echo(f"error: {line or internal_error_line(e)}", err=True)
        sys.exit(1 if line else INTERNAL_ERROR_EXIT)
    except Exception as e:            # a bug: one line here, the traceback in a file
        click.echo(f"error: {internal_error_line(e)}", err=True)
        sys.exit(INTERNAL_ERROR_EXIT)

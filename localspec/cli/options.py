"""Options shared by every command that generates text, and the objects they build. Defaults come
from the dataclasses they fill (SamplingParams, EngineConfig), so they live once.

stdout carries only generated data; progress, statistics and errors go to stderr.
"""

from __future__ import annotations

import contextlib
import os
import sys
from typing import Iterator

import click

from ..apps.checks import number_problem
from ..speculative.config import PROPOSERS, EngineConfig
from ..speculative.engine import Engine
from ..speculative.factory import load_model
from ..speculative.parallel import MAX_SLOTS, Slots, check_parallel
from ..errors import LocalspecError
from ..files import internal_error_line, system_error_line
from ..text import check_utf8, decode_utf8
from ..policy.config import K_LIMIT, PolicyConfig
from ..llama.rpc import parse_servers
from ..speculative.sampling import SamplingParams
from .limits import CTX_MAX, CTX_TRAINING_FACTOR, cap_threads, check_context, note_rounded_context

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


def model_name(_ctx, param, value):
    """A -m/--draft value: an empty one is one line that says so (it would otherwise name the
    current folder: "  is a directory")."""
    if value is not None and not value.strip():
        what = "draft model" if param.name == "draft" else "model"
        raise LocalspecError(f"the {what} name is empty; give a catalog name (`localspec models "
                             "list`) or the path of a .gguf file.")
    return value


def model_option(f):
    """-m/--model: the model every command that loads one names the same way."""
    return click.option("-m", "--model", default="default", show_default=True,
                        envvar="LOCALSPEC_MODEL", callback=model_name,
                        help="Catalog name (see `localspec models list`) or path to a .gguf "
                             "file. Env: LOCALSPEC_MODEL.")(f)


def draft_option(note: str = ""):
    """--draft: the draft model (catalog name or path)."""
    return click.option(
        "--draft", default=None, envvar="LOCALSPEC_DRAFT", callback=model_name,
        help="Draft model: catalog name (e.g. default-draft) or .gguf path; must share the "
             "target's tokenizer." + (f" {note}" if note else "") + " Env: LOCALSPEC_DRAFT.")


def proposer_options(default_proposer: str = "ngram"):
    """--proposer, --draft and --k: where draft tokens come from and how many."""
    return _stack([
        click.option("--proposer", type=click.Choice(list(PROPOSERS)),
                     default=default_proposer, show_default=True,
                     help="Where draft tokens come from: ngram = prompt lookup (free, wins "
                          "when the output repeats the input); draft = the --draft model; "
                          "hybrid = ngram, then the draft model where lookup finds nothing; "
                          "none = plain decoding."),
        draft_option("Used by --proposer draft/hybrid (--draft alone means hybrid). Where "
                     "its cost curve says it cannot pay (a small CPU), it is dropped with a "
                     "one-line note unless --k forces drafting."),
        click.option("--k", "fixed_k", type=click.IntRange(0, K_LIMIT), default=None,
                     help=f"Draft exactly this many tokens per step, at most {K_LIMIT} "
                          "(default: adaptive, from the measured cost curve and running "
                          "acceptance)."),
    ])


def gpu_layers_option(help_text: str = "Layers to offload to the GPU (CUDA/Metal/Vulkan builds) "
                                       "or the --rpc servers; -1 = all."):
    return click.option("--gpu-layers", type=int, default=ENGINE.n_gpu_layers,
                        show_default=True, help=help_text)


def placement_options(f):
    """Where and how large the model runs: --exact, --ctx, --force-ctx, --threads,
    --gpu-layers, --rpc."""
    return _stack([
        click.option("--exact", is_flag=True, envvar="LOCALSPEC_EXACT",
                     help="Insist on batch-invariant kernels (speculative output "
                          "bit-for-bit plain decoding's): on the CPU localspec's patched "
                          "ggml-cpu, which install.sh builds and every run loads by default, "
                          "at llama.cpp's own speed (docs/exactness.md); on a Vulkan or CUDA GPU "
                          "(--gpu-layers -1) the row limit of localspec's patched Vulkan or "
                          "CUDA library, which this flag switches on (docs/gpu.md). With this "
                          "flag a missing library is one error line instead of a fallback to "
                          "llama.cpp's own kernels and the near-tie guard "
                          "(LOCALSPEC_EXACT=0 chooses those). Refused with RPC servers and "
                          "GPU backends without the patch (Metal, or an unpatched build). "
                          "Env: LOCALSPEC_EXACT=1."),
        click.option("--ctx", "n_ctx", type=click.IntRange(64, CTX_MAX), default=ENGINE.n_ctx,
                     show_default=True,
                     help="Context size in tokens (prompt + output); llama.cpp rounds it up "
                          "to a multiple of 256. More than the model was trained on is a "
                          f"warning, more than {CTX_TRAINING_FACTOR}x that or more than the "
                          "memory available for its KV cache is refused (--force-ctx)."),
        click.option("--force-ctx", is_flag=True, envvar="LOCALSPEC_FORCE_CTX",
                     help="Take --ctx as given: no limit from the model's training context or "
                          "from this machine's available memory. Env: LOCALSPEC_FORCE_CTX=1."),
        click.option("--threads", type=click.IntRange(1), default=None,
                     help="CPU threads (default, and at most: the cores this process may "
                          "use)."),
        gpu_layers_option(),
        click.option("--rpc", default=None, metavar="HOST:PORT[,HOST:PORT]",
                     callback=parse_rpc_option, envvar="LOCALSPEC_RPC",
                     help="Put the model's layers on these `localspec rpc-server`s (llama.cpp's "
                          "RPC backend; all layers unless --gpu-layers says how many). The "
                          "protocol is unauthenticated: trusted networks only. "
                          "Env: LOCALSPEC_RPC."),
    ])(f)


def cache_option(f):
    return click.option("--cache-mb", type=Number(0), default=None,
                        help="RAM for saved prompt states (KV rows) that later requests with "
                             "the same beginning reuse instead of re-reading (default: two "
                             "full contexts' worth, e.g. 224 MB for the 1.5B model at 4096 "
                             "tokens; 0 turns the prompt cache off).")(f)


def model_options(default_proposer: str = "ngram"):
    """Everything a generating command's engine needs: the model, the proposer, placement and
    the prompt cache."""
    return _stack([model_option, proposer_options(default_proposer), placement_options,
                   cache_option])


def _stack(decorators: list):
    """Apply decorators so that --help lists their options in the order given."""
    def wrap(f):
        for decorate in reversed(decorators):
            f = decorate(f)
        return f
    return wrap


def parallel_option(f):
    """--parallel N: how many generations run at once, each in its own slot of one context."""
    return click.option(
        "--parallel", type=click.IntRange(1, MAX_SLOTS), default=1, show_default=True, metavar="N",
        help=f"Run up to N generations at once (at most {MAX_SLOTS}): serve answers N requests "
             "together, summarize reads N files together. The model is loaded once; --ctx is "
             "the total, each slot holds --ctx/N rounded down to a multiple of 256 (--ctx 8192 "
             "--parallel 4: 2048 a request). Each request gets the text it would get alone; "
             "drafts come from n-gram lookup (no --draft model, no draft store).")(f)


def parallel_slots(kw: dict) -> int:
    """--parallel, checked against --ctx and the proposer before anything loads: a usage error
    naming the limit."""
    n = kw.get("parallel", 1)
    try:
        check_parallel(n, kw["n_ctx"])
    except LocalspecError as e:
        raise click.BadParameter(str(e), param_hint="'--parallel'") from None
    if n > 1 and _proposer(kw) not in ("ngram", "none"):
        raise click.BadParameter(f"--parallel {n} runs n-gram lookup or plain decoding; a draft "
                                 "model would need a context per slot (use --proposer ngram).",
                                 param_hint="'--parallel'")
    return n


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


def sampler_options(seed=None, seed_note: str = ""):
    """The sampler chain: -t, --top-k, --top-p, --min-p, --repeat-penalty, --seed."""
    return _stack([
        click.option("-t", "--temperature", type=Number(0.0), default=SAMPLING.temperature,
                     show_default=True, help="0 = greedy (deterministic); > 0 samples."),
        click.option("--top-k", type=click.IntRange(0), default=SAMPLING.top_k,
                     show_default=True, help="Keep the k most likely tokens (0 = off)."),
        click.option("--top-p", type=Number(0.0, 1.0), default=SAMPLING.top_p,
                     show_default=True, help="Nucleus sampling mass (1.0 = off)."),
        click.option("--min-p", type=Number(0.0, 1.0), default=SAMPLING.min_p,
                     show_default=True, help="Drop tokens below this fraction of the top "
                                             "probability (0 = off)."),
        click.option("--repeat-penalty", type=Number(0.0, lo_open=True),
                     default=SAMPLING.repeat_penalty, show_default=True,
                     help="Penalty for recently seen tokens (1.0 = off)."),
        click.option("--seed", type=int, default=seed, show_default=seed is not None,
                     help="Random seed: the same seed gives the same text, with or without "
                          "speculation." + (f" {seed_note}" if seed_note else "")),
    ])


def sampling_options(max_tokens: int = 256):
    """-n/--max-tokens (this command's default), the sampler chain and --stop."""
    return _stack([
        click.option("-n", "--max-tokens", type=click.IntRange(1), default=max_tokens,
                     show_default=True, help="Stop after this many generated tokens."),
        sampler_options(),
        click.option("--stop", multiple=True, callback=_utf8_values,
                     help="Stop string (repeatable); not printed."),
    ])


def _utf8_values(_ctx, param, values):
    return tuple(check_utf8(v, f"--{param.name}") for v in values)


def text_arg(value: str, what: str) -> str:
    """A text argument checked for bytes that are not UTF-8; `-` reads all of stdin."""
    if value == "-":
        return decode_utf8(stdin("give the text as an argument").buffer.read(), "stdin")
    return check_utf8(value, what)


def stdin(instead: str):
    """sys.stdin, or one error line when the process was started with it closed (`<&-`: Python
    then has no sys.stdin at all, and the next file opened takes its descriptor)."""
    if sys.stdin is None:
        raise LocalspecError(f"stdin is closed, so there is nothing to read; pipe the text in or "
                             f"{instead}.")
    return sys.stdin


def build_sampling(kw: dict) -> SamplingParams:
    return SamplingParams(temperature=kw["temperature"], top_k=kw["top_k"], top_p=kw["top_p"],
                          min_p=kw["min_p"], repeat_penalty=kw["repeat_penalty"], seed=kw["seed"])


def engine_config(kw: dict, *, learn: bool) -> EngineConfig:
    """The engine's one typed config, from the options of model_options() or placement_options()
    alone (and serve's cache_disk): everything below the command line receives this, never the
    options dict. `learn`: whether this run's outputs join the draft store, each command's
    own decision (its --learn/--no-learn, or False where it generates nothing worth keeping)."""
    return EngineConfig(proposer=_proposer(kw), draft=kw.get("draft"), n_ctx=kw["n_ctx"],
                        exact=kw["exact"], n_threads=cap_threads(kw["threads"]),
                        n_gpu_layers=gpu_layers(kw), rpc=kw["rpc"] or (),
                        cache_mb=kw.get("cache_mb"), cache_disk=kw.get("cache_disk", False),
                        store=True, learn=learn, policy=PolicyConfig(fixed_k=kw.get("fixed_k")))


def gpu_layers(kw: dict) -> int:
    """--gpu-layers, where --rpc alone means every layer on the RPC servers (0 would put none
    there)."""
    return -1 if kw.get("rpc") and kw["gpu_layers"] == 0 else kw["gpu_layers"]


def _proposer(kw: dict) -> str:
    """--proposer; --draft without --proposer means: use the draft model too (hybrid)."""
    if "proposer" not in kw:
        return "none"              # a command without speculation (calibrate; bench's modes)
    ctx = click.get_current_context(silent=True)
    chosen = ctx is not None and ctx.get_parameter_source("proposer") not in (
        None, click.core.ParameterSource.DEFAULT)
    return "hybrid" if kw.get("draft") and not chosen else kw["proposer"]


@contextlib.contextmanager
def open_engine(kw: dict, *, learn: bool) -> Iterator[Engine]:
    """The engine for -m/--model and the options, with progress lines on stderr. The model is
    loaded first so that --ctx is checked against it before the context is allocated."""
    config = engine_config(kw, learn=learn)
    model = load_model(kw["model"], config.n_gpu_layers, config.exact, config.rpc)
    try:
        if not kw["force_ctx"]:
            check_context(model, config)
        with Engine(model, config, progress=lambda msg: click.echo(msg, err=True)) as engine:
            note_rounded_context(config.n_ctx, engine.ctx.n_ctx)
            yield engine
    finally:
        model.close()           # handed in, so the engine leaves it open: after the engine


@contextlib.contextmanager
def open_engines(kw: dict, *, learn: bool, prepare: bool = False) -> Iterator[list]:
    """The engines of --parallel N: [one plain Engine] (open_engine) for 1, else N engines over
    one model and one shared context (speculative/parallel.py), one per slot thread. `prepare`:
    measure (or load) the cost curve first, once for all slots (a server, before requests)."""
    n = parallel_slots(kw)
    if n == 1:
        with open_engine(kw, learn=learn) as engine:
            if prepare:
                engine.prepare()
            yield [engine]
        return
    config = engine_config(kw, learn=learn)
    model = load_model(kw["model"], config.n_gpu_layers, config.exact, config.rpc)
    try:
        if not kw["force_ctx"]:
            check_context(model, config, slots=n)
        with Slots(model, config, n, progress=lambda msg: click.echo(msg, err=True)) as slots:
            note_rounded_context(config.n_ctx, slots.n_ctx, slots=n)
            if prepare:
                slots.prepare()
            yield slots.engines
    finally:
        model.close()


def run_command(command: click.Command, argv=None, prog_name=None) -> None:
    """Run a click command with localspec's rules: user errors are one line on stderr (exit 1),
    Ctrl-C is "interrupted" (exit 130), a closed stdout (`| head`) a quiet exit 0, a bug one
    line naming the file that holds its traceback (exit 70, EX_SOFTWARE): never a traceback on
    the terminal."""
    sys.exit(_exit_code(command, argv, prog_name))


def _exit_code(command: click.Command, argv, prog_name) -> int:
    # The command is invoked here, not through click's main(), which turns a closed stdout
    # into exit 1. Returns from inside each `except`: leaving it drops the exception and the
    # frames it holds (a generator among them) while this process can still run their cleanup.
    try:
        args = sys.argv[1:] if argv is None else list(argv)
        with command.make_context(prog_name or "localspec", args) as ctx:
            code = command.invoke(ctx)
        return code if isinstance(code, int) else 0
    except click.exceptions.Exit as e:          # ctx.exit(n), --help, --version
        return e.exit_code
    except click.ClickException as e:
        e.show()
        return e.exit_code
    except (click.exceptions.Abort, EOFError):
        click.echo("interrupted", err=True)
        return 130
    except LocalspecError as e:
        click.echo(f"error: {e}", err=True)
        return 1
    except KeyboardInterrupt:
        click.echo("\ninterrupted", err=True)
        return 130
    except BrokenPipeError:       # the reader went away (`| head`): what it wanted, it has
        _stdout_to_devnull()
        return 0
    except OSError as e:          # the machine's answer (disk full...) is no bug of ours
        line = system_error_line(e)
        click.echo(f"error: {line or internal_error_line(e)}", err=True)
        return 1 if line else INTERNAL_ERROR_EXIT
    except Exception as e:        # a bug: one line here, the traceback in a file
        click.echo(f"error: {internal_error_line(e)}", err=True)
        return INTERNAL_ERROR_EXIT


def write_out(text: str) -> None:
    """Write generated text to stdout now (flushed). A write the system refuses (`> /dev/full`,
    a full disk behind a redirect) is one line that names stdout, not the cache folder; a
    closed pipe (`| head`) stays a BrokenPipeError, a quiet exit."""
    try:
        sys.stdout.write(text)
        sys.stdout.flush()
    except BrokenPipeError:
        raise
    except OSError as e:
        _stdout_to_devnull()            # what is still buffered must not fail again at exit
        raise LocalspecError(f"could not write the output (stdout): {e.strerror or e}.") from None


def _stdout_to_devnull() -> None:
    """Point stdout at /dev/null, so the flush at exit of what is still buffered does not fail
    again ("Exception ignored ... BrokenPipeError", exit 120)."""
    try:
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        os.close(devnull)
    except (OSError, ValueError, AttributeError):   # no stdout at all: nothing to flush
        pass

"""`localspec bench`: options, tables on stdout, `--json` and `--plot`. The run is localspec.bench."""

from __future__ import annotations

import datetime
import sys
from dataclasses import replace
from pathlib import Path
from typing import Optional

import click

from ..bench import KINDS, Bench, BenchSettings, load_workloads, parse_modes, summarize
from ..bench.report import (format_rows, format_summary, format_versus, plot_ratios,
                            require_matplotlib, versus_llamacpp)
from ..bench.runner import setup_record, write_json
from .limits import check_context
from .options import (COMMAND, build_sampling, draft_option, engine_config, model_option,
                      placement_options, run_command, sampler_options)

DEFAULT_DRAFT = "default-draft"


def _csv(_ctx, _param, value):
    return [s.strip() for s in value.split(",") if s.strip()] if value else None


@click.command(context_settings=COMMAND)
@click.option("--workloads", type=click.Path(dir_okay=False, path_type=Path), default=None,
              help="Workloads JSONL file (default: the 20 cases shipped with localspec).")
@model_option
@click.option("--modes", default="plain,ngram,peer", show_default=True,
              help="Comma-separated: plain, ngram (adaptive k), store (ngram with the draft "
                   "store of past outputs, in memory, empty at the start of each workload "
                   "session), draft, hybrid (n-gram, then the "
                   "draft model), peer (llama-cpp-python's LlamaPromptLookupDecoding, k=10); "
                   "add -kN to any but plain to draft exactly N tokens (ngram-k3, peer-k4; "
                   "N at most 64 but for peer). llamacpp-mod, llamacpp-simple: llama.cpp's own "
                   "n-gram speculation (its llama-speculative-simple, built once by "
                   "scripts/llamacpp_tools.sh), each over llamacpp-plain, the same binary's "
                   "plain decoding, which runs with them.")
@draft_option(f"Used by the draft and hybrid modes [default: {DEFAULT_DRAFT}].")
@click.option("--kinds", callback=_csv, default=None,
              help=f"Only these kinds ({','.join(KINDS)}).")
@click.option("--cases", callback=_csv, default=None,
              help="Only these case ids, run in the order given.")
@click.option("-n", "--max-tokens", type=click.IntRange(1), default=None,
              help="Cap every case's generation budget (default: each case's own max_tokens).")
@sampler_options(seed=0, seed_note="Fixed here, unlike generate's: a benchmark repeats. At "
                                   "-t 0 (greedy) every mode must match plain token for "
                                   "token; above it, the n-gram modes must match plain under "
                                   "the same seed.")
@placement_options
@click.option("--rounds", type=click.IntRange(1), default=1, show_default=True,
              help="Run every case this many times in every mode, the mode order reversed each "
                   "round; tok/s and ratios are medians of the rounds (each round's ratio from "
                   "runs made side by side), with their range. On a shared 2-core box one run of "
                   "a short case moves by ~10%, a median of 3 by ~5%, of 9 by ~3-4% "
                   "(docs/benchmarks.md); rounds after the first keep the "
                   "prompt's KV rows but its last chunk, so they cost little more than decoding.")
@click.option("--lockstep", is_flag=True,
              help="Run the engine modes of a case together, taking turns a step or so at a "
                   "time (the one with fewer tokens goes next), each timed only during its own "
                   "turns: drift of a shared machine hits every mode alike, so small differences "
                   "show in fewer rounds. Peers still run one after another.")
@click.option("--no-warmup", is_flag=True, help="Skip the warm-up request per mode.")
@click.option("--json", "json_path", type=click.Path(dir_okay=False, path_type=Path),
              default=None, help="Also write every row, the summary and the setup as JSON.")
@click.option("--plot", "plot_path", type=click.Path(dir_okay=False, path_type=Path),
              default=None, help="Also draw a bar chart of ratios to plain (needs matplotlib: "
                                 "pip install 'localspec[plot]').")
def bench(workloads, modes, kinds, cases, rounds, lockstep, no_warmup, json_path, plot_path,
          **kw):
    """Benchmark decoding modes side by side on the same cases and the same model.

    Every case runs in every mode in one process, modes interleaved case by case after a warm-up,
    each request starting from an empty KV cache. Tables go to stdout (Markdown), progress to
    stderr. Ratios are decode tokens/s over plain decoding of the same case.

    \b
    Examples:
      localspec bench                                   # 20 cases x plain,ngram,peer
      localspec bench --kinds chat --modes plain,ngram,ngram-k3 -n 64
      localspec bench --cases sum-with,chat-haiku --json out.json --plot out.png
      localspec bench --modes plain,ngram --rounds 3   # medians: a noisy machine
      localspec bench --modes plain,ngram --lockstep --rounds 3   # and drift cancelled
      localspec bench --kinds code-edit -n 256 \\
          --modes plain,ngram,llamacpp-plain,llamacpp-mod,llamacpp-simple   # vs llama.cpp
    """
    if plot_path is not None:
        require_matplotlib()
    for k in kinds or ():
        if k not in KINDS:
            raise click.BadParameter(f"unknown kind {k!r}; use {', '.join(KINDS)}.",
                                     param_hint="--kinds")
    mode_list = parse_modes(modes)
    selected = load_workloads(workloads, kinds, cases)
    settings = bench_settings(kw, mode_list, warmup=not no_warmup, rounds=rounds,
                              lockstep=lockstep)
    say = lambda msg: click.echo(_clear_live() + msg, err=True)
    live = _live_writer() if sys.stderr.isatty() else None
    started = datetime.datetime.now(datetime.timezone.utc)
    interrupted = False
    check = None if kw["force_ctx"] else lambda model: check_context(model, settings.engine)
    with Bench(mode_list, settings, say=say, live=live, check_model=check) as b:
        say(f"benchmarking {b.model_path.name}: {len(selected)} cases x "
            f"{', '.join(m.name for m in mode_list)}, {b.n_threads} threads")
        meta = {}

        def save(rows, done=False):   # rewritten after every case: a killed run keeps its rows
            if not meta:
                meta.update(setup_record(b, settings, started))
            meta["finished"] = done
            if json_path is not None:
                write_json(json_path, meta, rows)

        try:
            b.run(selected, on_case=save)
        except KeyboardInterrupt:
            interrupted = True
            say("interrupted: reporting the cases that finished")
        save(b.rows, done=not interrupted)
        rows = b.rows
    click.echo(format_rows(rows))
    click.echo()
    click.echo(format_summary(summarize(rows)))
    versus = versus_llamacpp(rows)
    if versus:
        click.echo()
        click.echo("localspec's ratio to plain over llama.cpp's ratio to its own plain:")
        click.echo(format_versus(versus))
    if json_path is not None:
        say(f"wrote {json_path}")
    if plot_path is not None and rows:
        plot_ratios(rows, plot_path)
        say(f"wrote {plot_path}")
    if interrupted:
        sys.exit(130)


def bench_settings(kw: dict, modes: list, **run) -> BenchSettings:
    """The shared options, through the same EngineConfig every command builds (each mode then
    sets its own proposer, store and policy on it), with the draft model only where a mode
    drafts with one."""
    engine = engine_config(kw, learn=False)     # a benchmark keeps nothing it generates
    uses_draft = any(m.proposer in ("draft", "hybrid") for m in modes)
    engine = replace(engine, draft=(kw["draft"] or DEFAULT_DRAFT) if uses_draft else None)
    return BenchSettings(kw["model"], engine, build_sampling(kw),
                         kw["max_tokens"], **run)


# -- live progress -------------------------------------------------------------------------------
_live_state = {"shown": False}


def _live_writer():
    def write(msg: str) -> None:
        sys.stderr.write("\r\033[K" + msg)
        sys.stderr.flush()
        _live_state["shown"] = True
    return write


def _clear_live() -> str:
    if _live_state["shown"]:
        _live_state["shown"] = False
        return "\r\033[K"
    return ""


def main(argv: Optional[list] = None) -> None:
    """Run `bench` alone (python -m localspec.cli.bench ...), with one-line user errors."""
    run_command(bench, argv, prog_name="localspec bench")


if __name__ == "__main__":
    main()

"""`localspec bench`: options, tables on stdout, `--json` and `--plot`. The logic is in bench.py."""

from __future__ import annotations

import datetime
import json
import os
import platform
import sys
from dataclasses import asdict
from pathlib import Path
from typing import Optional, Sequence

import click

from . import __version__
from .bench import KINDS, Bench, BenchSettings, load_workloads, parse_modes, summarize
from .cli_common import parse_rpc_option
from .errors import LocalspecError
from .sampling import SamplingParams


def _csv(_ctx, _param, value):
    return [s.strip() for s in value.split(",") if s.strip()] if value else None


@click.command(context_settings={"help_option_names": ["-h", "--help"], "max_content_width": 100})
@click.option("--workloads", type=click.Path(dir_okay=False, path_type=Path), default=None,
              help="Workloads JSONL file (default: the 20 cases shipped with localspec).")
@click.option("-m", "--target", default="default", show_default=True, envvar="LOCALSPEC_MODEL",
              help="Catalog name or .gguf path of the model to benchmark. Env: LOCALSPEC_MODEL.")
@click.option("--draft", default="default-draft", show_default=True,
              help="Draft model for the draft and hybrid modes (catalog name or .gguf path).")
@click.option("--modes", default="plain,ngram,peer", show_default=True,
              help="Comma-separated: plain, ngram (adaptive k), draft, hybrid (n-gram, then the "
                   "draft model), peer (llama-cpp-python's LlamaPromptLookupDecoding, k=10); "
                   "add -kN to any but plain to draft exactly N tokens (ngram-k3, peer-k4).")
@click.option("--kinds", callback=_csv, default=None,
              help=f"Only these kinds ({','.join(KINDS)}).")
@click.option("--cases", callback=_csv, default=None,
              help="Only these case ids, run in the order given.")
@click.option("-n", "--max-tokens", type=click.IntRange(1), default=None,
              help="Cap every case's generation budget (default: each case's own max_tokens).")
@click.option("-t", "--temperature", type=click.FloatRange(0.0), default=0.0, show_default=True,
              help="0 = greedy, where every mode must match plain token for token; > 0 samples, "
                   "and n-gram modes must then match plain under the same --seed.")
@click.option("--seed", type=int, default=0, show_default=True, help="Seed for sampled runs.")
@click.option("--top-k", type=click.IntRange(0), default=40, show_default=True)
@click.option("--top-p", type=click.FloatRange(0.0, 1.0), default=0.95, show_default=True)
@click.option("--min-p", type=click.FloatRange(0.0, 1.0), default=0.05, show_default=True)
@click.option("--ctx", "n_ctx", type=click.IntRange(64), default=4096, show_default=True,
              help="Context size of every mode (prompt + output).")
@click.option("--threads", type=click.IntRange(1), default=None,
              help="CPU threads for every mode (default: all cores this process may use).")
@click.option("--gpu-layers", type=int, default=0, show_default=True,
              help="Layers to offload to the GPU (CUDA/Metal builds) or the --rpc servers; "
                   "-1 = all.")
@click.option("--rpc", default=None, metavar="HOST:PORT[,HOST:PORT]",
              callback=parse_rpc_option,
              help="Layers on these `localspec rpc-server`s, for every mode and the peer (all "
                   "layers unless --gpu-layers says how many).")
@click.option("--exact", is_flag=True, help="Batch-invariant CPU kernels for our modes (no weight "
              "repacking): speculative output is then plain output bit for bit, at some speed.")
@click.option("--no-warmup", is_flag=True, help="Skip the warm-up request per mode.")
@click.option("--json", "json_path", type=click.Path(dir_okay=False, path_type=Path),
              default=None, help="Also write every row, the summary and the setup as JSON.")
@click.option("--plot", "plot_path", type=click.Path(dir_okay=False, path_type=Path),
              default=None, help="Also draw a bar chart of ratios to plain (needs matplotlib: "
                                 "pip install 'localspec[plot]').")
def bench(workloads, target, draft, modes, kinds, cases, max_tokens, temperature, seed, top_k,
          top_p, min_p, n_ctx, threads, gpu_layers, rpc, exact, no_warmup, json_path, plot_path):
    """Benchmark decoding modes side by side on the same cases and the same model.

    Every case runs in every mode in one process, modes interleaved case by case after a warm-up,
    each request starting from an empty KV cache. Tables go to stdout (Markdown), progress to
    stderr. Ratios are decode tokens/s over plain decoding of the same case.

    \b
    Examples:
      localspec bench                                   # 20 cases x plain,ngram,peer
      localspec bench --kinds chat --modes plain,ngram,ngram-k3 -n 64
      localspec bench --cases sum-with,chat-haiku --json out.json --plot out.png
    """
    if plot_path is not None:
        _require_matplotlib()
    for k in kinds or ():
        if k not in KINDS:
            raise click.BadParameter(f"unknown kind {k!r}; use {', '.join(KINDS)}.",
                                     param_hint="--kinds")
    mode_list = parse_modes(modes)
    selected = load_workloads(workloads, kinds, cases)
    sampling = SamplingParams(temperature=temperature, top_k=top_k, top_p=top_p, min_p=min_p,
                              seed=seed)
    uses_draft = any(m.proposer in ("draft", "hybrid") for m in mode_list)
    settings = BenchSettings(target, draft if uses_draft else None, sampling, max_tokens, n_ctx,
                             threads, -1 if rpc and gpu_layers == 0 else gpu_layers, exact,
                             warmup=not no_warmup, rpc=rpc)
    say = lambda msg: click.echo(_clear_live() + msg, err=True)
    live = _live_writer() if sys.stderr.isatty() else None
    started = datetime.datetime.now(datetime.timezone.utc)
    interrupted = False
    with Bench(mode_list, settings, say=say, live=live) as b:
        say(f"benchmarking {b.model_path.name}: {len(selected)} cases x "
            f"{', '.join(m.name for m in mode_list)}, {b.n_threads} threads")
        meta = {}

        def save(rows, done=False):   # rewritten after every case: a killed run keeps its rows
            if not meta:
                meta.update(_meta(b, settings, started))
            meta["finished"] = done
            if json_path is not None:
                _write_json(json_path, meta, rows)

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
    if json_path is not None:
        say(f"wrote {json_path}")
    if plot_path is not None and rows:
        plot_ratios(rows, plot_path)
        say(f"wrote {plot_path}")
    if interrupted:
        sys.exit(130)


# -- presentation --------------------------------------------------------------------------------
def _fmt(v, spec: str = ".2f", none: str = "-") -> str:
    return none if v is None else format(v, spec)


def _identity(r) -> str:
    if r.identical is None:
        return "-"
    if r.identical:
        return "yes" if r.text_identical is not False else "yes (text differs)"
    gap = "" if r.top2_gap is None else f", gap {r.top2_gap:.3f}"
    return f"NO @{r.diverge_at}{gap}"


def _table(header: Sequence[str], body: Sequence[Sequence[str]]) -> str:
    widths = [max(len(h), *(len(row[i]) for row in body)) if body else len(h)
              for i, h in enumerate(header)]
    line = lambda cells: "| " + " | ".join(c.ljust(w) for c, w in zip(cells, widths)) + " |"
    return "\n".join([line(header), "|" + "|".join("-" * (w + 2) for w in widths) + "|"]
                     + [line(row) for row in body])


def format_rows(rows) -> str:
    """Per case and mode, as a Markdown table."""
    header = ["case", "kind", "mode", "prompt", "gen", "TTFT ms", "tok/s", "x plain", "x peer",
              "acc len", "acc rate", "identical"]
    body = [[r.case, r.kind, r.mode, str(r.prompt_tokens), str(r.generated_tokens),
             f"{r.ttft_ms:.0f}", f"{r.decode_tps:.2f}", _fmt(r.ratio), _fmt(r.vs_peer),
             _fmt(r.mean_accepted_len), _fmt(r.acceptance_rate, ".0%"), _identity(r)]
            for r in rows]
    return _table(header, body)


def format_summary(summary) -> str:
    """Per kind and mode: geometric means, worst case, identity count, as a Markdown table."""
    header = ["kind", "mode", "cases", "tok/s (geomean)", "x plain (geomean)", "worst x plain",
              "x peer (geomean)", "identical to plain"]
    body = []
    for s in summary:
        worst = "-" if s["worst_ratio"] is None else f"{s['worst_ratio']:.2f} ({s['worst_case']})"
        ident = "-" if s["identical"] is None else f"{s['identical']}/{s['compared']}"
        body.append([s["kind"], s["mode"], str(s["cases"]), f"{s['decode_tps']:.2f}",
                     _fmt(s["geomean_ratio"]), worst, _fmt(s["geomean_vs_peer"]), ident])
    return _table(header, body)


def _require_matplotlib() -> None:
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        raise LocalspecError("--plot needs matplotlib: pip install 'localspec[plot]' "
                             "(or drop --plot).") from None


def plot_ratios(rows, path: Path) -> None:
    """Grouped bars: one group per case (ordered by kind), one bar per non-plain mode."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    cases = list(dict.fromkeys(r.case for r in rows))
    modes = [m for m in dict.fromkeys(r.mode for r in rows) if m != "plain"]
    ratio = {(r.case, r.mode): r.ratio or 0.0 for r in rows}
    width = 0.8 / max(1, len(modes))
    fig, ax = plt.subplots(figsize=(max(8, 0.55 * len(cases) + 2), 4.5))
    for j, mode in enumerate(modes):
        xs = [i + (j - (len(modes) - 1) / 2) * width for i in range(len(cases))]
        ax.bar(xs, [ratio.get((c, mode), 0.0) for c in cases], width, label=mode)
    ax.axhline(1.0, color="black", linewidth=0.8)
    ax.set_xticks(range(len(cases)))
    ax.set_xticklabels(cases, rotation=60, ha="right", fontsize=8)
    ax.set_ylabel("decode tokens/s / plain")
    ax.set_title("localspec bench: speed relative to plain decoding")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


# -- setup record --------------------------------------------------------------------------------
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


def _cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def _write_json(path: Path, meta: dict, rows) -> None:
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps({"meta": meta, "summary": summarize(rows),
                               "rows": [asdict(r) for r in rows]}, indent=1) + "\n")
    os.replace(tmp, path)


def _meta(b: Bench, settings: BenchSettings, started) -> dict:
    from .llama import system_info
    try:
        curve = b.cost_curve()
    except Exception:   # the record must not lose the results
        curve = None
    return {
        "command": " ".join(["localspec", "bench", *sys.argv[1 + (sys.argv[1:2] == ["bench"]):]]),
        "started_utc": started.isoformat(timespec="seconds"),
        "localspec": __version__,
        "model": str(b.model_path), "model_desc": b.model.describe(), "draft": settings.draft,
        "exact": settings.exact,
        "cpu": _cpu_model(), "cores": os.cpu_count(), "threads": b.n_threads,
        "platform": platform.platform(), "python": platform.python_version(),
        "llama_cpp_system_info": system_info(),
        "sampling": asdict(settings.sampling), "max_tokens_cap": settings.max_tokens,
        "n_ctx": settings.n_ctx, "n_gpu_layers": settings.n_gpu_layers,
        "verify_cost_curve": curve,
    }


def main(argv: Optional[list] = None) -> None:
    """Run `bench` alone (python -m localspec.cli_bench ...), with one-line user errors."""
    from .cli import run_command

    run_command(bench, argv, prog_name="localspec bench")


if __name__ == "__main__":
    main()

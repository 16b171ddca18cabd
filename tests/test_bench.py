"""`localspec bench`: workloads and prompt shape, modes, summary maths, and short real runs on the
tiny self-made GGUF (n-gram modes token-identical to plain; tables on stdout, progress on stderr).
No timing is asserted: a benchmark prints numbers, it does not test them."""

from __future__ import annotations

import json
import sys
from dataclasses import replace
from pathlib import Path

import pytest
from click.testing import CliRunner

from localspec.policy.config import PolicyConfig
from localspec.speculative.config import EngineConfig
from localspec.bench import (DEFAULT_WORKLOADS, Bench, BenchSettings, Case, Row, first_difference,
                             geomean, load_workloads, parse_modes, read_source, summarize)
from localspec.bench import format_rows, format_summary
from localspec.cli.bench import bench, main
from localspec.errors import LocalspecError

CTX_2048 = EngineConfig(n_ctx=2048)      # what every engine mode starts from, in these tests
SMALL_WORKLOADS = [
    {"id": "edit-indent", "kind": "code-edit", "source": {"python": "textwrap:indent"},
     "instruction": "Add type hints. Output only the function.", "max_tokens": 20},
    {"id": "sum-pass", "kind": "summarize", "source": {"pydoc_topic": "pass"},
     "instruction": "Summarize in one sentence.", "max_tokens": 20},
    {"id": "chat-hi", "kind": "chat", "source": None, "instruction": "Say hi.", "max_tokens": 20},
]


@pytest.fixture
def small_workloads(tmp_path):
    path = tmp_path / "small.jsonl"
    path.write_text("".join(json.dumps(d) + "\n" for d in SMALL_WORKLOADS))
    return path


# -- workloads and prompts -------------------------------------------------------------------------
def test_shipped_workloads_load_with_sources():
    cases = load_workloads()
    assert len(cases) == 20
    kinds = [c.kind for c in cases]
    assert [kinds.count(k) for k in ("code-edit", "summarize", "chat")] == [8, 6, 6]
    assert len({c.id for c in cases}) == 20
    for c in cases:
        assert (c.document is None) == (c.kind == "chat")
        assert c.max_tokens > 0


def test_shipped_workloads_match_the_shared_copy():
    shared = DEFAULT_WORKLOADS.parents[2].parent / "shared" / "workloads" / "workloads.jsonl"
    if not shared.exists():
        pytest.skip("no shared/ beside this checkout")
    assert DEFAULT_WORKLOADS.read_text() == shared.read_text()


def test_prompt_shapes_follow_the_workloads_readme():
    src = read_source({"python": "textwrap:indent"})
    assert src.startswith("def indent(")
    edit = Case("e", "code-edit", "Add hints.", src, 10).user_message()
    assert edit == f"Add hints.\n\n```python\n{src}```"
    doc = read_source({"pydoc_topic": "pass"})
    assert Case("s", "summarize", "Summarize.", doc, 10).user_message() == f"Summarize.\n\n{doc}"
    assert Case("c", "chat", "Say hi.", None, 10).messages() == [{"role": "user",
                                                                   "content": "Say hi."}]


def test_load_workloads_filters_and_one_line_errors(small_workloads, tmp_path):
    assert [c.id for c in load_workloads(small_workloads, kinds=["chat"])] == ["chat-hi"]
    assert [c.id for c in load_workloads(small_workloads, ids=["sum-pass"])] == ["sum-pass"]
    assert [c.id for c in load_workloads(small_workloads, ids=["chat-hi", "edit-indent"])] == \
        ["chat-hi", "edit-indent"]                    # --cases order is the run order
    with pytest.raises(LocalspecError, match="no case called nope"):
        load_workloads(small_workloads, ids=["nope"])
    with pytest.raises(LocalspecError, match="cannot read workloads file"):
        load_workloads(tmp_path / "missing.jsonl")
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"id": "x"}\n')
    with pytest.raises(LocalspecError, match=r"bad.jsonl:1: not a workload case"):
        load_workloads(bad)
    with pytest.raises(LocalspecError, match="cannot read the source of textwrap:nothing"):
        read_source({"python": "textwrap:nothing"})
    with pytest.raises(LocalspecError, match="no pydoc topic"):
        read_source({"pydoc_topic": "no-such-topic"})
    import textwrap
    assert read_source({"python": "textwrap"}) == Path(textwrap.__file__).read_text()


# -- modes and maths -------------------------------------------------------------------------------
def test_parse_modes_puts_plain_first_and_reads_fixed_k():
    modes = parse_modes("ngram,peer-k4,plain,ngram-k3,ngram")
    assert [m.name for m in modes] == ["plain", "ngram", "peer-k4", "ngram-k3"]
    assert [m.fixed_k for m in modes] == [None, None, 4, 3]
    assert [m.is_peer for m in modes] == [False, False, True, False]
    assert [m.proposer for m in modes] == ["none", "ngram", "peer", "ngram"]
    assert [(m.proposer, m.fixed_k) for m in parse_modes("draft,hybrid-k2")] == \
        [("draft", None), ("hybrid", 2)]
    assert parse_modes("ngram-k16")[0].policy.fixed_k == 16
    assert parse_modes("peer-k32")[0].fixed_k == 32      # llama-cpp-python's, not our cap
    for bad in ("fast", "plain-k2", "ngram-kx", "", "ngram-unbudgeted", "ngram-k65"):
        with pytest.raises(LocalspecError):
            parse_modes(bad)


def test_first_difference_and_geomean():
    assert first_difference([1, 2, 3], [1, 5]) == 1
    assert first_difference([1, 2], [1, 2, 3]) == 2
    assert first_difference([1], [1]) is None
    assert geomean([2.0, 0.5]) == pytest.approx(1.0)
    assert geomean([None, 4.0]) == pytest.approx(4.0)
    assert geomean([]) is None


def _row(case, kind, mode, ratio, identical=True, vs_peer=None):
    return Row(case, kind, mode, 10, 20, 5.0, 10.0 * (ratio or 1), ratio, vs_peer, None, None,
               None if mode == "plain" else identical)


def test_summarize_geomean_worst_case_and_identity():
    rows = [_row("a", "chat", "plain", None), _row("a", "chat", "ngram", 2.0, vs_peer=1.0),
            _row("b", "chat", "plain", None), _row("b", "chat", "ngram", 0.5, False, 4.0),
            _row("c", "code-edit", "ngram", 3.0)]
    by = {(s["kind"], s["mode"]): s for s in summarize(rows)}
    chat = by[("chat", "ngram")]
    assert chat["geomean_ratio"] == pytest.approx(1.0)
    assert (chat["worst_ratio"], chat["worst_case"]) == (0.5, "b")
    assert chat["geomean_vs_peer"] == pytest.approx(2.0)
    assert (chat["identical"], chat["compared"]) == (1, 2)
    assert by[("chat", "plain")]["identical"] is None
    assert by[("all", "ngram")]["geomean_ratio"] == pytest.approx(3 ** (1 / 3), abs=1e-3)
    assert [s["kind"] for s in summarize(rows)][:2] == ["code-edit", "chat"]
    table = format_summary(summarize(rows))
    assert "| chat" in table and "1/2" in table and "0.50 (b)" in table


def test_the_summary_says_why_each_mode_ran_at_its_speed():
    """Per kind and mode: the mean draft of the steps that drafted, the share accepted and the
    tokens a step, over all its rows' counts; per mode, what chose its drafts and the curve it
    started from and learned (issue 63: a poisoned curve must show beside the speed)."""
    def row(case, mode, drafted, spec, accepted, steps, tokens):
        r = _row(case, "code-edit", mode, 2.0)
        r.stats = {"drafted": drafted, "spec_steps": spec, "accepted": accepted, "steps": steps,
                   "step_tokens": tokens}
        r.settings = "ngram, adaptive" if mode == "ngram" else "llama.cpp ngram-simple"
        return r
    rows = [row("a", "ngram", 30, 10, 27, 12, 41), row("b", "ngram", 10, 10, 5, 20, 25),
            row("a", "llamacpp-simple", 96, 2, 96, 3, 99)]
    rows[1].cost_curve = {"source": "sliced, unfinished", "calibrated": [1.0, 1.06, 2.59, 6.26],
                          "learned": [1.0, 1.23, 1.36, 1.49], "probes": 1}
    by = {(s["kind"], s["mode"]): s for s in summarize(rows)}
    ours = by[("all", "ngram")]
    assert (ours["mean_draft"], ours["acceptance"], ours["tokens_per_step"]) == \
        (2.0, 0.8, round(66 / 32, 3))
    assert by[("all", "llamacpp-simple")]["mean_draft"] == 48.0
    table = format_summary(summarize(rows))
    assert "| mean draft | accepted | tokens/step |" in table
    assert "| ngram           | ngram, adaptive        | sliced, unfinished r(1,3) 1.06 6.26 " \
        "-> learned 1.23 1.49 (1 probe) |" in table
    assert "llama.cpp ngram-simple" in table and "| 48.0 " in table


# -- real runs on the tiny model -------------------------------------------------------------------
def test_bench_on_tiny_model_ngram_modes_match_plain(tiny_path, small_workloads):
    cases = load_workloads(small_workloads)
    lines = []
    settings = BenchSettings(str(tiny_path), CTX_2048, max_tokens=16)
    modes = ("plain", "ngram", "ngram-k3", "peer")
    with Bench(parse_modes(",".join(modes)), settings, say=lines.append) as b:
        rows = b.run(cases)
        policy = b.engines["ngram"]._policy_for(None)[0].config
    assert [(r.case, r.mode) for r in rows] == [(c.id, m) for c in cases for m in modes]
    assert policy == PolicyConfig()
    for r in rows:
        assert r.generated_tokens > 0 and r.ttft_ms > 0
        assert r.prompt_tokens == rows[0].prompt_tokens or r.case != rows[0].case
        if r.mode.startswith("ngram"):
            assert r.identical is True, (r.case, r.mode)   # greedy: token for token
            assert r.ratio is not None
            # A step whose row 0 was a near-tie emits nothing (the guard re-decides it alone).
            assert r.mean_accepted_len >= 1.0 or r.stats["rechecks"] > 0
            assert r.stats["prefill_tokens"] == r.prompt_tokens   # every request starts cold
        if r.mode == "plain":
            assert r.identical is None and r.ratio is None
    # the peer's text on a random byte model is not valid UTF-8, so no identity claim here
    assert any("[3/3] chat-hi" in s for s in lines) and any("warm-up: peer" in s for s in lines)
    assert "| edit-indent | code-edit | ngram-k3" in format_rows(rows)
    adaptive = [r for r in rows if r.mode == "ngram"]
    assert all(r.settings.startswith("ngram, adaptive k <= 64") and r.cost_curve for r in adaptive)
    assert adaptive[-1].cost_curve["calibrated"][0] == 1.0
    assert [r.settings for r in rows if r.mode == "ngram-k3"][0] == "ngram, k = 3 every step"


def test_rounds_give_medians_of_side_by_side_ratios(tiny_path, small_workloads):
    settings = BenchSettings(str(tiny_path), CTX_2048, max_tokens=12, warmup=False, rounds=3)
    lines = []
    with Bench(parse_modes("plain,ngram-k2"), settings, say=lines.append) as b:
        rows = b.run(load_workloads(small_workloads, ids=["chat-hi", "sum-pass"]))
    assert [(r.case, r.mode) for r in rows] == [("chat-hi", "plain"), ("chat-hi", "ngram-k2"),
                                                ("sum-pass", "plain"), ("sum-pass", "ngram-k2")]
    assert sum("round 2/3" in s for s in lines) == 2 and sum("round 3/3" in s for s in lines) == 2
    # round 2 runs the modes the other way round: ngram-k2 first
    i = next(j for j, s in enumerate(lines) if "round 2/3" in s)
    assert "ngram-k2" in lines[i + 1] and "plain" in lines[i + 2]
    for r in rows:
        assert r.rounds == 3
        assert r.stats["prefill_tokens"] == r.prompt_tokens     # the reported round is cold
        if r.mode == "ngram-k2":
            lo, hi = r.ratio_range
            assert lo <= r.ratio <= hi and r.identical is True
    assert "rounds' range" in format_rows(rows)


def test_a_repeat_round_reproduces_the_cold_round(tiny_path, small_workloads):
    """Warm rounds re-evaluate the prompt's last prefill chunk with its cold batch shape: same
    first logits, same output, without prefilling the whole prompt again."""
    from localspec.bench.engine_run import run_engine
    from localspec.llama import PREFILL_GRID
    from localspec.speculative.sampling import SamplingParams

    case = load_workloads(small_workloads, ids=["sum-pass"])[0]
    with Bench(parse_modes("plain"), BenchSettings(str(tiny_path), CTX_2048)) as b:
        engine = b.engines["plain"]
        n_prompt = len(engine.tokenize_prompt(case.messages()))
        assert n_prompt > PREFILL_GRID          # more than one chunk, so some rows are kept
        cold = run_engine(engine, case, SamplingParams(), 16)
        warm = run_engine(engine, case, SamplingParams(), 16, cold=False)
        assert warm.tokens == cold.tokens
        assert warm.stats.prefill_tokens == n_prompt - (n_prompt - 1) // PREFILL_GRID * \
            PREFILL_GRID
        assert cold.stats.prefill_tokens == n_prompt


def test_lockstep_takes_turns_by_tokens_and_times_each_mode_alone(tiny_path, small_workloads,
                                                                  monkeypatch):
    """Modes in lockstep write what they write alone; the one behind in tokens always goes next;
    each mode's time is its own turns only, so the times add up to no more than the wall clock."""
    import time

    from localspec.bench import engine_run
    from localspec.speculative.sampling import SamplingParams

    turns, runs = [], []               # per turn: (the run going, {run: (tokens, done)})
    real_turn = engine_run.EngineRun.turn

    def logged(self):
        if self not in runs:
            runs.append(self)
        turns.append((self, {r: (r.n_tokens, r.done) for r in runs}))
        return real_turn(self)

    case = load_workloads(small_workloads, ids=["sum-pass"])[0]
    settings = BenchSettings(str(tiny_path), CTX_2048, warmup=False)
    with Bench(parse_modes("plain,ngram-k2"), settings) as b:
        alone = {m: engine_run.run_engine(e, case, SamplingParams(), 24)
                 for m, e in b.engines.items()}
        monkeypatch.setattr(engine_run.EngineRun, "turn", logged)
        t0 = time.perf_counter()
        outs = engine_run.run_lockstep(b.engines, case, SamplingParams(), 24)
        wall_ms = 1000 * (time.perf_counter() - t0)
    assert len(runs) == 2 and turns[0][0] is runs[0] and turns[1][0] is runs[1]  # prefills
    for run, state in turns[2:]:
        other = next(r for r in runs if r is not run)
        assert state[other][1] or state[run][0] <= state[other][0]    # the one behind goes
    assert all(r.done for r in runs)
    # they took turns through the text, not one after the other
    switches = sum(a[0] is not b[0] for a, b in zip(turns, turns[1:]))
    assert switches >= min(o.generated_tokens for o in outs.values()) // 3
    for mode, out in outs.items():
        assert out.tokens == alone[mode].tokens and out.stop_reason == alone[mode].stop_reason
        assert 0 < out.ttft_ms <= out.total_ms
        assert out.stats.prefill_tokens == out.stats.prompt_tokens       # cold
    assert sum(o.total_ms for o in outs.values()) <= wall_ms


def test_ctrl_c_in_lockstep_ends_both_requests_cleanly(tiny_path, small_workloads, monkeypatch):
    """An interrupt inside one mode's turn ends the other request too, at once: both contexts
    keep only rows that match what they emitted, and the next run writes the same text."""
    from localspec.bench import engine_run
    from localspec.speculative.sampling import SamplingParams

    case = load_workloads(small_workloads, ids=["sum-pass"])[0]
    with Bench(parse_modes("plain,ngram-k2"), BenchSettings(str(tiny_path), CTX_2048)) as b:
        before = engine_run.run_lockstep(b.engines, case, SamplingParams(), 16)
        real_turn, calls = engine_run.EngineRun.turn, []

        def interrupted(self):
            calls.append(self)
            if len(calls) == 7:
                raise KeyboardInterrupt
            return real_turn(self)

        monkeypatch.setattr(engine_run.EngineRun, "turn", interrupted)
        with pytest.raises(KeyboardInterrupt):
            engine_run.run_lockstep(b.engines, case, SamplingParams(), 16)
        assert all(r.gen._run.gi_frame is None for r in calls)       # both generators ended
        for e in b.engines.values():
            assert e.ctx.rows_held() == e.ctx.n_past                 # no stray KV rows
        monkeypatch.setattr(engine_run.EngineRun, "turn", real_turn)
        after = engine_run.run_lockstep(b.engines, case, SamplingParams(), 16)
    assert {m: o.tokens for m, o in after.items()} == {m: o.tokens for m, o in before.items()}


def test_bench_lockstep_rounds_match_plain(tiny_path, small_workloads):
    settings = BenchSettings(str(tiny_path), CTX_2048, max_tokens=12, warmup=False, rounds=2,
                             lockstep=True)
    lines = []
    with Bench(parse_modes("plain,ngram-k2"), settings, say=lines.append) as b:
        rows = b.run(load_workloads(small_workloads, ids=["chat-hi", "sum-pass"]))
    assert sum("plain+ngram-k2 in lockstep" in s for s in lines) == 2
    assert sum("ngram-k2+plain in lockstep" in s for s in lines) == 2   # round 2 reversed
    for r in rows:
        assert r.rounds == 2 and r.decode_tps > 0
        if r.mode == "ngram-k2":
            assert r.identical is True and r.ratio_range[0] <= r.ratio <= r.ratio_range[1]


def test_merge_rounds_takes_the_median_of_per_round_ratios():
    from localspec.bench.report import make_row, merge_rounds
    from localspec.bench.runner import Mode
    from localspec.bench.timing import Outcome

    def out(tps, tokens=(1, 2, 3)):   # 11 tokens over 1 s after the first: tps = 10 / s
        return Outcome("t", list(tokens), 11, 100.0, 100.0 + 10_000 / tps, "length")

    plain, ngram = Mode("plain"), Mode("ngram")
    case = Case("c", "chat", "hi", None, 10)
    rounds = [{"plain": out(10), "ngram": out(12)},       # 1.2
              {"plain": out(20), "ngram": out(18)},       # 0.9 (the machine sped up)
              {"plain": out(10), "ngram": out(11)}]       # 1.1
    row = make_row(case, ngram, 5, rounds[0]["ngram"], rounds[0]["plain"], None, True)
    merge_rounds(row, ngram, rounds, None)
    assert (row.rounds, row.ratio, row.ratio_range) == (3, 1.1, [0.9, 1.2])
    assert row.decode_tps == 12.0 and row.identical is True
    rounds[2]["ngram"] = out(11, tokens=(1, 2, 4))
    row = make_row(case, ngram, 5, rounds[0]["ngram"], rounds[0]["plain"], None, True)
    merge_rounds(row, ngram, rounds, None)
    assert row.identical is False                          # one round differing is a difference
    base = make_row(case, plain, 5, rounds[0]["plain"], rounds[0]["plain"], None, True)
    merge_rounds(base, plain, rounds, None)
    assert base.ratio is None and base.decode_tps == 10.0


def test_draft_and_hybrid_modes_match_plain(tiny_path, tiny_dir, small_workloads):
    from tinymodel import make_tiny_gguf

    draft = tiny_dir / "tiny-bench-draft.gguf"
    if not draft.exists():
        make_tiny_gguf(draft, seed=1, logit_scale=3.0)
    settings = BenchSettings(str(tiny_path), replace(CTX_2048, draft=str(draft)), max_tokens=12,
                             warmup=False)
    with Bench(parse_modes("plain,draft-k2,hybrid"), settings) as b:
        rows = b.run(load_workloads(small_workloads, ids=["chat-hi"]))
    assert [(r.mode, r.identical) for r in rows] == [("plain", None), ("draft-k2", True),
                                                     ("hybrid", True)]
    assert rows[1].stats["drafted"] > 0


def test_cli_tables_on_stdout_progress_on_stderr(tiny_path, small_workloads, tmp_path):
    out_json = tmp_path / "bench.json"
    result = CliRunner().invoke(bench, [
        "--workloads", str(small_workloads), "-m", str(tiny_path), "--modes", "plain,ngram",
        "--kinds", "chat,summarize", "-n", "8", "--ctx", "2048", "--no-warmup",
        "--json", str(out_json)])
    assert result.exit_code == 0, result.output
    assert result.stdout.startswith("| case ")
    assert "| sum-pass " in result.stdout and "| all " in result.stdout
    assert "edit-indent" not in result.stdout
    assert "[1/2] sum-pass" in result.stderr and "[1/2]" not in result.stdout
    data = json.loads(out_json.read_text())
    assert {r["mode"] for r in data["rows"]} == {"plain", "ngram"}
    assert all(r["identical"] for r in data["rows"] if r["mode"] == "ngram")
    assert data["meta"]["sampling"]["temperature"] == 0.0
    assert data["meta"]["threads"] >= 1 and data["summary"]
    assert data["meta"]["verify_cost"]["ngram"]["learned"][0] == 1.0
    assert data["meta"]["verify_cost_curve"] == data["meta"]["verify_cost"]["ngram"]["calibrated"]
    assert "| mode  | drafts chosen by" in result.stdout


def test_cli_sampled_run_is_seeded_equal(tiny_path, small_workloads):
    result = CliRunner().invoke(bench, [
        "--workloads", str(small_workloads), "-m", str(tiny_path), "--modes", "plain,ngram-k2",
        "--cases", "chat-hi", "-n", "12", "--ctx", "2048", "--no-warmup", "-t", "0.8",
        "--seed", "3"])
    assert result.exit_code == 0, result.output
    assert "| chat-hi | chat | ngram-k2 |" in result.stdout.replace("  ", " ").replace("  ", " ")
    row = [l for l in result.stdout.splitlines() if "ngram-k2" in l][0]
    assert "| yes" in row


def test_cli_checks_the_context_as_every_command_does(tiny_path, small_workloads, capsys):
    """bench's --ctx is the shared option, checked against the model before any context is
    made (a usage error, exit 2), with --repeat-penalty and -m/--model as elsewhere."""
    with pytest.raises(SystemExit) as exc:
        main(["--workloads", str(small_workloads), "--model", str(tiny_path), "--modes", "plain",
              "--cases", "chat-hi", "--ctx", "20000", "--repeat-penalty", "1.1"])
    err = capsys.readouterr().err
    assert exc.value.code == 2 and "'--ctx'" in err and "2048" in err and "Traceback" not in err


def test_plot_without_matplotlib_is_one_line_error(monkeypatch, capsys, small_workloads):
    monkeypatch.setitem(sys.modules, "matplotlib", None)
    with pytest.raises(SystemExit) as exc:
        main(["--workloads", str(small_workloads), "--plot", "out.png"])
    assert exc.value.code == 1
    err = capsys.readouterr().err
    assert err.startswith("error: --plot needs matplotlib") and err.count("\n") == 1


def test_unknown_mode_and_kind_are_one_line_errors(capsys, small_workloads):
    with pytest.raises(SystemExit):
        main(["--workloads", str(small_workloads), "--modes", "plain,fast"])
    assert capsys.readouterr().err.startswith("error: unknown mode 'fast'")
    with pytest.raises(SystemExit):
        main(["--workloads", str(small_workloads), "--kinds", "poetry"])
    assert "unknown kind 'poetry'" in capsys.readouterr().err


@pytest.mark.smollm
def test_peer_on_smollm_counts_tokens_and_compares_text(smollm_path, small_workloads):
    """On a real model the peer's text is comparable with plain's (greedy)."""
    settings = BenchSettings(str(smollm_path), CTX_2048, max_tokens=24, warmup=False)
    with Bench(parse_modes("plain,ngram,peer"), settings) as b:
        rows = b.run(load_workloads(small_workloads, ids=["chat-hi", "edit-indent"]))
    for r in rows:
        if r.mode == "ngram":
            assert r.identical is True
        if r.mode == "peer":
            assert r.identical is not None and 0 < r.generated_tokens <= 24
            if r.identical:
                plain = next(p for p in rows if p.case == r.case and p.mode == "plain")
                assert r.generated_tokens == plain.generated_tokens
            else:
                assert r.diverge_at is not None


def test_plot_writes_a_png(tmp_path):
    pytest.importorskip("matplotlib")
    from localspec.bench.report import plot_ratios

    rows = [_row("a", "chat", "plain", None), _row("a", "chat", "ngram", 1.5),
            _row("a", "chat", "peer", 0.6), _row("b", "code-edit", "ngram", 2.5)]
    out = tmp_path / "ratios.png"
    plot_ratios(rows, out)
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_store_mode_sessions_start_empty_and_learn_in_file_order(tiny_path, tmp_path):
    """Two sessions of the same prompt twice: the store mode drafts from the store only in each
    session's second case (its first starts with an empty store), output equals plain's."""
    path = tmp_path / "sessions.jsonl"
    case = {"kind": "chat", "instruction": "Once upon a time", "max_tokens": 24}
    path.write_text("".join(json.dumps({**case, "id": f"{s}-{i}", "session": s}) + "\n"
                            for s in ("a", "b") for i in (1, 2)))
    cases = load_workloads(path)
    assert [c.session for c in cases] == ["a", "a", "b", "b"]
    settings = BenchSettings(str(tiny_path), EngineConfig(n_ctx=1024), warmup=False)
    with Bench(parse_modes("plain,ngram-k4,store-k4"), settings) as b:
        rows = b.run(cases)
    store = {r.case: r.stats.get("store_tokens", 0) for r in rows if r.mode == "store-k4"}
    assert store["a-1"] == store["b-1"] == 0
    assert store["a-2"] > 0 and store["b-2"] == store["a-2"]
    assert all(r.identical for r in rows if r.mode != "plain")
    kinds = {s["kind"] for s in summarize(rows)}
    assert {"session a", "session b", "all"} <= kinds

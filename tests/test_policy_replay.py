"""tools.replay: offline scoring of draft policies against recorded plain outputs, and the
future-knowing bound they are measured against."""

import doctest
import json
import os
import subprocess
import sys
from collections import defaultdict
from pathlib import Path

import pytest

from tools import replay as rp
from localspec.policy.acceptance import PRIOR_WEIGHTS
from localspec.policy.adaptive import AdaptivePolicy
from localspec.policy.costmodel import CostModel
from localspec.errors import LocalspecError
from localspec.policy.config import K_LIMIT, PolicyConfig
from localspec.policy.draft_estimate import DraftPolicy

RECORDING = Path(__file__).resolve().parents[1] / "data" / "recordings" / "policy_plain.json"
XEON = rp.extend_curve([1, 1.55, 1.75, 1.75, 2.2], 16, {8: 3.0, 16: 3.9})
EPYC = rp.extend_curve([1, 1.48, 1.96, 2.22, 2.68], 16, {8: 5.9, 16: 8.4})


def policies(curve):
    return {"old": lambda: DraftPolicy(curve, PolicyConfig()),
            "new": lambda: AdaptivePolicy(CostModel(curve, rp.BASE_MS), PolicyConfig())}


def synthetic(prompt, out, margin=9.0):
    return rp.Recorded("synthetic", "code-edit", prompt, out, [margin] * len(out),
                       [0.99] * len(out))


def test_docstring_examples():
    assert doctest.testmod(rp).failed == 0


@pytest.mark.parametrize("name", ["old", "new"])
def test_copied_output_replays_faster_than_plain_and_never_beats_the_bound(name):
    source = [(37 * i + 11) % 500 + 3 for i in range(120)]        # no repeats inside
    case = synthetic([1, 2] + source, source[:100])               # the answer copies the source
    score = rp.replay_case(case, policies(XEON)[name], XEON, propose_cost=0.002)
    bound = rp.bound_case(case, XEON)
    assert 2.0 < score.speedup <= bound + 1e-9


@pytest.mark.parametrize("name", ["old", "new"])
def test_output_with_nothing_to_copy_stays_at_plain_speed(name):
    case = synthetic([1, 2, 3], [(37 * i + 11) % 500 + 10 for i in range(80)])
    assert rp.replay_case(case, policies(EPYC)[name], EPYC).speedup == pytest.approx(1.0)
    assert rp.bound_case(case, EPYC) == pytest.approx(1.0)


def test_near_ties_cut_steps_in_the_replay_and_the_bound_avoids_them():
    source = [(37 * i + 11) % 500 + 3 for i in range(60)]
    clean, tied = synthetic([1, 2] + source, source[:50]), synthetic([1, 2] + source, source[:50])
    tied.margin[10:40:3] = [0.1] * 10                             # every third row a near-tie
    make = policies(XEON)["new"]
    assert rp.replay_case(tied, make, XEON).speedup < rp.replay_case(clean, make, XEON).speedup
    assert rp.bound_case(tied, XEON) < rp.bound_case(clean, XEON)
    assert rp.replay_case(tied, make, XEON).speedup <= rp.bound_case(tied, XEON)


RECORDINGS = [RECORDING] + [RECORDING.with_name(f"policy_{name}_zen4.json")
                            for name in ("plain", "heldout", "heldout2", "heldout3", "heldout4")]


@pytest.mark.parametrize("recording", RECORDINGS, ids=lambda p: p.stem)
@pytest.mark.parametrize("curve", [XEON, EPYC], ids=["xeon", "epyc"])
def test_recorded_cases_score_the_same_twice_and_never_above_their_bound(curve, recording):
    cases = rp.load(str(recording))
    picked = {c.kind: c for c in cases}.values()                  # one case of each kind
    for case in picked:
        bound = rp.bound_case(case, curve)
        for make in policies(curve).values():
            a = rp.replay_case(case, make, curve, propose_cost=0.002)
            b = rp.replay_case(case, make, curve, propose_cost=0.002)
            assert a == b
            assert a.speedup <= bound + 1e-9


def test_curves_come_from_this_machines_calibration_or_a_json_file(tmp_path, monkeypatch):
    monkeypatch.setenv("LOCALSPEC_HOME", str(tmp_path))
    with pytest.raises(LocalspecError, match="localspec calibrate --threads 2"):
        rp.calibrated_curve("model.gguf", 2)
    cal = tmp_path / "calibration"
    cal.mkdir(exist_ok=True)
    (cal / "a.json").write_text(json.dumps({"ratios": [1.0, 1.5, 2.0], "ms_per_step": 30.0,
                                            "model": "/m/model.gguf", "threads": 2}))
    (cal / "b.json").write_text(json.dumps({"ratios": [1.0, 1.1, 1.2], "ms_per_step": 30.0,
                                            "model": "/m/model.gguf", "threads": 4}))
    (cal / "junk.json").write_text("{not json")
    curve, path = rp.calibrated_curve("model.gguf", 2)
    assert curve == [1.0, 1.5, 2.0] and path.endswith("a.json")
    bench = tmp_path / "bench.json"
    bench.write_text(json.dumps({"meta": {"verify_cost_curve": [1.0, 1.7, 2.3]}, "rows": []}))
    assert rp.curve_from_json(str(bench)) == [1.0, 1.7, 2.3]
    (tmp_path / "other.json").write_text(json.dumps({"ratios": [0.5, 2.0]}))
    with pytest.raises(LocalspecError, match="holds no cost curve"):
        rp.curve_from_json(str(tmp_path / "other.json"))
    with pytest.raises(LocalspecError, match="cannot read a cost curve"):
        rp.curve_from_json(str(cal / "junk.json"))


def test_replay_script_reads_this_machines_curve_and_refuses_a_bad_one(tmp_path):
    env = {**os.environ, "LOCALSPEC_HOME": str(tmp_path)}
    script = Path(__file__).resolve().parents[1] / "scripts" / "bench" / "policy_replay.py"
    cmd = [sys.executable, str(script), "replay", str(RECORDING), "--policies", "new"]
    missing = subprocess.run(cmd, env=env, capture_output=True, text=True)
    assert missing.returncode == 1 and missing.stdout == ""
    assert missing.stderr.strip().splitlines() == [
        "error: no calibration of qwen2.5-coder-1.5b-instruct-q4_k_m.gguf with 2 threads on this "
        "machine: run `localspec calibrate --threads 2` first"]
    bad = subprocess.run(cmd + ["--curve", "1.5,2"], env=env, capture_output=True, text=True)
    assert bad.returncode == 1 and bad.stderr.startswith("error: --curve '1.5,2'")
    (tmp_path / "calibration").mkdir(exist_ok=True)     # the failed run made it
    (tmp_path / "calibration" / "x.json").write_text(json.dumps(
        {"ratios": EPYC, "ms_per_step": 50.0, "threads": 2,
         "model": "/cache/qwen2.5-coder-1.5b-instruct-q4_k_m.gguf"}))
    ok = subprocess.run(cmd, env=env, capture_output=True, text=True)
    assert ok.returncode == 0, ok.stderr
    named = subprocess.run(cmd + ["--curve", "epyc"], env=env, capture_output=True, text=True)
    assert ok.stdout == named.stdout and "x.json" in ok.stderr     # the same curve, by file


def test_recording_a_workloads_file_on_a_real_model_replays(tmp_path, tiny_path):
    from tools.replay_record import record
    workloads = tmp_path / "w.jsonl"
    workloads.write_text(
        '{"id": "s", "kind": "summarize", "source": {"pydoc_topic": "global"}, '
        '"instruction": "Summarize.", "max_tokens": 12}\n'
        '{"id": "c", "kind": "chat", "source": null, "instruction": "Hi", "max_tokens": 9}\n')
    out = tmp_path / "rec.json"
    said = []
    data = record(str(out), threads=1, workloads=str(workloads), model=str(tiny_path),
                  say=said.append)
    assert [line.split(":")[0] for line in said] == ["s", "c"]
    saved = json.loads(out.read_text())
    assert saved == json.loads(json.dumps(data)) and saved["model"] == tiny_path.name
    for cid, n_max in (("s", 12), ("c", 9)):
        case = saved["cases"][cid]
        n = len(case["out"])
        assert 1 <= n <= n_max and len(case["margin"]) == len(case["p_top"]) == n
        assert all(m >= 0 for m in case["margin"]) and all(0 < p <= 1 for p in case["p_top"])
    assert record(str(out), threads=1, workloads=str(workloads), model=str(tiny_path),
                  say=said.append) == saved and len(said) == 2        # resumed: nothing to do
    for case in rp.load(str(out)):
        bound = rp.bound_case(case, EPYC)
        assert rp.replay_case(case, policies(EPYC)["new"], EPYC).speedup <= bound + 1e-9


def test_timing_noise_is_seeded_and_only_what_the_policy_is_told():
    """--timing-noise: the cost model learns from jittered times, the score is still charged
    the true curve, and a replay stays deterministic (the same case, the same jitter)."""
    case = next(c for c in rp.load(str(RECORDING)) if c.kind == "code-edit")
    make = policies(EPYC)["new"]
    a = rp.replay_case(case, make, EPYC, propose_cost=0.002, timing_noise=0.1, seed=1)
    assert a == rp.replay_case(case, make, EPYC, propose_cost=0.002, timing_noise=0.1, seed=1)
    assert a.speedup <= rp.bound_case(case, EPYC) + 1e-9
    told = []
    rp.replay_case(case, lambda: Told(make(), told), EPYC, timing_noise=0.1, seed=1)
    ratios = [ms / (EPYC[k] * rp.BASE_MS) for k, ms in told]
    assert len(set(round(r, 9) for r in ratios)) > len(ratios) // 2     # jittered...
    assert 0.9 < sorted(ratios)[len(ratios) // 2] < 1.1                 # ...around the truth
    # a policy whose choices ignore timings scores the same: steps are charged the true curve
    fixed = lambda: AdaptivePolicy(CostModel(EPYC, rp.BASE_MS), PolicyConfig(fixed_k=3))
    assert rp.replay_case(case, fixed, EPYC, timing_noise=0.3, seed=2) == \
        rp.replay_case(case, fixed, EPYC)


class Told:
    """A policy wrapper that records (k, verify_ms) as the replay tells them."""

    def __init__(self, policy, log):
        self.policy, self.log = policy, log

    def __getattr__(self, name):
        return getattr(self.policy, name)

    def observe_step(self, f, k, n_accepted, emitted, verify_ms=None, propose_ms=0.0):
        self.log.append((k, verify_ms))
        self.policy.observe_step(f, k, n_accepted, emitted, verify_ms, propose_ms)


def test_replay_script_variants_and_calibration(tmp_path):
    """--variant adds the adaptive policy with settings changed; --calibration prints what its
    drafting steps were predicted to gain against what they gained; bad settings are one line."""
    script = Path(__file__).resolve().parents[1] / "scripts" / "bench" / "policy_replay.py"
    cmd = [sys.executable, str(script), "replay", str(RECORDING), "--curve", "xeon",
           "--policies", "new", "--propose-cost", "0.002"]
    ok = subprocess.run(cmd + ["--variant", "never:min_gain=99,probe_share=0",
                              "--calibration"],
                        capture_output=True, text=True)
    assert ok.returncode == 0, ok.stderr
    lines = ok.stdout.splitlines()
    never = next(line for line in lines if line.startswith("never "))
    assert never.split()[1::4] == ["0.998x"] * 3          # never drafts: plain + propose cost
    head = lines.index("drafting steps: gain predicted by the acceptance model vs realised "
                       "(tokens / r(k))")
    rows = [line.split() for line in lines[head + 2:]]
    assert rows and all(r[0] == "new" for r in rows)       # "never" drafted nothing
    code = [r for r in rows if r[1] == "code-edit"]
    assert code and all(float(r[4]) > 1.0 and float(r[5]) > 0 for r in code)
    for bad, says in (("x:foo=1", "error: --variant x: cannot set 'foo=1'"),
                      ("x:min_gain=abc", "error: --variant x: min_gain='abc' is not a float"),
                      ("new:min_gain=2", "error: --variant 'new:min_gain=2': expected")):
        out = subprocess.run(cmd + ["--variant", bad], capture_output=True, text=True)
        assert out.returncode == 1 and out.stdout == "" and out.stderr.startswith(says)
        assert len(out.stderr.strip().splitlines()) == 1
    out = subprocess.run(cmd[:-4] + ["--policies", "nope"], capture_output=True, text=True)
    assert out.returncode == 1 and out.stderr.startswith("error: --policies: unknown policy")


def test_replay_script_drafts_to_the_shipped_limit_unless_told_a_lower_one():
    """Curves are carried to --k-max (K_LIMIT by default): the policy is judged as it ships, with
    drafts past 16 on copied code; --k-max 16 replays the old limit; a bad one is one line."""
    script = Path(__file__).resolve().parents[1] / "scripts" / "bench" / "policy_replay.py"
    cmd = [sys.executable, str(script), "replay", str(RECORDING), "--curve", "epyc",
           "--policies", "new", "--tie-margin", "0", "--calibration"]

    def buckets(extra):
        out = subprocess.run(cmd + extra, capture_output=True, text=True)
        assert out.returncode == 0, out.stderr
        lines = out.stdout.splitlines()
        assert len(lines[0].split(",")) == (K_LIMIT if not extra else int(extra[1])) + 1
        head = next(i for i, line in enumerate(lines) if line.startswith("drafting steps:"))
        return {r.split()[2] for r in lines[head + 2:] if r.split()[1] == "code-edit"}

    assert "33-64" in buckets([])
    capped = buckets(["--k-max", "16"])
    assert capped and not capped & {"17-32", "33-64"}
    bad = subprocess.run(cmd + ["--k-max", "0"], capture_output=True, text=True)
    assert bad.returncode == 1 and bad.stdout == ""
    assert bad.stderr.strip().splitlines() == [f"error: --k-max 0: expected 1..{K_LIMIT}"]


def test_prior_refitted_on_other_recordings_replays_beside_the_shipped_one():
    """fit takes several recordings (ids kept apart); replay --refit-on adds a `refit` policy
    whose prior is fitted on the other recordings, leaving the replayed one out."""
    script = Path(__file__).resolve().parents[1] / "scripts" / "bench" / "policy_replay.py"
    ho3, ho4 = (RECORDING.with_name(f"policy_heldout{n}_zen4.json") for n in (3, 4))
    fit = subprocess.run([sys.executable, str(script), "fit", str(ho3), str(ho4), "--folds", "1"],
                         capture_output=True, text=True)
    assert fit.returncode == 0, fit.stderr
    rows = sum(len(rp.training_rows(c)[1]) for p in (ho3, ho4) for c in rp.load(str(p)))
    assert f"all cases: {rows} rows" in fit.stdout and "PRIOR_WEIGHTS = (" in fit.stdout
    cmd = [sys.executable, str(script), "replay", str(ho4), "--curve", "epyc", "--policies",
           "new", "--refit-on", f"{ho3},{ho4}"]
    out = subprocess.run(cmd, capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    lines = out.stdout.splitlines()
    head = f"refit's prior: fitted on {len(rp.load(str(ho3)))} cases of {ho3.name}: ("
    refit_line = next(line for line in lines if line.startswith("refit's prior"))
    assert refit_line.startswith(head)
    weights = [float(w) for w in refit_line[len(head):].rstrip(")").split(", ")]
    assert len(weights) == len(PRIOR_WEIGHTS) and weights != list(PRIOR_WEIGHTS)
    refit, bound = (next(line.split() for line in lines if line.startswith(name + " "))
                    for name in ("refit", "bound"))
    for mine, best in ((refit[1], bound[1]), (refit[5], bound[4])):   # summarize, chat
        assert 0.5 < float(mine.rstrip("x")) <= float(best.rstrip("x")) + 1e-9
    alone = subprocess.run(cmd[:-1] + [str(ho4)], capture_output=True, text=True)
    assert alone.returncode == 1 and alone.stderr.strip().splitlines() == [
        "error: --refit-on: no recording left to fit on once the replayed one is left out"]
    missing = subprocess.run(cmd[:-1] + [str(ho3.with_name("nope.json"))], capture_output=True,
                             text=True)
    assert missing.returncode == 1 and len(missing.stderr.strip().splitlines()) == 1
    assert missing.stderr.startswith("error: cannot read the recording ")


def _replay_watch():
    scripts = Path(__file__).resolve().parents[1] / "scripts" / "bench"
    if str(scripts) not in sys.path:
        sys.path.insert(0, str(scripts))
    import replay_watch
    return replay_watch


def test_shortfall_counts_the_matches_a_policy_left_undrafted():
    """A policy that never drafts, on output copied from its prompt: every proposal lands in a
    'not drafted' row, each right, and what drafting the matching runs would have saved is
    (j + 1) - r(j) per step, j the run (capped by what is left of the output)."""
    watch = _replay_watch()
    case = synthetic([5, 1, 2, 3, 4, 6, 7, 8], [1, 2, 3, 4, 6, 7, 8])
    sums = defaultdict(lambda: [0, 0, 0.0, 0, 0.0])

    def make():
        policy = AdaptivePolicy(CostModel(XEON, rp.BASE_MS), PolicyConfig(min_gain=99.0))
        return watch.Shortfall(policy, XEON, case, sums, ("never", "code-edit"))
    s = rp.replay_case(case, make, XEON)
    assert s.spec_steps == 0 and s.steps == len(case.out) - 1
    rows = {where: row for (_, _, where), row in sums.items()}
    assert set(rows) <= set(watch.MISSED[:2])               # below plain or under min_gain
    steps = sum(r[0] for r in rows.values())
    assert steps == s.steps and sum(r[1] for r in rows.values()) == steps   # all right
    left = [len(case.out) - t - 1 for t in range(1, len(case.out))]         # run at t: to the end
    want = sum(max(0.0, j + 1 - XEON[j]) for j in left)
    assert abs(sum(r[2] for r in rows.values()) - want) < 1e-9


def test_replay_script_shortfall_watches_without_changing_a_decision():
    script = Path(__file__).resolve().parents[1] / "scripts" / "bench" / "policy_replay.py"
    cmd = [sys.executable, str(script), "replay", str(RECORDING), "--curve", "xeon",
           "--policies", "old,new", "--variant", "never:min_gain=99,probe_share=0"]
    plain = subprocess.run(cmd, capture_output=True, text=True)
    watched = subprocess.run(cmd + ["--shortfall"], capture_output=True, text=True)
    assert plain.returncode == 0 and watched.returncode == 0, watched.stderr
    assert watched.stdout.startswith(plain.stdout)          # same table, then the section
    section = watched.stdout[len(plain.stdout):].splitlines()
    assert section[1].startswith("where each policy falls short of the bound")
    totals, rows, who = {}, {}, None
    for line in section[5:]:
        parts = line.split()
        if "its cost" in line:
            who = (parts[0], parts[1])
            cost, bound = (float(x.rstrip(",")) for x in (parts[4], parts[7]))
            assert cost >= bound > 0 and abs(float(parts[-1]) - (cost - bound)) < 0.11
            totals[who] = cost
        else:
            rows.setdefault(who, []).append(line.strip())
    assert {p for p, _ in totals} == {"old", "new", "never"}
    assert {k for _, k in totals} == {"code-edit", "summarize", "chat"}
    for (policy, kind), lines in rows.items():
        drafted = [line for line in lines if line.startswith("drafted")]
        missed = [line for line in lines if line.startswith("not drafted")]
        if policy == "never":
            assert not drafted and missed
        if policy == "old":
            assert not missed                                # no reasons from the scalar policy
        for line in missed:
            n, right, saved = line.split()[-4:-1]
            assert int(n) >= int(right) >= 0 and float(saved) >= 0


def test_concurrent_sessions_emit_every_token_and_a_plain_tick_costs_one_pass():
    """tools/slots_replay.py: two clients through two cases (one copies its source, one does
    not), every rule emits each recorded token once; a plain tick costs one pass of its rows;
    drafting the copy costs less than decoding it plainly."""
    from tools import slots_replay as sr
    source = [(37 * i + 11) % 500 + 3 for i in range(120)]
    copy = synthetic([1, 2] + source, source[:100])
    fresh = synthetic([4, 5, 6], [(11 * i + 7) % 400 + 600 for i in range(60)])
    curve = rp.extend_curve(EPYC, 64)
    make = policies(curve)["new"]
    tokens = 2 * (len(copy.out) - 1 + len(fresh.out) - 1)
    results = {rule: sr.replay_slots([copy, fresh], make, curve, 2, rule, 66)
               for rule in sr.RULES}
    assert all(r["tokens"] == tokens for r in results.values())
    plain = results["plain"]
    assert plain["rows"] == tokens and plain["drafted"] == 0
    # a plain tick is one pass of its busy slots' rows (two, or one once a client is done)
    assert plain["ticks"] * curve[0] < plain["cost"] <= plain["ticks"] * (curve[1] + 0.004) + 1e-6
    for rule in ("rest", "trim"):
        assert results[rule]["cost"] < plain["cost"]               # the copy pays
        assert results[rule]["accepted"] <= results[rule]["drafted"]
    assert sr.shared_curve([1.0, 1.5, 2.0, 2.4], 2)[1] == pytest.approx(2.2)

"""Concurrent sessions replayed offline: several recordings decode at once in the ticks of a
shared context (`serve --parallel N`, localspec/llama/slots.py), each slot drafting with its own
policy, and what a rule for drafting under a shared batch gives over one request at a time.

    python tools/slots_replay.py data/recordings/policy_heldout_zen4.json [more.json ...]
        [--cases ID,ID,...] [--kinds code-edit] [--clients 4] [--curves zen4,zen3,xeon,spr,here]
        [--rules share,rest,trim,priced,plain] [--store] [--verbose]

The workload is scripts/bench/bench_parallel.py's throughput scenario: `--clients` clients at once,
each through every case in turn, rotated so that they start on different ones; a slot per
client. One request at a time is each case's lone replay (tools/replay.py) once per client.
A tick gives every busy slot one step ([last] + drafts); it costs what llama.cpp's split of
those steps costs on the curve (llama/batch_shape.py: one pass per run of equal-length parts),
or one padded pass where that is cheaper, in groups of at most `row_cap` rows, as SharedContext
runs them. Prompt prefill is left out of both sides (each prompt chunk runs alone either way).
Slot policies are told no step times (a tick's time is every slot's), as in the engine.

Rules (`--rules`):
- share: each slot drafts as a lone request would, within an equal share of 31 rows
  (31 // busy - 1 drafts): the rule before this tool;
- rest: within the rows the others leave (row_cap - busy), the lone choice otherwise;
- trim: the shipped rule: rest's choices, then cut where that raises the tick's expected tokens
  per unit of cost (llama/batch_shape.py's trim over each slot's policy.survival());
- priced: trim, and each slot's policy believes what its drafts add to a tick of that many
  busy slots (shared_curve() below; tried, not shipped: it starves copies from the draft store);
- plain: no drafts (batching alone).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Callable, Optional, Sequence

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))            # the repository
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "scripts" / "bench"))  # policy_replay

from tools import replay as rp  # noqa: E402
from localspec.llama.batch_shape import Step, tick_cost, trim  # noqa: E402
from localspec.policy.config import K_LIMIT  # noqa: E402
from localspec.policy.costmodel import CostConfig, CostModel  # noqa: E402
from localspec.speculative.learning_store import LearningStore  # noqa: E402
from localspec.speculative.store import DraftStore, max_tokens_for  # noqa: E402

RULES = ("share", "rest", "trim", "priced", "plain")
HERE_MODEL = "qwen2.5-coder-1.5b-instruct-q4_k_m.gguf"
SHARE_CAP = 31        # the rows a tick took together before (the invariant kernels' old limit)


def shared_curve(ratios: Sequence[float], busy: int) -> list:
    """Rule `priced` (tried, not shipped): r_B(k) for one slot of a shared context while `busy`
    slots step together, what its k drafts add to a tick in which the others step plainly
    (their rows one pass, r(busy - 1)), in units of one slot's share of that plain tick. The
    drafts either take a pass of their own (llama.cpp splits unequal steps: r(k - 1)) or every
    slot is padded to k + 1 rows, the cheaper. busy < 2: the curve itself.

    >>> [round(r, 2) for r in shared_curve([1.0, 1.5, 2.0, 2.4], 2)]
    [1.0, 2.2, 3.0, 3.67]
    """
    if busy < 2:
        return list(ratios)
    plain = ratios[busy - 1]
    out = [1.0]
    for k in range(1, len(ratios)):
        extra = ratios[k - 1]
        if busy * (k + 1) <= len(ratios):
            extra = min(extra, ratios[busy * (k + 1) - 1] - plain)
        out.append(1.0 + extra * busy / plain)
    return out


def client_queues(cases: Sequence[rp.Recorded], clients: int) -> list:
    """Each client's requests: every case, rotated so that client c starts on case c."""
    return [list(cases[c % len(cases):]) + list(cases[:c % len(cases)]) for c in range(clients)]


def new_store() -> LearningStore:
    """An empty draft store in memory (a server's first request): outputs join it as they end."""
    return LearningStore(DraftStore(max_tokens_for(64)), None, learn=False)


def replay_slots(cases: Sequence[rp.Recorded], make_policy: Callable, curve: Sequence[float],
                 clients: int, rule: str, row_cap: int, propose_cost: float = 0.002,
                 store: bool = False) -> dict:
    """Totals of the concurrent run under `rule`: tokens, cost (one-token decodes), ticks,
    rows, and drafts verified, accepted and predicted to be (survival, before any cut). With
    `store`, the slots share a draft store that every output joins when it ends."""
    shared = new_store() if store else None

    def cost(n: int) -> float:
        return curve[n - 1] if n <= len(curve) else \
            curve[-1] + (curve[-1] - curve[-2]) * (n - len(curve))
    queues = client_queues(cases, clients)
    runs: list = [None] * clients
    priced: dict = {}                # busy slots -> the curve a slot believes (rule tick)
    tot = dict(tokens=0, cost=0.0, ticks=0, rows=0, drafted=0, accepted=0, expected=0.0)
    cap = SHARE_CAP if rule == "share" else row_cap
    while True:
        for c in range(clients):
            if (runs[c] is None or runs[c].done) and queues[c]:
                if runs[c] is not None:
                    _end(runs[c], shared)
                runs[c] = rp.CaseRun(queues[c].pop(0), make_policy, tie_margin=0.0,
                                     store=shared)
                runs[c].policy.tracking = True              # as the engine does for a slot
        busy = [c for c in range(clients) if runs[c] is not None and not runs[c].done]
        if not busy:
            break
        room = {"share": cap // len(busy) - 1, "plain": 0}.get(rule, cap - len(busy))
        if rule == "priced" and len(busy) > 1:        # each slot believes shared_curve()
            model = priced.get(len(busy))
            if model is None:
                model = priced[len(busy)] = CostModel(shared_curve(curve, len(busy)),
                                                      config=CostConfig(online=False))
            for c in busy:
                runs[c].policy.cost = model
        props = {c: runs[c].propose(min(room, K_LIMIT)) if room > 0 else (None, [])
                 for c in busy}
        worth = {c: runs[c].survival(f, len(d)) for c, (f, d) in props.items()}
        if rule in ("trim", "priced") and len(busy) > 1:    # SharedContext._trim
            kept = trim({c: Step(len(d), worth[c]) for c, (f, d) in props.items()}, cost, cap)
            props = {c: (f, d[:kept[c]]) for c, (f, d) in props.items()}
        lengths = {c: len(d) + 1 for c, (f, d) in props.items()}
        step_cost = tick_cost(lengths, cost, cap) + propose_cost * len(busy)
        tot["cost"] += step_cost
        tot["ticks"] += 1
        tot["rows"] += sum(lengths.values())
        for c, (f, d) in props.items():
            n = runs[c].finish(f, d, step_cost / len(busy), None, propose_cost * rp.BASE_MS)
            tot["tokens"] += n
            if d:
                tot["drafted"] += len(d)
                tot["accepted"] += n - 1
                tot["expected"] += sum(worth[c][:len(d)])
    for r in runs:
        if r is not None:
            _end(r, shared)
    if shared is not None:
        shared.close()
    return tot


def _end(run: rp.CaseRun, store: Optional[LearningStore]) -> None:
    run.close()
    if store is not None:
        store.remember(run.case.out, run.case.prompt)


def lone_cost(cases: Sequence[rp.Recorded], make_policy: Callable, curve: Sequence[float],
              clients: int, propose_cost: float = 0.002, store: bool = False) -> tuple:
    """(tokens, cost) of the clients' requests one at a time, as replay_case runs them: in
    the order a one-slot server answers them (each client's first, then each one's second...),
    with `store` a draft store every output joins when it ends."""
    queues = client_queues(cases, clients)
    shared = new_store() if store else None
    tokens, total = 0, 0.0
    for i in range(len(cases)):
        for q in queues:
            c = q[i]
            s = rp.replay_case(c, make_policy, curve, k_max=K_LIMIT, tie_margin=0.0,
                               propose_cost=propose_cost, store=shared)
            if shared is not None:
                shared.remember(c.out, c.prompt)
            tokens += len(c.out) - 1
            total += (len(c.out) - 1) / s.speedup
    if shared is not None:
        shared.close()
    return tokens, total


def main(argv=None) -> int:
    from llamacpp_replay import CURVES, localspec_policy
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("recordings", nargs="+")
    ap.add_argument("--cases", default="", help="case ids, comma-separated (default: all)")
    ap.add_argument("--kinds", default="", help="case kinds, comma-separated (default: all)")
    ap.add_argument("--clients", type=int, default=4)
    ap.add_argument("--curves", default="zen4,zen3,xeon,spr",
                    help="named curves (tools/llamacpp_replay.py) or `here`: this machine's "
                         "newest calibration of the default model with 2 threads")
    ap.add_argument("--verbose", action="store_true", help="each rule's counts too")
    ap.add_argument("--store", action="store_true",
                    help="a draft store, empty at the start, that every output joins when it "
                         "ends (one at a time and the slots alike)")
    ap.add_argument("--rules", default=",".join(RULES))
    ap.add_argument("--row-cap", type=int, default=K_LIMIT + 4,
                    help="rows a tick's steps take in one batch (rules rest, trim, priced)")
    a = ap.parse_args(argv)
    bad = [r for r in a.rules.split(",") if r not in RULES] + \
        [c for c in a.curves.split(",") if c not in CURVES and c != "here"]
    if bad:
        ap.error(f"unknown rule or curve {bad[0]!r}: rules {', '.join(RULES)}; curves "
                 f"{', '.join(CURVES)}, here")
    cases = [c for path in a.recordings for c in rp.load(path)]
    if a.cases:
        want = a.cases.split(",")
        cases = sorted((c for c in cases if c.id in want), key=lambda c: want.index(c.id))
    if a.kinds:
        cases = [c for c in cases if c.kind in a.kinds.split(",")]
    if not cases:
        print("slots_replay: no cases", file=sys.stderr)
        return 2
    print(f"{len(cases)} cases x {a.clients} clients; tokens/cost over plain one at a time")
    print("| curve | lone spec | " + " | ".join(a.rules.split(",")) + " |")
    print("|---" * (2 + len(a.rules.split(","))) + "|")
    for name in a.curves.split(","):
        curve = CURVES[name][0] if name != "here" else rp.extend_curve(
            rp.calibrated_curve(HERE_MODEL, 2)[0], K_LIMIT)
        make = localspec_policy(curve, K_LIMIT)
        tok, cost = lone_cost(cases, make, curve, a.clients, store=a.store)
        cells = [f"{tok / cost:.3f}"]
        slot_make = localspec_policy(curve, K_LIMIT, {"cost.online": False})
        for rule in a.rules.split(","):
            r = replay_slots(cases, slot_make, curve, a.clients, rule, a.row_cap,
                             store=a.store)
            cells.append(f"{r['tokens'] / r['cost']:.3f}")
            if a.verbose:
                print(f"{name} {rule}: " + ", ".join(f"{k} {v:.0f}" for k, v in r.items()))
        print(f"| {name} | " + " | ".join(cells) + " |")
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""One speculative step: decode [last] + drafts in one batch, verify, keep what the target agrees
with, roll the KV cache back past the first rejection. A function of explicit inputs (context,
proposal, sampling, random stream, output position, guard), so tests drive it with a scripted
context; the engine owns the loop around it (prefill, emitting, stop rules, lifetimes).
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Optional, Sequence

import numpy as np

from .greedy import RowsVerdict, argmax_verify, greedy_verify
from .sampling import PositionStream, SamplingParams, target_dist, top2_gap
from .verify import verify


@dataclass(frozen=True)
class StepResult:
    emitted: list            # tokens for the output: accepted drafts + the recovered/bonus token
                             # (fewer after a near-tie; none after a tie at row 0)
    n_drafted: int
    n_accepted: int          # drafts the verifier kept, before the near-tie guard cut them
    recheck: bool            # a near-tie: the next step must decode its position alone
    rolled_back: bool        # False: the cache refused to drop rows (recurrent models)
    verify_ms: float         # the batched decode
    sample_ms: float         # sampler chain, verification maths and the guard


def step(ctx, proposal, sampling: SamplingParams, history: Sequence[int],
         stream: PositionStream, out_pos: int, tie_margin: float = 0.0,
         survival: Sequence[float] = (), one_pass: bool = True) -> StepResult:
    """Verify `proposal.tokens` (k drafts, maybe none) after `history`; `out_pos` is the output
    position of the first of them (what the random stream is indexed by). `survival`: each
    draft's predicted chance of being reached and accepted; a slot's shared tick may verify
    fewer drafts than proposed by it (ctx.verify_rows), and the step then checks those.

    KV invariant: before, the cache holds every token of `history` but the last; after, it holds
    every token of history + emitted but the last emitted one (which the next step decodes).
    Example (greedy): history [..., 3], drafts [5, 9, 4], target argmaxes per row [5, 9, 7, 2]
    -> emitted [5, 9, 7]; the cache keeps the rows of 3, 5 and 9.
    tie_margin > 0 (greedy only): a row whose top-2 logit gap is below it is not trusted.
    Greedy sampling with point-mass drafts takes greedy.greedy_verify's one pass over the rows
    (it penalises them in place); one_pass=False sends it through the per-row path too, the
    same answer (the overhead bench's reference). With the argmax on the device (the engine
    switches it on for greedy requests with no penalty and no guard) only the rows' tokens
    come back, and argmax_verify decides.
    """
    clock = time.perf_counter
    drafts, n_past, p_draft = list(proposal.tokens), ctx.n_past, proposal.p_draft
    decode_start = clock()
    if getattr(ctx, "argmax_on", False):         # a scripted test context has none
        targets = ctx.verify_tokens([history[-1], *drafts])
        decode_end = clock()
        return _finish(ctx, argmax_verify(targets, drafts), drafts, n_past, decode_start,
                       decode_end, clock)
    rows = ctx.verify_rows([history[-1], *drafts], survival)   # [k + 1, n_vocab] float32
    decode_end = clock()
    if len(rows) <= len(drafts):          # the tick kept fewer rows: fewer drafts to check
        drafts = drafts[:len(rows) - 1]
        p_draft = p_draft[:len(drafts)] if p_draft is not None else None
    recent = sampling.penalty_window(history)
    if one_pass and sampling.greedy and p_draft is None:
        decided = greedy_verify(rows, drafts, sampling, recent, tie_margin)
    else:
        verdict = verify(drafts, p_draft, lambda i: target_dist(rows[i], sampling,
                                                                recent + drafts[:i]),
                         stream, out_pos)
        tie = near_tie(rows, verdict.n_accepted, sampling, recent, drafts, tie_margin) \
            if drafts else None
        decided = RowsVerdict(verdict.n_accepted, verdict.token, tie)
    return _finish(ctx, decided, drafts, n_past, decode_start, decode_end, clock)


def _finish(ctx, decided: RowsVerdict, drafts: list, n_past: int, decode_start: float,
            decode_end: float, clock) -> StepResult:
    """Emit what the rows decided and roll the cache back past the first rejection."""
    # after a near-tie only what the rows before it decided; a one-token decode decides it
    emitted, kept = decided.emitted(drafts), decided.kept
    # Keep [last] + the kept drafts; the last emitted token is not in the cache yet.
    rolled_back = ctx.truncate(n_past + 1 + kept)
    verify_ms, sample_ms = 1000 * (decode_end - decode_start), 1000 * (clock() - decode_end)
    return StepResult(emitted, len(drafts), decided.n_accepted, decided.tie is not None,
                      rolled_back, verify_ms, sample_ms)


def near_tie(rows: np.ndarray, upto: int, sampling: SamplingParams, recent: list,
             drafts: list, margin: float) -> Optional[int]:
    """First row 0..upto whose greedy choice is closer than `margin`, or None.

    With the default (fast, not batch-invariant) kernels a row of a verify batch differs from a
    one-token decode by up to ~0.4-0.9 in a logit (docs/design.md), enough to flip a near-tie that
    plain decoding would decide the other way. Such a token is not taken from the batch: the
    next step decodes it alone, as plain decoding does. The default margin 0.25 covers every
    divergence measured on the workloads (top-2 gaps 0.02-0.18) while few rows fall under it
    (Qwen 1.5B greedy: 0% of code-edit rows, 0.8% of summary rows, 12% of chat rows, where
    n-gram drafting is mostly off anyway). The engine passes 0 (off) on batch-invariant CPU
    kernels (the default libraries, docs/exactness.md) and when sampling: sampled draws have no
    margin to test.
    """
    if margin <= 0:
        return None
    for i in range(upto + 1):
        if top2_gap(rows[i], sampling, recent + drafts[:i]) < margin:
            return i
    return None

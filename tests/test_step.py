"""The speculative step and the engine's loop on a scripted context: no model, exact logits.

A ScriptedContext plays a target whose greedy choice after any token sequence is a fixed rule, with a
chosen top-2 margin, and records the KV rows it holds like a real context. This reaches the step's
edge cases directly: full acceptance, a rejection, a refused rollback, a tie at row 0 or later, an
end-of-generation token inside an accepted run.
"""

from __future__ import annotations

import contextlib

import numpy as np
import pytest

from localspec.speculative.engine import Engine, EngineConfig
from localspec.policy.config import PolicyConfig
from localspec.policy.acceptance import Offer
from localspec.speculative.proposers import Proposal, Proposer
from localspec.speculative.sampling import PositionStream, SamplingParams
from localspec.speculative.step import step

N_VOCAB = 32
EOS = 31
GREEDY = SamplingParams()


def rule(history) -> int:
    """The scripted target's greedy next token: (last + 1) mod 30, so 5 -> 6 -> 7 ..."""
    return (history[-1] + 1) % 30


class ScriptedContext:
    """Logits rows from `rule`, `margin` between the top two; KV rows tracked like Context."""

    def __init__(self, n_ctx=256, margin=2.0, ties_after=(), refuse_rollback=False, target=rule):
        self.n_ctx, self.margin, self.ties_after = n_ctx, margin, set(ties_after)
        self.refuse_rollback, self.target = refuse_rollback, target
        self.tokens: list = []
        self.decoded: list = []          # every batch, for assertions

    @property
    def n_past(self):
        return len(self.tokens)

    def _row(self, seen):
        row = np.zeros(N_VOCAB, dtype=np.float32)
        best = self.target(seen)
        row[best] = 5.0
        row[(best + 1) % N_VOCAB] = 5.0 - (0.01 if seen[-1] in self.ties_after else self.margin)
        return row

    def decode(self, tokens, logits="last"):
        self.decoded.append(list(tokens))
        rows = []
        for t in tokens:
            self.tokens.append(int(t))
            rows.append(self._row(self.tokens))
        rows = np.array(rows)
        return {"last": rows[-1:], "all": rows, "none": rows[:0]}[logits]

    def sync(self, tokens, stop=None, grid=0):
        self.tokens = list(tokens[:-1])
        return self.decode(tokens[-1:])[0], 0

    def truncate(self, n_keep):
        if self.refuse_rollback and n_keep < self.n_past:
            return False
        del self.tokens[n_keep:]
        return True

    def clear(self):
        self.tokens = []

    def reconcile(self):
        pass

    timed = True                     # a lone context: its decode times are its own

    def hold(self):                  # no shared ticks to mark a slot busy for
        return contextlib.nullcontext()

    def free_drafts(self, k, room):
        return k

    def draft_room(self):
        return self.n_ctx

    def stepping(self):              # no other slots' steps beside this one's
        return 1

    def verify_rows(self, tokens, survival=()):
        return self.decode(tokens, logits="all")

    def close(self):
        pass


def drafted(tokens, source="history"):
    return Proposal(list(tokens), None, source)


def run_step(ctx, history, drafts, sampling=GREEDY, tie_margin=0.0, out_pos=0):
    ctx.tokens = list(history[:-1])        # the invariant: every token but the last is in KV
    return step(ctx, drafted(drafts), sampling, history, PositionStream(7), out_pos, tie_margin)


def test_all_drafts_accepted_gives_a_bonus_token_and_keeps_their_rows():
    ctx = ScriptedContext()
    r = run_step(ctx, [1, 2, 3], [4, 5, 6])
    assert r.emitted == [4, 5, 6, 7] and r.n_accepted == 3 and not r.recheck
    assert ctx.decoded == [[3, 4, 5, 6]]
    assert ctx.tokens == [1, 2, 3, 4, 5, 6]          # all but the bonus token 7


def test_first_rejection_emits_the_recovered_token_and_drops_later_rows():
    ctx = ScriptedContext()
    r = run_step(ctx, [1, 2, 3], [4, 9, 6])
    assert r.emitted == [4, 5] and r.n_accepted == 1 and r.n_drafted == 3
    assert ctx.tokens == [1, 2, 3, 4]


def test_plain_step_decodes_one_token():
    ctx = ScriptedContext()
    r = run_step(ctx, [1, 2, 3], [])
    assert r.emitted == [4] and r.n_drafted == 0 and ctx.tokens == [1, 2, 3]


def test_tie_at_row_zero_emits_nothing_and_hands_the_position_back():
    """The guard distrusts row 0: nothing is emitted, even [last]'s row goes, and the next step
    must decode that position alone (as plain decoding does)."""
    ctx = ScriptedContext(ties_after={3})
    r = run_step(ctx, [1, 2, 3], [4, 5], tie_margin=0.25)
    assert r.emitted == [] and r.recheck and r.n_accepted == 2
    assert ctx.tokens == [1, 2]                      # back to the state before the step
    again = run_step(ctx, [1, 2, 3], [])              # the engine's recheck step
    assert again.emitted == [4] and not again.recheck


def test_tie_inside_an_accepted_run_keeps_what_rows_before_it_decided():
    ctx = ScriptedContext(ties_after={5})            # the row after 5 is a near-tie
    r = run_step(ctx, [1, 2, 3], [4, 5, 6, 7], tie_margin=0.25)
    assert r.emitted == [4, 5] and r.recheck
    assert ctx.tokens == [1, 2, 3, 4]                # 5 is emitted but not in KV yet


def test_tie_guard_off_takes_every_row_from_the_batch():
    ctx = ScriptedContext(ties_after={3, 5})
    r = run_step(ctx, [1, 2, 3], [4, 5, 6], tie_margin=0.0)
    assert r.emitted == [4, 5, 6, 7] and not r.recheck


def test_refused_rollback_is_reported_not_hidden():
    ctx = ScriptedContext(refuse_rollback=True)
    r = run_step(ctx, [1, 2, 3], [4, 9, 9])
    assert not r.rolled_back and r.emitted == [4, 5]
    assert ctx.tokens == [1, 2, 3, 4, 9, 9]          # unchanged: the engine must rebuild


def test_repetition_penalty_sees_the_drafts_before_each_row():
    """Target prefers `last + 1`, but 4 was just drafted: with a strong penalty the row after a
    draft of 4 must see it. Here the runner-up (best + 1) wins once the best is penalised."""
    sampling = SamplingParams(repeat_penalty=100.0, repeat_last_n=64)
    ctx = ScriptedContext(target=lambda seen: 4)     # always wants 4
    r = run_step(ctx, [1, 2, 3], [4, 4], sampling=sampling)
    assert r.emitted == [4, 5]                       # row 1 sees the draft 4: penalised


def test_seeded_sampling_is_the_same_with_and_without_drafts():
    """Point-mass drafts + the per-position stream: the step draws what plain sampling would."""
    sampling = SamplingParams(temperature=1.0, top_k=0, top_p=1.0, min_p=0.0, seed=3)
    ctx = ScriptedContext(margin=0.7)
    plain, history = [], [1, 2, 3]
    for t in range(6):
        plain += run_step(ctx, history + plain, [], sampling, out_pos=t).emitted
    spec = run_step(ctx, history, plain[:4], sampling, out_pos=0).emitted
    assert spec == plain[:len(spec)] and len(spec) >= 1


# --- the engine's loop on a scripted model and context --------------------------------------------

class ScriptedModel:
    """What the engine asks of a model when prompts are token ids: pieces and end-of-generation."""

    n_ctx_train = 256
    path = None

    def is_eog(self, token):
        return token == EOS

    def token_piece(self, token):
        return f"<{token}>".encode()

    def tokenize(self, text, add_special=True, parse_special=False):
        raise AssertionError("prompts here are token ids")


class ScriptedProposer(Proposer):
    """Proposes a fixed continuation for each history length: drafts through an EOS."""

    name = "scripted"

    def __init__(self, script):
        self.script, self.history = script, []

    def begin(self, history, document=None, sampling=None, seed=0):
        self.history = list(history)

    def offers(self, limit):
        tokens = self.script.get(len(self.history), [])[:limit]
        return [Offer("scripted", len(tokens))] if tokens else []

    def draft(self, offer, k):
        return drafted(self.script[len(self.history)][:k])

    def accept(self, tokens):
        self.history += tokens

    def close(self):
        pass


def scripted_engine(ctx, proposer):
    config = EngineConfig(policy=PolicyConfig(fixed_k=8), n_ctx=ctx.n_ctx, cache_mb=0)
    return Engine(ScriptedModel(), config, proposer=proposer, context=ctx)


def test_eos_inside_an_accepted_run_stops_and_leaves_only_output_rows():
    """Target: 27 28 29 EOS ... The proposer drafts [28, 29, EOS, 0] after 27: all accepted, but
    generation must stop at the EOS and the KV cache must hold prompt + output only."""
    target = lambda seen: EOS if seen[-1] == 29 else (seen[-1] + 1) % 30
    ctx = ScriptedContext(target=target)
    prompt = [20, 25, 26]
    with scripted_engine(ctx, ScriptedProposer({4: [28, 29, EOS, 0]})) as engine:
        gen = engine.generate(prompt, max_tokens=20)
        assert gen.complete_tokens() == [27, 28, 29]
        assert gen.stats.stop_reason == "eos" and gen.text == "<27><28><29>"
        assert ctx.tokens == prompt + [27, 28, 29][:len(ctx.tokens) - len(prompt)]
        assert len(ctx.tokens) <= len(prompt) + 3


def test_refused_rollback_rebuilds_the_cache_and_decodes_plainly(capfd):
    ctx = ScriptedContext(refuse_rollback=True)
    prompt = [1, 2, 3]
    with scripted_engine(ctx, ScriptedProposer({4: [5, 9, 9]})) as engine:
        gen = engine.generate(prompt, max_tokens=6)
        assert gen.complete_tokens() == [4, 5, 6, 7, 8, 9]   # the target's own output
        assert gen.stats.spec_steps == 1                     # then plain decoding
    assert "cannot roll back its KV cache" in capfd.readouterr().err


def test_max_tokens_inside_an_accepted_run_trims_the_cache():
    ctx = ScriptedContext()
    with scripted_engine(ctx, ScriptedProposer({4: [5, 6, 7, 8, 9]})) as engine:
        gen = engine.generate([1, 2, 3], max_tokens=3)
        assert gen.complete_tokens() == [4, 5, 6] and gen.stats.stop_reason == "length"
        assert ctx.tokens == [1, 2, 3, 4, 5, 6][:len(ctx.tokens)] and len(ctx.tokens) <= 6


def test_a_text_that_runs_to_the_end_of_the_context_ends_where_plain_decoding_ends():
    """Plain decoding stops before it would decode at the context's last position; speculation
    must stop at the same token: a verify batch that reached that position gave a fully accepted
    draft one bonus token more than plain (the soak's 502 tokens against plain's 501)."""
    prompt = [1, 2, 3]
    with scripted_engine(ScriptedContext(n_ctx=40), ScriptedProposer({})) as engine:
        plain = engine.generate(prompt, max_tokens=1000)
        ref = plain.complete_tokens()
    assert plain.stats.stop_reason == "context"
    text = prompt + ref
    oracle = {n: text[n:n + 8] for n in range(len(prompt), len(text))}   # drafts that all hold
    for start in range(8):            # every alignment of the drafts against the context's end
        script = {n: d for n, d in oracle.items() if n >= len(prompt) + start}
        ctx = ScriptedContext(n_ctx=40)
        with scripted_engine(ctx, ScriptedProposer(script)) as engine:
            gen = engine.generate(prompt, max_tokens=1000)
            assert gen.complete_tokens() == ref, start
            assert gen.stats.stop_reason == "context" and gen.stats.accepted > 0


@pytest.mark.parametrize("prompt", [[], ""])
def test_empty_prompt_is_a_clear_error(prompt):
    ctx = ScriptedContext()
    with scripted_engine(ctx, ScriptedProposer({})) as engine:
        engine.model.tokenize = lambda text, **kw: []
        with pytest.raises(Exception, match="prompt is empty"):
            engine.generate(prompt)

"""The generation loop: prefill, then speculative steps (step.py) until a stop rule fires.

Plain decoding is the same loop with no drafts (k = 0), so the baseline and the speculative path
share the prefill, the sampler chain, the random stream and the stopping rules. The engine owns
the target's context, the loop and lifetimes; factory.py builds the model, cache and proposer,
drafting.py each request's draft policy and each step's draft, generation.py the handle a caller
iterates.
"""

from __future__ import annotations

import os
import random
import sys
import threading
import time
from dataclasses import replace
from typing import Callable, Iterator, Optional, Sequence, Union

import numpy as np

from ..errors import LocalspecError
from ..llama import PREFILL_GRID, Context, Model
from ..policy.config import PolicyConfig
from .config import EngineConfig
from .drafting import Drafting, observe, propose
from .factory import batches_trusted, build
from .generation import Generation, Request
from .proposers import EMPTY, Proposer
from .sampling import PositionStream, SamplingParams, draw, target_dist
from .step import step
from .textstream import TextStream

__all__ = ["Engine", "EngineConfig", "Generation", "Prompt"]

Prompt = Union[str, Sequence[dict], Sequence[int]]
# Prompts are prefilled in chunks of PREFILL_GRID tokens on a grid of absolute positions (the
# prompt cache keeps whole chunks only, so cached equals cold). A cancel (Ctrl-C in chat, `cancel`
# in the protocol) is seen between two chunks, ~1.3 s apart for the 1.5B at 50 prompt tokens/s
# on 2 cores. Measured cost: docs/prompt-cache.md, "Cached equals cold".


class Engine:
    """A target model, its context, and a proposer. Not thread-safe: one generation at a time.

    `target` is a catalog name, a path, or a loaded Model (shared, not closed here). `proposer`
    replaces the one the config would build, `context` the target context (tests pass scripted
    ones); the engine closes whichever it runs.
    """

    def __init__(self, target: Union[str, os.PathLike, Model], config: EngineConfig = EngineConfig(),
                 progress: Optional[Callable[[str], None]] = None,
                 proposer: Optional[Proposer] = None, context: Optional[Context] = None):
        self.config = config
        parts = build(target, config, proposer, context)
        self.model, self.ctx, self.cache, self.proposer = parts.model, parts.ctx, parts.cache, \
            parts.proposer
        self._own_model = parts.own_model
        if self.ctx.n_ctx > self.model.n_ctx_train > 0:
            print(f"localspec: warning: a context of {self.ctx.n_ctx} tokens is more than "
                  f"{self.model.path.name} was trained on ({self.model.n_ctx_train}); output "
                  "past that length may degrade. Lower --ctx unless you know it copes.",
                  file=sys.stderr)
        self.drafting = Drafting(config, progress)
        self.trusts_batches = batches_trusted(config)    # no near-tie guard needed
        self._can_rollback = True
        self._running: Optional[Generation] = None      # the request whose cleanup is pending

    # -- public --------------------------------------------------------------------------------
    def tokenize_prompt(self, prompt: Prompt) -> list:
        """Raw text (BOS added as the model wants), chat messages (the model's template), or
        token ids used as they are."""
        if isinstance(prompt, (list, tuple)) and (not prompt or isinstance(prompt[0], int)):
            return list(prompt)
        if isinstance(prompt, str):
            return self.model.tokenize(prompt, add_special=True, parse_special=False)
        text = self.model.apply_chat_template(list(prompt), add_assistant=True)
        return self.model.tokenize(text, add_special=True, parse_special=True)

    def generate(self, prompt: Prompt, sampling: SamplingParams = SamplingParams(),
                 max_tokens: int = 256, stop: Sequence[str] = (), document: Optional[str] = None,
                 speculate: bool = True, cancel: Optional[threading.Event] = None,
                 policy: Optional[PolicyConfig] = None) -> Generation:
        """Start a generation. `prompt` is raw text, or chat messages [{"role", "content"}] that
        are rendered with the model's own template. `document` is extra text for the n-gram
        proposer to search; `policy` overrides the engine's draft policy for this request.
        Iterate the result for streamed text. A request still open from an earlier call is
        ended first (one generation at a time: its cleanup must not touch this one's KV)."""
        self._end_running()
        prompt_tokens = self.tokenize_prompt(prompt)
        if not prompt_tokens:
            raise LocalspecError("the prompt is empty (and this model adds no start token); "
                                 "give at least one character of prompt.")
        if len(prompt_tokens) >= self.ctx.n_ctx:
            raise LocalspecError(
                f"the prompt is {len(prompt_tokens)} tokens but the context holds {self.ctx.n_ctx}; "
                f"raise --ctx (the model was trained on {self.model.n_ctx_train}) or shorten it.")
        seed = sampling.seed if sampling.seed is not None else random.getrandbits(63)
        rules = None
        if speculate:    # the first policy may drop a draft model that cannot pay here
            rules, self.proposer = self._policy_for(policy)
            if rules is not None and not self.ctx.timed:   # a slot: its ticks weigh drafts
                rules.tracking = True                      # by survival(), kept per request
        guard = self.config.tie_margin if sampling.greedy and not self.trusts_batches else 0.0
        req = Request(sampling, PositionStream(seed), rules, list(prompt_tokens), guard)
        if rules is not None:
            doc = self.model.tokenize(document, add_special=False) if document else None
            self.proposer.begin(prompt_tokens, doc, sampling, seed)
        texts = TextStream(self.model.token_piece, stop)
        self._running = Generation(self._run(req, texts, max_tokens, cancel), req, texts)
        return self._running

    def next_logits(self, tokens: Sequence[int]) -> np.ndarray:
        """The logits row [n_vocab] after `tokens`, evaluated from a cold cache (a copy)."""
        self.reset()
        try:
            return np.array(self.ctx.sync(list(tokens), grid=PREFILL_GRID)[0])
        finally:
            self.reset()

    def reset(self) -> None:
        """Forget the KV cache: the next request evaluates its whole prompt (cold start)."""
        self.ctx.clear()

    def prepare(self) -> None:
        """Measure (or load) the cost curve now rather than on the first speculative request,
        e.g. when a server starts, and drop a draft model that cannot pay."""
        if self.proposer is not None:
            _, self.proposer = self._policy_for(None)

    def keep_live_state(self) -> None:
        """Save the live KV state in the prompt cache (on disk too when it has a folder), e.g.
        before a server exits, so the next process finds the last document it read."""
        if self.cache is None:
            return
        try:
            self.cache.store(self.ctx)
        except (OSError, LocalspecError) as e:
            print(f"localspec: could not save the prompt state ({e}).", file=sys.stderr)

    def close(self) -> None:
        """End the open request (its cleanup runs now, on a live context), then free the
        proposer, the context and an owned model, in that order. Idempotent."""
        self._end_running()
        if self.proposer is not None:
            self.proposer.close()
            self.proposer = None
        if getattr(self, "ctx", None) is not None:
            self.ctx.close()
        if self._own_model:
            self.model.close()

    def _end_running(self) -> None:
        """Close the last generator handed out: its `finally` (KV cleanup, the draft store's
        update) runs now, while everything it touches is open, never later from the garbage
        collector or at interpreter exit. A no-op for one already finished or never started."""
        running, self._running = self._running, None
        if running is not None:
            running.close()

    def __enter__(self) -> "Engine":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    # -- the loop ------------------------------------------------------------------------------
    def _run(self, req: Request, texts: TextStream, max_tokens: int,
             cancel: Optional[threading.Event]) -> Iterator[str]:
        st, n_prompt = req.stats, len(req.history)
        st.prompt_tokens = n_prompt
        start = time.perf_counter()
        with self.ctx.hold():     # a slot of a shared context: its ticks wait for this one
            try:
                # A saved state holding more of the prompt than the live KV is restored first.
                reuse = (self.cache.prepare(self.ctx, req.history, PREFILL_GRID)
                         if self.cache is not None else None)
                logits, reused = self.ctx.sync(req.history, stop=cancel, grid=PREFILL_GRID)
                st.prefill_tokens = self.ctx.n_past - reused
                st.record_reuse(reuse.source if reuse else "context", reused,
                                reuse.restore_ms if reuse else 0.0)
                st.prefill_ms = 1000 * (time.perf_counter() - start)
                if logits is None:                 # cancelled between two chunks of the prompt
                    return
                damage = "NaN/infinite" if not np.isfinite(logits).all() else \
                    "identical" if logits.min() == logits.max() else ""
                if damage:                         # zeroed weights give every token the same logit
                    self.ctx.clear()               # rows computed from such weights are no use
                    raise LocalspecError(
                        f"{self.model.path.name} produced {damage} logits for this prompt: its "
                        "weights are most likely corrupt. Check it with `localspec models verify`, "
                        "then re-download (`localspec models pull NAME --force`) or replace the file.")
                emitted = [draw(target_dist(logits, req.sampling, req.history), req.stream.u(0, 0))]
                if self._argmax_for(req):      # after the prefill: its row is checked above
                    self.ctx.device_argmax(True)
                while True:
                    for tok in emitted:
                        if self.model.is_eog(tok):
                            st.stop_reason = "eos"
                            break
                        req.out.append(tok)
                        req.history.append(tok)
                        piece = texts.feed(tok)
                        if piece:
                            yield piece
                        if texts.stopped:
                            st.stop_reason = "stop"
                            break
                        if len(req.out) >= max_tokens:
                            st.stop_reason = "length"
                            break
                    if st.stop_reason:
                        break
                    if req.policy is not None:
                        self.proposer.accept(emitted)
                    if cancel is not None and cancel.is_set():
                        st.stop_reason = "cancelled"
                        break
                    if self.ctx.n_past + 1 >= self.ctx.n_ctx:
                        st.stop_reason = "context"
                        break
                    emitted = self._step(req)
                tail = texts.finish()
                if tail:
                    yield tail
            finally:
                self._finish(req, n_prompt)
                st.total_ms = 1000 * (time.perf_counter() - start)
                if not st.stop_reason:
                    st.stop_reason = "cancelled"

    def _finish(self, req: Request, n_prompt: int) -> None:
        """A request's cleanup. Keep only KV rows that match prompt + output: a stop inside an
        accepted run, an exception or Ctrl-C must not leave stray rows for the next request to
        reuse. Touches nothing that was closed (engine.close() ends the request first, so a
        closed context here means its owner freed it behind the engine's back), and nothing at
        interpreter exit, when a never-closed engine's generator is collected: no KV is reused
        then, and llama.cpp is not called while Python tears down."""
        st = req.stats
        st.generated_tokens = len(req.out)
        if req.policy is not None:
            st.pauses = req.policy.guard.n_backoffs
        if getattr(self.ctx, "closed", False) or sys.is_finalizing():
            return
        if getattr(self.ctx, "argmax_on", False):
            self.ctx.device_argmax(False)      # the next prompt's prefill reads its logits
        self.ctx.reconcile()
        if not self.ctx.truncate(min(self.ctx.n_past, n_prompt + len(req.out))):
            self.ctx.clear()
        if req.policy is not None and self.proposer is not None:
            self.proposer.end()                # the draft store keeps the output

    def _step(self, req: Request) -> list:
        """Ask the proposer (unless a near-tie must be re-decided alone), run one step, let the
        policy observe it."""
        started = time.perf_counter()
        # plain decoding stops before it would decode at the context's last position (the stop
        # rule in generate), so a verify batch ends one short of it too: else a fully accepted
        # draft's bonus token is one plain decoding never reaches
        room = min(self.ctx.n_ctx - self.ctx.n_past - 2, self.ctx.draft_room())
        proposal = propose(self.ctx, self.proposer, req.policy, room) \
            if req.policy is not None and room > 0 and not req.recheck else EMPTY
        survival = ()             # a slot's drafts: what each is worth to its shared tick
        if proposal.tokens and proposal.features is not None and self.ctx.stepping() > 1:
            survival = req.policy.survival(proposal.features, len(proposal.tokens))
        propose_ms = 1000 * (time.perf_counter() - started)
        result = step(self.ctx, proposal, req.sampling, req.history, req.stream,
                      out_pos=len(req.out), tie_margin=req.tie_margin, survival=survival)
        req.recheck = result.recheck
        if not result.rolled_back:
            self._rollback_refused(req, result.emitted)
        if req.policy is not None:       # a shared tick's time is not this step's: the curve
            timed = result if self.ctx.timed else replace(result, verify_ms=None)
            observe(req.policy, proposal, timed, propose_ms)
        st = req.stats
        st.record_step(proposal.source, result.n_drafted,
                       min(result.n_accepted, len(result.emitted)))
        st.rechecks += result.recheck
        st.step_tokens += len(result.emitted)
        st.propose_ms += propose_ms
        st.verify_ms += result.verify_ms
        st.sample_ms += result.sample_ms
        return result.emitted

    # -- helpers -------------------------------------------------------------------------------
    def _argmax_for(self, req: Request) -> bool:
        """Whether this request's rows may be reduced to their argmax on the device
        (EngineConfig.device_argmax): greedy, no repetition penalty, no near-tie guard: nothing
        needs a row but its best token."""
        s = req.sampling
        return self.config.device_argmax and s.greedy and s.repeat_penalty == 1.0 and \
            req.tie_margin == 0 and hasattr(self.ctx, "device_argmax")   # not a scripted one

    def _policy_for(self, override: Optional[PolicyConfig]) -> tuple:
        """(the draft policy for a request, the proposer to keep), from drafting.py. Policy None:
        decode plainly. The proposer comes back changed when the first policy drops a draft
        model that cannot pay here (None: no speculation left); the caller stores it."""
        if self.proposer is None or not self._can_rollback:
            return None, self.proposer
        return self.drafting.policy(self.ctx, self.proposer, override)

    def _rollback_refused(self, req: Request, emitted: list) -> None:
        """The model's memory cannot drop rows (recurrent/hybrid): rebuild KV, stop speculating."""
        print("localspec: this model cannot roll back its KV cache; continuing with plain "
              "decoding.", file=sys.stderr)
        self._can_rollback = False
        req.policy = None
        self.ctx.clear()
        self.ctx.decode((req.history + emitted)[:-1], logits="none")

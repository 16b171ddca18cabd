"""The generation loop: prefill, then speculative steps (propose -> verify in one batch -> roll back).

Plain decoding is the same loop with no drafts (k = 0), so the baseline and the speculative path
share the prefill, the sampler chain, the random stream and the stopping rules.
"""

from __future__ import annotations

import os
import random
import sys
import threading
import time
from dataclasses import dataclass, field, replace
from typing import Callable, Iterator, Optional, Sequence, Union

from .calibrate import load_or_measure
from .catalog import resolve_model
from .errors import LocalspecError
from .llama import Context, ContextParams, Model, ModelParams, enable_exact_kernels
from .policy import DraftPolicy, PolicyConfig
from .compat import check_pair
from .proposers import EMPTY, DraftProposer, HybridProposer, NgramProposer
from .rpc import attach as attach_rpc
from .sampling import PositionStream, SamplingParams, draw, target_dist, top2_gap
from .stats import GenerationStats
from .textstream import TextStream
from .verify import verify

Prompt = Union[str, Sequence[dict], Sequence[int]]


@dataclass(frozen=True)
class EngineConfig:
    """Engine settings with defaults for a laptop CPU.

    proposer: "ngram" (prompt lookup), "draft" (the `draft` model), "hybrid" (n-gram, then the
    draft model where lookup finds nothing) or "none" (plain decoding).
    """

    proposer: str = "ngram"
    draft: Optional[str] = None           # catalog name or path of the draft model
    draft_gpu_layers: Optional[int] = None  # None: same as n_gpu_layers
    draft_min_confidence: float = 0.0
    n_ctx: int = 4096
    n_batch: int = 512
    n_threads: Optional[int] = None
    n_gpu_layers: int = 0
    rpc: tuple = ()                       # HOST:PORT of `localspec rpc-server`s (see rpc.attach)
    exact: bool = False                   # batch-invariant CPU kernels: speculative == plain, bit for bit
    tie_margin: float = 0.25              # greedy, not exact: rows closer than this are re-decided
    ngram_min: int = 1
    ngram_max: int = 8
    policy: PolicyConfig = field(default_factory=PolicyConfig)


@dataclass
class _Request:
    """Mutable state of one generate() call."""

    sampling: SamplingParams
    stream: PositionStream
    policy: Optional[DraftPolicy]
    history: list                 # prompt + emitted tokens (what penalties and n-gram see)
    out: list = field(default_factory=list)
    stats: GenerationStats = field(default_factory=GenerationStats)
    recheck: bool = False         # the next step decodes one token: a near-tie is re-decided


class Generation:
    """Iterate for text pieces as they are ready; afterwards `.text`, `.tokens`, `.stats`."""

    def __init__(self, run: Iterator[str], request: _Request, texts: TextStream):
        self._run, self._request, self._texts = run, request, texts

    def __iter__(self) -> Iterator[str]:
        yield from self._run

    def complete(self) -> str:
        for _ in self:
            pass
        return self.text

    def complete_tokens(self) -> list:
        self.complete()
        return list(self.tokens)

    @property
    def text(self) -> str:
        return self._texts.text

    @property
    def tokens(self) -> list:
        return self._request.out

    @property
    def stats(self) -> GenerationStats:
        return self._request.stats


class Engine:
    """A target model, its context, and a proposer. Not thread-safe: one generation at a time."""

    def __init__(self, target: Union[str, os.PathLike, Model], config: EngineConfig = EngineConfig(),
                 progress: Optional[Callable[[str], None]] = None):
        self.config = config
        self._progress = progress
        self._own_model = not isinstance(target, Model)
        if config.exact:
            enable_exact_kernels()
        attach_rpc(config.rpc)                # before any model loads: layers go to them first
        self._model_params = ModelParams(n_gpu_layers=config.n_gpu_layers,
                                         use_extra_bufts=False if config.exact else None)
        self.model = Model(resolve_model(str(target)), self._model_params) \
            if self._own_model else target
        if config.rpc:          # say where the layers went: RPC is silent otherwise
            print(f"localspec: {self.model.path.name}: "
                  f"{self.model.placement or 'every layer on this machine'}", file=sys.stderr)
        try:
            self.ctx = Context(self.model, ContextParams(config.n_ctx, config.n_batch,
                                                         config.n_threads))
        except Exception:
            self._close_model()
            raise
        self.draft_model: Optional[Model] = None
        self._draft_cost = 0.0
        try:
            self.proposer = self._make_proposer(config)
        except Exception:
            self.close()
            raise
        self._cost = None
        self._kv_tokens: list = []       # tokens whose KV rows are in ctx, positions 0..n_past-1
        self._can_rollback = True

    # -- public --------------------------------------------------------------------------------
    def tokenize_prompt(self, prompt: Prompt) -> list:
        """Raw text (BOS added as the model wants), chat messages (the model's template), or
        token ids used as they are."""
        if isinstance(prompt, (list, tuple)) and prompt and isinstance(prompt[0], int):
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
        Iterate the result for streamed text."""
        prompt_tokens = self.tokenize_prompt(prompt)
        if len(prompt_tokens) >= self.ctx.n_ctx:
            raise LocalspecError(
                f"the prompt is {len(prompt_tokens)} tokens but the context holds {self.ctx.n_ctx}; "
                f"raise --ctx (the model was trained on {self.model.n_ctx_train}) or shorten it.")
        seed = sampling.seed if sampling.seed is not None else random.getrandbits(63)
        rules = None
        if speculate and self.proposer is not None and self._can_rollback:
            rules = DraftPolicy(self._cost_curve(), policy or self.config.policy, self._draft_cost)
            if self.draft_model is not None and not rules.draft_can_pay():
                self._drop_draft(rules)
            if self.proposer is None:
                rules = None
        req = _Request(sampling, PositionStream(seed), rules, list(prompt_tokens))
        if rules is not None:
            doc = self.model.tokenize(document, add_special=False) if document else None
            self.proposer.begin(prompt_tokens, doc, sampling, seed)
        texts = TextStream(self.model.token_piece, stop)
        return Generation(self._run(req, texts, max_tokens, cancel), req, texts)

    def reset(self) -> None:
        """Forget the KV cache: the next request evaluates its whole prompt (cold start)."""
        self.ctx.clear()
        self._kv_tokens = []

    def prepare(self) -> None:
        """Measure (or load) the cost curve now rather than on the first speculative request,
        e.g. when a server starts."""
        if self.proposer is not None:
            self._cost_curve()

    def close(self) -> None:
        if getattr(self, "proposer", None) is not None:
            self.proposer.close()
            self.proposer = None
        self.ctx.close()
        if self.draft_model is not None:
            self.draft_model.close()
            self.draft_model = None
        self._close_model()

    def __enter__(self) -> "Engine":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    # -- the loop ------------------------------------------------------------------------------
    def _run(self, req: _Request, texts: TextStream, max_tokens: int,
             cancel: Optional[threading.Event]) -> Iterator[str]:
        st, n_prompt = req.stats, len(req.history)
        st.prompt_tokens = n_prompt
        start = time.perf_counter()
        try:
            logits = self._prefill(req.history)
            st.prefill_tokens = self._prefilled
            st.prefill_ms = 1000 * (time.perf_counter() - start)
            emitted = [draw(target_dist(logits, req.sampling, req.history), req.stream.u(0, 0))]
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
            # Keep only KV rows that match prompt + output: a stop inside an accepted run, an
            # exception or Ctrl-C must not leave stray rows for the next request to reuse.
            keep = min(self.ctx.n_past, n_prompt + len(req.out))
            if not self.ctx.truncate(keep):
                self.ctx.clear()
            self._kv_tokens = (req.history[:n_prompt] + req.out)[: self.ctx.n_past]
            st.generated_tokens = len(req.out)
            st.total_ms = 1000 * (time.perf_counter() - start)
            if not st.stop_reason:
                st.stop_reason = "cancelled"

    def _step(self, req: _Request) -> list:
        """One step: propose, decode [last] + drafts in one batch, verify, roll back, emit.

        KV invariant: before the step, KV holds every token but the last emitted one.
        """
        clock = time.perf_counter
        t0 = clock()
        room = self.ctx.n_ctx - self.ctx.n_past - 1
        proposal = self.proposer.propose(req.policy, room) \
            if req.policy is not None and room > 0 and not req.recheck else EMPTY
        drafts, p_draft, k = proposal.tokens, proposal.p_draft, len(proposal.tokens)
        n_past, req.recheck = self.ctx.n_past, False
        t1 = clock()
        rows = self.ctx.decode([req.history[-1], *drafts], logits="all")  # [k + 1, n_vocab] f32
        t2 = clock()
        recent = req.history[-req.sampling.repeat_last_n:] if req.sampling.repeat_penalty != 1.0 else []
        verdict = verify(drafts, p_draft,
                         lambda i: target_dist(rows[i], req.sampling, recent + drafts[:i]),
                         req.stream, t0=len(req.out))
        emitted, kept = verdict.emitted(drafts), verdict.n_accepted
        tie = self._near_tie(rows, kept, req.sampling, recent, drafts) if k else None
        if tie is not None:   # emit what rows before it decided; a one-token decode decides it
            emitted, kept, req.recheck = drafts[:tie], tie - 1, True
        # Keep [last] + kept drafts; the last emitted token is not in KV yet.
        if not self.ctx.truncate(n_past + 1 + kept):
            self._rollback_refused(req, emitted)
        if k == 0 and proposal.shadow is not None:
            # Plain step with a guess at hand: learn its acceptance for free.
            req.policy.observe(proposal.policy_key, 1, int(proposal.shadow == emitted[0]))
        elif req.policy is not None:
            req.policy.observe(proposal.policy_key, k, verdict.n_accepted)
        st = req.stats
        st.record_step(proposal.source, k, min(verdict.n_accepted, len(emitted)))
        st.rechecks += tie is not None
        st.step_tokens += len(emitted)
        st.propose_ms += 1000 * (t1 - t0)
        st.verify_ms += 1000 * (t2 - t1)
        st.sample_ms += 1000 * (clock() - t2)
        return emitted

    def _near_tie(self, rows, upto: int, sampling: SamplingParams, recent: list,
                  drafts: list) -> Optional[int]:
        """First row 0..upto whose greedy choice is closer than `tie_margin`, or None.

        With the default (fast, not batch-invariant) kernels a row of a verify batch differs
        from a one-token decode by up to ~0.4-0.9 in a logit (DESIGN.md), enough to flip a
        near-tie that plain decoding would decide the other way. Such a token is not taken from
        the batch: the next step decodes it alone, as plain decoding does. The default margin
        0.25 covers every divergence measured on the workloads (top-2 gaps 0.02-0.18) while
        few rows fall under it (Qwen 1.5B greedy: 0% of code-edit rows, 0.8% of summary rows,
        12% of chat rows, where n-gram drafting is mostly off anyway). Exact mode needs no
        guard; sampled decoding is not guarded (its draws have no margin to test).
        """
        margin = self.config.tie_margin
        if margin <= 0 or self.config.exact or not sampling.greedy:
            return None
        for i in range(upto + 1):
            if top2_gap(rows[i], sampling, recent + drafts[:i]) < margin:
                return i
        return None

    # -- helpers -------------------------------------------------------------------------------
    def _prefill(self, prompt_tokens: list):
        """Evaluate the prompt, reusing the longest KV prefix left by the previous request.
        Returns the logits row [n_vocab] of the last prompt token."""
        common = 0
        for a, b in zip(self._kv_tokens, prompt_tokens):
            if a != b:
                break
            common += 1
        # At least one token to get logits from; never trust rows the context no longer holds.
        common = min(common, len(prompt_tokens) - 1, self.ctx.n_past)
        if not self.ctx.truncate(common):
            self.ctx.clear()
            common = 0
        self._kv_tokens = []
        logits = self.ctx.decode(prompt_tokens[common:], logits="last")[0]
        self._prefilled = len(prompt_tokens) - common
        self._kv_tokens = list(prompt_tokens)
        return logits

    def _rollback_refused(self, req: _Request, emitted: list) -> None:
        """The model's memory cannot drop rows (recurrent/hybrid): rebuild KV, stop speculating."""
        print("localspec: this model cannot roll back its KV cache; continuing with plain "
              "decoding.", file=sys.stderr)
        self._can_rollback = False
        req.policy = None
        self.ctx.clear()
        self.ctx.decode((req.history + emitted)[:-1], logits="none")

    def _make_proposer(self, config: EngineConfig):
        """Build the configured proposer; load and check the draft model when one is needed."""
        if config.proposer not in ("ngram", "draft", "hybrid", "none"):
            raise LocalspecError(f"unknown proposer {config.proposer!r}; "
                                 "use ngram, draft, hybrid or none.")
        if config.proposer == "none":
            return None
        ngram = NgramProposer(config.ngram_min, config.ngram_max)
        if config.proposer == "ngram":
            return ngram
        if not config.draft:
            ngram.close()
            raise LocalspecError(f"--proposer {config.proposer} needs a draft model: "
                                 "pass --draft MODEL (e.g. --draft default-draft).")
        layers = config.n_gpu_layers if config.draft_gpu_layers is None else config.draft_gpu_layers
        try:
            self.draft_model = Model(resolve_model(config.draft),
                                     replace(self._model_params, n_gpu_layers=layers))
            report = check_pair(self.model, self.draft_model)
            if not report.ok:
                raise LocalspecError(
                    f"draft model {self.draft_model.path.name} cannot draft for "
                    f"{self.model.path.name}: {report.problems[0]}; use a draft of the same "
                    f"model family (same tokenizer), or see `localspec doctor`.")
            draft = DraftProposer(self.draft_model, ContextParams(
                config.n_ctx, config.n_batch, config.n_threads), self.model.n_vocab,
                config.draft_min_confidence)
        except Exception:
            ngram.close()
            raise
        if config.proposer == "draft":
            ngram.close()
            return draft
        return HybridProposer(ngram, draft)

    def _drop_draft(self, policy: DraftPolicy) -> None:
        """The draft model cannot pay on this device: stop asking it (it would only add its
        prefill to every prompt and its catch-up to every probe). Hybrid keeps n-gram lookup."""
        keep = self.proposer.ngram if isinstance(self.proposer, HybridProposer) else None
        then = "drafting with n-gram lookup only." if keep else "decoding without speculation."
        print(f"localspec: the draft model {self.draft_model.path.name} cannot pay on this device "
              f"(one draft decode costs {self._draft_cost:.2f} target steps, so even at "
              f"{policy.config.draft_best_acceptance:.0%} acceptance no draft length gains "
              f"{policy.config.draft_min_gain - 1:.0%} over plain decoding); {then}",
              file=sys.stderr)
        (self.proposer.draft if keep else self.proposer).close()
        self.proposer = keep
        self.draft_model.close()
        self.draft_model = None

    def _cost_curve(self):
        if self._cost is None:
            self._kv_tokens = []          # calibration clears the context (even if interrupted)
            curve = load_or_measure(self.ctx, self.config.n_gpu_layers, self.config.policy.k_max,
                                    progress=self._progress)
            self._cost = curve.ratios
            if self.draft_model is not None:   # drafting one token, in target-step units
                draft_ctx = self.proposer.draft.ctx if isinstance(self.proposer, HybridProposer) \
                    else self.proposer.ctx
                draft_curve = load_or_measure(draft_ctx, self.config.n_gpu_layers, 1,
                                              progress=self._progress)
                self._draft_cost = draft_curve.ms_per_step / curve.ms_per_step
        return self._cost

    def _close_model(self) -> None:
        if self._own_model:
            self.model.close()

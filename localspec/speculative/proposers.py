"""Proposers: where draft tokens come from. Every proposer has the same small lifecycle
(the `Proposer` base class); the engine depends on that and nothing else:

    begin(history, document, sampling, seed)   the prompt tokens and request settings
    offers(limit) -> [Offer]                   what it could draft now, at no cost yet
    draft(offer, k) -> Proposal                k draft tokens for an offer the policy took
    accept(tokens)                             the tokens the verifier emitted this step
    end()                                      the request is over (the draft store learns)
    close()

The draft length goes one way: the proposer offers (an n-gram match with its features, or a draft
model that is ready), the policy chooses k from the offer, the proposer drafts k. A draft model
spends its time only in draft(). Proposers are built from the engine's config by factory.py.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Optional, Sequence

import numpy as np

from ..policy.acceptance import DraftFeatures, Offer
from ..policy.calibrate import first_run_budget, load_or_measure
from ..llama import PREFILL_GRID, Context, ContextParams, Model
from .ngram import NGRAM_MAX, NGRAM_TIE, SOURCE_DOCUMENT, NgramIndex
from .learning_store import LearningStore
from ..policy.draft_estimate import CostCurve
from .sampling import SamplingParams, draw, target_dist


@dataclass(frozen=True)
class Proposal:
    tokens: list                      # [k] draft token ids
    p_draft: Optional[list]           # [k] Dist, or None: point masses (n-gram, greedy drafts)
    source: str                       # "history" | "document" | "draft"
    features: Optional[DraftFeatures] = None  # what the proposer knew (n-gram): the policy's
                                              # observe_step() wants it back after verify


EMPTY = Proposal([], None, "none")


class Proposer:
    """The lifecycle the engine depends on. The last two methods matter only to proposers that
    run a draft model: its cost enters the policy, and where it cannot pay it is dropped."""

    name = "proposer"
    uses_draft_model = False

    def begin(self, history: Sequence[int], document: Optional[Sequence[int]] = None,
              sampling: Optional[SamplingParams] = None, seed: int = 0) -> None:
        raise NotImplementedError

    def offers(self, limit: int) -> list:
        """[Offer] of what could be drafted now, at most `limit` tokens each, best first."""
        raise NotImplementedError

    def draft(self, offer: Offer, k: int) -> Proposal:
        """k (1..offer.limit) draft tokens for one of this step's offers."""
        raise NotImplementedError

    def accept(self, tokens: Sequence[int]) -> None:
        raise NotImplementedError

    def end(self) -> None:
        """The request is over (finished, stopped or cancelled)."""

    def close(self) -> None:
        raise NotImplementedError

    def draft_cost(self, target: CostCurve, progress: Optional[Callable[[str], None]] = None
                   ) -> float:
        """One draft-model decode in target-decode units (0: drafting costs nothing)."""
        return 0.0

    def without_draft_model(self) -> Optional["Proposer"]:
        """What is left once the draft model is dropped (closing it): self, a part, or None."""
        return self


class NgramProposer(Proposer):
    """Prompt lookup: continue the longest suffix (up to ngram_max tokens) that occurred earlier
    in the prompt, the generated text, or the lookup document (C matcher, incremental, no
    rescans; occurrence chosen by `tie`, see ngram.py for the defaults and why). With a draft
    `store` (store.py) it also offers what followed the current context in past outputs; the
    policy takes the offer it predicts gains most, and every output joins the store."""

    name = "ngram"

    def __init__(self, ngram_min: int = 1, ngram_max: int = NGRAM_MAX, tie: str = NGRAM_TIE,
                 token_classes=None, store: Optional[LearningStore] = None):
        self._index = NgramIndex(ngram_min=ngram_min, ngram_max=ngram_max, tie=tie)
        self._classes = token_classes      # acceptance.TokenClasses, or None
        self.store = store
        self._recent: list = []            # the last tokens of the history: the store's query
        self._offered = None               # first token of this step's store offer

    def begin(self, history: Sequence[int], document: Optional[Sequence[int]] = None,
              sampling: Optional[SamplingParams] = None, seed: int = 0) -> None:
        self._index.truncate(0)
        self._index.append(list(history))
        self._index.set_document(list(document) if document else None)
        if self.store is not None:
            self.store.end_output()        # a request left unfinished by its caller
            self._recent = list(history[-self.store.context_max:])
            self.store.begin_output(self._recent)

    def features(self, limit: int) -> Optional[DraftFeatures]:
        """The continuation the matcher finds now (at most `limit` tokens), with its occurrence
        support; None: no match."""
        found = self._index.propose_supported(limit)
        if found is None:
            return None
        tokens, source, ngram_len, n_occ, agree = found
        breaks = self._classes(tokens) if self._classes is not None else None
        return DraftFeatures(tokens, "document" if source == SOURCE_DOCUMENT else "history",
                             ngram_len, n_occ, agree, breaks)

    def store_features(self, limit: int) -> Optional[DraftFeatures]:
        """The store's draft for the current context, with its continuation counts."""
        m = self.store.propose(self._recent, limit) if self.store is not None else None
        if m is None:
            return None
        # No line-break / sentence-end classes: a quoted source is left at those, but a past
        # output's line breaks and punctuation are as much its pattern as its words (the
        # JSON of tool calls, docstring sections): their prior terms cut the store's runs short.
        return DraftFeatures(m.tokens, "store", m.ngram_len, m.n_occ, m.agree, None,
                             self.store.trust)

    def offers(self, limit: int) -> list:
        found = [self.features(limit)]
        if self.store is not None:
            mine = self.store_features(limit)
            # The request's own text matched over a context at least as long speaks for this
            # request; the store competes where it knows a longer context than prompt lookup.
            self._offered = None
            if mine is not None and (found[0] is None or found[0].ngram_len < mine.ngram_len):
                found.append(mine)
                self._offered = mine.tokens[0]         # checked in accept()
        return [Offer(f.source, len(f.tokens), f) for f in found if f is not None]

    def draft(self, offer: Offer, k: int) -> Proposal:
        return Proposal(list(offer.features.tokens[:k]), None, offer.source, offer.features)

    def accept(self, tokens: Sequence[int]) -> None:
        tokens = list(tokens)
        self._index.append(tokens)
        if self.store is not None:
            if self._offered is not None and tokens:
                self.store.checked(tokens[0] == self._offered)
                self._offered = None
            self.store.add(tokens)
            self._recent = (self._recent + tokens)[-self.store.context_max:]

    def end(self) -> None:
        if self.store is not None:
            self.store.end_output()

    def close(self) -> None:
        self._index.close()
        if self.store is not None:
            self.store.close()
            self.store = None


class DraftProposer(Proposer):
    """A smaller model of the same family drafts autoregressively in its own context.

    Owns its model and context. Its KV is kept in step with the target by common prefix
    (Context.sync): before drafting, rows past the accepted history are dropped and only the
    tokens it has not seen (the recovered/bonus token, at most one more) are decoded, never a
    re-prefill of the whole history.
    """

    name = "draft"
    uses_draft_model = True

    def __init__(self, model: Model, params: ContextParams, n_vocab_target: int,
                 min_confidence: float = 0.0, n_gpu_layers: int = 0, cache=None):
        self.model = model
        self.cache = cache                        # a PromptCache shared with the target, or None
        self.ctx = Context(model, params)
        # Draft ids the target does not have are never proposed: logits are cut to shared ids.
        self.n_shared = min(n_vocab_target, model.n_vocab)
        self.min_confidence = min_confidence      # stop drafting when p_draft(x) falls below
        self.n_gpu_layers = n_gpu_layers          # part of its calibration's identity
        self._history: list = []
        self._sampling = SamplingParams()
        self._rng = np.random.default_rng(0)

    def begin(self, history: Sequence[int], document=None,
              sampling: Optional[SamplingParams] = None, seed: int = 0) -> None:
        self._history = list(history)
        self._sampling = sampling or SamplingParams()
        self._rng = np.random.default_rng(seed ^ 0x5EED)   # independent of the target's stream
        # Prompt processing for the draft belongs with the target's prefill (time to first
        # token); left to the first proposal it would stall decoding for a whole prefill. A
        # prompt seen before comes back from the cache, as the target's does.
        if self.cache is not None:
            self.cache.prepare(self.ctx, self._history, PREFILL_GRID)
        self.ctx.sync(self._history, grid=PREFILL_GRID)  # proposals as a cold prompt's would be

    def offers(self, limit: int) -> list:
        limit = min(limit, self.ctx.n_ctx - len(self._history))
        return [Offer("draft", limit)] if limit > 0 else []

    def draft(self, offer: Offer, k: int) -> Proposal:
        row, _ = self.ctx.sync(self._history)
        tokens, dists = [], []
        for i in range(k):
            dist = target_dist(row[: self.n_shared], self._sampling, self._history + tokens)
            x = int(dist.ids[0]) if self._sampling.greedy else draw(dist, self._rng.random())
            tokens.append(x)
            dists.append(dist)
            if i == k - 1 or (self.min_confidence and dist.prob(x) < self.min_confidence):
                break
            row = self.ctx.decode([x], logits="last")[0]
        return Proposal(tokens, None if self._sampling.greedy else dists, "draft")

    def accept(self, tokens: Sequence[int]) -> None:
        self._history.extend(tokens)

    def draft_cost(self, target: CostCurve, progress=None) -> float:
        mine = load_or_measure(self.ctx, self.n_gpu_layers, 1, progress=progress,
                               budget_s=first_run_budget())
        return mine.ms_per_step / target.ms_per_step

    def without_draft_model(self) -> None:
        self.close()
        return None

    def close(self) -> None:
        self.ctx.close()
        self.model.close()


class HybridProposer(Proposer):
    """n-gram first; where it has no usable match, the draft model proposes."""

    name = "hybrid"
    uses_draft_model = True

    def __init__(self, ngram: NgramProposer, draft: DraftProposer):
        self.ngram, self.draft_model = ngram, draft

    def begin(self, history, document=None, sampling=None, seed: int = 0) -> None:
        self.ngram.begin(history, document, sampling, seed)
        self.draft_model.begin(history, document, sampling, seed)

    def offers(self, limit: int) -> list:
        return self.ngram.offers(limit) + self.draft_model.offers(limit)

    def draft(self, offer: Offer, k: int) -> Proposal:
        return (self.draft_model if offer.source == "draft" else self.ngram).draft(offer, k)

    def accept(self, tokens) -> None:
        self.ngram.accept(tokens)
        self.draft_model.accept(tokens)

    def end(self) -> None:
        self.ngram.end()

    def draft_cost(self, target: CostCurve, progress=None) -> float:
        return self.draft_model.draft_cost(target, progress)

    def without_draft_model(self) -> NgramProposer:
        self.draft_model.close()
        return self.ngram

    def close(self) -> None:
        self.ngram.close()
        self.draft_model.close()

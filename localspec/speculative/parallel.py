"""`--parallel N`: N engines, one per slot of a shared context (llama/slots.py), over one model.

Each slot is a whole Engine (its own requests, proposer, policy and random stream) whose context
is a SeqContext, so every rule of a lone engine holds per slot: the same prefill grid, the same
step, the same stop rules. What the slots share: the model, the llama_context (its decodes run
in ticks that batch the slots' steps), the cost curve (measured once), the prompt cache (a slot
may start from a state another slot saved) and the draft store (each slot's output joins it
whole when it ends: learning_store.SlotView).

The caller runs each slot's generations in its own thread (apps/http_worker.py,
apps/protocol.py); a slot's engine is not thread-safe, the set is.
"""

from __future__ import annotations

import os
import threading
from dataclasses import replace
from typing import Callable, Optional, Union

from ..errors import LocalspecError
from ..llama import Model, batch_invariant_rows
from ..llama.exact_rows import exact_rows_settable
from ..llama.slots import SharedContext, slot_size
from ..policy.config import K_LIMIT
from .config import EngineConfig
from .drafting import Drafting
from .engine import Engine
from .factory import (context_params, load_model, make_cache, make_proposer,
                      make_store)
from .learning_store import SlotView

MAX_SLOTS = 16          # each slot is a thread and a KV buffer, and a tick waits for every
                        # busy one: more than 16 would serve no CPU this runs on


def check_parallel(n: int, n_ctx: int) -> None:
    """A usage error naming the limit for a --parallel that cannot work with --ctx."""
    if n < 1 or n > MAX_SLOTS:
        raise LocalspecError(f"--parallel must be 1..{MAX_SLOTS}, got {n}.")
    if n > 1 and slot_size(n_ctx, n) == 0:
        raise LocalspecError(f"--parallel {n} needs a context of at least {256 * n} tokens "
                             f"(256 per slot), but --ctx is {n_ctx}; raise --ctx or lower "
                             "--parallel.")


class _LockedCache:
    """The prompt cache, shared by the slots: one slot at a time saves or restores."""

    def __init__(self, cache):
        self._cache, self._lock = cache, threading.Lock()

    def __getattr__(self, name):
        attr = getattr(self._cache, name)
        if not callable(attr):
            return attr

        def call(*args, **kwargs):
            with self._lock:
                return attr(*args, **kwargs)
        return call

    def __len__(self) -> int:
        return len(self._cache)


def row_cost(ratios: list):
    """A pass of n rows in one-token decodes from the calibrated r(k) (k + 1 rows), carried on
    past its end at the slope of its last half."""
    last = len(ratios) - 1
    half = last // 2
    slope = (ratios[last] - ratios[half]) / max(1, last - half)

    def cost(n: int) -> float:
        k = n - 1
        return ratios[k] if k <= last else ratios[last] + slope * (k - last)
    return cost


class Slots:
    """`n` engines over one model and one shared context. `engines[i]` runs slot i's requests;
    close() frees them, the context, the shared draft store and the model (when it was loaded
    here). `row_cap`: the most rows the slots' steps take in one batch (default K_LIMIT + n:
    a full-length draft beside every other slot's row, each such batch raising the batch-
    invariant limit for itself; 31 where the limit cannot move, an older ggml-cpu)."""

    def __init__(self, target: Union[str, os.PathLike, Model], config: EngineConfig, n: int,
                 progress: Optional[Callable[[str], None]] = None, row_cap: Optional[int] = None):
        check_parallel(n, config.n_ctx)
        if config.proposer not in ("ngram", "none"):
            raise LocalspecError("--parallel runs n-gram lookup or plain decoding; a draft model "
                                 "would need a context per slot (use --proposer ngram).")
        self.n = n
        own = isinstance(target, (str, os.PathLike))
        self.model = load_model(target, config.n_gpu_layers, config.exact, config.rpc) if own \
            else target
        self._own_model = own
        self.engines: list = []
        self.shared = None
        self.store = None                # the draft store the slots share (LearningStore)
        try:
            if row_cap is None:      # the rows a tick's steps take together: a full-length
                invariant = batch_invariant_rows()     # draft beside every other slot's row,
                row_cap = K_LIMIT + n if not invariant or exact_rows_settable() \
                    else invariant - 1                 # or under an unmovable invariant limit
            self.shared = SharedContext(self.model, context_params(config), n, row_cap)
            # A shared tick's time is not one slot's cost: the curve stays as measured alone.
            # The draft store is one, shared: each slot's output joins it whole at its end.
            slot_config = replace(config, refit_cost=False, cache_mb=0, store=False)
            cache = make_cache(config, self.model)
            shared_cache = _LockedCache(cache) if cache is not None else None
            if config.proposer == "ngram":
                self.store = make_store(config, self.model)
            store_lock = threading.Lock()
            drafting = Drafting(slot_config, progress)
            for i in range(n):
                proposer = make_proposer(slot_config, self.model)
                if self.store is not None and proposer is not None:
                    proposer.store = SlotView(self.store, store_lock)
                engine = Engine(self.model, slot_config, progress, proposer=proposer,
                                context=self.shared.slots[i])
                engine.cache = shared_cache
                engine.drafting = drafting
                self.engines.append(engine)
        except BaseException:
            self.close()
            raise

    @property
    def n_ctx(self) -> int:
        """Tokens each slot holds."""
        return self.shared.n_ctx_seq

    def prepare(self) -> None:
        """Measure (or load) the cost curve once, on slot 0, before requests arrive; the ticks
        then shape their batches by it."""
        engine = self.engines[0]
        engine.prepare()
        cost = engine.drafting.cost
        if cost is not None:
            self.shared.row_cost = row_cost(cost.ratios())


    def close(self) -> None:
        for engine in self.engines:
            engine.close()
        self.engines = []
        if self.store is not None:       # after the engines: their last outputs are in it
            self.store.close()
            self.store = None
        if self.shared is not None:
            self.shared.close()
        if self._own_model and self.model is not None:
            self.model.close()
            self.model = None

    def __enter__(self) -> "Slots":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

"""LearningStore: the draft store as a proposer holds it. The store in memory (store.py's
DraftStore), its file (store_file.py), whether this run adds its outputs (learn), and how far
the store's offers are trusted: the decayed share of recent offers whose first token was right,
kept across requests and, saved in the file's header, across restarts.
"""

from __future__ import annotations

import math
import threading
from pathlib import Path
from typing import Optional, Sequence

from .store import BREAK, DraftStore, StoreMatch, max_tokens_for
from .store_file import StoreFile, budget_mb, new_store_file

TRUST_PRIOR = 0.6        # share of store offers right, before any is checked (the sessions'
                         # and unrelated requests' replays: 68% where the store competes)
TRUST_DECAY = 0.9        # per checked offer: the last ~10 count


class LearningStore:
    """What a proposer holds: the store in memory, its file (None: memory only, e.g. the bench),
    and `learn` (False: outputs are not added, the file is only read). Requests call
    begin_output(), add() per step, end_output(); offers come from propose()."""

    def __init__(self, memory: DraftStore, file: Optional[StoreFile] = None, learn: bool = True):
        self.memory, self.file, self.learn = memory, file, learn
        self._pending: list = []           # tokens added since the last save
        # decayed share of store offers whose first token was right, across requests and
        # (saved with the file) restarts: an agent script's every call
        saved = file.hits if file is not None else None
        self.hits = TRUST_PRIOR if saved is None else saved
        self._open = False                 # an output is being added

    @classmethod
    def for_model(cls, model_path: Path, model_name: str, mb: Optional[float] = None,
                  learn: bool = True, disk: bool = True, n_vocab: Optional[int] = None
                  ) -> Optional["LearningStore"]:
        """The store of a model (None when the budget is 0): loaded from its file when `disk`;
        with `n_vocab` (the model's vocabulary size) a file holding other ids is refused."""
        max_tokens = max_tokens_for(budget_mb(mb))
        if max_tokens < 1:
            return None
        memory = DraftStore(max_tokens)
        file = None
        if disk:
            file = new_store_file(model_path, model_name, max_tokens, n_vocab)
            memory.extend(file.load())
        return cls(memory, file, learn)

    @property
    def context_max(self) -> int:
        """The longest context the store matches: a query needs no more of the history."""
        return self.memory.ngram_max

    def propose(self, context: Sequence[int], k: int) -> Optional[StoreMatch]:
        """The store's draft for the end of `context` (DraftStore.propose)."""
        return self.memory.propose(context, k)

    def checked(self, right: bool) -> None:
        """One store offer's first token against what was emitted there (drafted or not)."""
        self.hits = TRUST_DECAY * self.hits + (1.0 - TRUST_DECAY) * right

    @property
    def trust(self) -> float:
        """The logit by which recent offers were right more (or less) often than offers in
        general: an agent loop's store earns trust, one of unrelated requests loses it.

        Example: hits 0.8 against the prior 0.6: log(0.8/0.2) - log(0.6/0.4) = 0.98."""
        h = min(0.99, max(0.01, self.hits))
        return math.log(h / (1.0 - h)) - math.log(TRUST_PRIOR / (1.0 - TRUST_PRIOR))

    def begin_output(self, prompt: Sequence[int] = ()) -> None:
        """A request starts; the last tokens of its prompt go in first (the chat template's
        "assistant" turn, the question's end), so that the first tokens of later outputs have
        a long context to match, not only the 2-token rest of a chat template."""
        self._open = self.learn
        self.add(list(prompt[-self.context_max:]))

    def add(self, tokens: Sequence[int]) -> None:
        if self._open and tokens:
            self.memory.extend(tokens)
            self._pending.extend(tokens)

    def end_output(self) -> None:
        """The output is complete (or cut short: still what the model wrote): close it with a
        BREAK and save, if learning and a file is kept."""
        if not self._open:
            return
        self._open = False
        self.keep([BREAK])

    def remember(self, tokens: Sequence[int], prompt: Sequence[int] = ()) -> None:
        """Add one finished output (after the end of its prompt) at once: the bench and the
        replay add a request's output when it ends, so repeated rounds of one case never
        draft from themselves."""
        self.memory.extend(list(prompt[-self.context_max:]) + list(tokens) + [BREAK])

    def keep(self, tokens: Sequence[int]) -> None:
        """Add tokens as a learning run does, and save: a request's closing BREAK, or a slot's
        whole output (prompt tail, tokens, BREAK), kept aside while it ran (SlotView)."""
        if self.learn and tokens:
            self.memory.extend(tokens)
            self._pending.extend(tokens)
            self.flush()

    def reset(self) -> None:
        """An empty store (a bench session's start); the file is not touched."""
        self.memory.clear()
        self._pending = []
        self.hits = TRUST_PRIOR

    def flush(self) -> None:
        """Save what this process added since its last save; kept for the next try when the
        disk refuses (at most the store's max_tokens of it: the newest)."""
        if self.file is None or not self._pending:
            return
        if self.file.save(self._pending, self.hits):
            self._pending = []
        else:
            del self._pending[:-self.memory.max_tokens]

    def close(self) -> None:
        if self._open:
            self.end_output()
        self.flush()
        self.memory.close()


class SlotView:
    """One slot's handle on a LearningStore the slots of `serve --parallel` share: offers come
    from the shared store, under its lock (the index is not thread-safe); the slot's output is
    kept aside while it runs and joins the store whole when it ends, so outputs written side by
    side are never spliced into one. The shared store's owner (Slots) closes it."""

    def __init__(self, shared: LearningStore, lock: threading.Lock):
        self.shared, self.lock = shared, lock
        self._out: list = []
        self._open = False

    @property
    def context_max(self) -> int:
        return self.shared.context_max

    @property
    def trust(self) -> float:
        return self.shared.trust

    def propose(self, context: Sequence[int], k: int) -> Optional[StoreMatch]:
        with self.lock:
            return self.shared.propose(context, k)

    def checked(self, right: bool) -> None:
        with self.lock:
            self.shared.checked(right)

    def begin_output(self, prompt: Sequence[int] = ()) -> None:
        self._open = self.shared.learn
        self._out = list(prompt[-self.context_max:])

    def add(self, tokens: Sequence[int]) -> None:
        if self._open:
            self._out.extend(tokens)

    def end_output(self) -> None:
        if not self._open:
            return
        self._open = False
        out, self._out = self._out + [BREAK], []
        with self.lock:
            self.shared.keep(out)

    def close(self) -> None:
        self.end_output()

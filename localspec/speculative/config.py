"""The engine's settings, in one frozen dataclass with the defaults every front end shares."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

from .ngram import NGRAM_MAX, NGRAM_TIE
from ..policy.config import PolicyConfig

# --proposer -> where its draft tokens come from (the one list of proposers)
PROPOSERS = {"ngram": ("ngram",), "draft": ("draft",), "hybrid": ("ngram", "draft"), "none": ()}


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
    cache_mb: Optional[float] = None      # RAM for saved prompt KV states (cache/prompt_cache.py);
                                          # None: two full contexts' worth, 0: no prompt cache
    cache_disk: bool = False              # also keep them under <home>/prompt-cache (restarts)
    exact: bool = False                   # insist on the batch-invariant CPU kernels (loaded by
                                          # default anyway): an error without them
    tie_margin: float = 0.25              # greedy, batches not trusted (GPU, RPC, llama.cpp's own
                                          # kernels): rows closer than this are re-decided
    ngram_min: int = 1
    ngram_max: int = NGRAM_MAX
    ngram_tie: str = NGRAM_TIE
    policy: PolicyConfig = field(default_factory=PolicyConfig)
    store: bool = False                   # the draft store of past outputs (speculative/store.py)
    learn: bool = True                    # add this engine's outputs to it (False: read only)
    store_mb: Optional[float] = None      # its RAM budget (None: $LOCALSPEC_STORE_MB or 64)
    store_disk: bool = True               # keep it in <home>/store across restarts
    device_argmax: bool = False           # greedy rows' argmax by llama.cpp's backend sampler,
                                          # only each row's token copied back (Context.
                                          # device_argmax), for greedy requests without a
                                          # penalty or the near-tie guard. Opt-in until a GPU
                                          # run proves it: never on Vulkan (it crashed on
                                          # lavapipe), dearer than rows on a CPU
    refit_cost: bool = True               # refine r(k) from step timings (False: the cached
                                          # curve alone decides k: same k sequence every run)

"""Builds what an Engine runs from its config, in one call (build): the target model (with
exact-mode kernels when asked), its context, the prompt cache, and the proposer, loading the draft
model and checking that it can draft for the target. Also decides, once the cost curve is known,
whether a draft model can pay (fit_to_device, called by drafting.py).
"""

from __future__ import annotations

import os
import sys
from dataclasses import dataclass
from typing import Optional, Union

from ..policy.acceptance import TokenClasses
from ..llama.exact_rows import (device_exact_backends, device_exact_rows, device_unproven_note,
                                exact_rows_settable, set_device_exact_rows)
from ..policy.config import K_LIMIT
from ..catalog.models import resolve_model
from .compat import check_pair
from .config import PROPOSERS, EngineConfig
from ..errors import LocalspecError
from ..files import cache_dir
from ..llama import (Context, ContextParams, Model, ModelParams, batch_invariant_rows,
                     enable_exact_kernels, gpu_backends, library_account, prefer_exact_libraries)
from ..policy.draft_estimate import DraftPolicy
from ..cache.prompt_cache import PromptCache, default_budget_mb
from .learning_store import LearningStore
from .proposers import DraftProposer, HybridProposer, NgramProposer, Proposer
from ..llama.rpc import attach as attach_rpc


@dataclass(frozen=True)
class Parts:
    """What an engine runs; it closes them (the model only when `own_model`)."""

    model: Model
    own_model: bool
    ctx: Context
    cache: Optional[PromptCache]
    proposer: Optional[Proposer]


def build(target: Union[str, os.PathLike, Model], config: EngineConfig,
          proposer: Optional[Proposer] = None, context: Optional[Context] = None) -> Parts:
    """The model (a catalog name or path is resolved, pulled if needed, and loaded; a loaded
    Model is used as it is), its context, the prompt cache and the proposer. `proposer` and
    `context` replace the ones the config would build (tests pass scripted ones). If a part
    fails, what was made or handed in is closed (a handed-in Model is not)."""
    own_model = isinstance(target, (str, os.PathLike))
    if not own_model and config.exact and config.n_gpu_layers:
        exact_on_device()            # a handed-in model on a GPU: its backend's switch goes on
    model = load_model(target, config.n_gpu_layers, config.exact, config.rpc) if own_model \
        else target
    ctx = context
    try:
        ctx = ctx if ctx is not None else Context(model, context_params(config))
        cache = make_cache(config, model)
        if proposer is None:
            proposer = make_proposer(config, model, cache)
    except BaseException:
        for part in (proposer, ctx, model if own_model else None):
            if part is not None:
                part.close()
        raise
    return Parts(model, own_model, ctx, cache, proposer)


def batches_trusted(config: EngineConfig) -> bool:
    """Whether a verify batch's rows equal one-token decodes bit for bit, so the near-tie guard
    can go: the target runs on the CPU (no GPU or RPC layers) with localspec's batch-invariant
    ggml-cpu, for batches as large as the policy may verify: under its row limit, or past it
    where the limit moves for each wider decode (docs/exactness.md); or, with --exact, on a GPU
    backend whose patched library has its row limit on (load_model set it)."""
    if config.n_gpu_layers and not config.rpc:
        return config.exact and device_exact_rows() > 0      # exact_for raises it past 31
    on_cpu = config.n_gpu_layers == 0 and not config.rpc
    rows = batch_invariant_rows()
    return on_cpu and bool(rows) and (rows > K_LIMIT + 1 or exact_rows_settable())


def load_model(target: Union[str, os.PathLike], n_gpu_layers: int = 0,
               exact: bool = False, rpc: tuple = ()) -> Model:
    """Resolve a catalog name or path (pulling if needed) and load it; exact mode first makes
    sure this process loaded the batch-invariant kernels (one error line if not): on the CPU
    localspec's ggml-cpu, on a GPU its patched backend, whose row limit is then switched on.
    RPC servers are attached before the load (process-wide), and where the layers went is said,
    since RPC is otherwise silent."""
    if exact and rpc:
        raise LocalspecError(
            "--exact promises speculative output bit for bit plain decoding's, which RPC "
            "servers do not keep: their kernels are other builds' (docs/gpu.md). Drop --exact "
            "(and LOCALSPEC_EXACT), or drop --rpc.")
    exact_backends = exact_on_device() if exact and n_gpu_layers else []
    if exact and not n_gpu_layers:
        enable_exact_kernels()
    attach_rpc(rpc)
    model = Model(resolve_model(str(target)), ModelParams(n_gpu_layers=n_gpu_layers))
    if exact and n_gpu_layers and 0 <= model.n_gpu_layers <= model.n_layer and \
            not batch_invariant_rows():
        model.close()
        raise LocalspecError(
            f"--exact with part of {model.path.name} on the CPU needs localspec's batch-"
            f"invariant CPU library too, which this process did not load ({library_account()}):"
            f" put every layer on the GPU (--gpu-layers -1), or rerun ./install.sh without "
            f"LOCALSPEC_EXACT_LIBS=0.")
    note = device_unproven_note(exact_backends, model.meta("general.file_type"), model.path.name)
    if note:
        print(note, file=sys.stderr)
    if rpc or n_gpu_layers:
        print(placement_line(model), file=sys.stderr)
    return model


def exact_on_device() -> list:
    """--exact with layers on a GPU: the GPU backend must be localspec's patched build; its row
    limit is switched on for this process (batches of up to 31 rows then compute every row as a
    one-row batch does), else one error line. The batch-invariant CPU library is loaded too
    where install.sh built it, for layers left on the CPU. Returns the patched backends."""
    prefer_exact_libraries()
    found = device_exact_backends()
    if not found:
        built = "/".join(gpu_backends())
        has = f"this build's {built} library is not patched" if built else \
            "this is a CPU build"
        raise LocalspecError(
            f"--exact promises speculative output bit for bit plain decoding's; on a GPU only "
            f"localspec's patched Vulkan and CUDA libraries keep it (docs/gpu.md), and {has}. "
            f"Drop --exact (and LOCALSPEC_EXACT), keep every layer on this CPU (--gpu-layers 0),"
            f" or rebuild with ./install.sh (LOCALSPEC_BACKEND=vulkan or cuda).")
    set_device_exact_rows()
    return found


def placement_line(model: Model) -> str:
    """Where a model asked to offload put its layers (RPC and devices are otherwise silent),
    e.g. "localspec: m.gguf: 3/3 layers on Vulkan0 (llvmpipe) (Vulkan0 3), KV cache with them";
    a request beyond the model's layers (n_layer + the output layer) is clamped and said so."""
    line = f"localspec: {model.path.name}: {model.placement or 'every layer on this machine'}"
    if model.placement:
        line += ", KV cache with them"           # llama.cpp's default: KV follows its layer
    if model.n_gpu_layers > model.n_layer + 1:
        line += f" (asked for {model.n_gpu_layers}: clamped to the model's {model.n_layer + 1})"
    return line


def context_params(config: EngineConfig) -> ContextParams:
    return ContextParams(config.n_ctx, config.n_batch, config.n_threads)


def make_cache(config: EngineConfig, target: Model) -> Optional[PromptCache]:
    """The prompt cache the engine and a draft model share (None when cache_mb is 0)."""
    if config.cache_mb == 0:
        return None
    budget = config.cache_mb if config.cache_mb is not None else \
        default_budget_mb(target, config.n_ctx)
    return PromptCache(budget, cache_dir("prompt-cache") if config.cache_disk else None)


def make_proposer(config: EngineConfig, target: Model,
                  cache: Optional[PromptCache] = None) -> Optional[Proposer]:
    """The configured proposer (None for plain decoding); loads and checks the draft model,
    which keeps its prompt states in `cache` beside the target's."""
    if config.proposer not in PROPOSERS:
        raise LocalspecError(f"unknown proposer {config.proposer!r}; "
                             f"use {', '.join(PROPOSERS)}.")
    if config.proposer == "none":
        return None
    if config.proposer == "ngram":
        return make_ngram(config, target)
    if not config.draft:
        raise LocalspecError(f"--proposer {config.proposer} needs a draft model: "
                             "pass --draft MODEL (e.g. --draft default-draft).")
    draft = load_draft(config, target, cache)
    if config.proposer == "draft":
        return draft
    return HybridProposer(make_ngram(config, target), draft)


def make_ngram(config: EngineConfig, target: Model) -> NgramProposer:
    """The n-gram proposer, telling the acceptance model which drafted tokens are line breaks or
    sentence ends (acceptance.token_class) through the target's vocabulary."""
    return NgramProposer(config.ngram_min, config.ngram_max, config.ngram_tie,
                         token_classes=TokenClasses(target.token_piece),
                         store=make_store(config, target))


def make_store(config: EngineConfig, target: Model) -> Optional[LearningStore]:
    """The draft store of the target model, if the config keeps one (and its budget is not 0)."""
    if not config.store:
        return None
    return LearningStore.for_model(target.path, target.path.name, config.store_mb, config.learn,
                                   config.store_disk, n_vocab=target.n_vocab)


def load_draft(config: EngineConfig, target: Model,
               cache: Optional[PromptCache] = None) -> DraftProposer:
    layers = config.n_gpu_layers if config.draft_gpu_layers is None else config.draft_gpu_layers
    model = Model(resolve_model(config.draft), ModelParams(n_gpu_layers=layers))
    if layers or config.rpc:
        print(placement_line(model).replace("localspec: ", "localspec: draft ", 1), file=sys.stderr)
    try:
        report = check_pair(target, model)
        if not report.ok:
            raise LocalspecError(
                f"draft model {model.path.name} cannot draft for {target.path.name}: "
                f"{report.problems[0]}; use a draft of the same model family (same tokenizer), "
                "or see `localspec doctor`.")
        return DraftProposer(model, context_params(config), target.n_vocab,
                             config.draft_min_confidence, layers, cache)
    except Exception:
        model.close()
        raise


def fit_to_device(proposer: Proposer, policy: DraftPolicy) -> Optional[Proposer]:
    """Drop the draft model where the cost curve says it cannot pay (it would only add its
    prefill to every prompt and its catch-up to every probe); hybrid keeps n-gram lookup.
    One line on stderr says so."""
    if not proposer.uses_draft_model or policy.draft_can_pay():
        return proposer
    rest = proposer.without_draft_model()
    then = "drafting with n-gram lookup only." if rest is not None else \
        "decoding without speculation."
    cfg = policy.config
    print(f"localspec: the draft model cannot pay on this device (one draft decode costs "
          f"{policy.draft_cost:.2f} target steps, so even at {cfg.draft_best_acceptance:.0%} "
          f"acceptance no draft length gains {cfg.draft_min_gain - 1:.0%} over plain "
          f"decoding); {then}", file=sys.stderr)
    return rest

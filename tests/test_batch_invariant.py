"""On the CPU, with localspec's patched ggml-cpu (llama_cpp/lib-exact, loaded by default), every
row of a verify batch is bit-identical to a one-token decode, so speculative output is plain
output token for token with no near-tie guard, greedy or seeded (docs/exactness.md). The choice
of libraries is per process: these tests skip in a process that loaded llama.cpp's own
(LOCALSPEC_EXACT=0, or no lib-exact), and tests/test_exact_libs.py then runs them in one that
asked for the patched copy (LOCALSPEC_EXACT=1). The default model's checks run with
LOCALSPEC_TEST_QWEN=1. Past 32 rows (patch 0001's run-time limit): with the row limit raised at
run time (backend.exact_rows_raised) batches of 33..65 and 100 rows are batch-invariant too, and
with the default limit a 64-row prefill chunk still takes the fast kernels."""

from __future__ import annotations

import contextlib
import os

import numpy as np
import pytest

from localspec.llama import (Context, ContextParams, Model, ModelParams, batch_invariant_rows,
                             system_info)
from localspec.llama.exact_rows import (exact_rows, exact_rows_raised, exact_rows_settable,
                                     set_exact_rows)
from localspec.policy.config import K_LIMIT
from localspec.speculative.sampling import SamplingParams

from kernel_models import TYPES, random_smollm
from test_speculative import PROMPTS, assert_greedy_lossless, engine

INVARIANT = batch_invariant_rows() > 0
needs_invariant = pytest.mark.skipif(
    not INVARIANT, reason="this process loaded llama.cpp's own libraries (tests/test_exact_libs.py "
                          "runs these with LOCALSPEC_EXACT=1)")
needs_settable = pytest.mark.skipif(
    not (INVARIANT and exact_rows_settable()),
    reason="no batch-invariant library, or a lib-exact from before the run-time row limit (rerun "
           "./install.sh): its row limit cannot be raised")
needs_qwen = pytest.mark.skipif(not os.environ.get("LOCALSPEC_TEST_QWEN"),
                                reason="the default model (1 GB) runs when LOCALSPEC_TEST_QWEN=1")
TEXT = "Speculative decoding verifies many drafted tokens at once, then keeps the longest " \
       "prefix the target agrees with. "


# Every batch size from 2 to 17 rows (up to 16 drafts); the wider batches past the row limit's
# 32 are the raised-limit tests' (WIDE below).
VERIFY_SIZES = range(2, min(K_LIMIT, 16) + 2)


def every_row_mismatch(path, n_prompt: int, threads: int, sizes=VERIFY_SIZES, runs=None,
                       gpu_layers: int = 0):
    """(batch size, first differing row) for each batch of `sizes` tokens whose rows are not
    bit-identical to decoding the same tokens one at a time after an n_prompt-token context.
    runs [(limit, sizes), ...]: one such list per run, each with the library's row limit as it
    is (limit None), inside exact_rows_raised(limit), or "fast": the default limit with the last
    row's logits left out (not a verify batch: Context does not raise it), all from one context
    and one set of one-token decodes. gpu_layers: on a device (tests/test_device_exact.py)."""
    with Model(path, ModelParams(n_gpu_layers=gpu_layers)) as model, \
            Context(model, ContextParams(n_ctx=2048, n_threads=threads)) as ctx:
        prompt = model.tokenize(TEXT * 80)[:n_prompt]
        assert len(prompt) == n_prompt
        ctx.decode(prompt, logits="none")
        base = ctx.n_past
        plan = runs or [(None, sizes)]
        cont = [(97 * i + 11) % model.n_vocab for i in range(max(max(s) for _, s in plan))]
        single = np.stack([ctx.decode([t], logits="last")[0].copy() for t in cont])
        found = []
        for limit, run_sizes in plan:
            bad = []
            fast = limit == "fast"
            with exact_rows_raised(limit) if limit and not fast else contextlib.nullcontext():
                for n in run_sizes:
                    ctx.truncate(base)
                    # A decode with every row's logits is a verify batch, which Context runs
                    # exact past 31 rows (exact_for); leaving the last row's logits out keeps
                    # the library's own choice of kernels, as a prefill chunk gets.
                    batch = ctx.decode(cont[:n], logits=list(range(n - 1)) if fast else "all")
                    rows = [i for i in range(len(batch))
                            if not np.array_equal(batch[i], single[i])]
                    if rows:
                        bad.append((n, rows[0]))
            found.append(bad)
        return found if runs else found[0]


@needs_invariant
def test_the_patched_library_says_how_many_rows_it_keeps_invariant():
    # verify batches up to 31 rows fit; longer ones raise the limit for their decode (patch 0001)
    assert batch_invariant_rows() > min(K_LIMIT, 30) + 1
    assert "LLAMAFILE = 1" in system_info()              # prefill keeps tinyBLAS


@needs_invariant
@pytest.mark.smollm
@pytest.mark.parametrize("n_prompt", [40, 700, 1500])
def test_every_row_of_a_verify_batch_equals_one_token_decodes_on_smollm(smollm_path, n_prompt):
    """SmolLM2-135M Q4_1 (vec_dot Q4_1 and Q8_0, the F16 KV cache's attention matmuls that
    tinyBLAS served upstream), after a short and a long context, on every core."""
    assert every_row_mismatch(smollm_path, n_prompt, threads=os.cpu_count() or 1) == []


@pytest.fixture(scope="module", params=TYPES)
def random_smollm_path(request, smollm_path, tmp_path_factory):
    """SmolLM2-135M's shape with every matrix in one weight type (tests/kernel_models.py)."""
    return random_smollm(smollm_path, tmp_path_factory.getbasetemp() / "kernel-models",
                         request.param)


@needs_invariant
@pytest.mark.smollm
@pytest.mark.parametrize("n_prompt", [40, 1500])
def test_every_row_of_a_verify_batch_equals_one_token_decodes_per_weight_type(
        random_smollm_path, n_prompt):
    """Each weight type through the kernels the patch series gives it (docs/exactness.md):
    Q8_0 through 0007's shared-load tiles (llama.cpp's own build sends them to tinyBLAS from 2
    rows), repacked Q4_0, IQ4_NL and MXFP4 through 0004's many-row gemv and Q2_K through 0005's
    (the 4-row gemm upstream), F16, BF16 and F32 through 0006's tiles (tinyBLAS upstream),
    Q4_K_M's repacked Q4_K through 0003's rows and its Q5_0 through tinyBLAS (0002: its
    arithmetic is vec_dot's on AVX2 + FMA + F16C builds), Q5_0 weights likewise, Q6_K and Q3_K
    through 0008's tiles (the tiled K-quant matmul upstream from 8 rows): every row of
    2..17-row batches is a one-token decode's bit for bit, after a short and a long context, on
    every core and on one."""
    assert every_row_mismatch(random_smollm_path, n_prompt, threads=os.cpu_count() or 1) == []
    if n_prompt == 40:
        assert every_row_mismatch(random_smollm_path, n_prompt, threads=1) == []


@needs_invariant
@needs_qwen
@pytest.mark.qwen
@pytest.mark.parametrize("n_prompt", [40, 700, 1500])
def test_every_row_of_a_verify_batch_equals_one_token_decodes_on_the_default_model(n_prompt):
    """Qwen2.5-Coder-1.5B Q4_K_M with its Q4_K weights repacked: rows 4k.. of a batch go through
    the patched 4-row Q4_K gemm, the rest through the gemv one-token decoding uses (the gemm-vs-
    gemv check), and its Q6_K tensors through vec_dot instead of the tiled matmul."""
    from localspec.catalog.models import resolve_model

    path = resolve_model("default", progress=False)
    assert every_row_mismatch(path, n_prompt, threads=os.cpu_count() or 1) == []


@needs_invariant
@pytest.mark.smollm
def test_greedy_speculative_equals_plain_with_no_near_tie_guard_on_smollm(smollm):
    chats = [[{"role": "user", "content": f"Repeat exactly: {p}"}] for p in PROMPTS]
    assert assert_greedy_lossless(smollm, chats, max_tokens=40, fixed_k=None, tie_margin=0) == []


@needs_invariant
@pytest.mark.smollm
def test_the_engine_drops_the_near_tie_guard_on_batch_invariant_kernels(smollm):
    chat = [{"role": "user", "content": f"Repeat exactly: {PROMPTS[0]}"}]
    with engine(smollm, "ngram", fixed_k=4) as spec:
        assert spec.trusts_batches
        gen = spec.generate(chat, max_tokens=24)
        gen.complete()
        assert gen.stats.rechecks == 0 and gen.stats.accepted > 0


@needs_invariant
@pytest.mark.smollm
@pytest.mark.parametrize("seed", [0, 1, 2, 3])
def test_seeded_sampling_gives_the_same_text_speculative_or_not_on_smollm(smollm, seed):
    """Same seed, same text: the verifier draws from the same per-position random stream as
    plain sampling, and the batch's probabilities are the one-token decodes' bit for bit."""
    sp = SamplingParams(temperature=0.8, top_k=40, top_p=0.95, min_p=0.05, seed=seed)
    chat = [{"role": "user", "content": f"Repeat exactly, then go on: {PROMPTS[seed]}"}]
    with engine(smollm, "none") as plain, engine(smollm, "ngram", fixed_k=4) as spec:
        a = plain.generate(chat, sp, max_tokens=48).complete_tokens()
        gen = spec.generate(chat, sp, max_tokens=48)
        b = gen.complete_tokens()
    assert a == b and gen.stats.drafted > 0


# Past 32 rows (patch 0001's run-time limit). Issue 42 verifies several sequences in one batch
# (4 slots x 9 rows = 36), issue 45 drafts up to 64 tokens (65-row verify batches); prefill goes
# in 64-row chunks.
WIDE = list(range(32, 66)) + [100]     # every size from the old limit to 65, and one past 64
# Fewer sizes where a run costs more: every remainder mod 4 (the repacked gemms' row groups) and
# of 16 full and partial (the tiles of patches 0006-0008 take columns in blocks of 16), 64 and
# 65. (Every size of WIDE was checked on every model here once: docs/exactness.md.)
WIDE_FEW = [35, 46, 64, 65]


@needs_settable
def test_the_invariant_row_limit_moves_at_run_time_and_comes_back():
    """exact_rows_raised(n) raises the limit for a block; the library runs with the largest live
    request, so an outer or overlapping block's end never lowers another's; set_exact_rows never
    goes below the library's 32."""
    assert exact_rows() == 32 and "BATCH_INVARIANT_SET = 1" in system_info()
    with exact_rows_raised(66):
        assert exact_rows() == 66
        with exact_rows_raised(40):
            assert exact_rows() == 66
        with exact_rows_raised(101):
            assert exact_rows() == 101
        assert exact_rows() == 66
    assert exact_rows() == 32
    a, b = exact_rows_raised(66), exact_rows_raised(40)    # two threads' blocks, overlapping
    a.__enter__()
    b.__enter__()
    a.__exit__(None, None, None)
    assert exact_rows() == 40
    b.__exit__(None, None, None)
    assert exact_rows() == 32
    try:
        assert set_exact_rows(8) == 32 and exact_rows() == 32
        assert set_exact_rows(50) == 32 and exact_rows() == 50
        with exact_rows_raised(40):
            assert exact_rows() == 50
    finally:
        set_exact_rows(32)
    assert exact_rows() == 32


def assert_wide_batches(path, n_prompt: int, sizes, threads: int) -> None:
    """With the limit raised past the largest batch every row of every size is a one-token
    decode's bit for bit; with the default limit a 64-row batch (a prefill chunk) takes the fast
    kernels, whose rows differ from one-token decodes somewhere, before and after the raise."""
    before, raised, after = every_row_mismatch(
        path, n_prompt, threads, runs=[("fast", [64]), (max(sizes) + 1, sizes), ("fast", [64])])
    assert raised == []
    assert before and after, "a 64-row batch on the default limit equals one-token decodes"
    assert exact_rows() == 32


@needs_settable
@pytest.mark.smollm
@pytest.mark.parametrize("n_prompt, sizes", [(40, WIDE), (1500, WIDE_FEW + [100])])
def test_batches_of_33_to_100_rows_equal_one_token_decodes_with_the_limit_raised_on_smollm(
        smollm_path, n_prompt, sizes):
    """SmolLM2-135M Q4_1 (Q4_1 and Q8_0 weights, the F16 KV cache's attention matmuls): every
    size from 32 to 65 rows and 100 after a short context, some of them after a long one."""
    assert_wide_batches(smollm_path, n_prompt, sizes, threads=os.cpu_count() or 1)


@needs_settable
@pytest.mark.smollm
@pytest.mark.parametrize("n_prompt", [40, 1500])
def test_batches_past_32_rows_equal_one_token_decodes_with_the_limit_raised_per_weight_type(
        random_smollm_path, n_prompt):
    """The same kernel models with the row limit raised past the batch: every type's kernels of
    the previous test (0003-0008's rows and tiles, Q5_0 through tinyBLAS) at 33-100 rows."""
    assert_wide_batches(random_smollm_path, n_prompt, WIDE_FEW, threads=os.cpu_count() or 1)


@needs_settable
@needs_qwen
@pytest.mark.qwen
@pytest.mark.parametrize("n_prompt", [40, 1500])
def test_batches_of_33_to_100_rows_equal_one_token_decodes_with_the_limit_raised_on_qwen(n_prompt):
    from localspec.catalog.models import resolve_model

    assert_wide_batches(resolve_model("default", progress=False), n_prompt, WIDE,
                        threads=os.cpu_count() or 1)

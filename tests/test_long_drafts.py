"""Drafts past 31 tokens (K_LIMIT 64, issue 45): a verify batch of 32 rows or more runs with the
batch-invariant row limit raised for that decode (llama/exact_rows.exact_for from
Context._decode_chunk), so every row equals a one-token decode bit for bit, the engine keeps the
near-tie guard off, and greedy speculative output stays plain output token for token."""

from __future__ import annotations

import numpy as np
import pytest

from localspec.llama import Context, ContextParams, batch_invariant_rows
from localspec.llama.exact_rows import exact_rows, exact_rows_settable
from localspec.policy.config import K_LIMIT, PolicyConfig
from localspec.speculative.engine import Engine, EngineConfig
from localspec.speculative.factory import batches_trusted

needs_settable = pytest.mark.skipif(
    batch_invariant_rows() == 0 or not exact_rows_settable(),
    reason="this process's ggml-cpu cannot raise its batch-invariant row limit")

TEXT = ("def area(width, height):\n    return width * height\n\n"
        "def perimeter(width, height):\n    return 2 * (width + height)\n\n") * 4


def test_the_limit_is_64_and_batches_of_it_are_trusted_where_the_limit_moves():
    assert K_LIMIT == 64
    assert PolicyConfig().k_max == 64
    with pytest.raises(ValueError, match="1..64"):
        PolicyConfig(k_max=65)
    on_cpu = EngineConfig(n_gpu_layers=0)
    assert batches_trusted(on_cpu) == (batch_invariant_rows() > 0 and exact_rows_settable())
    assert not batches_trusted(EngineConfig(n_gpu_layers=-1))


@needs_settable
@pytest.mark.smollm
@pytest.mark.parametrize("n_rows", [32, 41, 65])
def test_every_row_of_a_wide_verify_decode_equals_a_one_token_decode(smollm, n_rows):
    """Context.decode(..., logits="all") of 32-65 rows, no raise asked for by the caller."""
    prompt = smollm.tokenize(TEXT)[:300]
    cont = [(37 * i + 5) % smollm.n_vocab for i in range(n_rows)]
    with Context(smollm, ContextParams(n_ctx=1024, n_threads=2)) as ctx:
        ctx.decode(prompt, logits="none")
        before = exact_rows()
        rows = ctx.decode(cont, logits="all").copy()
        assert exact_rows() == before           # raised for that decode only
        ctx.truncate(len(prompt))
        single = np.stack([ctx.decode([t], logits="last")[0].copy() for t in cont])
    differing = [i for i in range(n_rows) if not np.array_equal(rows[i], single[i])]
    assert not differing, f"rows {differing} of {n_rows} differ from one-token decodes"


@needs_settable
@pytest.mark.smollm
def test_greedy_drafts_of_48_equal_plain_decoding(smollm):
    """Fixed 48-token drafts on a text that repeats (the copies run long): every step verifies
    49 rows under the raised limit, the guard is off, and the text is plain's."""
    chat = [{"role": "user", "content": "Repeat this code exactly:\n" + TEXT}]
    cfg = dict(n_ctx=2048, n_threads=2, cache_mb=0)
    with Engine(smollm, EngineConfig(proposer="none", **cfg)) as plain, \
            Engine(smollm, EngineConfig(proposer="ngram", **cfg)) as spec:
        ref = plain.generate(chat, max_tokens=160).complete_tokens()
        gen = spec.generate(chat, max_tokens=160, policy=PolicyConfig(fixed_k=48))
        out = gen.complete_tokens()
    assert out == ref
    assert gen.stats.rechecks == 0                # batches trusted: no near-tie re-checks
    by_pos = gen.stats.drafted_by_pos             # some step verified 33 rows or more
    assert len(by_pos) > 32 and by_pos[32] > 0, by_pos

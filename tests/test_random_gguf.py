"""scripts/random_gguf.py: a random-weight model with a real model's exact shapes, tensor types,
metadata and tokenizer, from the real model's metadata alone."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import numpy as np
import pytest

from localspec.llama import Context, ContextParams, Model

_path = Path(__file__).resolve().parent.parent / "scripts" / "random_gguf.py"
_spec = importlib.util.spec_from_file_location("random_gguf", _path)
rg = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(rg)

TEXTS = ["The capital of France is", "def add(a, b):\n    return a + b\n",
         "h\u00e9llo \u65e5\u672c \U0001f642", "<|im_start|>user\nhi<|im_end|>"]


def same_tokenizer(a: Model, b: Model) -> None:
    assert (a.n_vocab, a.bos, a.eos, a.chat_template()) == \
        (b.n_vocab, b.bos, b.eos, b.chat_template())
    for text in TEXTS:
        for special in (False, True):
            assert a.tokenize(text, parse_special=special) == \
                b.tokenize(text, parse_special=special)


def greedy(model: Model, n: int = 24) -> list:
    """n greedy tokens after a chat prompt; every logit finite."""
    with Context(model, ContextParams(n_ctx=256, n_threads=1)) as ctx:
        prompt = model.tokenize(model.apply_chat_template([{"role": "user", "content": "Hi!"}]),
                                parse_special=True)
        row, out = ctx.decode(prompt)[0], []
        for _ in range(n):
            assert np.isfinite(row).all()
            out.append(int(np.argmax(row)))
            row = ctx.decode(out[-1:])[0]
        return out


def test_tiny_model_round_trips_through_a_spec(tiny_path, tmp_path):
    spec, out = tmp_path / "tiny.spec.gguf", tmp_path / "random.gguf"
    rg.write_spec(str(tiny_path), str(spec))
    assert spec.stat().st_size < tiny_path.stat().st_size / 4   # metadata only
    assert rg.compare(str(spec), str(tiny_path)) == []
    rg.make(str(spec), str(out), None, seed=3, logit_scale=rg.LOGIT_SCALE, threads=1, workdir=None)
    assert rg.compare(str(out), str(tiny_path)) == []             # keys, tensors, byte size
    with Model(tiny_path) as real, Model(out) as fake:
        same_tokenizer(real, fake)
        tokens = greedy(fake)
    assert len(set(tokens)) > 4                                   # not stuck on one token


def test_make_can_quantize_to_another_type(tiny_path, tmp_path):
    spec, out = tmp_path / "tiny.spec.gguf", tmp_path / "q8.gguf"
    rg.write_spec(str(tiny_path), str(spec))
    rg.make(str(spec), str(out), rg.FTYPES["q8_0"], seed=0, logit_scale=rg.LOGIT_SCALE,
            threads=1, workdir=None)
    diffs = rg.compare(str(out), str(tiny_path))
    assert any("file_type" in d for d in diffs) and any("Q8_0" in d for d in diffs)
    assert not any("F32" in d.split("!=")[0] for d in diffs if d.startswith("tensor"))
    with Model(out) as fake:
        assert len(greedy(fake, 8)) == 8


def test_init_scales_follow_the_tensor_roles():
    assert rg.init_std("blk.0.attn_norm.weight", (576,), False, 8.0) == "ones"
    assert rg.init_std("blk.0.attn_q.bias", (1536,), False, 8.0) == "zeros"
    assert rg.init_std("blk.0.ffn_down.weight", (8960, 1536), False, 8.0) == \
        pytest.approx(8960 ** -0.5)
    assert rg.init_std("blk.0.attn_k.weight", (1536, 256), False, 8.0) == \
        pytest.approx(3 / 1536 ** 0.5)
    assert rg.init_std("token_embd.weight", (576, 49152), True, 8.0) == pytest.approx(8 / 24)
    assert rg.init_std("token_embd.weight", (1536, 151936), False, 8.0) == 1.0


@pytest.mark.smollm
def test_smollm2_shaped_random_model_matches_the_real_file(smollm_path, tmp_path):
    spec, out = tmp_path / "smollm2.spec.gguf", tmp_path / "random.gguf"
    rg.write_spec(str(smollm_path), str(spec))
    rg.make(str(spec), str(out), None, seed=0, logit_scale=rg.LOGIT_SCALE, threads=2, workdir=None)
    # Against the spec (every key and tensor of the real file; one slow read less), and the size.
    assert rg.compare(str(out), str(spec)) == []                  # Q4_1 + a Q8_0 embedding
    assert out.stat().st_size == Path(smollm_path).stat().st_size
    with Model(smollm_path) as real, Model(out) as fake:
        same_tokenizer(real, fake)
        tokens = greedy(fake)
    assert len(set(tokens)) > 12

"""The llama.cpp door and plain decoding, on real models: the tiny self-made GGUF and SmolLM2-135M."""

from __future__ import annotations

import subprocess
import sys

import numpy as np
import pytest

from localspec.speculative.engine import Engine, EngineConfig
from localspec.errors import LocalspecError
from localspec.llama import Context, ContextParams
from localspec.speculative.sampling import SamplingParams

ONE_THREAD = ContextParams(n_ctx=512, n_threads=1)


def plain_engine(model, n_ctx=512):
    return Engine(model, EngineConfig(proposer="none", n_ctx=n_ctx, n_threads=1))


def test_tiny_model_loads_and_reports_its_vocabulary(tiny_model):
    assert tiny_model.n_vocab == 259
    assert (tiny_model.bos, tiny_model.eos) == (1, 2)
    assert tiny_model.is_eog(2) and not tiny_model.is_eog(100)


@pytest.mark.parametrize("text", ["hello", "a-b_c.d", "héllo→✓", "x\ny\tz"])
def test_tokenize_detokenize_round_trip(tiny_model, text):
    tokens = tiny_model.tokenize(text)
    assert tokens[0] == tiny_model.bos
    assert tiny_model.detokenize(tokens[1:]) == text


def test_round_trip_on_a_real_bpe_vocabulary(smollm):
    text = "def add(a, b):\n    return a + b  # ünïcode ✓"
    tokens = smollm.tokenize(text, add_special=False)
    assert smollm.detokenize(tokens) == text


def test_chat_template_renders_chatml(tiny_model):
    text = tiny_model.apply_chat_template([{"role": "user", "content": "hi"}])
    assert text == "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"


def test_greedy_is_deterministic_across_fresh_engines(tiny_model):
    outs = []
    for _ in range(2):
        with plain_engine(tiny_model) as e:
            outs.append(e.generate("abcabc", max_tokens=40).complete_tokens())
    assert outs[0] == outs[1] and len(outs[0]) > 0


def test_seeded_sampling_is_deterministic_and_seed_matters(tiny_model):
    sp = lambda seed: SamplingParams(temperature=1.0, top_k=0, top_p=1.0, min_p=0.0, seed=seed)
    with plain_engine(tiny_model) as e:
        a = e.generate("xyz", sp(7), max_tokens=40).complete_tokens()
        b = e.generate("xyz", sp(7), max_tokens=40).complete_tokens()
        c = e.generate("xyz", sp(8), max_tokens=40).complete_tokens()
    assert a == b
    assert a != c


def test_remove_kv_rows_then_decode_equals_fresh_decode(tiny_model):
    prompt = tiny_model.tokenize("the quick brown fox")
    other = tiny_model.tokenize("jumps over", add_special=False)
    tail = tiny_model.tokenize("lazy dog", add_special=False)
    with Context(tiny_model, ONE_THREAD) as ctx, Context(tiny_model, ONE_THREAD) as fresh:
        ctx.decode(prompt, logits="none")
        ctx.decode(other, logits="none")                    # rows we then roll back
        assert ctx.truncate(len(prompt)) and ctx.n_past == len(prompt)
        rolled = ctx.decode(tail, logits="all").copy()
        fresh.decode(prompt, logits="none")
        expected = fresh.decode(tail, logits="all").copy()
    np.testing.assert_array_equal(rolled, expected)       # same batch shapes: bit-identical


def test_logits_only_on_requested_rows(tiny_model):
    with Context(tiny_model, ONE_THREAD) as ctx:
        rows = ctx.decode(tiny_model.tokenize("abcdef"), logits=[2, 5])
        assert rows.shape == (2, 259) and rows.dtype == np.float32
        assert ctx.decode([65], logits="none").shape == (0, 259)


def test_prompt_longer_than_context_is_a_clear_error(tiny_model):
    with Engine(tiny_model, EngineConfig(proposer="none", n_ctx=64, n_threads=1)) as e:
        with pytest.raises(LocalspecError, match=r"prompt is \d+ tokens but the context holds"):
            e.generate("x" * 2000)


def test_stop_string_and_eos_end_generation(tiny_model):
    with plain_engine(tiny_model) as e:
        full = e.generate("hello", max_tokens=30)
        text = full.complete()
        assert full.stats.stop_reason in ("length", "eos")
        stop = text[5:7] if len(text) > 8 else None
    if stop:
        with plain_engine(tiny_model) as e:
            cut = e.generate("hello", max_tokens=30, stop=[stop])
            assert cut.complete() == text[: text.index(stop)]
            assert cut.stats.stop_reason == "stop"


def test_kv_prefix_is_reused_between_requests(tiny_model):
    """Whole prefill chunks of the shared prefix are kept (cached equals cold: no partial ones)."""
    from localspec.llama import PREFILL_GRID

    prefix = "a long shared prefix, " * 5                  # > 64 byte tokens: whole chunks
    with plain_engine(tiny_model) as e:
        first = e.generate(prefix + "then", max_tokens=5)
        first.complete()
        second = e.generate(prefix + "then more", max_tokens=5)
        second.complete()
        reused = second.stats.reused_tokens
        assert reused > 0 and reused % PREFILL_GRID == 0
        assert second.stats.prefill_tokens < PREFILL_GRID + 10


def test_plain_greedy_equals_llama_cpp_python_high_level(smollm_path):
    """Our plain decoding is token for token what llama-cpp-python's own Llama produces."""
    import llama_cpp

    prompt = "The three primary colors are"
    ref = llama_cpp.Llama(model_path=str(smollm_path), n_ctx=512, n_threads=1, verbose=False,
                          seed=0)
    try:
        out = ref.create_completion(prompt, max_tokens=48, temperature=0.0, top_k=1,
                                    repeat_penalty=1.0)
        ref_text = out["choices"][0]["text"]
    finally:
        ref.close()
    with Engine(str(smollm_path), EngineConfig(proposer="none", n_ctx=512, n_threads=1)) as e:
        gen = e.generate(prompt, max_tokens=48)
        text = gen.complete()
    assert len(gen.tokens) == 48
    assert text == ref_text


def run_cli(*args, **kw):
    return subprocess.run([sys.executable, "-m", "localspec", *args], capture_output=True,
                          text=True, timeout=120, **kw)


@pytest.mark.parametrize("make_bad, expect", [
    (lambda p: p / "missing.gguf", "not found"),
    (lambda p: (p / "notes.gguf").write_text("hello") and p / "notes.gguf", "not a GGUF"),
    (None, "could not load"),
])
def test_bad_model_files_give_one_line_errors(tmp_path, tiny_path, make_bad, expect):
    if make_bad is None:  # a truncated GGUF: the header survives, the tensors do not
        bad = tmp_path / "truncated.gguf"
        bad.write_bytes(tiny_path.read_bytes()[: 40_000])
    else:
        bad = make_bad(tmp_path)
    r = run_cli("generate", "-m", str(bad), "hi")
    assert r.returncode == 1
    assert r.stdout == ""
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error:") and expect in lines[0]
    assert "Traceback" not in r.stderr


def test_unknown_catalog_name_is_one_line_error():
    r = run_cli("generate", "-m", "no-such-model", "hi")
    assert r.returncode == 1 and "unknown model" in r.stderr and "Traceback" not in r.stderr


def test_cli_generate_streams_completion_to_stdout(tiny_path):
    r = run_cli("generate", "-m", str(tiny_path), "-n", "12", "--threads", "1", "--stats", "abc")
    assert r.returncode == 0, r.stderr
    assert len(r.stdout) > 0
    assert "tokens/step" in r.stderr            # stats go to stderr, never stdout


def test_context_tracks_the_tokens_its_cache_holds(tiny_model):
    """Context.tokens is what the KV cache holds; sync() reuses the longest common prefix and
    always evaluates the last token; reconcile() drops rows an interrupt left unrecorded."""
    with Context(tiny_model, ContextParams(n_ctx=256, n_threads=1)) as ctx:
        a = tiny_model.tokenize("abcdef")
        row, reused = ctx.sync(a)
        assert reused == 0 and ctx.tokens == a and row.shape == (tiny_model.n_vocab,)
        b = a[:4] + tiny_model.tokenize("xyz", add_special=False)
        fresh = np.array(ctx.sync(b)[0])
        assert ctx.sync(b)[1] == len(b) - 1          # same tokens again: only the last re-done
        with Context(tiny_model, ContextParams(n_ctx=256, n_threads=1)) as cold:
            # other batch shapes, so not bit for bit; a wrong position would miss by whole units
            np.testing.assert_allclose(np.array(cold.sync(b)[0]), fresh, atol=1e-3)
        with pytest.raises(ValueError):
            ctx.truncate(-1)                          # never a negative position
        assert ctx.tokens == b
        n = ctx.n_past
        ctx.tokens = ctx.tokens[:2]                   # as if an interrupt skipped the bookkeeping
        ctx.reconcile()
        assert ctx.n_past == 2 and ctx.sync(b)[1] == 2
        assert n == len(b)

"""The tiny random GGUF of tests/tinymodel.py, checked through llama_cpp's low-level API directly.

These tests are about the file format only (does llama.cpp load, tokenize, template and run it);
localspec's own wrapper is tested elsewhere.
"""

import ctypes
import itertools

import numpy as np
import pytest

import llama_cpp as L
from tinymodel import make_tiny_gguf

N_GEN = 30


@L.llama_log_callback
def _drop_log(level, text, user_data):
    pass


@pytest.fixture(scope="module", autouse=True)
def quiet_llama():
    L.llama_log_set(_drop_log, None)  # the module-level _drop_log keeps the ctypes callback alive
    L.llama_backend_init()
    yield


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return tmp_path_factory.mktemp("tinymodel")


class Model:
    """A llama_model handle with its vocab; close() frees it (contexts must be freed first)."""

    def __init__(self, path):
        self.ptr = L.llama_model_load_from_file(str(path).encode(), L.llama_model_default_params())
        assert self.ptr, f"llama.cpp could not load {path}"
        self.vocab = L.llama_model_get_vocab(self.ptr)
        self.n_vocab = L.llama_vocab_n_tokens(self.vocab)

    def close(self):
        L.llama_model_free(self.ptr)

    def tokenize(self, text: str, add_special=True) -> list:
        data = text.encode()
        buf = (L.llama_token * (3 * len(data) + 8))()  # a space costs 3 byte tokens (U+2581)
        n = L.llama_tokenize(self.vocab, data, len(data), buf, len(buf), add_special, False)
        assert n >= 0
        return list(buf[:n])

    def piece(self, token: int) -> bytes:
        buf = ctypes.create_string_buffer(64)
        n = L.llama_token_to_piece(self.vocab, token, buf, len(buf), 0, False)
        assert n >= 0
        return buf.raw[:n]

    def new_context(self):
        params = L.llama_context_default_params()
        params.n_ctx = 256
        params.n_batch = 256
        params.n_threads = params.n_threads_batch = 1  # a tiny model: threads only add sync cost
        ctx = L.llama_init_from_model(self.ptr, params)
        assert ctx
        return ctx

    def greedy(self, prompt: str, n: int = N_GEN):
        """Greedy tokens after `prompt` in a fresh context, and the softmax max-prob at each step."""
        ctx = self.new_context()
        try:
            tokens = self.tokenize(prompt)
            batch = (L.llama_token * len(tokens))(*tokens)
            assert L.llama_decode(ctx, L.llama_batch_get_one(batch, len(tokens))) == 0
            out, max_prob = [], []
            for _ in range(n):
                logits = np.ctypeslib.as_array(L.llama_get_logits_ith(ctx, -1), shape=(self.n_vocab,))
                p = np.exp(logits - logits.max())  # [n_vocab] float32
                max_prob.append(float(p.max() / p.sum()))
                token = int(np.argmax(logits))
                out.append(token)
                one = (L.llama_token * 1)(token)
                assert L.llama_decode(ctx, L.llama_batch_get_one(one, 1)) == 0
            return out, max_prob
        finally:
            L.llama_free(ctx)


@pytest.fixture
def open_model():
    opened = []

    def _open(path):
        opened.append(Model(path))
        return opened[-1]

    yield _open
    for model in opened:
        model.close()


@pytest.fixture(scope="module")
def target_path(model_dir):
    return make_tiny_gguf(model_dir / "seed0.gguf", seed=0)


PROMPTS = ["hello", "The quick brown fox", "def f(x):\n    return x", "1 2 3 4 5", "zzz", "abcabcabc"]


def test_same_arguments_give_same_bytes(tmp_path):
    a = make_tiny_gguf(tmp_path / "a.gguf", seed=3, logit_scale=2.0)
    b = make_tiny_gguf(tmp_path / "b.gguf", seed=3, logit_scale=2.0)
    c = make_tiny_gguf(tmp_path / "c.gguf", seed=4, logit_scale=2.0)
    assert a == tmp_path / "a.gguf"
    assert a.read_bytes() == b.read_bytes()
    assert a.read_bytes() != c.read_bytes()


def test_loads_with_byte_vocab(target_path, open_model):
    model = open_model(target_path)
    assert model.n_vocab == 259
    assert L.llama_vocab_bos(model.vocab) == 1
    assert L.llama_vocab_eos(model.vocab) == 2
    assert model.piece(3) == b"\x00" and model.piece(258) == b"\xff"


@pytest.mark.parametrize("text", ["hello", "h\u00e9llo\n{x}"])
def test_tokenize_is_bos_then_bytes_and_round_trips(target_path, open_model, text):
    model = open_model(target_path)
    tokens = model.tokenize(text)
    assert tokens == [1] + [3 + b for b in text.encode()]
    assert b"".join(model.piece(t) for t in tokens[1:]) == text.encode()


def test_spaces_become_sentencepiece_marker(target_path, open_model):
    # No "\u2581" token in a bytes-only vocab: a space comes back as the marker's three bytes.
    model = open_model(target_path)
    tokens = model.tokenize("a b", add_special=False)
    assert b"".join(model.piece(t) for t in tokens) == "a\u2581b".encode()


def _apply_template(template: bytes, messages) -> str:
    chat = (L.llama_chat_message * len(messages))()
    keep = []  # the encoded strings must outlive the call
    for slot, (role, content) in zip(chat, messages):
        keep += [role.encode(), content.encode()]
        slot.role, slot.content = keep[-2], keep[-1]
    buf = ctypes.create_string_buffer(4096)
    n = L.llama_chat_apply_template(template, chat, len(messages), True, buf, len(buf))
    assert 0 < n <= len(buf), "llama.cpp did not recognise the chat template"
    return buf.raw[:n].decode()


def test_chat_template_is_detected_as_chatml(target_path, open_model):
    model = open_model(target_path)
    template = L.llama_model_chat_template(model.ptr, None)
    assert template and b"<|im_start|>" in template
    messages = [("system", "Be brief."), ("user", "hi")]
    text = _apply_template(template, messages)
    assert "<|im_start|>user\nhi<|im_end|>\n" in text
    assert text.endswith("<|im_start|>assistant\n")
    assert text == _apply_template(b"chatml", messages)  # same as llama.cpp's built-in chatml


def test_one_decode_gives_finite_logits(target_path, open_model):
    model = open_model(target_path)
    ctx = model.new_context()
    try:
        tokens = model.tokenize("hi there")
        batch = (L.llama_token * len(tokens))(*tokens)
        assert L.llama_decode(ctx, L.llama_batch_get_one(batch, len(tokens))) == 0
        logits = np.ctypeslib.as_array(L.llama_get_logits_ith(ctx, -1), shape=(model.n_vocab,)).copy()
    finally:
        L.llama_free(ctx)
    assert logits.shape == (259,) and np.isfinite(logits).all()
    assert logits.std() > 0.1


def test_greedy_is_deterministic_and_not_degenerate(target_path, open_model):
    model = open_model(target_path)
    for prompt in PROMPTS:
        first, _ = model.greedy(prompt)
        second, _ = model.greedy(prompt)
        assert first == second
        assert len(set(first)) >= 5, (prompt, first)
        assert max(len(list(run)) for _, run in itertools.groupby(first)) < N_GEN // 2


def test_different_seeds_disagree(model_dir, target_path, open_model):
    target = open_model(target_path)
    draft = open_model(make_tiny_gguf(model_dir / "seed1.gguf", seed=1))
    outputs = [(target.greedy(p)[0], draft.greedy(p)[0]) for p in PROMPTS]
    assert all(t != d for t, d in outputs)
    agree = np.mean([np.mean(np.equal(t, d)) for t, d in outputs])
    assert agree < 0.2


def test_noise_makes_a_draft_that_mostly_agrees_on_the_next_token(model_dir, target_path, open_model):
    target = open_model(target_path)
    draft = open_model(make_tiny_gguf(model_dir / "seed0-noisy.gguf", seed=0, noise=0.1))
    # First generated token of each prompt: a draft/target agreement rate well above chance (1/259).
    prompts = PROMPTS + ["x", "yy", "hello world", "0", "AAAA", "{}", "ok", "<s>"]
    agree = np.mean([target.greedy(p, 1)[0] == draft.greedy(p, 1)[0] for p in prompts])
    assert agree >= 0.4


def test_logit_scale_peaks_the_distribution(model_dir, open_model):
    flat = open_model(make_tiny_gguf(model_dir / "scale1.gguf", seed=0, logit_scale=1.0))
    peaked = open_model(make_tiny_gguf(model_dir / "scale5.gguf", seed=0, logit_scale=5.0))
    flat_max = np.mean([np.mean(flat.greedy(p, 10)[1]) for p in PROMPTS])
    peaked_max = np.mean([np.mean(peaked.greedy(p, 10)[1]) for p in PROMPTS])
    assert flat_max < 0.15
    assert peaked_max > 0.4
    # Scaling logits keeps the argmax: the greedy output is the same text.
    assert flat.greedy("hello")[0] == peaked.greedy("hello")[0]


def test_alt_vocab_is_incompatible_but_loads(model_dir, target_path, open_model):
    target = open_model(target_path)
    alt = open_model(make_tiny_gguf(model_dir / "alt.gguf", seed=0, vocab="alt"))
    assert alt.n_vocab == 300 != target.n_vocab
    assert alt.tokenize("the", add_special=False) != target.tokenize("the", add_special=False)
    out, _ = alt.greedy("the cat", 5)
    assert all(0 <= t < 300 for t in out)


def test_unknown_vocab_is_refused(tmp_path):
    with pytest.raises(ValueError):
        make_tiny_gguf(tmp_path / "x.gguf", vocab="wordpiece")


def test_other_shapes_load_and_run(tmp_path, open_model):
    path = make_tiny_gguf(tmp_path / "small.gguf", seed=5, n_layer=1, n_embd=32, n_head=2, n_ff=48,
                          n_ctx_train=512)
    model = open_model(path)
    assert L.llama_model_n_ctx_train(model.ptr) == 512
    assert L.llama_model_n_embd(model.ptr) == 32
    out, _ = model.greedy("hello", 5)
    assert len(out) == 5

"""The argmax on the device (Context.device_argmax): llama.cpp's greedy backend sampler after
the output layer, so a verify batch hands back each row's token instead of its logits. Run here on
the CPU backend for real; opt-in (EngineConfig.device_argmax) until a GPU run measures it, and
refused on Vulkan, where it crashed on lavapipe.
"""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest

from localspec.llama import Context, ContextParams, Model
from localspec.speculative.config import EngineConfig
from localspec.speculative.engine import Engine
from localspec.speculative.generation import Request
from localspec.speculative.greedy import argmax_verify
from localspec.speculative.sampling import PositionStream, SamplingParams

PROMPTS = ["def add(a, b):\n    return a + b\n\ndef add(a, b):\n",
           "Repeat after me: the cat sat on the mat. The cat sat on",
           "Name three colours:"]


@pytest.fixture(scope="module", params=["tiny_path", "smollm_path"])
def model(request):
    with Model(request.getfixturevalue(request.param)) as m:
        yield m


def test_every_rows_device_argmax_is_the_hosts_argmax_of_its_logits(model):
    """Batches of 1..17 rows after a prompt: the device's token of every row equals numpy's
    argmax of the same row decoded with logits; rows cannot be read while it is on, and off
    again the context gives rows as before."""
    prompt = model.tokenize(PROMPTS[0] * 3)
    cont = model.tokenize(" x = add(1, 2)\n print(x)\n y = add(x, 3)\n z = 7")[:17]
    with Context(model, ContextParams(1024, 512, 2)) as rows_ctx, \
            Context(model, ContextParams(1024, 512, 2)) as arg_ctx:
        for c in (rows_ctx, arg_ctx):
            c.sync(prompt)
        assert arg_ctx.device_argmax(True) and arg_ctx.device_argmax(True)   # idempotent
        base = rows_ctx.n_past
        for n in (1, 2, 5, 9, 17):
            for c in (rows_ctx, arg_ctx):
                assert c.truncate(base)
            want = [int(r.argmax()) for r in rows_ctx.decode(cont[:n], logits="all")]
            assert arg_ctx.verify_tokens(cont[:n]) == want, n
        with pytest.raises(RuntimeError, match="argmax runs on the device"):
            arg_ctx.decode(cont[:1], logits="last")
        assert not arg_ctx.device_argmax(False)
        arg_ctx.truncate(base)
        rows_ctx.truncate(base)
        assert np.array_equal(arg_ctx.decode(cont[:3], logits="all"),
                              rows_ctx.decode(cont[:3], logits="all"))
        assert arg_ctx.device_argmax(True)          # a fresh chain each time: attach again
    # closed with it on: freed with the context (no crash, nothing left)


def test_argmax_verify_accepts_the_drafts_the_tokens_agree_with():
    assert argmax_verify([5, 9, 7, 2], [5, 9, 4]).n_accepted == 2
    v = argmax_verify([5, 9, 4, 2], [5, 9, 4])
    assert (v.n_accepted, v.token, v.tie) == (3, 2, None)
    assert argmax_verify([3], []).emitted([]) == [3]


def _texts(path, device_argmax, proposer, sampling, monkeypatch, calls):
    real = Context.verify_tokens

    def counted(self, tokens):
        calls.append(len(tokens))
        return real(self, tokens)
    monkeypatch.setattr(Context, "verify_tokens", counted)
    config = EngineConfig(proposer=proposer, device_argmax=device_argmax, n_threads=2,
                          tie_margin=0.0)
    with Engine(path, config) as e:
        out = [e.generate(p, sampling, max_tokens=40).complete_tokens() for p in PROMPTS]
        assert not e.ctx.argmax_on           # off after every request: the next prefill's row
    return out


@pytest.mark.parametrize("proposer", ["none", "ngram"])
def test_greedy_text_is_the_same_with_the_argmax_on_the_device(tiny_path, smollm_path, proposer,
                                                               monkeypatch):
    """Greedy plain and n-gram speculative decoding give the same tokens with the argmax on the
    device as with full rows, and the device path is what ran (verify batches of several rows
    with n-gram drafts)."""
    for path in (tiny_path, smollm_path):
        calls: list = []
        rows = _texts(path, False, proposer, SamplingParams(), monkeypatch, calls)
        assert calls == []
        on = _texts(path, True, proposer, SamplingParams(), monkeypatch, calls)
        assert on == rows and calls
        assert proposer == "none" or max(calls) > 1


def test_requests_that_need_rows_keep_them(smollm_path, monkeypatch):
    """Sampling and a repetition penalty read rows: the device argmax stays off for them, with
    the setting on, and their text is what it is without it; so does the near-tie guard (on
    where batches are not trusted: a GPU without --exact), and by default a CPU model."""
    for sampling in (SamplingParams(temperature=0.8, seed=3), SamplingParams(repeat_penalty=1.3)):
        texts = {}
        for flag in (False, True):
            calls: list = []
            monkeypatch.setattr(Context, "verify_tokens", lambda self, t: calls.append(t))
            with Engine(smollm_path, EngineConfig(device_argmax=flag, n_threads=2)) as e:
                texts[flag] = e.generate(PROMPTS[1], sampling, max_tokens=24).complete_tokens()
            assert calls == []
        assert texts[True] == texts[False]
    with Engine(smollm_path, EngineConfig(device_argmax=True, n_threads=2)) as e, \
            Engine(smollm_path, EngineConfig(n_threads=2)) as default:
        greedy = Request(SamplingParams(), PositionStream(0), None, [1], 0.0)
        assert e._argmax_for(greedy) and not default._argmax_for(greedy)   # opt-in
        assert not e._argmax_for(replace(greedy, tie_margin=0.25))

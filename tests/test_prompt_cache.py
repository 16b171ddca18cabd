"""The prompt cache on real models: saved KV states restore bit-identically (target and a draft-like
second model), the RAM budget and LRU order hold, bad disk files are refused with one line, and two
processes share a cache folder without damaging each other's entries."""

from __future__ import annotations

import json
import os
import shutil
import struct
import subprocess
import sys
import textwrap
import time

import numpy as np
import pytest

from localspec.cache.format import (SUFFIX, Rejected, context_key, model_identity, read_file,
                                    write_file)
from localspec.catalog.models import get_entry
from localspec.errors import LocalspecError
from localspec.llama import Context, ContextParams, Model, system_info
from localspec.cache.prompt_cache import PromptCache, default_budget_mb
from tinymodel import make_tiny_gguf

PARAMS = ContextParams(n_ctx=1024, n_threads=1)


@pytest.fixture(scope="module")
def draft_model(tiny_dir):
    """A second tiny model, same shapes as the target but other weights: llama.cpp itself would
    load one's KV state into the other, so only the cache key keeps them apart."""
    with Model(make_tiny_gguf(tiny_dir / "tiny-draft.gguf", seed=1, logit_scale=3.0)) as model:
        yield model


@pytest.fixture(params=["tiny", "smollm"])
def any_model(request):
    return request.getfixturevalue("tiny_model" if request.param == "tiny" else "smollm")


def text_tokens(model, text, bos=False):
    return model.tokenize(text, add_special=bos)


def doc(model, name, n_lines=12):
    """A prompt shaped stable-first: a shared system part, then a document."""
    system = text_tokens(model, "You answer questions about code. ", bos=True)
    body = "".join(f"def {name}_{i}(x): return x * {i} + {len(name)}\n" for i in range(n_lines))
    return system + text_tokens(model, body)


# install.sh's default libraries have llamafile's tinyBLAS, which rounds a row differently by batch
# size: where the reference below splits a prompt into batches differently from the path under
# test, logits agree to float noise, not bit for bit. tests/test_exact_libs.py reruns this module
# on the llamafile-free libraries, where they must be identical.
BATCH_INVARIANT = "LLAMAFILE" not in system_info()


def same_logits(got, want) -> bool:
    return np.array_equal(got, want) if BATCH_INVARIANT else \
        np.allclose(got, want, rtol=1e-5, atol=1e-4)


def fresh_logits(model, prefix, rest):
    """Logits of every row of `rest`, decoded after `prefix` in a new context (the reference)."""
    with Context(model, PARAMS) as ctx:
        ctx.decode(prefix, logits="none")
        return ctx.decode(rest, logits="all").copy()


# -- Context.save_state / restore_state ----------------------------------------------------


def test_restored_state_decodes_bit_identically(any_model):
    prefix, rest = doc(any_model, "alpha"), text_tokens(any_model, "Explain alpha_3.")
    want = fresh_logits(any_model, prefix, rest)
    with Context(any_model, PARAMS) as src:
        src.decode(prefix, logits="none")
        assert src.state_size() == src.save_state().size
        state = src.save_state()
    with Context(any_model, PARAMS) as dst:
        dst.decode(text_tokens(any_model, "unrelated rows that the restore replaces"), "none")
        dst.restore_state(state, prefix)
        assert dst.n_past == len(prefix)
        assert np.array_equal(dst.decode(rest, logits="all"), want)


def test_restored_longer_state_cut_to_the_common_prefix_is_identical(any_model):
    prefix = doc(any_model, "beta")
    old_tail, rest = text_tokens(any_model, "Old question?"), text_tokens(any_model, "New one.")
    want = fresh_logits(any_model, prefix, rest)
    with Context(any_model, PARAMS) as ctx:
        ctx.decode(prefix + old_tail, logits="none")
        state = ctx.save_state()
        ctx.clear()
        ctx.restore_state(state, prefix + old_tail)
        assert ctx.truncate(len(prefix))
        assert np.array_equal(ctx.decode(rest, logits="all"), want)


def test_save_into_a_reused_buffer(tiny_model):
    with Context(tiny_model, PARAMS) as ctx:
        ctx.decode(doc(tiny_model, "buf"), logits="none")
        buf = np.zeros(ctx.state_size() + 100, dtype=np.uint8)
        view = ctx.save_state(buf)
        assert view.size == ctx.state_size() and np.shares_memory(view, buf)
        assert np.array_equal(view, ctx.save_state())
        with pytest.raises(ValueError):
            ctx.save_state(np.zeros(10, dtype=np.uint8))


def test_refused_states_raise_a_clear_error_and_leave_the_context_empty(tiny_model, smollm):
    tokens = doc(tiny_model, "gamma")
    with Context(tiny_model, PARAMS) as ctx:
        ctx.decode(tokens, logits="none")
        state = ctx.save_state()
        with pytest.raises(LocalspecError, match="refused a saved KV state: error loading state"):
            ctx.restore_state(state[: state.size // 2], tokens)
        assert ctx.n_past == 0
        with pytest.raises(LocalspecError, match="positions 0..%d" % (len(tokens) - 1)):
            ctx.restore_state(state, tokens + [5])
        assert ctx.n_past == 0
        with pytest.raises(LocalspecError, match="does not fit"):
            ctx.restore_state(state, [5] * (ctx.n_ctx + 1))
    with Context(smollm, PARAMS) as other:      # other layer count and row sizes
        with pytest.raises(LocalspecError, match="refused a saved KV state"):
            other.restore_state(state, tokens)
        assert other.n_past == 0


def test_kv_bytes_per_token_matches_the_state_size_slope(any_model):
    with Context(any_model, PARAMS) as ctx:
        ctx.decode(list(range(10, 20)), logits="none")
        small = ctx.state_size()
        ctx.decode(list(range(20, 110)), logits="none")
        per_token = (ctx.state_size() - small) / 90
    assert per_token == any_model.kv_bytes_per_token() + 12   # + position and seq id per cell


def test_speculative_greedy_after_a_restore_equals_plain_greedy(smollm):
    """Restore a document's state, then verify drafts in batches and roll back rejected ones
    (every fifth draft is wrong), as the engine's step does: the tokens equal plain greedy."""
    prompt = doc(smollm, "spec") + text_tokens(smollm, "Now write spec_12:")
    with Context(smollm, PARAMS) as ctx:
        row, plain = ctx.decode(prompt)[0], []
        while len(plain) < 24:
            plain.append(int(np.argmax(row)))
            row = ctx.decode(plain[-1:])[0]
    with Context(smollm, PARAMS) as src:
        src.decode(prompt[:-6], logits="none")
        state = src.save_state()
    with Context(smollm, PARAMS) as ctx:
        ctx.restore_state(state, prompt[:len(prompt) - 6])
        out = [int(np.argmax(ctx.decode(prompt[-6:])[0]))]
        while len(out) < len(plain):
            guess = plain[len(out):len(out) + 4]
            drafts = [t if (len(out) + i) % 5 else (t + 1) % smollm.n_vocab
                      for i, t in enumerate(guess)]
            n_past = ctx.n_past
            rows = ctx.decode([out[-1]] + drafts, logits="all")    # [k + 1, n_vocab]
            kept = 0
            while kept < len(drafts) and int(np.argmax(rows[kept])) == drafts[kept]:
                kept += 1
            assert ctx.truncate(n_past + 1 + kept)
            out += drafts[:kept] + [int(np.argmax(rows[kept]))]
    assert out[:len(plain)] == plain


# -- keys -----------------------------------------------------------------------------------


def test_context_key_separates_models_and_settings(tiny_model, draft_model, smollm_path, tmp_path):
    with Context(tiny_model, PARAMS) as a, Context(draft_model, PARAMS) as b, \
            Context(tiny_model, ContextParams(n_ctx=256, n_threads=2)) as a_small, \
            Context(tiny_model, ContextParams(n_ctx=256, flash_attn=True)) as a_fa:
        assert context_key(a) != context_key(b)
        assert context_key(a) == context_key(a_small)        # n_ctx and threads do not matter
        assert context_key(a) != context_key(a_fa)           # flash attention stores V untransposed
    assert model_identity(smollm_path) == "sha256:" + get_entry("smollm2-135m").sha256
    copy = tmp_path / "copy.gguf"
    shutil.copyfile(tiny_model.path, copy)
    assert model_identity(copy).startswith("sampled:")
    with open(copy, "r+b") as f:                             # same size, one byte in the middle
        f.seek(copy.stat().st_size // 2)
        byte = f.read(1)
        f.seek(-1, 1)
        f.write(bytes([byte[0] ^ 1]))
    assert model_identity(copy) != model_identity(tiny_model.path)


def test_default_budget_is_two_full_contexts(smollm):
    assert default_budget_mb(smollm, 4096) == -(-2 * 4096 * 23052 // 2**20)   # 181 MB


# -- PromptCache: lookup, budget, LRU ---------------------------------------------------------


class Session:
    """Drives a cache the way the engine's prefill will: prepare, decode the rest, remember."""

    def __init__(self, cache, ctx):
        self.cache, self.ctx = cache, ctx

    def prefill(self, prompt):
        reuse = self.cache.prepare(self.ctx, prompt)
        assert self.ctx.n_past == reuse.reused and reuse.evaluated == len(prompt) - reuse.reused
        logits = self.ctx.decode(prompt[reuse.reused:], logits="last")[0].copy()
        assert self.ctx.tokens == list(prompt)
        return reuse, logits


def test_alternating_documents_evaluate_only_new_tokens(any_model):
    question = [text_tokens(any_model, f"Question {i}: what does it do?") for i in range(3)]
    docs = [doc(any_model, name) for name in ("alpha", "beta", "gamma")]
    with Context(any_model, PARAMS) as ctx:
        s = Session(PromptCache(64), ctx)
        for d in docs:
            assert s.prefill(d + question[0])[0].source in ("", "context")
        for q in question[1:]:
            for d in docs:
                reuse, logits = s.prefill(d + q)
                assert reuse.source == "ram" and reuse.reused >= len(d), reuse
                assert reuse.evaluated <= len(q)
                prompt = d + q
                want = fresh_logits(any_model, prompt[:reuse.reused], prompt[reuse.reused:])
                assert same_logits(logits, want[-1])


def test_live_context_is_preferred_when_it_holds_the_prefix(tiny_model):
    d = doc(tiny_model, "live")
    with Context(tiny_model, PARAMS) as ctx:
        s = Session(PromptCache(64), ctx)
        s.prefill(d + text_tokens(tiny_model, "one"))
        reuse, _ = s.prefill(d + text_tokens(tiny_model, "two"))
        assert (reuse.source, reuse.reused) == ("context", len(d))
        assert len(s.cache) == 0          # same document: nothing saved


def test_budget_is_never_exceeded_and_eviction_is_lru(tiny_model):
    docs = [doc(tiny_model, name, n_lines=8) for name in ("aa", "bb", "cc", "dd", "ee")]
    with Context(tiny_model, PARAMS) as ctx:
        ctx.decode(docs[0], logits="none")
        entry_mb = ctx.state_size() / 2**20
        cache = PromptCache(2.5 * entry_mb * 1.01)           # room for two of these states
        ctx.clear()
        for d in docs[:3]:
            ctx.clear()
            ctx.decode(d, logits="none")
            assert cache.store(ctx)
            assert cache.used <= cache.budget
        assert [e.tokens.tolist() for e in cache.entries()] == docs[1:3]   # aa evicted
        s = Session(cache, ctx)
        assert s.prefill(docs[1] + [50, 51])[0].source == "ram"   # bb is used: most recent
        ctx.clear()
        ctx.decode(docs[3], logits="none")
        assert cache.store(ctx)
        kept = [e.tokens.tolist() for e in cache.entries()]
        assert kept == [docs[1], docs[3]]                   # cc, least recently used, went
        assert cache.used <= cache.budget


def test_entry_larger_than_the_budget_is_not_stored(tiny_model):
    with Context(tiny_model, PARAMS) as ctx:
        d = doc(tiny_model, "big")
        ctx.decode(d, logits="none")
        cache = PromptCache(ctx.state_size() / 2**20 / 2)
        assert not cache.store(ctx) and cache.used == 0


def test_a_newer_state_of_the_same_document_replaces_the_older(tiny_model):
    d = doc(tiny_model, "same")
    with Context(tiny_model, PARAMS) as ctx:
        cache = PromptCache(64)
        for q in ("first question", "second question"):
            ctx.clear()
            ctx.decode(d + text_tokens(tiny_model, q), logits="none")
            cache.store(ctx)
        assert len(cache) == 1 and cache.entries()[0].tokens[-1] == text_tokens(tiny_model, "n")[0]
        assert not cache.store(ctx)  # held


def test_documents_after_a_long_shared_system_prompt_are_kept_apart(tiny_model):
    system = text_tokens(tiny_model, "You are a careful reviewer. " * 8, bos=True)
    docs = [system + text_tokens(tiny_model, f"def {n}(): pass\n" * 6) for n in ("aa", "bb")]
    assert len(system) > len(docs[0]) / 2                  # they share more than half
    with Context(tiny_model, PARAMS) as ctx:
        s = Session(PromptCache(64), ctx)
        for d in docs + docs:
            reuse, _ = s.prefill(d + [90])
        assert reuse.source == "ram" and reuse.reused == len(docs[1])
        assert len(s.cache) == 2


def test_target_and_draft_contexts_share_one_cache(tiny_model, draft_model):
    """Entries are keyed by model: each context gets its own state back, bit-identical."""
    docs = [doc(tiny_model, name) for name in ("left", "right")]
    q = text_tokens(tiny_model, "And now?")
    cache = PromptCache(64)
    with Context(tiny_model, PARAMS) as target, Context(draft_model, PARAMS) as draft:
        sessions = [Session(cache, target), Session(cache, draft)]
        for d in docs + docs:
            for s in sessions:
                reuse, logits = s.prefill(d + q)
        assert {e.key for e in cache.entries()} == {context_key(target), context_key(draft)}
        for s, model in zip(sessions, (tiny_model, draft_model)):
            prompt = docs[0] + q
            reuse, logits = s.prefill(prompt)
            assert reuse.source == "ram"
            want = fresh_logits(model, prompt[:reuse.reused], prompt[reuse.reused:])
            assert same_logits(logits, want[-1])


# -- disk ------------------------------------------------------------------------------------


def stored_on_disk(model, tmp_path, name="disk"):
    d = doc(model, name)
    with Context(model, PARAMS) as ctx:
        ctx.decode(d, logits="none")
        cache = PromptCache(64, disk_dir=tmp_path)
        assert cache.store(ctx)
        return d, cache.entries()[0].path


def test_a_restarted_process_finds_the_disk_entry(any_model, tmp_path):
    d, path = stored_on_disk(any_model, tmp_path)
    assert path.parent.parent == tmp_path and path.suffix == SUFFIX
    q = text_tokens(any_model, "Why?")
    with Context(any_model, PARAMS) as ctx:
        reuse, logits = Session(PromptCache(64, disk_dir=tmp_path), ctx).prefill(d + q)
    assert (reuse.source, reuse.reused) == ("disk", len(d))
    assert same_logits(logits, fresh_logits(any_model, d + q[:-1], q[-1:])[-1])


def damage_flip(path):
    data = bytearray(path.read_bytes())
    data[-100] ^= 0xFF
    path.write_bytes(bytes(data))


def damage_truncate(path):
    path.write_bytes(path.read_bytes()[:-1000])


def damage_garbage(path):
    path.write_bytes(b"GGUF" + bytes(5000))


@pytest.mark.parametrize("damage, reason", [(damage_flip, "checksum mismatch"),
                                            (damage_truncate, "truncated"),
                                            (damage_garbage, "not a localspec prompt-cache file")])
def test_damaged_files_are_ignored_with_one_line(tiny_model, tmp_path, capsys, damage, reason):
    d, path = stored_on_disk(tiny_model, tmp_path)
    damage(path)
    capsys.readouterr()
    with Context(tiny_model, PARAMS) as ctx:
        s = Session(PromptCache(64, disk_dir=tmp_path), ctx)
        reuse, logits = s.prefill(d + [60, 61])
        assert reuse.source == "" and reuse.reused == 0
        assert same_logits(logits, fresh_logits(tiny_model, d + [60], [61])[-1])
        ctx.clear()
        s.prefill(d + [62, 63])                          # warned once, not on every lookup
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and str(path) in err[0] and reason in err[0], err
    assert not path.exists()                             # removed: it can never load


def damage_negative_sizes(path):
    """Header sizes that add up to the file's length but are negative (a reader that trusted
    them would read -8 bytes of tokens)."""
    data = path.read_bytes()
    _, version, n_header = struct.unpack("<8sII", data[:16])
    header = json.loads(data[16:16 + n_header])
    header["n_tokens"], header["payload_bytes"] = -2, header["payload_bytes"] + 4 * \
        header["n_tokens"] + 8
    raw = json.dumps(header).encode()
    path.write_bytes(struct.pack("<8sII", b"LSPCACHE", version, len(raw)) + raw +
                     data[16 + n_header:])


def test_negative_sizes_are_refused_like_any_damage(tiny_model, tmp_path, capsys):
    d, path = stored_on_disk(tiny_model, tmp_path)
    damage_negative_sizes(path)
    capsys.readouterr()
    with Context(tiny_model, PARAMS) as ctx:
        reuse, _ = Session(PromptCache(64, disk_dir=tmp_path), ctx).prefill(d + [60, 61])
    err = capsys.readouterr().err.strip().splitlines()
    assert reuse.reused == 0 and len(err) == 1 and "negative sizes" in err[0], err
    assert not path.exists()


def test_a_folder_where_an_entry_should_be_is_skipped_with_one_warning(tiny_model, tmp_path,
                                                                       capsys):
    """Not an error on every request until someone deletes it: one line, then the cache works
    around it (and stores and evicts as usual)."""
    d, path = stored_on_disk(tiny_model, tmp_path)
    path.unlink()
    path.mkdir()
    capsys.readouterr()
    with Context(tiny_model, PARAMS) as ctx:
        s = Session(PromptCache(64, disk_dir=tmp_path, disk_mb=1), ctx)
        for tail in ([60, 61], [62, 63], [64]):
            ctx.clear()
            reuse, logits = s.prefill(d + tail)
            assert reuse.reused == 0
            assert same_logits(logits, fresh_logits(tiny_model, d + tail[:-1], tail[-1:])[-1])
        assert s.cache.store(ctx)
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and str(path) in err[0] and "skipping" in err[0], err


def test_temporary_files_of_a_killed_save_are_removed_and_live_ones_counted(tiny_model,
                                                                            tmp_path):
    d, path = stored_on_disk(tiny_model, tmp_path)
    gone = subprocess.Popen([sys.executable, "-c", "pass"])
    gone.wait()                                    # a pid that no longer runs
    stale = path.parent / f".{path.name}.{gone.pid}.0badc0de.tmp"
    live = path.parent / f".{path.name}.{os.getpid()}.0000beef.tmp"
    size = path.stat().st_size
    for tmp in (stale, live):
        tmp.write_bytes(bytes(size))
        os.utime(tmp, (time.time() - 3600, time.time() - 3600))
    with Context(tiny_model, PARAMS) as ctx:
        ctx.decode(doc(tiny_model, "diks"), logits="none")      # as long as "disk"
        cache = PromptCache(64, disk_dir=tmp_path, disk_mb=2.5 * size / 2**20)
        assert cache.store(ctx)
    assert not stale.exists() and live.exists()
    entries = list(tmp_path.glob("*/*" + SUFFIX))
    assert entries and path not in entries      # old + new + the live temp file: over budget
    assert len(entries) == 1


def test_a_file_of_another_model_is_never_loaded(tiny_model, draft_model, tmp_path, capsys):
    d, path = stored_on_disk(draft_model, tmp_path)
    with Context(tiny_model, PARAMS) as ctx:
        key = context_key(ctx)
        (tmp_path / key).mkdir()
        shutil.copyfile(path, tmp_path / key / path.name)   # misplaced into the target's folder
        capsys.readouterr()
        reuse, _ = Session(PromptCache(64, disk_dir=tmp_path), ctx).prefill(d + [70])
    assert reuse.reused == 0
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "another model" in err[0] and "tiny-draft.gguf" in err[0], err
    assert path.exists() and not (tmp_path / key / path.name).exists()
    with pytest.raises(Rejected, match="another model"):
        read_file(path, key)


def test_write_file_is_atomic_and_read_file_round_trips(tmp_path):
    data = np.arange(1000, dtype=np.uint8)
    path = tmp_path / ("x" + SUFFIX)
    size = write_file(path, "k" * 32, [1, 2, 3], data, "m.gguf", {"turns": [1]})
    assert path.stat().st_size == size and list(tmp_path.iterdir()) == [path]
    header, tokens, payload = read_file(path, "k" * 32)
    assert tokens.tolist() == [1, 2, 3] and np.array_equal(payload, data)
    assert header["meta"] == {"turns": [1]} and header["model"] == "m.gguf"


def test_disk_budget_evicts_least_recently_used_files(tiny_model, tmp_path):
    docs = [doc(tiny_model, name) for name in ("d1", "d2", "d3", "d4")]
    with Context(tiny_model, PARAMS) as ctx:
        ctx.decode(docs[0], logits="none")
        file_mb = (ctx.state_size() + 4 * len(docs[0]) + 400) / 2**20
        cache = PromptCache(64, disk_dir=tmp_path, disk_mb=2.5 * file_mb)
        for d in docs:
            ctx.clear()
            ctx.decode(d, logits="none")
            cache.store(ctx)
    files = sorted(tmp_path.glob("*/*" + SUFFIX))
    assert len(files) == 2
    assert sum(f.stat().st_size for f in files) <= cache.disk_budget
    assert sorted(read_file(f, None)[1].tolist() for f in files) == sorted(docs[2:])


# -- named sessions ---------------------------------------------------------------------------


def test_named_session_round_trip_and_mismatch(tiny_model, draft_model, tmp_path, capsys):
    turns = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"}]
    tokens = doc(tiny_model, "chat")
    cache = PromptCache(64, disk_dir=tmp_path)
    with Context(tiny_model, PARAMS) as ctx:
        ctx.decode(tokens, logits="none")
        cache.save_named("my-chat.1", ctx, {"turns": turns})
        want = ctx.decode([80], logits="last")[0].copy()
    assert cache.list_named() == ["my-chat.1"]
    with Context(tiny_model, PARAMS) as ctx:
        session = PromptCache(64, disk_dir=tmp_path).load_named("my-chat.1", ctx)
        assert session.tokens == tokens and session.meta == {"turns": turns}
        assert (session.reuse.source, session.reuse.reused, ctx.n_past) == ("disk", len(tokens),
                                                                         len(tokens))
        assert np.array_equal(ctx.decode([80], logits="last")[0], want)
    capsys.readouterr()
    with Context(draft_model, PARAMS) as other:
        session = cache.load_named("my-chat.1", other)
        assert session.reuse.reused == 0 and other.n_past == 0 and session.meta["turns"] == turns
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "re-reading the conversation" in err[0], err
    with pytest.raises(LocalspecError, match="no saved session named 'nope'.*my-chat.1"):
        cache.load_named("nope", other)
    with pytest.raises(LocalspecError, match="session names"):
        cache.save_named("../escape", other, {})
    with pytest.raises(LocalspecError, match="RAM only"):
        PromptCache(64).save_named("x", other, {})


# -- two processes ----------------------------------------------------------------------------

WORKER = textwrap.dedent("""
    import sys
    from localspec.llama import Context, ContextParams, Model
    from localspec.cache.prompt_cache import PromptCache
    model_path, folder, me = sys.argv[1], sys.argv[2], int(sys.argv[3])
    with Model(model_path) as model, Context(model, ContextParams(n_ctx=1024, n_threads=1)) as ctx:
        # RAM for one state, disk for about twelve of the ~240 files written: most lookups read
        # files, and each process trims files the other is about to read
        cache = PromptCache(0.15, disk_dir=folder, disk_mb=1.0, min_tokens=8, min_gain=4)
        disk_hits = 0
        for i in range(60):
            # both processes write the same documents 0..2 with the same questions, so the
            # same file names race on os.replace
            d = i % 3
            document = [1] + [3 + d] * 20 + [3 + (d * 7 + j * (d + 1)) % 250 for j in range(120)]
            prompt = document + [3 + (i * 13 + j) % 250 for j in range(5)]
            reuse = cache.prepare(ctx, prompt)
            disk_hits += reuse.source == "disk"
            ctx.decode(prompt[reuse.reused:], logits="last")
            cache.store(ctx)
    print("done", me, disk_hits)
""")


def test_two_processes_share_a_folder_without_corrupting_entries(tiny_path, tmp_path):
    procs = [subprocess.Popen([sys.executable, "-c", WORKER, str(tiny_path), str(tmp_path), str(i)],
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
             for i in range(2)]
    results = [p.communicate(timeout=600) for p in procs]
    for p, (out, err) in zip(procs, results):
        assert p.returncode == 0 and out.startswith("done"), err
        assert int(out.split()[2]) > 0, out                     # entries were read back
        assert "localspec:" not in err, err      # never a half-written file, never a failure
    files = list(tmp_path.glob("*/*" + SUFFIX))
    assert files and not list(tmp_path.glob("*/.*.tmp"))
    for f in files:
        read_file(f, None)                                       # checksum holds


def test_two_processes_on_one_folder_never_remove_each_others_entries(tiny_model, tmp_path):
    """Two servers on one home read the same document (soak finding 3): an entry's file is
    named by its tokens, so both write the same file. When one moves on to a newer state of
    the document it removes only a file it wrote itself that nobody has rewritten since; before
    the fix A's newer state unlinked the file B had written last, and B's entry was gone from
    disk. A file it wrote alone still goes when its newer state replaces it."""
    d = doc(tiny_model, "shared")
    a, b = PromptCache(64, disk_dir=tmp_path), PromptCache(64, disk_dir=tmp_path)
    with Context(tiny_model, PARAMS) as ctx:
        def read(cache, question):
            ctx.clear()
            ctx.decode(d + text_tokens(tiny_model, question), logits="none")
            assert cache.store(ctx)
            return cache.entries()[-1].path
        first = read(a, "first?")
        assert read(b, "first?") == first                  # the same tokens, the same file
        second = read(a, "second?")                        # A moves on ...
        assert first.exists() and second.exists()          # ... B's file stays
        assert read(b, "third?") != first and not first.exists()   # B moves on: its own goes
        read(a, "fourth?")
        assert not second.exists()                         # A wrote it alone: replaced
        assert len(list(tmp_path.glob("*/*" + SUFFIX))) == 2


def test_states_of_contexts_with_other_slot_counts_are_kept_apart(tiny_model, tmp_path, capsys):
    """llama.cpp refuses a state saved with another count of KV buffers ("n_stream mismatch"):
    `serve --parallel 2` and `--parallel 4` on one home shared a key, and each refused the
    other's states, a line on stderr and a miss every time (the soak's --shared-home). Their
    keys now differ; slots of one count still share."""
    from localspec.llama.slots import SharedContext
    d = doc(tiny_model, "slots", n_lines=6)
    two = SharedContext(tiny_model, ContextParams(n_ctx=2 * 512, n_threads=1), 2, 31)
    four = SharedContext(tiny_model, ContextParams(n_ctx=4 * 512, n_threads=1), 4, 31)
    try:
        writer, reader = PromptCache(64, disk_dir=tmp_path), PromptCache(64, disk_dir=tmp_path)
        two.slots[1].sync(d, grid=64)
        assert writer.store(two.slots[1])
        assert reader.prepare(four.slots[2], d + [5], 64).reused == 0
        assert "could not restore" not in capsys.readouterr().err
        assert reader.prepare(two.slots[0], d + [5], 64).source == "disk"
        with Context(tiny_model, PARAMS) as lone:
            keys = {context_key(c) for c in (lone, two.slots[0], four.slots[0], four.slots[3])}
            assert len(keys) == 3
    finally:
        two.close()
        four.close()

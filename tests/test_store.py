"""The draft store (localspec.speculative.store, store_file, learning_store): the C index against a pure-Python
reference on seeded random corpora, eviction, and every fault the issue names (corrupt,
truncated, wrong-version, other-model files; a disk that refuses mid-save; kill -9 during a
save; budget 0; two writers at once): each is at most one warning line, and the next start
finds a valid store. Then the engine: a store learns from one run and drafts in the next."""
import dataclasses
import doctest
import os
import random
import signal
import stat
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import numpy as np
import pytest

import localspec.speculative.learning_store as learning_store
import localspec.speculative.store as store_mod
import localspec.speculative.store_file as store_file
from localspec.speculative.learning_store import LearningStore
from localspec.speculative.store import BREAK, DraftStore, max_tokens_for
from localspec.speculative.store_file import StoreFile, read_store, trim

REPO = Path(__file__).resolve().parents[1]


def test_docstring_examples():
    assert doctest.testmod(store_mod).failed == 0
    assert doctest.testmod(store_file).failed == 0
    assert doctest.testmod(learning_store).failed == 0


def reference(corpus, context, k, ngram_min=2, ngram_max=6, max_chain=64, floor=0.1):
    """store.h's PROPOSE, written plainly: (tokens, agree, n_occ, ngram_len)."""
    n = len(corpus)
    for L in range(min(ngram_max, len(context)), ngram_min - 1, -1):
        g = list(context[len(context) - L:])
        occ = [e for e in range(n - 1, L - 1, -1)
               if corpus[e - L:e] == g and corpus[e] != BREAK and BREAK not in corpus[e - L:e]]
        if not occ:
            continue
        alive, parent, score, tokens, agree = occ[:max_chain], None, 1.0, [], []
        parent = len(alive)
        for i in range(k):
            counts, order = {}, []
            for e in alive:
                t = corpus[e + i] if e + i < n else BREAK
                if t == BREAK:
                    continue
                if t not in counts:
                    order.append(t)
                counts[t] = counts.get(t, 0) + 1
            if not counts:
                break
            best = max(order, key=lambda t: (counts[t], -order.index(t)))
            nxt = np.float32(score) * np.float32(counts[best]) / np.float32(parent)
            if nxt < np.float32(floor):
                break
            score = float(nxt)
            tokens.append(best)
            agree.append(counts[best])
            parent = counts[best]
            alive = [e for e in alive if e + i < n and corpus[e + i] == best]
        return tokens, agree, len(occ[:max_chain]), L
    return [], [], 0, 0


def test_the_c_index_agrees_with_the_reference_on_random_corpora():
    rng = random.Random(7)
    for case in range(400):
        vocab = rng.choice([3, 5, 12])
        corpus = [rng.randrange(vocab) if rng.random() > 0.05 else BREAK
                  for _ in range(rng.randrange(1, 400))]
        chain = rng.choice([1, 3, 64])
        with DraftStore(max_tokens=1000, max_chain=chain) as s:
            s.extend(corpus)
            for _ in range(10):
                context = [rng.randrange(vocab) for _ in range(rng.randrange(1, 9))]
                k = rng.randrange(1, 12)
                want = reference(corpus, context, k, max_chain=chain)
                m = s.propose(context, k)
                got = ([], [], 0, 0) if m is None else (m.tokens, m.agree, m.n_occ, m.ngram_len)
                if not want[0]:
                    assert m is None, (case, corpus, context)
                else:
                    assert got == want, (case, corpus, context, k)


def test_a_full_store_evicts_its_oldest_half_and_keeps_the_newest():
    with DraftStore(max_tokens=100) as s:
        for i in range(30):
            s.extend([1000 + i, 1, 2, 3, BREAK])
        assert len(s) <= 100
        assert s.tokens()[-5:].tolist() == [1029, 1, 2, 3, BREAK]
        assert 1000 not in s.tokens().tolist()
        assert s.n_evicted > 0
        assert s.propose([1029, 1, 2], 4).tokens == [3]


def test_a_bad_handle_is_one_convention_in_both_c_apis():
    """ngram.h / store.h ERRORS: a count getter answers the HANDLE error code (not 0, which
    reads as an empty index), a pointer getter NULL; the defaults live in Python only."""
    lib, ffi = store_mod.lib, store_mod.ffi
    assert lib.lsng_len(ffi.NULL) == lib.LSNG_ERR_HANDLE < 0
    assert lib.lsst_len(ffi.NULL) == lib.LSST_ERR_HANDLE < 0
    assert lib.lsng_capacity(ffi.NULL) == lib.LSNG_ERR_HANDLE
    assert lib.lsst_capacity(ffi.NULL) == lib.LSST_ERR_HANDLE
    assert lib.lsng_tokens(ffi.NULL) == ffi.NULL and lib.lsst_tokens(ffi.NULL) == ffi.NULL
    assert not hasattr(lib, "lsng_default_params") and not hasattr(lib, "lsst_default_params")


def test_budget_in_mb_bounds_the_memory():
    assert max_tokens_for(0) == 0
    cap = max_tokens_for(64)
    assert 500_000 < cap < 2_000_000
    assert store_mod.lib.lsst_bytes(store_mod._params(2, 6, 64, 0.1), cap) <= 64e6


# ---- files ---------------------------------------------------------------------------------

@pytest.fixture
def home(tmp_path, monkeypatch):
    monkeypatch.setenv("LOCALSPEC_HOME", str(tmp_path / "home"))
    return tmp_path / "home"


def saved(path, tokens, max_tokens=10_000, key="k" * 32):
    f = StoreFile(path, key, "m.gguf", max_tokens)
    assert f.save(tokens)
    return f


def test_round_trip_owner_only_and_merge(home, capsys):
    path = store_file.store_dir() / "m.lsds"
    saved(path, [1, 2, 3, BREAK])
    saved(path, [4, 5, BREAK])                          # a second process's outputs: appended
    assert read_store(path, "k" * 32)[1].tolist() == [1, 2, 3, BREAK, 4, 5, BREAK]
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    assert stat.S_IMODE(path.parent.stat().st_mode) == 0o700
    assert capsys.readouterr().err == ""


def test_trust_is_saved_with_the_store_and_read_back_on_the_next_start(home, tiny_path):
    first = LearningStore.for_model(tiny_path, "tiny.gguf")
    assert first.hits == learning_store.TRUST_PRIOR
    for right in (True, True, True, False, True):          # an agent loop's store earns trust
        first.checked(right)
    first.begin_output([1, 2])
    first.add([3, 4, 5])
    first.close()                                           # saved with the output
    again = LearningStore.for_model(tiny_path, "tiny.gguf")
    assert again.hits == pytest.approx(first.hits, abs=1e-6) and again.trust > 0
    again.close()
    path = store_file.store_path(tiny_path)[0]
    header, _ = read_store(path, None)
    assert header["meta"]["trust_hits"] == pytest.approx(first.hits, abs=1e-6)
    for bad in (7, -1, "high", True, None):                 # out of range or not a number
        header["meta"]["trust_hits"] = bad
        assert store_file.saved_hits(header) is None


def test_the_file_keeps_the_newest_tokens_within_the_budget(home):
    path = store_file.store_dir() / "m.lsds"
    f = saved(path, list(range(50)) + [BREAK], max_tokens=40)
    f.save(list(range(100, 130)) + [BREAK])
    tokens = read_store(path, "k" * 32)[1].tolist()
    assert len(tokens) <= 40 and tokens[-31:] == list(range(100, 130)) + [BREAK]
    assert trim(np.array([1, -1, 2, 3]), 10).tolist() == [1, -1, 2, 3]


def _damage(path, how):
    data = bytearray(path.read_bytes())
    if how == "corrupt":
        data[-3] ^= 0xFF
    elif how == "truncated":
        data = data[:-5]
    elif how == "garbage":
        data = bytearray(b"hello, not a store")
    path.write_bytes(bytes(data))


@pytest.mark.parametrize("how, reason", [
    ("corrupt", "checksum mismatch"), ("truncated", "truncated"),
    ("garbage", "not a localspec draft-store file"), ("version", "draft-store version 0"),
    ("other-model", "saved for another model")])
def test_a_bad_file_is_one_warning_then_rebuilt(home, capsys, how, reason):
    path = store_file.store_dir() / "m.lsds"
    if how == "version":
        from localspec.cache.format import write_file
        write_file(path, "k" * 32, np.array([1, 2], np.int32), np.zeros(0, np.uint8), "m.gguf",
                   meta={"store_version": 0})
    elif how == "other-model":
        saved(path, [1, 2, BREAK], key="x" * 32)
    else:
        saved(path, [1, 2, 3, BREAK])
        _damage(path, how)
    f = StoreFile(path, "k" * 32, "m.gguf", 1000)
    assert f.load().tolist() == []
    assert f.load().tolist() == []                      # asked again: no second line
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and reason in err[0], err
    assert f.save([7, 8, BREAK])                        # the next save writes a valid store
    assert read_store(path, "k" * 32)[1].tolist() == [7, 8, BREAK]
    assert capsys.readouterr().err == ""


def _child(code, **env):
    return subprocess.Popen([sys.executable, "-c", textwrap.dedent(code)], cwd=REPO,
                            env={**os.environ, "PYTHONPATH": str(REPO), **env},
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def test_a_disk_that_refuses_mid_save_is_one_warning_and_keeps_the_old_store(home, tmp_path):
    """The OS refuses the write half way (a file-size limit: EFBIG, as a full disk refuses with
    ENOSPC); the old file stays valid, the new outputs stay in memory, one line is printed."""
    path = store_file.store_dir() / "m.lsds"
    saved(path, [1, 2, BREAK])
    p = _child(f"""
        import resource, signal
        from localspec.speculative.store_file import StoreFile
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
        resource.setrlimit(resource.RLIMIT_FSIZE, (4096, 4096))
        f = StoreFile({str(path)!r}, "k" * 32, "m.gguf", 10**6)
        print(f.save(list(range(5000)) + [-1]), f.save(list(range(6000)) + [-1]))
    """)
    out, err = p.communicate(timeout=60)
    assert out.split() == ["False", "False"]
    assert len(err.strip().splitlines()) == 1 and "could not save" in err, err
    assert read_store(path, "k" * 32)[1].tolist() == [1, 2, BREAK]
    assert not list(path.parent.glob("*.tmp"))


def test_kill_9_during_saves_leaves_a_valid_store(home):
    path = store_file.store_dir() / "m.lsds"
    p = _child(f"""
        from localspec.speculative.store_file import StoreFile
        f = StoreFile({str(path)!r}, "k" * 32, "m.gguf", 2 * 10**6)
        i = 0
        while True:
            f.save(list(range(i % 7, 200_000)) + [-1])
            i += 1
    """)
    deadline = time.time() + 30
    while not path.exists() and time.time() < deadline:
        time.sleep(0.05)
    time.sleep(random.Random(3).uniform(0.1, 0.5))
    p.send_signal(signal.SIGKILL)
    p.wait()
    tokens = StoreFile(path, "k" * 32, "m.gguf", 2 * 10**6).load()   # no warning, valid
    assert len(tokens) > 0 and tokens[-1] == BREAK
    assert saved(path, [5, BREAK], max_tokens=2 * 10**6)


def test_two_writers_at_once_lose_nothing(home):
    path = store_file.store_dir() / "m.lsds"
    code = """
        import sys
        from localspec.speculative.store_file import StoreFile
        f = StoreFile({path!r}, "k" * 32, "m.gguf", 10**6)
        for i in range(40):
            assert f.save([{base} + i, 1, 2, 3, -1])
    """
    ps = [_child(code.format(path=str(path), base=base)) for base in (1000, 2000)]
    for p in ps:
        out, err = p.communicate(timeout=120)
        assert p.returncode == 0 and err == "", err
    tokens = read_store(path, "k" * 32)[1].tolist()
    starts = {tokens[i + 1] for i, t in enumerate(tokens[:-1]) if t == BREAK} | {tokens[0]}
    assert starts == set(range(1000, 1040)) | set(range(2000, 2040))


def test_budget_zero_means_no_store_and_no_file(home, tiny_path, capsys, monkeypatch):
    monkeypatch.setenv("LOCALSPEC_STORE_MB", "0")
    assert LearningStore.for_model(tiny_path, "tiny.gguf") is None
    assert not (home / "store").exists() or not list((home / "store").glob("*.lsds"))
    assert capsys.readouterr().err == ""


# ---- the engine ----------------------------------------------------------------------------

def _run(tiny_path, learn, fixed_k=4):
    from localspec.policy.config import PolicyConfig
    from localspec.speculative.engine import Engine, EngineConfig
    from localspec.speculative.sampling import SamplingParams
    cfg = EngineConfig(proposer="ngram", store=True, learn=learn, n_threads=1, cache_mb=0,
                       n_ctx=512, policy=PolicyConfig(fixed_k=fixed_k))
    with Engine(tiny_path, cfg) as e:
        gen = e.generate("Once upon a time", SamplingParams(temperature=0.0), max_tokens=40)
        text = "".join(gen)
    return text, gen.stats


def test_an_output_learnt_in_one_run_drafts_in_the_next(home, tiny_path):
    text, st = _run(tiny_path, learn=False)
    assert not list((home / "store").glob("*.lsds"))     # --no-learn writes nothing
    assert _run(tiny_path, learn=True)[0] == text
    files = list((home / "store").glob("*.lsds"))
    assert len(files) == 1
    again, st = _run(tiny_path, learn=False)              # a restart reads what was learnt
    assert again == text
    assert st.store_tokens > 0 and st.to_dict()["store_tokens"] == st.store_tokens
    assert "from the draft store" in st.summary()


# ---- the command line ----------------------------------------------------------------------

def _cli(*args, home):
    env = {**os.environ, "PYTHONPATH": str(REPO), "LOCALSPEC_HOME": str(home)}
    return subprocess.run([sys.executable, "-m", "localspec", *args], cwd=REPO, env=env,
                          capture_output=True, text=True, timeout=300)


def test_generate_learns_stats_say_so_and_store_clear_empties_it(home, tiny_path):
    gen = ["generate", "-m", str(tiny_path), "--proposer", "ngram", "--k", "4", "--threads", "1",
           "--ctx", "512", "-n", "40", "--stats", "Once upon a time"]
    first = _cli(*gen, "--no-learn", home=home)
    assert first.returncode == 0, first.stderr
    assert "no stores yet" in _cli("store", "stats", home=home).stdout
    assert _cli(*gen, home=home).stdout == first.stdout            # learns (default)
    again = _cli(*gen, home=home)
    assert again.stdout == first.stdout
    assert "tokens from the draft store" in again.stderr
    listing = _cli("store", "stats", home=home).stdout
    assert "tiny-target.gguf: " in listing and " 2 outputs, " in listing
    assert "of recent offers right" in listing
    assert _cli("store", "clear", "-m", str(tiny_path), home=home).returncode == 0
    assert "no stores yet" in _cli("store", "stats", home=home).stdout


def test_stats_say_what_the_next_run_does_with_an_unusable_store(home):
    """Issue 43 item 8: stats promised a rebuild that a read-only folder makes impossible."""
    folder = home / "store"
    folder.mkdir(parents=True)
    (folder / "m-0123456789abcdef.lsds").write_bytes(b"not a store file")
    listing = _cli("store", "stats", home=home).stdout
    assert "unusable (" in listing and "moves it to m-0123456789abcdef.lsds.rejected" in listing
    folder.chmod(0o500)
    try:
        listing = _cli("store", "stats", home=home).stdout
    finally:
        folder.chmod(0o700)
    assert "the next run cannot replace it" in listing and "rebuilds" not in listing


def test_serve_help_says_whether_clients_shape_each_other(home):
    text = " ".join(_cli("serve", "--help", home=home).stdout.split())
    assert "--no-learn with --http" in text and "one client's outputs could then shape" in text


def test_store_counts_stand_in_for_the_run_a_request_has_not_shown_yet():
    """At a request's start (no run of right guesses shown) a CPU's loss budget allows no
    draft; a store offer whose tokens followed this context 5 times before brings that evidence."""
    from localspec.policy.acceptance import DraftFeatures, Offer
    from localspec.policy.adaptive import AdaptivePolicy
    from localspec.policy.config import PolicyConfig
    from localspec.policy.costmodel import CostConfig, CostModel
    curve = [1.0, 1.5, 1.7, 1.8, 2.2, 2.4, 2.6, 2.8, 3.0] + [3.2] * 8      # a Xeon's
    policy = AdaptivePolicy(CostModel(curve, 30.0, CostConfig(online=False)), PolicyConfig())
    tokens, agree = [11, 12, 13, 14, 15, 16], [5, 5, 5, 5, 5, 5]
    for source, want in (("history", 0), ("store", 1)):
        f = DraftFeatures(tokens, source, 6, n_occ=5, agree=agree)
        k, gain = policy.choose_scored(Offer(source, len(tokens), f))
        assert (k > 0) == bool(want), (source, k, gain)
    off = AdaptivePolicy(CostModel(curve, 30.0, CostConfig(online=False)),
                         PolicyConfig(store_evidence=0))
    f = DraftFeatures(tokens, "store", 6, n_occ=5, agree=agree)
    assert off.choose_scored(Offer("store", len(tokens), f))[0] == 0


def test_the_editor_protocol_learns_and_its_stats_count_store_tokens(tiny_path, tmp_path):
    from test_serve import Server
    srv = Server(tiny_path, tmp_path, "--ctx", "1024")
    try:
        params = {"prompt": "Once upon a time", "max_tokens": 32, "stream": False, "k": 4}
        first = srv.call("generate", params)["result"]
        second = srv.call("generate", params)["result"]
    finally:
        assert srv.close() == 0
    assert second["text"] == first["text"]
    assert first["stats"]["store_tokens"] == 0 and second["stats"]["store_tokens"] > 0
    assert list((tmp_path / "home" / "store").glob("*.lsds"))     # --stdio learns by default


def test_the_index_starts_small_and_grows_to_the_budget():
    with DraftStore(max_tokens=300_000) as s:
        start = s._mem
        s.extend(list(range(70_000)) + [BREAK])
        assert s._mem is not start and len(s) == 70_001
        s.extend([5, 6, 7, BREAK])
        assert s.propose([69_998, 69_999], 2) is None       # ended with the output
        assert s.propose([3, 4], 2).tokens == [5, 6]
        s.extend(list(range(100_000, 400_000)))
        assert len(s) <= 300_000 and s.tokens()[-1] == 399_999


def test_session_replay_on_the_recorded_sessions():
    """The shipped recording of the shipped sessions (Qwen2.5-Coder-1.5B greedy, Zen 4):
    every session replays, the store never lowers the future-knowing bound (it only adds
    offers), a policy shown only the right offers stays under it, and a case outside any
    session has an empty store (store == ngram exactly)."""
    from tools import replay as rp
    from tools.session_replay import curve_of, replay_sessions
    cases = rp.load(str(REPO / "data" / "recordings" / "sessions_zen4.json"))
    _, flat = curve_of("flat", "", 2)
    rows = replay_sessions(cases, flat, oracle=True)
    assert {r[0] for r in rows} == {"editor", "agent", "summarize", "chat"}
    assert all(r[5] >= r[3] - 1e-9 for r in rows)
    assert all(r[6] <= r[5] + 1e-9 for r in rows)     # knowing which offers are right: <= bound
    first = [r for r in rows if r[1] in ("editor-1-mean", "agent-1")]
    assert all(abs(r[4] - r[2]) < 1e-9 for r in first)         # each session starts empty
    lone = replay_sessions([dataclasses.replace(c, session=None) for c in cases[:3]], flat)
    assert all(abs(r[4] - r[2]) < 1e-9 for r in lone)


def test_the_store_corrections_are_the_documented_fit_and_hold_on_held_out_sessions():
    """STORE_WEIGHTS are what `session_replay fit` gives on the recorded sessions, and on
    sessions recorded apart (other modules, another agent task, other questions) they predict
    the store's drafts better than the two-term correction they replaced."""
    from localspec.policy.acceptance import STORE_TERMS, STORE_WEIGHTS
    from tools import replay as rp
    from tools.session_replay import fit_store, store_loss, store_rows
    train = store_rows(rp.load(str(REPO / "data" / "recordings" / "sessions_zen4.json")))
    held = store_rows(rp.load(str(REPO / "data" / "recordings" / "sessions_heldout_zen4.json")))
    assert fit_store(train, STORE_TERMS) == pytest.approx(STORE_WEIGHTS, abs=2e-3)
    assert {r[0] for r in held} == {"editor", "agent", "summarize", "chat"}
    before = (-0.5, 0.668, 0.0, 0.0, 0.0, 0.0, 0.0)
    assert store_loss(held, STORE_WEIGHTS) < store_loss(held, before) - 0.05


@pytest.mark.parametrize("value", ["-1", "nan", "lots"])
def test_a_bad_budget_is_one_error_naming_the_variable(monkeypatch, value):
    from localspec.errors import LocalspecError
    monkeypatch.setenv("LOCALSPEC_STORE_MB", value)
    with pytest.raises(LocalspecError, match="LOCALSPEC_STORE_MB=.*number of MB"):
        store_file.budget_mb()
    monkeypatch.setenv("LOCALSPEC_STORE_MB", " 0 ")
    assert store_file.budget_mb() == 0.0

"""The benchmark run: decoding modes, one timed request per (case, mode) interleaved case by case
(or the engine modes of a case in lockstep, engine_run.py), rounds, and the setup record.
Measures and asserts nothing; report.py turns its rows into tables.
"""

from __future__ import annotations

import json
import os
import platform
import sys
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Callable, Optional, Sequence

from .. import __version__
from ..speculative.config import EngineConfig
from ..speculative.engine import Engine
from ..errors import LocalspecError
from ..speculative.factory import load_model
from ..llama.buildflags import cpu_model, read_cpuinfo
from ..llama import Model, default_threads, library_account, system_info
from ..policy.config import K_LIMIT, PolicyConfig
from ..speculative.sampling import SamplingParams, top2_gap
from .engine_run import run_engine, run_lockstep
from .llamacpp import MODES as LLAMACPP_MODES, PLAIN as LLAMACPP_PLAIN, LlamaCppTool, logged_text
from .llamacpp_build import require_tool
from .peer import PEER_K, Peer
from .report import (Row, first_difference, make_row, merge_rounds, summarize,
                     versus_llamacpp)
from .timing import Outcome
from .why import curve_record, mode_settings
from .workloads import Case

WARMUP_PROMPT = "Write one sentence about the sea."

Say = Callable[[str], None]


@dataclass(frozen=True)
class Mode:
    """plain | ngram, draft, hybrid (adaptive k) | store (ngram + the draft store, empty at
    each session's start) | ngram-kN, store-kN, draft-kN, hybrid-kN (always N drafts) | peer |
    peer-kN (N predicted) | llamacpp-plain, llamacpp-mod, llamacpp-simple (llama.cpp's own
    binary, llamacpp.py)."""

    name: str
    fixed_k: Optional[int] = None

    @property
    def is_peer(self) -> bool:
        return self.name.startswith("peer")

    @property
    def is_llamacpp(self) -> bool:
        return self.name in LLAMACPP_MODES

    @property
    def external(self) -> bool:
        """Not one of our engines: runs alone, never in lockstep, with no engine statistics."""
        return self.is_peer or self.is_llamacpp

    @property
    def reference(self) -> str:
        """The mode its ratio is over: a llama.cpp mode's own plain decoding, else plain."""
        return LLAMACPP_PLAIN if self.is_llamacpp and self.name != LLAMACPP_PLAIN else "plain"

    @property
    def proposer(self) -> str:
        base = self.name.partition("-")[0]
        return "none" if base == "plain" else "ngram" if base == "store" else base

    @property
    def store(self) -> bool:
        return self.name.partition("-")[0] == "store"

    @property
    def policy(self) -> PolicyConfig:
        return PolicyConfig(fixed_k=self.fixed_k)


def parse_modes(text: str) -> list:
    """"plain,ngram,ngram-k3,peer" -> Modes; plain first whenever it is listed (it is the
    reference for ratios and identity), llamacpp-plain added where another llamacpp mode is
    listed (the reference for its ratio) and put before it."""
    bases = ("plain", "ngram", "store", "draft", "hybrid", "peer")
    modes = []
    names = [s.strip() for s in text.split(",") if s.strip()]
    if any(n in LLAMACPP_MODES for n in names) and LLAMACPP_PLAIN not in names:
        names.insert(next(i for i, n in enumerate(names) if n in LLAMACPP_MODES), LLAMACPP_PLAIN)
    for name in names:
        if name in LLAMACPP_MODES:
            if name not in [m.name for m in modes]:
                modes.append(Mode(name))
            continue
        base, _, k = name.partition("-k")
        if base not in bases or (k and not k.isdigit()) or (k and base == "plain"):
            raise LocalspecError(f"unknown mode {name!r}; use plain, ngram, store, draft, hybrid, "
                                 "peer, or one of those but plain with -kN (e.g. ngram-k3), or "
                                 f"{', '.join(LLAMACPP_MODES)}.")
        if k and int(k) > K_LIMIT and base != "peer":
            raise LocalspecError(f"mode {name!r} drafts more than {K_LIMIT} tokens a step, the "
                                 "most a verify batch carries.")
        if name not in [m.name for m in modes]:
            modes.append(Mode(name, int(k) if k else None))
    modes.sort(key=lambda m: m.name != "plain")
    if not modes:
        raise LocalspecError("no modes given; e.g. --modes plain,ngram,peer.")
    return modes


def plain_gap(engine: Engine, prompt_tokens: list, prefix: list) -> float:
    """Top-2 logit gap of the target after prompt + prefix (one batched prefill, so its logits
    may differ slightly from the one-token decodes plain used; cheap, and close enough to spot
    near-ties)."""
    return top2_gap(engine.next_logits(prompt_tokens + prefix), SamplingParams())



@dataclass(frozen=True)
class BenchSettings:
    """What every mode of a run shares: the model, the engine settings each engine mode starts
    from (the CLI builds them as every command does; a mode then sets its proposer, draft store
    and policy, with the prompt cache off so every request starts cold), the sampler, and how
    the run goes."""

    model: str = "default"
    engine: EngineConfig = EngineConfig()   # its draft: the model of the draft and hybrid modes
    sampling: SamplingParams = SamplingParams()
    max_tokens: Optional[int] = None  # cap on each case's own budget
    warmup: bool = True
    rounds: int = 1                   # runs of every (case, mode); ratios are per-round medians
    lockstep: bool = False            # engine modes of a case decode turn about (engine_run.py)

    def mode_config(self, mode: "Mode") -> EngineConfig:
        return replace(self.engine, proposer=mode.proposer, policy=mode.policy,
                       cache_mb=0,    # every request starts cold
                       store=mode.store, store_disk=False, learn=False)


class Bench:
    """Holds the model, one Engine per engine mode (sharing the model) and the peer; `run()`
    appends a Row per (case, mode) to `self.rows` as it goes, so an interrupt keeps them."""

    def __init__(self, modes: Sequence[Mode], settings: BenchSettings = BenchSettings(),
                 say: Say = lambda s: None, live: Optional[Say] = None,
                 check_model: Optional[Callable[[Model], None]] = None):
        """`check_model` sees the loaded model before any context is made (the CLI's limits)."""
        self.modes, self.settings, self.say, self.live = list(modes), settings, say, live
        self.rows: list = []
        self.engines: dict = {}
        self.peers: dict = {}
        self.llamacpp: dict = {}
        # Exact mode is chosen before any decode in this process; the peer shares it, and so its
        # libraries (llamafile-free): one set of llama.cpp libraries per process.
        # RPC servers are attached process-wide: the peer's offloaded layers go there too.
        cfg = settings.engine
        if any(m.is_llamacpp for m in self.modes):
            require_tool()            # before loading anything: one line on how to build it
        self.model = load_model(settings.model, cfg.n_gpu_layers, cfg.exact, cfg.rpc)
        self.model_path = self.model.path
        try:
            if check_model is not None:
                check_model(self.model)
            for m in self.modes:
                if m.is_peer:
                    self.peers[m.name] = None     # loaded in run(): keeps a failure readable
                elif m.is_llamacpp:
                    self.llamacpp[m.name] = LlamaCppTool(
                        m.name, self.model_path, cfg.n_ctx, cfg.n_threads or default_threads(),
                        cfg.n_gpu_layers)
                else:
                    self.engines[m.name] = Engine(self.model, settings.mode_config(m),
                                                  progress=say)
        except BaseException:
            self.close()
            raise

    @property
    def n_threads(self) -> int:
        return next(iter(self.engines.values())).ctx.n_threads if self.engines else \
            (self.settings.engine.n_threads or 0)

    def _load_peers(self) -> None:
        for m in self.modes:
            if m.is_peer and self.peers[m.name] is None:
                self.say(f"loading the peer ({m.name}: llama-cpp-python Llama + "
                         f"LlamaPromptLookupDecoding, k={m.fixed_k or PEER_K})...")
                cfg = self.settings.engine
                self.peers[m.name] = Peer(self.model_path, cfg.n_ctx,
                                          cfg.n_threads or default_threads(),
                                          cfg.n_gpu_layers, m.fixed_k or PEER_K)

    def _run_mode(self, mode: Mode, case: Case, max_tokens: int, tag: str,
                  cold: bool = True) -> Outcome:
        live = None
        if self.live is not None:
            live = lambda n, tps: self.live(f"{tag} {mode.name:<9} {n:>4} tokens {tps:6.1f} tok/s")
        if mode.is_peer:
            prompt = self.model.apply_chat_template(case.messages(), add_assistant=True)
            return self.peers[mode.name].run(prompt, self.settings.sampling, max_tokens, live)
        if mode.is_llamacpp:          # the same rendered prompt, in a file
            prompt = self.model.apply_chat_template(case.messages(), add_assistant=True)
            return self.llamacpp[mode.name].run(prompt, self.settings.sampling, max_tokens)
        return run_engine(self.engines[mode.name], case, self.settings.sampling, max_tokens, live,
                          cold)

    def _run_round(self, order: Sequence[Mode], case: Case, max_tokens: int, tag: str,
                   cold: bool) -> dict:
        """{mode name: Outcome} for one round: one mode after another, or with --lockstep the
        engine modes together, taking turns (the peers and llama.cpp's tool still one after
        another)."""
        together = [m for m in order if not m.external] if self.settings.lockstep else []
        outs = {}
        if len(together) > 1:
            self.say(f"    {'+'.join(m.name for m in together)} in lockstep")
            outs = run_lockstep({m.name: self.engines[m.name] for m in together}, case,
                                self.settings.sampling, max_tokens, cold)
        for mode in order:
            if mode.name not in outs:
                outs[mode.name] = self._run_mode(mode, case, max_tokens, tag, cold)
        return outs

    def warm_up(self) -> None:
        """One short request per mode: pages the weights in, builds compute graphs and measures
        (or loads) the verify cost curve the adaptive policy needs."""
        warm = Case("warm-up", "chat", WARMUP_PROMPT, None, 8)
        for mode in self.modes:
            self.say(f"warm-up: {mode.name}")
            self._run_mode(mode, warm, 8, "[warm-up]")

    def run(self, cases: Sequence[Case], on_case: Optional[Callable[[list], None]] = None) -> list:
        """Warm up, then every case in every mode; `on_case(rows)` after each case."""
        self._load_peers()
        if self.settings.warmup:
            self.warm_up()
        greedy = self.settings.sampling.greedy
        peer_name = next((m.name for m in self.modes if m.is_peer), None)
        any_engine = next(iter(self.engines.values()), None)
        session = object()
        for i, case in enumerate(cases, 1):
            if case.session is None or case.session != session:
                self._new_session()
            session = case.session
            max_tokens = min(case.max_tokens, self.settings.max_tokens or case.max_tokens)
            prompt = any_engine.tokenize_prompt(case.messages()) if any_engine else []
            n_prompt = len(prompt)
            tag = f"[{i}/{len(cases)}] {case.id}"
            self.say(f"{tag} ({case.kind}, {n_prompt} prompt tokens, max {max_tokens})")
            rounds = []                   # per round: {mode name: Outcome}
            for r in range(max(1, self.settings.rounds)):
                # Every mode of this case, then the next case; later rounds reverse the order
                # (plain-ngram, ngram-plain, ...) so a machine speeding up or slowing down during
                # a case favours no mode, and keep the prompt's KV rows but its last prefill
                # chunk (the peer's excepted): the first round's TTFT is the cold one reported.
                order = self.modes if r % 2 == 0 else self.modes[::-1]
                if r:
                    self.say(f"    round {r + 1}/{self.settings.rounds}")
                outs = self._run_round(order, case, max_tokens, tag, r == 0)
                for mode in order:
                    out = outs[mode.name]
                    self.say(f"    {mode.name:<9} {out.generated_tokens:>4} tokens  ttft "
                             f"{out.ttft_ms:7.0f} ms  {out.decode_tps:6.2f} tok/s")
                rounds.append(outs)
            outs = rounds[0]
            self._remember(outs, prompt)
            peer = outs.get(peer_name)
            load = round(os.getloadavg()[0], 2) if hasattr(os, "getloadavg") else None
            logged = [self._as_logged(o) for o in rounds] if self.llamacpp else rounds
            for mode in self.modes:
                seen = logged if mode.is_llamacpp else rounds    # plain's text as its log shows
                row = make_row(case, mode, n_prompt, outs[mode.name], seen[0].get("plain"), peer,
                               greedy, outs.get(mode.reference))
                if mode.is_llamacpp:          # what it printed past the cap (last round)
                    row.stats["tool_printed"] = len(self.llamacpp[mode.name].last_run.pieces)
                if mode.is_llamacpp and LLAMACPP_PLAIN in outs and greedy:
                    row.stats["text_as_llamacpp_plain"] = \
                        outs[mode.name].text == outs[LLAMACPP_PLAIN].text
                if len(rounds) > 1:
                    merge_rounds(row, mode, seen, peer_name,
                                 mode.reference if mode.reference in outs else "plain")
                row.load_avg = load
                row.settings, row.cost_curve = self.settings_of(mode), self.curve_of(mode)
                if row.identical is False and greedy and "plain" in self.engines and \
                        not mode.is_llamacpp:
                    # where it parted from plain, in the first round where it did
                    o = next((o for o in rounds if o[mode.name].tokens != o["plain"].tokens),
                             outs)
                    self._explain(row, case, o[mode.name], o["plain"])
                self.rows.append(row)
            self.say("    => " + ", ".join(self._verdict(r) for r in self.rows[-len(self.modes):]
                                          if r.ratio is not None))
            if on_case is not None:
                on_case(self.rows)
        return self.rows

    def _as_logged(self, outs: dict) -> dict:
        """{mode name: Outcome} with plain's text as llama.cpp's log would show its tokens."""
        plain = outs.get("plain")
        if plain is None or plain.tokens is None:
            return outs
        return {**outs, "plain": replace(plain, text=logged_text(self.model, plain.tokens))}

    def _stores(self):
        return [(m.name, self.engines[m.name].proposer.store) for m in self.modes
                if m.store and self.engines[m.name].proposer is not None]

    def _new_session(self) -> None:
        """Every store mode starts a session (or a case outside any) with an empty store."""
        for _, store in self._stores():
            store.reset()

    def _remember(self, outs: dict, prompt: list) -> None:
        """A case's output joins its mode's store once its rounds are done (memory only)."""
        for name, store in self._stores():
            store.remember(outs[name].tokens, prompt)

    def _explain(self, row: Row, case: Case, out: Outcome, plain: Outcome) -> None:
        """Where a greedy output left plain's, and how close plain's top-2 logits were there."""
        engine = self.engines["plain"]
        row.diverge_at = first_difference(out.tokens, plain.tokens)
        if row.diverge_at is not None and row.diverge_at < len(plain.tokens):
            row.top2_gap = round(plain_gap(engine, engine.tokenize_prompt(case.messages()),
                                          plain.tokens[:row.diverge_at]), 4)

    @staticmethod
    def _verdict(r: Row) -> str:
        where = "" if r.diverge_at is None else f" at token {r.diverge_at}"
        same = {None: "", True: " identical"}.get(r.identical, f" DIFFERS{where}")
        return f"{r.mode} {r.ratio:.2f}x{same}"

    def settings_of(self, mode: Mode) -> str:
        """What chose a mode's drafts, in a few words (why.py)."""
        return mode_settings(mode, self.engines.get(mode.name))

    def curve_of(self, mode: Mode) -> Optional[dict]:
        """An adaptive mode's verify cost curve record (why.py), None where it has none."""
        return curve_record(self.engines.get(mode.name))

    def cost_curve(self) -> Optional[list]:
        """The verify cost curve r(k) the n-gram engines started from (their calibration), for
        the record; None before any engine measured it. (Not load_or_measure: for a curve
        still in slices it would time a whole calibration in the middle of the bench.)"""
        for m in self.modes:
            curve = self.curve_of(m) if not m.external else None
            if curve is not None:
                return curve["calibrated"]
        return None

    def close(self) -> None:
        for peer in self.peers.values():
            if peer is not None:
                peer.close()
        for engine in self.engines.values():
            engine.close()
        self.model.close()

    def __enter__(self) -> "Bench":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


# -- setup record --------------------------------------------------------------------------------
def write_json(path: Path, meta: dict, rows) -> None:
    tmp = path.with_name(path.name + ".tmp")
    doc = {"meta": meta, "summary": summarize(rows)}
    versus = versus_llamacpp(rows)
    if versus:
        doc["versus_llamacpp"] = versus
    tmp.write_text(json.dumps({**doc, "rows": [asdict(r) for r in rows]}, indent=1) + "\n")
    os.replace(tmp, path)


def setup_record(b: Bench, settings: BenchSettings, started) -> dict:
    """What a reader of the numbers needs to know about the run: command, machine, model."""
    try:
        curve = b.cost_curve()
    except Exception:   # the record must not lose the results
        curve = None
    tools = {name: t.last_command for name, t in b.llamacpp.items()}
    return {
        "llamacpp_commands": tools or None,    # each mode's last command line
        "command": " ".join(["localspec", "bench", *sys.argv[1 + (sys.argv[1:2] == ["bench"]):]]),
        "started_utc": started.isoformat(timespec="seconds"),
        "localspec": __version__,
        "model": str(b.model_path), "model_desc": b.model.describe(),
        "draft": settings.engine.draft, "exact": settings.engine.exact,
        "cpu": cpu_model(read_cpuinfo()), "cores": os.cpu_count(), "threads": b.n_threads,
        "platform": platform.platform(), "python": platform.python_version(),
        "llama_cpp_system_info": system_info(), "llama_cpp_libraries": library_account(),
        "sampling": asdict(settings.sampling), "max_tokens_cap": settings.max_tokens,
        "n_ctx": settings.engine.n_ctx, "n_gpu_layers": settings.engine.n_gpu_layers,
        "rounds": settings.rounds, "lockstep": settings.lockstep,
        "verify_cost_curve": curve,
        "verify_cost": {name: c for name, c in ((m.name, b.curve_of(m)) for m in b.modes)
                        if c is not None},
    }

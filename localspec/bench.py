"""The benchmark behind `localspec bench`: run workload cases in several decoding modes, interleaved
case by case, and compare each mode's speed and output with plain decoding of the same case.

Owns the workloads format (data/workloads.jsonl), the prompt shape, the timing rules and the summary
maths. Printing, JSON and plots live in cli_bench.py. Not a test: it measures and asserts nothing.
"""

from __future__ import annotations

import inspect
import importlib
import json
import math
import os
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Iterable, Optional, Sequence

from .catalog import resolve_model
from .engine import Engine, EngineConfig
from .errors import LocalspecError
from .llama import Model, ModelParams, enable_exact_kernels
from .policy import PolicyConfig
from .rpc import attach as attach_rpc
from .sampling import SamplingParams, top2_gap
from .stats import GenerationStats

DEFAULT_WORKLOADS = Path(__file__).parent / "data" / "workloads.jsonl"
KINDS = ("code-edit", "summarize", "chat")
PEER_K = 10                       # LlamaPromptLookupDecoding's num_pred_tokens, as users run it
WARMUP_PROMPT = "Write one sentence about the sea."

Say = Callable[[str], None]


# -- workloads and prompts -----------------------------------------------------------------------
@dataclass(frozen=True)
class Case:
    id: str
    kind: str
    instruction: str
    document: Optional[str]           # the source text the prompt quotes (None for chat)
    max_tokens: int

    def user_message(self) -> str:
        """One user message, shaped as workloads/README.md says.

        Example: kind code-edit, instruction "Add hints.", document "def f(x):\\n    return x\\n"
        -> "Add hints.\\n\\n```python\\ndef f(x):\\n    return x\\n```"
        """
        if self.document is None:
            return self.instruction
        if self.kind == "code-edit":
            body = self.document if self.document.endswith("\n") else self.document + "\n"
            return f"{self.instruction}\n\n```python\n{body}```"
        return f"{self.instruction}\n\n{self.document}"

    def messages(self) -> list:
        return [{"role": "user", "content": self.user_message()}]


def read_source(source: Optional[dict]) -> Optional[str]:
    """The text a case quotes, read from the running interpreter: {"python": "module:qualname"}
    -> inspect.getsource of that object; {"pydoc_topic": name} -> pydoc_data.topics.topics[name]."""
    if source is None:
        return None
    if "python" in source:
        module_name, _, qualname = source["python"].partition(":")
        try:
            obj = importlib.import_module(module_name)
            for part in qualname.split("."):
                obj = getattr(obj, part)
            return inspect.getsource(obj)
        except (ImportError, AttributeError, OSError, TypeError) as e:
            raise LocalspecError(f"cannot read the source of {source['python']} from this Python "
                                 f"({e}); drop that case with --cases.") from None
    if "pydoc_topic" in source:
        from pydoc_data.topics import topics
        try:
            return topics[source["pydoc_topic"]]
        except KeyError:
            raise LocalspecError(f"this Python has no pydoc topic {source['pydoc_topic']!r}; drop "
                                 "that case with --cases.") from None
    raise LocalspecError(f"unknown workload source {source!r}: expected 'python' or 'pydoc_topic'.")


def load_workloads(path: Optional[Path] = None, kinds: Optional[Sequence[str]] = None,
                   ids: Optional[Sequence[str]] = None) -> list:
    """Cases of a workloads JSONL file (default: the copy shipped with localspec), filtered by
    kind and id; in the order of `ids` when given, else in file order."""
    path = Path(path) if path else DEFAULT_WORKLOADS
    try:
        lines = path.read_text(encoding="utf-8").splitlines()
    except OSError as e:
        raise LocalspecError(f"cannot read workloads file {path}: {e.strerror}.") from None
    cases = []
    for n, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            d = json.loads(line)
            raw = (d["id"], d["kind"], d.get("source"), d["instruction"], int(d["max_tokens"]))
        except (ValueError, KeyError, TypeError) as e:
            raise LocalspecError(f"{path}:{n}: not a workload case ({e}); see the format in "
                                 "docs/benchmarks.md.") from None
        if (kinds and raw[1] not in kinds) or (ids and raw[0] not in ids):
            continue
        cases.append(Case(raw[0], raw[1], raw[3], read_source(raw[2]), raw[4]))
    missing = sorted(set(ids or ()) - {c.id for c in cases})
    if missing:
        raise LocalspecError(f"no case called {', '.join(missing)} in {path} (with these kinds).")
    if ids:
        cases.sort(key=lambda c: list(ids).index(c.id))
    if not cases:
        raise LocalspecError(f"no cases selected from {path}.")
    return cases


# -- modes ---------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Mode:
    """plain | ngram, draft, hybrid (adaptive k) | ngram-kN, draft-kN, hybrid-kN (always N
    drafts) | peer | peer-kN (N predicted)."""

    name: str
    fixed_k: Optional[int] = None

    @property
    def is_peer(self) -> bool:
        return self.name.startswith("peer")

    @property
    def proposer(self) -> str:
        return "none" if self.name == "plain" else self.name.partition("-k")[0]


def parse_modes(text: str) -> list:
    """"plain,ngram,ngram-k3,peer" -> Modes; plain first whenever it is listed (it is the
    reference for ratios and identity)."""
    bases = ("plain", "ngram", "draft", "hybrid", "peer")
    modes = []
    for name in (s.strip() for s in text.split(",") if s.strip()):
        base, _, k = name.partition("-k")
        if base not in bases or (k and not k.isdigit()) or \
                (k and base == "plain"):
            raise LocalspecError(f"unknown mode {name!r}; use plain, ngram, draft, hybrid, peer, "
                                 "or one of those but plain with -kN (e.g. ngram-k3).")
        if name not in [m.name for m in modes]:
            modes.append(Mode(name, int(k) if k else None))
    modes.sort(key=lambda m: m.name != "plain")
    if not modes:
        raise LocalspecError("no modes given; e.g. --modes plain,ngram,peer.")
    return modes


# -- one timed run -------------------------------------------------------------------------------
@dataclass
class Outcome:
    """What one (case, mode) run produced, timed by wall clock from the request to its end."""

    text: str
    tokens: Optional[list]            # the peer's: all but its last token (not observable)
    generated_tokens: int
    ttft_ms: float                    # request -> first token (tokenize + prefill + first draw)
    total_ms: float
    stop_reason: str
    stats: Optional[GenerationStats] = None

    @property
    def decode_tps(self) -> float:
        """Tokens after the first, per second after the first: the same rule for every mode."""
        span = (self.total_ms - self.ttft_ms) / 1000.0
        return (self.generated_tokens - 1) / span if self.generated_tokens > 1 and span > 0 else 0.0


class Ticker:
    """Calls `live(n_tokens, tok/s so far)` about twice a second during a run."""

    def __init__(self, live: Optional[Callable[[int, float], None]]):
        self.live, self.t0, self.last, self.first = live, time.perf_counter(), 0.0, None

    def tick(self, n: int) -> None:
        now = time.perf_counter()
        if self.first is None:
            self.first = now
        if self.live is not None and now - self.last > 0.5:
            self.last = now
            span = now - self.first
            self.live(n, (n - 1) / span if n > 1 and span > 0 else 0.0)


def run_engine(engine: Engine, case: Case, sampling: SamplingParams, max_tokens: int,
               live=None) -> Outcome:
    # Cold: forget the previous request's KV rows so the whole prompt is prefilled (the engine
    # would otherwise reuse the shared chat-template prefix), as the peer does after reset().
    engine.reset()
    ticker = Ticker(live)
    gen = engine.generate(case.messages(), sampling, max_tokens=max_tokens)
    t_iter = time.perf_counter()      # the generation loop (and its prefill clock) starts here
    for _ in gen:
        ticker.tick(len(gen.tokens))
    end = time.perf_counter()
    st = gen.stats
    # First token = end of prefill, not first piece: text is held back while it could be an
    # incomplete UTF-8 sequence or the start of a stop string, which is not decoding time.
    first = min(end, t_iter + st.prefill_ms / 1000)
    if st.prefill_tokens != st.prompt_tokens:
        raise RuntimeError(f"{case.id}: the request reused {st.prompt_tokens - st.prefill_tokens} "
                           "KV rows; timings would not be cold.")
    return Outcome(gen.text, list(gen.tokens), len(gen.tokens), 1000 * (first - ticker.t0),
                   1000 * (end - ticker.t0), st.stop_reason, st)


class Peer:
    """llama-cpp-python's own speculative path: `Llama(draft_model=LlamaPromptLookupDecoding)`
    fed the same rendered chat prompt through create_completion(stream=True).

    It imports llama_cpp's high-level API on purpose: it is the thing being measured, not a door
    localspec uses (that is localspec.llama)."""

    def __init__(self, model_path: Path, n_ctx: int, n_threads: int, n_gpu_layers: int,
                 num_pred_tokens: int = PEER_K):
        from llama_cpp.llama import Llama, StoppingCriteriaList
        from llama_cpp.llama_speculative import LlamaPromptLookupDecoding

        self._criteria = StoppingCriteriaList

        self.llm = Llama(str(model_path), n_ctx=n_ctx, n_threads=n_threads,
                         n_threads_batch=n_threads, n_gpu_layers=n_gpu_layers,
                         logits_all=True,   # what draft_model implies; passing it sizes the
                         # logits buffer for prompts longer than n_batch (else a ValueError)
                         draft_model=LlamaPromptLookupDecoding(num_pred_tokens=num_pred_tokens),
                         verbose=False)

    def run(self, prompt: str, sampling: SamplingParams, max_tokens: int, live=None) -> Outcome:
        calls = []                    # (perf_counter(), ids) per stopping-criteria call
        self.llm.reset()              # cold: no prompt-prefix reuse from the previous request
        ticker = Ticker(live)
        chunks = self.llm.create_completion(
            prompt, max_tokens=max_tokens, temperature=sampling.temperature, top_k=sampling.top_k,
            top_p=sampling.top_p, min_p=sampling.min_p, repeat_penalty=sampling.repeat_penalty,
            seed=sampling.seed, stream=True,
            stopping_criteria=self._criteria([lambda ids, logits: calls.append(
                (time.perf_counter(), ids)) or False]))
        text, reason = [], "length"
        for chunk in chunks:
            choice = chunk["choices"][0]
            text.append(choice["text"])
            reason = choice.get("finish_reason") or reason
            ticker.tick(len(calls))
        end = time.perf_counter()
        # create_completion calls the criteria right after sampling output token j with
        # ids = prompt + tokens[:j] (final: rows before j never change), and once more after its
        # loop. So every output token but the last is observable; the EOS token is not output.
        sampled = calls[:-1]
        n = max(0, len(sampled) - (reason == "stop"))
        tokens = None
        if sampled:
            n_prompt = len(sampled[0][1])
            tokens = [int(t) for t in sampled[-1][1][n_prompt:]][:n]   # [n - 1] (or n at EOS)
        # First token = first sample, not first chunk: the peer holds text back while it could
        # be an incomplete UTF-8 sequence, which is not decoding time.
        first = sampled[0][0] if sampled else end
        return Outcome("".join(text), tokens, n, 1000 * (first - ticker.t0),
                       1000 * (end - ticker.t0), "eos" if reason == "stop" else reason)

    def close(self) -> None:
        self.llm.close()


# -- rows and summaries --------------------------------------------------------------------------
@dataclass
class Row:
    case: str
    kind: str
    mode: str
    prompt_tokens: int
    generated_tokens: int
    ttft_ms: float
    decode_tps: float
    ratio: Optional[float]            # decode tok/s over plain's on the same case
    vs_peer: Optional[float]          # decode tok/s over the peer's on the same case
    mean_accepted_len: Optional[float]
    acceptance_rate: Optional[float]
    identical: Optional[bool]         # None: plain itself, or not comparable (sampled peer)
    diverge_at: Optional[int] = None  # first output token index that differs from plain
    top2_gap: Optional[float] = None  # plain path's top-2 logit gap there
    text_identical: Optional[bool] = None   # same text as plain (the peer's stream can differ)
    stop_reason: str = ""
    load_avg: Optional[float] = None  # 1-minute load average after the case: other work running
    text: str = ""
    stats: dict = field(default_factory=dict)


def first_difference(a: Sequence[int], b: Sequence[int]) -> Optional[int]:
    """Index of the first differing element, len of the shorter if one is a prefix, None if equal.

    Example: [1, 2, 3], [1, 5] -> 1; [1, 2], [1, 2, 3] -> 2; [1], [1] -> None."""
    for i, (x, y) in enumerate(zip(a, b)):
        if x != y:
            return i
    return None if len(a) == len(b) else min(len(a), len(b))


def plain_gap(engine: Engine, prompt_tokens: list, prefix: list) -> float:
    """Top-2 logit gap of the target after prompt + prefix (one batched prefill, so its logits
    may differ slightly from the one-token decodes plain used; cheap, and close enough to spot
    near-ties)."""
    engine.reset()
    gap = top2_gap(engine.ctx.decode(prompt_tokens + prefix, logits="last")[0], SamplingParams())
    engine.reset()
    return gap


def make_row(case: Case, mode: Mode, prompt_tokens: int, out: Outcome,
             plain: Optional[Outcome], peer: Optional[Outcome], greedy: bool) -> Row:
    st = out.stats
    row = Row(case.id, case.kind, mode.name, prompt_tokens, out.generated_tokens,
              round(out.ttft_ms, 1), round(out.decode_tps, 2), None, None,
              round(st.mean_accepted_len, 3) if st and mode.name != "plain" else None,
              round(st.acceptance_rate, 4) if st and mode.name != "plain" else None,
              None, stop_reason=out.stop_reason, text=out.text,
              stats=st.to_dict() if st else {})
    if plain is not None and plain is not out:
        row.ratio = _ratio(out.decode_tps, plain.decode_tps)
        row.text_identical = out.text == plain.text
        if not mode.is_peer:          # greedy, or seeded: same seed, same tokens
            row.identical = out.tokens == plain.tokens
        elif greedy and out.tokens is not None:
            # the peer's last token is not observable: its tokens but the last, and its count
            seen = len(out.tokens)
            row.identical = out.generated_tokens == plain.generated_tokens and \
                out.tokens == plain.tokens[:seen]
    if peer is not None and not mode.is_peer:
        row.vs_peer = _ratio(out.decode_tps, peer.decode_tps)
    return row


def _ratio(a: float, b: float) -> Optional[float]:
    return round(a / b, 3) if a > 0 and b > 0 else None


def geomean(values: Iterable[float]) -> Optional[float]:
    vals = [v for v in values if v is not None and v > 0]
    return math.exp(sum(math.log(v) for v in vals) / len(vals)) if vals else None


def summarize(rows: Sequence[Row]) -> list:
    """Per kind (and "all") and mode: geometric-mean ratio to plain, the worst case, geometric-
    mean ratio to the peer, and how many outputs were identical to plain."""
    out = []
    kinds = [k for k in KINDS if any(r.kind == k for r in rows)]
    kinds += sorted({r.kind for r in rows} - set(KINDS))
    modes = list(dict.fromkeys(r.mode for r in rows))
    for kind in kinds + ["all"]:
        for mode in modes:
            sel = [r for r in rows if r.mode == mode and kind in (r.kind, "all")]
            if not sel:
                continue
            rated = [r for r in sel if r.ratio is not None]
            worst = min(rated, key=lambda r: r.ratio) if rated else None
            checked = [r for r in sel if r.identical is not None]
            g, gp = geomean(r.ratio for r in sel), geomean(r.vs_peer for r in sel)
            out.append({
                "kind": kind, "mode": mode, "cases": len(sel),
                "geomean_ratio": round(g, 3) if g else None,
                "worst_ratio": worst.ratio if worst else None,
                "worst_case": worst.case if worst else None,
                "geomean_vs_peer": round(gp, 3) if gp else None,
                "identical": sum(bool(r.identical) for r in checked) if checked else None,
                "compared": len(checked),
                "decode_tps": round(geomean(r.decode_tps for r in sel) or 0.0, 2),
            })
    return out


# -- the run -------------------------------------------------------------------------------------
@dataclass(frozen=True)
class BenchSettings:
    target: str = "default"
    draft: Optional[str] = None       # draft model for the draft and hybrid modes
    sampling: SamplingParams = SamplingParams()
    max_tokens: Optional[int] = None  # cap on each case's own budget
    n_ctx: int = 4096
    n_threads: Optional[int] = None
    n_gpu_layers: int = 0
    exact: bool = False               # batch-invariant CPU kernels for every engine mode
    rpc: tuple = ()                   # `localspec rpc-server`s holding the offloaded layers
    warmup: bool = True


class Bench:
    """Holds the model, one Engine per engine mode (sharing the model) and the peer; `run()`
    appends a Row per (case, mode) to `self.rows` as it goes, so an interrupt keeps them."""

    def __init__(self, modes: Sequence[Mode], settings: BenchSettings = BenchSettings(),
                 say: Say = lambda s: None, live: Optional[Say] = None):
        self.modes, self.settings, self.say, self.live = list(modes), settings, say, live
        self.rows: list = []
        self.model_path = resolve_model(settings.target)
        if settings.exact:            # before any decode in this process; the peer shares it
            enable_exact_kernels()
        attach_rpc(settings.rpc)      # process-wide: the peer's offloaded layers go there too
        self.model = Model(self.model_path, ModelParams(
            n_gpu_layers=settings.n_gpu_layers, use_extra_bufts=False if settings.exact else None))
        if settings.rpc:
            say(f"{self.model_path.name}: {self.model.placement or 'every layer on this machine'}")
        self.engines: dict = {}
        self.peers: dict = {}
        try:
            for m in self.modes:
                if m.is_peer:
                    self.peers[m.name] = None     # loaded in run(): keeps a failure readable
                else:
                    cfg = EngineConfig(proposer=m.proposer, draft=settings.draft,
                                       n_ctx=settings.n_ctx, n_threads=settings.n_threads,
                                       n_gpu_layers=settings.n_gpu_layers, exact=settings.exact,
                                       policy=PolicyConfig(fixed_k=m.fixed_k))
                    self.engines[m.name] = Engine(self.model, cfg, progress=say)
        except Exception:
            self.close()
            raise

    @property
    def n_threads(self) -> int:
        return next(iter(self.engines.values())).ctx.n_threads if self.engines else \
            (self.settings.n_threads or 0)

    def _load_peers(self) -> None:
        from .llama import default_threads
        for m in self.modes:
            if m.is_peer and self.peers[m.name] is None:
                self.say(f"loading the peer ({m.name}: llama-cpp-python Llama + "
                         f"LlamaPromptLookupDecoding, k={m.fixed_k or PEER_K})...")
                self.peers[m.name] = Peer(self.model_path, self.settings.n_ctx,
                                          self.settings.n_threads or default_threads(),
                                          self.settings.n_gpu_layers, m.fixed_k or PEER_K)

    def _run_mode(self, mode: Mode, case: Case, max_tokens: int, tag: str) -> Outcome:
        live = None
        if self.live is not None:
            live = lambda n, tps: self.live(f"{tag} {mode.name:<9} {n:>4} tokens {tps:6.1f} tok/s")
        if mode.is_peer:
            prompt = self.model.apply_chat_template(case.messages(), add_assistant=True)
            return self.peers[mode.name].run(prompt, self.settings.sampling, max_tokens, live)
        return run_engine(self.engines[mode.name], case, self.settings.sampling, max_tokens, live)

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
        for i, case in enumerate(cases, 1):
            max_tokens = min(case.max_tokens, self.settings.max_tokens or case.max_tokens)
            n_prompt = len(any_engine.tokenize_prompt(case.messages())) if any_engine else 0
            tag = f"[{i}/{len(cases)}] {case.id}"
            self.say(f"{tag} ({case.kind}, {n_prompt} prompt tokens, max {max_tokens})")
            outs = {}
            for mode in self.modes:       # interleaved: every mode of this case, then the next
                out = outs[mode.name] = self._run_mode(mode, case, max_tokens, tag)
                self.say(f"    {mode.name:<9} {out.generated_tokens:>4} tokens  ttft "
                         f"{out.ttft_ms:7.0f} ms  {out.decode_tps:6.2f} tok/s")
            plain, peer = outs.get("plain"), outs.get(peer_name)
            load = round(os.getloadavg()[0], 2) if hasattr(os, "getloadavg") else None
            for mode in self.modes:
                row = make_row(case, mode, n_prompt, outs[mode.name], plain, peer, greedy)
                row.load_avg = load
                if row.identical is False and greedy and "plain" in self.engines:
                    self._explain(row, case, outs[mode.name], plain)
                self.rows.append(row)
            self.say("    => " + ", ".join(self._verdict(r) for r in self.rows[-len(self.modes):]
                                          if r.ratio is not None))
            if on_case is not None:
                on_case(self.rows)
        return self.rows

    def _explain(self, row: Row, case: Case, out: Outcome, plain: Outcome) -> None:
        """Where a greedy output left plain's, and how close plain's top-2 logits were there."""
        engine = self.engines["plain"]
        row.diverge_at = first_difference(out.tokens, plain.tokens)
        if row.diverge_at is not None and row.diverge_at < len(plain.tokens):
            row.top2_gap = round(plain_gap(engine, engine.tokenize_prompt(case.messages()),
                                          plain.tokens[:row.diverge_at]), 4)

    @staticmethod
    def _verdict(r: Row) -> str:
        same = {None: "", True: " identical"}.get(r.identical, f" DIFFERS at token {r.diverge_at}")
        return f"{r.mode} {r.ratio:.2f}x{same}"

    def cost_curve(self) -> Optional[list]:
        """The verify cost curve r(k) the n-gram engines used (cached on disk), for the record."""
        from .calibrate import load_or_measure
        for m in self.modes:
            if m.proposer != "none" and not m.is_peer:
                e = self.engines[m.name]
                return list(load_or_measure(e.ctx, self.settings.n_gpu_layers,
                                            e.config.policy.k_max).ratios)
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

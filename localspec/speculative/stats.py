"""Per-request statistics of a generation: what was drafted, accepted, and what it cost."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field


@dataclass
class GenerationStats:
    """Counters for one request (or, merged, for a session).

    A *step* is one target decode after prefill. `emitted` counts tokens produced by steps
    (accepted drafts + one recovered/bonus token each); the first token comes from prefill.
    """

    prompt_tokens: int = 0
    prefill_tokens: int = 0          # prompt tokens actually evaluated (the rest came from KV reuse)
    reused_tokens: int = 0           # prompt tokens whose KV rows were reused, not evaluated
    reused_by_source: dict = field(default_factory=dict)  # "context" | "ram" | "disk" -> tokens
    generated_tokens: int = 0
    steps: int = 0
    spec_steps: int = 0              # steps that verified at least one draft
    drafted: int = 0
    accepted: int = 0
    step_tokens: int = 0             # tokens the steps emitted (an EOS included)
    rechecks: int = 0                # near-ties re-decided by a one-token decode (guard on)
    pauses: int = 0                  # times the regret guard turned drafting off (not paying)
    drafted_by_pos: list = field(default_factory=list)    # [i] drafts evaluated at position i
    accepted_by_pos: list = field(default_factory=list)   # [i] of those, accepted
    drafted_by_source: dict = field(default_factory=dict)
    accepted_by_source: dict = field(default_factory=dict)
    prefill_ms: float = 0.0
    restore_ms: float = 0.0          # loading a saved KV state (part of prefill_ms)
    propose_ms: float = 0.0
    verify_ms: float = 0.0           # target decodes of [last] + drafts
    sample_ms: float = 0.0           # sampler chain and verification maths
    total_ms: float = 0.0
    stop_reason: str = ""            # eos | stop | length | context | cancelled

    def record_step(self, source: str, n_drafted: int, n_accepted: int) -> None:
        self.steps += 1
        if n_drafted == 0:
            return
        self.spec_steps += 1
        self.drafted += n_drafted
        self.accepted += n_accepted
        self.drafted_by_source[source] = self.drafted_by_source.get(source, 0) + n_drafted
        self.accepted_by_source[source] = self.accepted_by_source.get(source, 0) + n_accepted
        while len(self.drafted_by_pos) < n_drafted:
            self.drafted_by_pos.append(0)
            self.accepted_by_pos.append(0)
        # Positions after the first rejection were drafted and verified too; only the
        # leading n_accepted count as accepted.
        for i in range(n_drafted):
            self.drafted_by_pos[i] += 1
            self.accepted_by_pos[i] += i < n_accepted

    def record_reuse(self, source: str, reused: int, restore_ms: float = 0.0) -> None:
        """One prefill reused `reused` prompt tokens from `source` (a prompt cache Reuse)."""
        if reused:
            self.reused_tokens += reused
            self.reused_by_source[source] = self.reused_by_source.get(source, 0) + reused
        self.restore_ms += restore_ms

    @property
    def reuse_source(self) -> str:
        """Where most reused prompt tokens came from ("" when none were reused)."""
        return max(self.reused_by_source, key=self.reused_by_source.get, default="")

    @property
    def store_tokens(self) -> int:
        """Output tokens drafted from the draft store and accepted."""
        return self.accepted_by_source.get("store", 0)

    @property
    def acceptance_rate(self) -> float:
        return self.accepted / self.drafted if self.drafted else 0.0

    @property
    def mean_accepted_len(self) -> float:
        """Tokens emitted per step, the recovered or bonus token included."""
        return self.step_tokens / self.steps if self.steps else 0.0

    @property
    def decode_tokens_per_s(self) -> float:
        """Tokens after the first (which prefill produces) per second after prefill."""
        decode_ms = self.total_ms - self.prefill_ms
        n = self.generated_tokens - 1
        return 1000.0 * n / decode_ms if n > 0 and decode_ms > 0 else 0.0

    def merge(self, other: "GenerationStats") -> None:
        """Add another request's counters into this one (session totals)."""
        for name in ("prompt_tokens", "prefill_tokens", "reused_tokens", "generated_tokens",
                     "steps", "spec_steps", "drafted", "accepted", "step_tokens", "rechecks",
                     "pauses", "prefill_ms", "restore_ms", "propose_ms", "verify_ms", "sample_ms",
                     "total_ms"):
            setattr(self, name, getattr(self, name) + getattr(other, name))
        for mine, theirs in ((self.drafted_by_pos, other.drafted_by_pos),
                             (self.accepted_by_pos, other.accepted_by_pos)):
            mine.extend([0] * (len(theirs) - len(mine)))
            for i, v in enumerate(theirs):
                mine[i] += v
        for mine, theirs in ((self.drafted_by_source, other.drafted_by_source),
                             (self.accepted_by_source, other.accepted_by_source),
                             (self.reused_by_source, other.reused_by_source)):
            for key, v in theirs.items():
                mine[key] = mine.get(key, 0) + v
        self.stop_reason = other.stop_reason

    def to_dict(self) -> dict:
        d = asdict(self)
        d.update(acceptance_rate=round(self.acceptance_rate, 4),
                 mean_accepted_len=round(self.mean_accepted_len, 3),
                 decode_tokens_per_s=round(self.decode_tokens_per_s, 2),
                 store_tokens=self.store_tokens,
                 reuse_source=self.reuse_source)
        return d

    def summary(self) -> str:
        """One line for humans (stderr)."""
        by_src = ", ".join(f"{s} {self.accepted_by_source.get(s, 0)}/{n}"
                           for s, n in sorted(self.drafted_by_source.items()))
        reused = ", ".join(f"{n} reused from {s}" for s, n in sorted(self.reused_by_source.items()))
        return (f"{self.generated_tokens} tokens in {self.total_ms / 1000:.2f}s "
                f"({self.decode_tokens_per_s:.1f} tok/s decode), prompt {self.prompt_tokens} "
                f"({self.prefill_tokens} evaluated, "
                + (f"{reused}, " if reused else "")
                + f"{self.prefill_ms:.0f} ms); "
                f"steps {self.steps} ({self.spec_steps} speculative), "
                f"accepted {self.accepted}/{self.drafted} ({100 * self.acceptance_rate:.0f}%)"
                + (f" [{by_src}]" if by_src else "")
                + (f", {self.store_tokens} tokens from the draft store" if self.store_tokens
                   else "")
                + f", {self.mean_accepted_len:.2f} tokens/step"
                + (f", {self.rechecks} near-ties re-decided" if self.rechecks else "")
                + (f", drafting paused {self.pauses}x (not paying)" if self.pauses else "")
                + f"; stop: {self.stop_reason}")

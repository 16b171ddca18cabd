"""llama.cpp's own speculation as bench modes: its stock `llama-speculative-simple`
(llamacpp_build.py) run as a child process on the same rendered chat prompt as localspec's modes,
once per (case, mode), its per-token log read back into an Outcome capped at exactly the bench's
number of tokens.

Modes (each ratio is over llamacpp-plain, the same binary's own plain decoding):
  llamacpp-plain   ngram-simple with a 1024-token key and 1-token values: it never drafts
                   (ngram-simple drafts only when at least key-length tokens follow a match, and a
                   value is at most 1), so every step decodes one token through the same loop.
  llamacpp-mod     ngram-mod with --spec-default's settings: 24-token match, drafts of 48-64.
  llamacpp-simple  ngram-simple at its defaults: 12-token key, drafts of up to 48.

The cap. The tool's loop bounds each draft by the budget left, except that a bound of 0 means
"no bound" (common_speculative_draft truncates only when n_max > 0): once it stands at cap - 1 or
cap it may verify a whole 48-64-token draft and print up to that many tokens past the cap. So the
text is cut at `max_tokens` tokens (its log prints one entry per token), and decode speed is
timed through the last step that ended within the cap: tokens after the first per second after
the first (timing.py's rule), that step's end being the last time counted. The overshooting step
is neither counted nor timed; at most one token of the cap goes untimed.
"""

from __future__ import annotations

import json
import subprocess
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

from ..errors import LocalspecError
from ..speculative.sampling import SamplingParams
from ..speculative.stats import GenerationStats
from .llamacpp_build import TOOL, require_tool, tool_env
from .timing import Outcome

MODES = {
    "llamacpp-plain": ("ngram-simple", ("--spec-ngram-simple-size-n", "1024",
                                        "--spec-ngram-simple-size-m", "1")),
    "llamacpp-mod": ("ngram-mod", ("--spec-ngram-mod-n-match", "24", "--spec-ngram-mod-n-min",
                                   "48", "--spec-ngram-mod-n-max", "64")),
    "llamacpp-simple": ("ngram-simple", ("--spec-ngram-simple-size-n", "12",
                                         "--spec-ngram-simple-size-m", "48")),
}
PLAIN = "llamacpp-plain"
SETTINGS = {   # MODES in words, for the bench's tables
    "llamacpp-plain": "llama.cpp: never drafts (ngram-simple, 1024-token key)",
    "llamacpp-mod": "llama.cpp ngram-mod: 24-token match, drafts of 48-64 or none",
    "llamacpp-simple": "llama.cpp ngram-simple: 12-token key, drafts of 12-48 or none",
}
STEP_END = "accepted "            # LOG_DBG("accepted %d/%d draft tokens, ...") after each step


class IncompleteLog(LocalspecError):
    """The tool's log lacks what parse() needs."""


@dataclass(frozen=True)
class Run:
    """What one run of the tool logged: the prompt's token count, each generated token's text and
    log time (µs), and each step's (tokens printed, drafted, accepted)."""

    n_prompt: int
    echo: str                         # the prompt as the tool read it, token by token
    t_prompt_us: int                  # when the prompt echo began: after tokenizing, before prefill
    pieces: list                      # [(text, t_us)] per generated token, EOS excluded
    steps: list                       # [(printed, n_drafted, n_accepted)]


def command(tool: Path, mode: str, model: Path, prompt_file: Path, max_tokens: int, n_ctx: int,
            n_threads: int, n_gpu_layers: int, sampling: SamplingParams) -> list:
    """The tool's command line for one run. -b holds the whole prompt (the tool refuses a prompt
    longer than a batch); -ub 512 and flash attention off as localspec's contexts have them;
    --no-escape keeps a prompt's backslashes; the JSONL log with timestamps and debug lines is
    what parse() reads."""
    spec_type, spec_args = MODES[mode]
    return [str(tool), "-m", str(model), "-f", str(prompt_file), "-n", str(max_tokens),
            "-c", str(n_ctx), "-b", str(n_ctx), "-ub", "512", "-fa", "off",
            "-t", str(n_threads), "-tb", str(n_threads),
            "-ngl", "all" if n_gpu_layers < 0 else str(n_gpu_layers),   # its -1 is "auto"
            "--temp", repr(max(0.0, sampling.temperature)), "--top-k", str(sampling.top_k),
            "--top-p", repr(sampling.top_p), "--min-p", repr(sampling.min_p),
            "--repeat-penalty", repr(sampling.repeat_penalty),
            "--repeat-last-n", str(sampling.repeat_last_n),
            "--seed", str(sampling.seed if sampling.seed is not None else -1),
            "--no-escape", "--log-jsonl", "--log-timestamps", "--log-colors", "off", "-lv", "5",
            "--spec-type", spec_type, *spec_args]


def parse(jsonl: str) -> Run:
    """The tool's JSONL log -> Run. Its output entries (level "none") are "\\n\\n", one per
    prompt token, one per generated token, then "\\n\\n" twice; a debug "accepted A/D" line ends
    each step; "encoded N tokens" gives the prompt's count.

    Example: none "\\n\\n", none "a", none "b" (prompt), none "X" at t=5, debug "accepted 0/0",
    none "Y", none "Z" at t=9, debug "accepted 1/3", none "\\n\\n", info "encoded    2 tokens"
    -> Run(2, "ab", t of "a", [("X", 5), ("Y", 9), ("Z", 9)], [(1, 0, 0), (2, 3, 1)])."""
    out, step_ends, n_prompt = [], [], None
    for line in jsonl.splitlines():
        try:
            e = json.loads(line)
        except ValueError:
            continue
        if not isinstance(e, dict) or e.get("type") != "log":
            continue
        msg, level = str(e.get("msg", "")), e.get("level")
        if level == "none":
            out.append((msg, int(e.get("time", 0))))
        elif level == "debug" and msg.startswith(STEP_END):
            a, _, d = msg[len(STEP_END):].split(" ", 1)[0].partition("/")
            step_ends.append((len(out), int(d), int(a)))
        elif level == "info" and msg.lstrip().startswith("encoded") and n_prompt is None:
            n_prompt = int(msg.split()[1])
    if n_prompt is None or not out:
        raise IncompleteLog(f"{TOOL} logged no prompt count; not the expected version?")
    first = 1 + n_prompt                      # after "\n\n" and the prompt's echo
    if len(step_ends) > 1:                    # the first step printed all it accepted, + 1:
        end, _, accepted = step_ends[0]       # robust to other output before the echo
        first = end - accepted - 1
    steps, at = [], first
    for end, drafted, accepted in step_ends:
        steps.append((end - at, drafted, accepted))
        at = end
    echo = out[max(0, first - n_prompt):first]
    return Run(n_prompt, "".join(m for m, _ in echo), echo[0][1] if echo else out[0][1],
               out[first:at], steps)


def outcome(run: Run, max_tokens: int) -> Outcome:
    """The run cut at `max_tokens` tokens and timed through its last step that ended within
    them (module docstring)."""
    pieces = run.pieces[:max_tokens]
    stats = GenerationStats(prompt_tokens=run.n_prompt, prefill_tokens=run.n_prompt,
                            generated_tokens=len(pieces))
    timed = 0
    for printed, drafted, accepted in run.steps:
        if timed + printed > max_tokens:
            break
        stats.record_step("llamacpp", drafted, accepted)
        stats.step_tokens += printed
        timed += printed
    if not pieces:
        return Outcome("", None, 0, 0.0, 0.0, "eos", stats)
    t_first = pieces[0][1]
    ttft = (t_first - run.t_prompt_us) / 1000
    span = (run.pieces[timed - 1][1] - t_first) / 1000 if timed else 0.0
    stats.total_ms = ttft + span
    stop = "length" if len(run.pieces) >= max_tokens else "eos"
    return Outcome("".join(p for p, _ in pieces), None, len(pieces), ttft, ttft + span, stop,
                   stats, timed_tokens=max(1, timed))


def logged_text(model, tokens) -> str:
    """`tokens` as the tool's log shows them: each token's bytes decoded on its own, invalid UTF-8
    replaced (JSON cannot carry a token that ends inside a character), end-of-generation tokens
    left out; what a llama.cpp mode's text is compared with.

    Example: the three byte tokens of "é" + "!" (0xC3, 0xA9, "!") -> "\ufffd\ufffd!"."""
    return "".join(model.token_piece(t).decode("utf-8", "replace") for t in tokens
                   if not model.is_eog(t))


class LlamaCppTool:
    """Runs one llamacpp-* mode of the bench: the binary is checked at construction (a one-line
    error says how to build it), each run writes the prompt to a file and reads the log back."""

    def __init__(self, mode: str, model_path: Path, n_ctx: int, n_threads: int,
                 n_gpu_layers: int):
        if mode not in MODES:
            raise LocalspecError(f"unknown llama.cpp mode {mode!r}; use {', '.join(MODES)}.")
        self.mode, self.model_path = mode, model_path
        self.n_ctx, self.n_threads, self.n_gpu_layers = n_ctx, n_threads, n_gpu_layers
        self.tool = require_tool()
        self.env = tool_env(self.tool)
        self.last_command: list = []
        self.last_run: Optional[Run] = None

    def run(self, prompt: str, sampling: SamplingParams, max_tokens: int) -> Outcome:
        """One run; a log that comes back incomplete is run once more. (The cause seen, on
        loaded boxes: llama.cpp's leaked logger lost its last lines at exit; the build now makes
        the tool drain its log, llamacpp_build.DRAIN_AT. The retry stays for what else may.)"""
        try:
            return self._run(prompt, sampling, max_tokens)
        except IncompleteLog:
            return self._run(prompt, sampling, max_tokens)

    def _run(self, prompt: str, sampling: SamplingParams, max_tokens: int) -> Outcome:
        with tempfile.TemporaryDirectory(prefix="localspec-llamacpp-") as d:
            prompt_file, log_file = Path(d) / "prompt.txt", Path(d) / "log.jsonl"
            # -f drops one trailing newline of the file: add one, the prompt stays whole
            prompt_file.write_bytes(prompt.encode("utf-8") + b"\n")
            cmd = command(self.tool, self.mode, self.model_path, prompt_file, max_tokens,
                          self.n_ctx, self.n_threads, self.n_gpu_layers, sampling)
            self.last_command = cmd
            with open(log_file, "wb") as out:        # a file, not a pipe: the tool never waits
                r = subprocess.run(cmd, stdout=out, stderr=subprocess.PIPE,
                                   stdin=subprocess.DEVNULL, env=self.env)
            text = log_file.read_text(encoding="utf-8", errors="replace")
        if r.returncode != 0:       # its log is lost when it crashes (it does on a bad model)
            tail = [ln for ln in (r.stderr.decode(errors="replace") + text).splitlines()
                    if ln.strip()][-1:] or ["no output"]
            how = f"signal {-r.returncode}" if r.returncode < 0 else f"status {r.returncode}"
            raise LocalspecError(f"{TOOL} ({self.mode}) ended with {how}: {tail[0][:300]} "
                                 f"(command: {' '.join(cmd)})")
        self.last_run = parse(text)
        return outcome(self.last_run, max_tokens)

    def close(self) -> None:
        pass

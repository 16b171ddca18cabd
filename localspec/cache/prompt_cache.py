"""Prompt cache: saved KV states of llama contexts, keyed by their tokens and found by longest
common prefix, held in RAM under a byte budget (LRU) and optionally on disk, plus named sessions.

Owns `<localspec_home()>/prompt-cache/`. Switching uses llama.cpp's per-sequence state API
(Context.save_state/restore_state), not cached prefixes kept as extra sequences of one unified KV
cache: those switch in ~0.15 ms against ~16-29 ms for a 1k-token restore, but every later decode
attends over every cached sequence's cells (one-token decodes 1.4x slower on Qwen2.5-1.5B, 2.0x
on SmolLM2, with three 1k-token prefixes cached; docs/prompt-cache.md).

Integration contract (engine, draft model, front ends):
- One PromptCache per process, shared by the target and the draft context: entries are keyed by
  context_key(ctx) (model file identity + the settings that change KV contents), one budget.
- Engine prefill: `reuse = cache.prepare(ctx, prompt)` runs before Context.sync(); it keeps the
  live KV prefix (ctx.tokens) or restores a better saved state (saving the live state first when
  it is a different document) and leaves ctx.n_past == reuse.reused. sync() then decodes
  prompt[reuse.reused:] (never empty); stats.record_reuse(reuse).
- After a request nothing is needed: the live state (prompt + output) is saved when a later
  prompt moves away from it. `cache.store(ctx)` at shutdown (and when idle, if a restart must not
  lose it) puts the live state in RAM and on disk.
- Draft model: DraftProposer.begin() calls `cache.prepare(draft_ctx, history)` before its own
  sync, so the draft prefix comes back with the target's.
- `serve --stdio`: a cache with a disk dir; prompts built stable-first (system text, then the
  document, then the instruction: the instruction last, so every request about a document shares
  the document's rows); the final response reports reuse (source, reused, evaluated).
- `chat --save NAME` / `--resume NAME`: save_named() with the conversation as meta; load_named()
  restores the KV when the model and settings match, else returns the turns to re-read.
- `summarize`: one instruction prefix first, then the document chunk, so chunks share the
  instruction's rows; the reduce prompt starts with the same prefix.
"""

from __future__ import annotations

import re
import sys
import time
from collections import OrderedDict
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional, Sequence

import numpy as np

from ..errors import LocalspecError
from ..files.atomic import set_aside
from ..files.private import private_dir
from ..llama import Context, Model, cold_prefix
from .disk import DiskFolder, touch
from .format import (SUFFIX, Entry, Rejected, clean_of, common_prefix, context_key, read_file,
                     read_header, write_file)

_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,63}")


def check_session_name(name: str) -> str:
    """`name` when it can name a saved chat, else a LocalspecError saying what names are; the CLI
    calls it before a chat starts. fullmatch, not ^...$: '$' also matches before a final newline.

    Example: 'work-2' -> 'work-2'; '../x', 'a/b', '', 'x\n' and 65 characters are refused."""
    if not isinstance(name, str) or not _NAME.fullmatch(name):
        raise LocalspecError(f"session names are 1-64 letters, digits, '.', '_' and '-', "
                             f"starting with a letter or digit, not {name!r}.")
    return name


@dataclass
class Reuse:
    """Where a prefill's prompt rows came from. source: "" (nothing reused), "context" (still in
    the live KV), "ram" or "disk" (a restored entry)."""

    source: str = ""
    reused: int = 0
    evaluated: int = 0
    restore_ms: float = 0.0


@dataclass
class Session:
    """A named save: its tokens, its metadata (e.g. chat turns), and how its KV came back."""

    tokens: list
    meta: dict
    reuse: Reuse = field(default_factory=Reuse)


def default_budget_mb(model: Model, n_ctx: int) -> int:
    """Room for two full contexts of KV state, at least 32 MB: e.g. 224 MB for Qwen2.5-1.5B at
    4096 tokens (28 KiB a token), eight 1k-token documents."""
    return max(32, -(-2 * n_ctx * (model.kv_bytes_per_token() + 12) // 2**20))


# ---------------------------------------------------------------------------------------------
# The cache


class PromptCache:
    """Saved KV states of contexts under a RAM budget (LRU), optionally mirrored on disk.

    budget_mb: RAM for saved states, never exceeded (a state's size is known before it is
    copied). disk_dir: None keeps RAM only; else states are written through to
    `<disk_dir>/<context key>/` and found there too, saves of other processes included; disk_mb
    bounds that folder (named sessions excepted), least recently used files go first.
    min_tokens: shorter states are not kept. min_gain: a saved state is restored only when it
    reuses this many more prompt tokens than the live KV already holds.
    One entry per document: a new state replaces an older one that it holds all but at most a
    quarter of (see _covers); the live state is saved before a prompt would drop more of it.
    The older one's file goes too when this process wrote it and no other has rewritten it
    (DiskFolder.remove_own); else the disk budget's LRU trims it.
    """

    def __init__(self, budget_mb: float, disk_dir: Optional[Path] = None, disk_mb: float = 2048,
                 min_tokens: int = 32, min_gain: int = 32):
        self.budget = int(budget_mb * 2**20)
        self.disk_dir = Path(disk_dir) if disk_dir is not None else None
        self.disk_budget = int(disk_mb * 2**20)
        self.min_tokens, self.min_gain = min_tokens, min_gain
        self._entries: OrderedDict = OrderedDict()   # id -> Entry, least recently used first
        self._next_id = 0
        self.used = 0                                # bytes of states held in RAM
        self.disk = DiskFolder(self.disk_dir, self.disk_budget) if disk_dir is not None else None

    def __len__(self) -> int:
        return len(self._entries)

    def entries(self) -> list:
        """RAM entries, least recently used first."""
        return list(self._entries.values())

    # -- prefill --------------------------------------------------------------------------
    def prepare(self, ctx: Context, prompt: Sequence[int], grid: int = 0) -> Reuse:
        """Leave in ctx the longest prefix of `prompt` that the live KV (ctx.tokens) or a saved
        state holds, at most len(prompt) - 1 tokens (the last one is decoded for its logits);
        ctx.n_past == reuse.reused after. The caller decodes prompt[reuse.reused:], with
        ctx.sync(prompt, grid=grid): grid > 0 keeps whole on-grid chunks only (cold_prefix),
        so the prefill's logits equal a cold one's.

        Example: live KV [sys, docA, q1, out1], prompt [sys, docB, q2] with docB saved earlier:
        the live state is saved (it is another document), docB's state restored and cut after
        docB; reuse == Reuse("ram", len(sys + docB), len(q2)).
        """
        limit = len(prompt) - 1
        shared = common_prefix(ctx.tokens, prompt)
        live = cold_prefix(min(shared, limit), ctx.clean, grid)
        entry, common, source = self._best(context_key(ctx), prompt[:limit], ctx.n_ctx, grid)
        if not self._covers(shared, ctx.n_past):
            self.store(ctx)               # the live state is another document: keep it first
        if entry is not None and common >= live + self.min_gain:
            reuse = self._restore(ctx, entry, common, source)
            if reuse is not None:
                reuse.evaluated = len(prompt) - reuse.reused
                return reuse
            live = 0                      # the failed restore left ctx empty
        if not ctx.truncate(live):
            ctx.clear()
            live = 0
        return Reuse("context" if live else "", live, len(prompt) - live)

    def store(self, ctx: Context) -> bool:
        """Keep ctx's state (the rows of ctx.tokens) in RAM, and on disk when the cache has a
        folder. False when it is too short, already held by a longer entry, or larger than the
        whole budget."""
        n, tokens = ctx.n_past, ctx.tokens
        if n < self.min_tokens:
            return False
        key, toks, clean = context_key(ctx), np.asarray(tokens, dtype=np.int32), ctx.clean
        for eid, e in self._entries.items():
            if e.key == key and len(e.tokens) >= n and common_prefix(e.tokens, toks) == n \
                    and e.usable(toks, clean[1]) >= clean[0]:
                self._entries.move_to_end(eid)
                return False
        size = ctx.state_size()
        if size > self.budget:
            return False
        for eid in [eid for eid, e in self._entries.items()
                    if e.key == key and self._covers(common_prefix(e.tokens, toks), len(e.tokens))]:
            old = self._entries[eid]                  # superseded: same document, older
            self._drop(eid)
            if old.path is not None:                  # (another process's file stays)
                self.disk.remove_own(old.path)
        entry = Entry(key, toks, None, None, size, clean)
        self._admit(entry)
        entry.data = ctx.save_state(np.empty(size, dtype=np.uint8))
        if self.disk is not None:
            entry.path = self.disk.write(entry, ctx.model.path.name)
        return True

    def _covers(self, shared: int, n_old: int) -> bool:
        """Whether a state sharing `shared` leading tokens with an older one of `n_old` tokens
        makes the older one not worth keeping: it would lose at most a quarter of its rows
        (min_gain at least), e.g. the previous question and answer about the same document,
        not another document after a long common system prompt."""
        return n_old - shared <= max(self.min_gain, n_old // 4)

    # -- named sessions -------------------------------------------------------------------
    def save_named(self, name: str, ctx: Context, meta: dict) -> Path:
        """Save ctx's state (the rows of ctx.tokens) under `name` with `meta` (JSON-able, e.g.
        the chat turns)."""
        path = self._session_path(name)
        tokens = ctx.tokens
        data = ctx.save_state()
        try:
            private_dir(self.disk_dir)
            private_dir(path.parent)
            with self.disk.lock():
                write_file(path, context_key(ctx), tokens, data, ctx.model.path.name, meta,
                           ctx.clean)
        except OSError as e:      # a full disk, a folder in the way: the old save, if any, holds
            raise LocalspecError(f"could not save {name!r} in {path.parent}: "
                                 f"{e.strerror or e}.") from None
        return path

    def load_named(self, name: str, ctx: Context) -> Session:
        """The session saved as `name`. Its KV is restored into ctx when it was saved from the
        same model and settings and its checksum holds; otherwise one line on stderr and
        reuse.reused == 0: the caller re-reads the conversation from meta."""
        path = self._session_path(name)
        try:
            with open(path, "rb") as f:
                header, tokens = read_header(f)
        except FileNotFoundError:
            saved = ", ".join(self.list_named()) or "none"
            raise LocalspecError(f"no saved session named {name!r} (saved: {saved}).") from None
        except Rejected as e:
            aside = set_aside(path, e.inode, self.disk_dir / ".lock")
            moved = f"; it was moved to {aside.name}" if aside is not None else ""
            raise LocalspecError(f"the saved session {name!r} is unreadable: {e}{moved}; "
                                 "start a new chat or resume another.") from None
        session = Session([int(t) for t in tokens], header.get("meta", {}))
        start = time.perf_counter()
        try:
            _, _, data = read_file(path, context_key(ctx))
            ctx.restore_state(data, tokens, clean_of(header))
        except (Rejected, LocalspecError) as e:
            ctx.clear()
            print(f"localspec: session {name!r}: not reusing its saved KV ({e}); "
                  "re-reading the conversation.", file=sys.stderr)
            return session
        session.reuse = Reuse("disk", len(tokens), 0, 1000 * (time.perf_counter() - start))
        return session

    def list_named(self) -> list:
        """Names of the saved sessions, sorted."""
        if self.disk_dir is None:
            return []
        files = (self.disk_dir / "sessions").glob("*" + SUFFIX)
        return sorted(p.name[:-len(SUFFIX)] for p in files)

    def _session_path(self, name: str) -> Path:
        if self.disk_dir is None:
            raise LocalspecError("named sessions need a cache folder; this cache is RAM only.")
        return self.disk_dir / "sessions" / (check_session_name(name) + SUFFIX)

    # -- internals ------------------------------------------------------------------------
    def _best(self, key: str, prompt: Sequence[int], n_ctx: int, grid: int) -> tuple:
        """(entry, rows of it usable for `prompt` on `grid`, "ram" | "disk") of the entry that
        gives most, the smaller one on a tie (cheaper to restore); (None, 0, "") when none. A
        disk entry must give min_gain tokens more than the best RAM one: reading costs more."""
        best, best_n, best_score, source = None, 0, 0, ""
        candidates = [(e, "ram") for e in self._entries.values() if e.key == key]
        if self.disk is not None:
            in_ram = {e.path for e, _ in candidates if e.path is not None}
            candidates += [(e, "disk") for e in self.disk.scan(key) if e.path not in in_ram]
        for e, where in candidates:
            if len(e.tokens) > n_ctx:
                continue
            n = e.usable(prompt, grid)
            score = n - (self.min_gain if where == "disk" else 0)
            if score > best_score or (score == best_score and best is not None
                                      and e.nbytes < best.nbytes):
                best, best_n, best_score, source = e, n, score, where
        return best, best_n, source

    def _restore(self, ctx: Context, entry: Entry, common: int, source: str) -> Optional[Reuse]:
        """Load `entry` into ctx and cut it to `common` rows; None (ctx empty) when it fails."""
        start = time.perf_counter()
        try:
            data = entry.data
            if data is None:                          # (file names hash the tokens)
                _, _, data = read_file(entry.path, entry.key)
                touch(entry.path)
            ctx.restore_state(data, entry.tokens, entry.clean)
        except Rejected as e:
            self.disk.discard(entry.path, e)
            ctx.clear()
            return None
        except FileNotFoundError:                     # another process evicted it: no matter
            self.disk.forget(entry.path)
            ctx.clear()
            return None
        except (OSError, LocalspecError) as e:       # unreadable; refused by llama.cpp
            print(f"localspec: prompt cache: could not restore a saved state ({e}).",
                  file=sys.stderr)
            self._drop_entry(entry)
            ctx.clear()
            return None
        if not ctx.truncate(common):
            ctx.clear()
            return None
        for eid, e in self._entries.items():
            if e is entry:
                self._entries.move_to_end(eid)
                break
        else:
            if entry.nbytes <= self.budget:           # from disk: keep a RAM copy
                self._admit(Entry(entry.key, entry.tokens, data, entry.path, entry.nbytes,
                                  entry.clean))
        return Reuse(source, common, 0, 1000 * (time.perf_counter() - start))

    def _admit(self, entry: Entry) -> None:
        """Add `entry` as the most recent, first evicting least recently used ones to fit."""
        while self._entries and self.used + entry.nbytes > self.budget:
            self._drop(next(iter(self._entries)))
        self._entries[self._next_id] = entry
        self._next_id += 1
        self.used += entry.nbytes

    def _drop(self, eid: int) -> None:
        self.used -= self._entries.pop(eid).nbytes

    def _drop_entry(self, entry: Entry) -> None:
        for eid, e in list(self._entries.items()):
            if e is entry:
                self._drop(eid)

"""Several sequences decoding together in one llama.cpp context: `serve --parallel N`.

Each slot is a SeqContext, a Context (context.py) whose rows live in sequence `seq` of a shared
llama_context; its decodes go through the SharedContext's ticks instead of calling llama_decode
itself. A tick runs when every busy slot has handed in its next decode (or the oldest has waited
MAX_WAIT_S: a slot whose owner stalls does not stall the others), and gives each of them one unit
of work:

- a prompt chunk runs alone, in exactly the llama_decode a lone context would run for it (same
  tokens, positions and batch shape), so its rows are a lone prefill's bit for bit;
- the steps ([last] + drafts) of every decoding slot run together, in batches of at most
  `row_cap` rows, each under a batch-invariant limit raised past its size (every row of such
  a batch equals a one-token decode, docs/exactness.md), so a step's rows are what its lone
  run computes; before they run, drafts that would cost the tick more than they bring are
  cut (batch_shape.trim), and the cut step gets the rows it kept.

The KV cache is not unified: each sequence has its own buffer, filled from cell 0 as a lone
context fills it, so attention sums run over its cells in the same order. llama.cpp then splits
a batch into equal-length parts per sequence; steps of equal length cost one pass
(docs/parallel.md). Every llama.cpp call on the shared context (decode, row removal, states)
holds one lock: llama.cpp's memory is not thread-safe.
"""

from __future__ import annotations

import contextlib
import ctypes
import threading
import time
from typing import Optional, Sequence

import numpy as np

from ..errors import LocalspecError
from . import backend as _b
from . import native
from .batch_shape import Step, default_row_cost, groups, plan, trim
from .context import _IDLE, Context, ContextParams, Handle, cold_prefix
from .exact_rows import exact_for, exact_rows_settable
from .model import Model

MAX_WAIT_S = 0.25     # a tick waits at most this long for a busy slot that has not handed in
                      # its decode (its owner stalled, e.g. a client not reading its stream)
CELL_GRID = 256       # llama.cpp gives each sequence a multiple of this many cells


def slot_size(n_ctx: int, n_seq: int) -> int:
    """Cells per sequence when `n_ctx` is shared by `n_seq` slots: an equal share, rounded down
    to llama.cpp's grid; 0 when a share would be under one grid step."""
    return n_ctx // n_seq // CELL_GRID * CELL_GRID


class _Work:
    """One decode handed in by a slot, and what came back."""

    __slots__ = ("seq", "tokens", "pos", "want", "prompt", "since", "rc", "rows", "done", "error",
                 "pad", "survival")

    def __init__(self, seq: int, tokens, pos: int, want: np.ndarray, prompt: bool,
                 survival: Sequence[float] = ()):
        self.seq, self.tokens, self.pos = seq, list(tokens), pos
        self.want, self.prompt, self.survival = want, prompt, tuple(survival)
        self.since = time.monotonic()
        self.rc, self.rows, self.done, self.error = 0, None, False, None
        self.pad = 0                     # rows at the end only there to shape the batch


class SharedContext(Handle):
    """One llama_context with `n_seq` sequences of `n_ctx_seq` cells each, the slots over it
    (`slots[i]`, SeqContexts), and the ticks that decode for them."""

    def __init__(self, model: Model, params: ContextParams, n_seq: int, row_cap: int):
        if n_seq < 2:
            raise ValueError("a shared context needs at least 2 sequences")
        if row_cap >= 32 and _b.batch_invariant_rows() and not exact_rows_settable():
            raise LocalspecError(f"steps of {row_cap} rows together need a ggml-cpu that raises "
                                 "its batch-invariant limit at run time (rerun "
                                 "./install.sh).")   # (llama.cpp's own promise no exact rows)
        per_seq = slot_size(params.n_ctx, n_seq)
        if per_seq == 0:
            raise LocalspecError(f"a context of {params.n_ctx} tokens cannot hold {n_seq} "
                                 f"slots of at least {CELL_GRID} tokens; raise --ctx to "
                                 f"{n_seq * CELL_GRID} or more, or lower --parallel.")
        self.n_seq, self.row_cap = n_seq, max(1, row_cap)
        self._open(model, params, per_seq * n_seq, n_seq)
        self.n_ctx_seq = int(_b.C.llama_n_ctx_seq(self._ctx))
        self.lock = threading.Condition(threading.RLock())
        self._phases: dict = {}          # (rows, slots) -> the crash line's phase
        self._pending: dict = {}         # seq -> _Work handed in, not yet run
        self._busy: set = set()          # slots in a generation: a tick waits for them
        self._stalled: set = set()       # busy slots that kept a tick waiting MAX_WAIT_S
        self.ticks = 0                   # llama_decode calls made for slots, for stats
        self.stalls = 0                  # ticks that waited MAX_WAIT_S for a stalled slot
        self.copies = 0                  # prompts that started from another slot's rows
        self.cut = 0                     # drafts a tick cut (_trim), for stats and tests
        # a pass of n rows in one-token decodes; Slots.prepare() sets the calibrated curve
        self.row_cost = default_row_cost
        self.slots = [SeqContext(self, i) for i in range(n_seq)]

    @property
    def busy(self) -> int:
        """Slots in a generation now (for the draft room each may take)."""
        return len(self._busy)

    @contextlib.contextmanager
    def hold(self, seq: int):
        """Mark slot `seq` busy while a generation runs on it: ticks wait for its decodes."""
        with self.lock:
            self._busy.add(seq)
        try:
            yield
        finally:
            with self.lock:
                self._busy.discard(seq)
                self._stalled.discard(seq)
                self.lock.notify_all()         # a tick may have been waiting for this slot

    # -- ticks ---------------------------------------------------------------------------------
    def submit(self, work: _Work) -> None:
        """Hand in one decode and wait until a tick (maybe run by this thread) has done it."""
        with self.lock:
            self._live()
            self._pending[work.seq] = work
            self._stalled.discard(work.seq)
            self.lock.notify_all()
            while not work.done:
                if self._ready():
                    self._tick()
                else:
                    self.lock.wait(MAX_WAIT_S / 5)
            if work.error is not None:
                raise work.error

    def _ready(self) -> bool:
        """Whether a tick runs now: every busy slot has handed in its decode, except slots
        found stalled (not waited for again until they hand one in); or the oldest decode has
        waited MAX_WAIT_S, and the slots it waited for are found stalled."""
        if not self._pending:
            return False
        missing = self._busy - self._pending.keys() - self._stalled
        if not missing:
            return True
        oldest = min(w.since for w in self._pending.values())
        if time.monotonic() - oldest < MAX_WAIT_S:
            return False
        self._stalled |= missing
        self.stalls += 1
        return True

    def _tick(self) -> None:
        """Run every pending decode: prompt chunks one by one, as a lone context would, then the
        steps together in batches of at most row_cap rows, in sequence order, padded to one
        pass over the weights where that is cheaper than llama.cpp's split (batch_shape.py)."""
        works, self._pending = sorted(self._pending.values(), key=lambda w: w.seq), {}
        try:
            steps = [w for w in works if not w.prompt]
            prompted = {w.seq for w in works if w.prompt}
            for w in works:
                if w.prompt:
                    self._run([w])
            if len(steps) > 1 and any(len(w.tokens) > 1 for w in steps):
                self._trim(steps, prompted)
            if steps and sum(len(w.tokens) for w in steps) <= self.row_cap:
                self._run(self._padded(steps, prompted))
                return
            by_seq = {w.seq: w for w in steps}
            for group in groups({w.seq: len(w.tokens) for w in steps}, self.row_cap):
                self._run([by_seq[s] for s in group])
        except BaseException as e:             # a crash of ours, not llama.cpp's return code
            for w in works:
                if not w.done:
                    w.error, w.done = e, True
            raise
        finally:
            self.lock.notify_all()

    def _trim(self, steps: list, prompted: set) -> None:
        """Cut the steps' drafts where the tick's expected tokens per unit of cost rises
        (batch_shape.trim: a slot's drafts were chosen as if alone, and beside other slots'
        single rows they may cost a pass of their own). A step that brought no survival (a
        fixed k) counts its drafts as sure, so it is cut only to shape the others."""
        plan_in = {w.seq: Step(len(w.tokens) - 1, w.survival or (1.0,) * (len(w.tokens) - 1))
                   for w in steps}
        kept = trim(plan_in, self.row_cost, self.row_cap,
                    self._free_cells(self._ends(steps), prompted))
        for w in steps:
            n = kept[w.seq] + 1
            if n < len(w.tokens):
                self.cut += len(w.tokens) - n
                w.tokens, w.want = w.tokens[:n], w.want[:n]

    def _padded(self, steps: list, prompted: set) -> list:
        """`steps`, each padded to the longest, with idle sequences in their span padded too,
        when the cost curve says one pass costs less than llama.cpp's split; else as given.
        A sequence that ran a prompt chunk in this tick is not padded (its rows are not in its
        `tokens` yet)."""
        lengths = {w.seq: len(w.tokens) for w in steps}
        ends = self._ends(steps)
        width = plan(lengths, self._free_cells(ends, prompted), self.row_cost, self.row_cap)
        if width is None:
            return steps
        by_seq = {w.seq: w for w in steps}
        out = []
        for s in range(min(lengths), max(lengths) + 1):
            w = by_seq.get(s)
            if w is None:                        # an idle slot in the gap: rows to drop
                w = _Work(s, [], ends[s], np.zeros(0, dtype=np.int8), False)
            pad = width - len(w.tokens)
            filler = (w.tokens[-1:] or self.slots[s].tokens[-1:] or [0]) * pad
            w.tokens, w.want, w.pad = w.tokens + filler, \
                np.concatenate([w.want, np.zeros(pad, dtype=np.int8)]), pad
            out.append(w)
        return out

    def _ends(self, steps: list) -> dict:
        """Where each sequence's next row goes: a step's own position, else where its KV ends
        (past n_past while its thread has yet to record a decode a tick ran for it)."""
        ends = {s: int(_b.C.llama_memory_seq_pos_max(self._mem, s)) + 1
                for s in range(self.n_seq)}
        ends.update({w.seq: w.pos for w in steps})
        return ends

    def _free_cells(self, ends: dict, prompted: set) -> dict:
        return {s: 0 if s in prompted else self.n_ctx_seq - end for s, end in ends.items()}

    def free_width(self, seq: int, rows: int, pos: int) -> int:
        """The rows a step of `rows` rows for `seq` at `pos` may have at no extra cost: the
        width the steps handed in so far would pad it to, or `rows`."""
        with self.lock:
            steps = [w for w in self._pending.values() if not w.prompt and w.seq != seq]
            if not steps:
                return rows
            lengths = {w.seq: len(w.tokens) for w in steps}
            lengths[seq] = rows
            ends = self._ends(steps)
            ends[seq] = pos
            prompted = {w.seq for w in self._pending.values() if w.prompt}
            width = plan(lengths, self._free_cells(ends, prompted), self.row_cost, self.row_cap)
            return rows if width is None else width

    def _run(self, group: list) -> None:
        """One llama_decode of `group`'s rows; each work gets its return code and a copy of its
        logits rows (the buffer is the next tick's)."""
        n = sum(len(w.tokens) for w in group)
        if n > self.n_batch:
            raise ValueError(f"a tick of {n} rows is over the batch of {self.n_batch}")
        b, i = self._batch, 0
        for w in group:
            m = len(w.tokens)
            self._tok[i:i + m] = w.tokens
            self._pos[i:i + m] = np.arange(w.pos, w.pos + m)
            self._out[i:i + m] = w.want
            for j in range(i, i + m):
                b.seq_id[j][0] = w.seq
            i += m
        b.n_tokens = n
        phase = self._phases.get((n, len(group)))      # the crash line, made once per shape
        if phase is None:
            phase = self._phases[n, len(group)] = native.encode_phase(
                f"in llama.cpp while decoding a batch of {n} tokens for {len(group)} slot(s) "
                f"with {self.model.path.name} on {self.model.device} {self.model.crash_hint}")
        steps = not any(w.prompt for w in group)        # a prompt chunk keeps prefill's kernels
        with exact_for(n) if steps else contextlib.nullcontext():        # row_cap > 31
            native.set_phase(phase)
            rc = _b.C.llama_decode(self._live(), b)
            native.set_phase(_IDLE)
        _b.drain_log()
        _b._state["decoded"] = True
        self.ticks += 1
        for w in group:
            if w.pad:                            # padding rows: their KV goes at once
                _b.C.llama_memory_seq_rm(self._mem, w.seq, w.pos + len(w.tokens) - w.pad, -1)
        i = 0
        for w in group:
            w.rc = rc
            rows = int(w.want.sum())
            if rc == 0 and rows:
                first = i + int(np.argmax(w.want))
                ptr = _b.C.llama_get_logits_ith(self._ctx, first)
                w.rows = np.array(np.ctypeslib.as_array(ptr, shape=(rows, self.model.n_vocab)))
            w.done = True
            i += len(w.tokens)

    def close(self) -> None:
        """Free the context (idempotent); its slots raise from then on."""
        with self.lock:
            for slot in self.slots:
                slot._ctx = slot._mem = None
            super().close()


class SeqContext(Context):
    """Sequence `seq` of a SharedContext, with a lone Context's interface and invariants: the
    engine, the step, the prompt cache and calibration run on it unchanged. Its decodes go
    through the shared ticks; every other llama.cpp call holds the shared lock."""

    def device_argmax(self, on: bool) -> bool:
        """Never on a slot: a shared tick decodes every sequence's rows together."""
        return False

    def __init__(self, shared: SharedContext, seq: int):        # noqa: no Context.__init__:
        self.shared, self.seq = shared, seq                     # the llama_context is shared
        self.model, self.params = shared.model, shared.params
        self._ctx, self._mem = shared._ctx, shared._mem
        self._phases: dict = {}
        self.n_ctx, self.n_batch = shared.n_ctx_seq, shared.n_batch
        self.n_threads, self.n_stream = shared.n_threads, shared.n_seq   # a KV buffer per slot
        self.tokens: list = []
        self._clean = (0, 0)
        self._prompt = False             # the decode in progress is a prompt chunk
        self._survival: tuple = ()       # the verify step in progress: its drafts' worth

    def hold(self):
        """A generation runs on this slot (the engine wraps each one in it)."""
        return self.shared.hold(self.seq)

    timed = False         # a tick's time is every slot's: the policy reads the curve instead

    def draft_room(self) -> int:
        """The drafts a step may take: the rows of a tick the other busy slots' own rows leave,
        less the step's own (the tick then cuts what does not pay beside the others' steps)."""
        return max(0, self.shared.row_cap - max(1, self.shared.busy))

    def stepping(self) -> int:
        return max(1, self.shared.busy)

    def verify_rows(self, tokens: Sequence[int], survival: Sequence[float] = ()) -> np.ndarray:
        """The tick may keep only the first rows of a step (its drafts were cut): the rows
        dropped were never decoded, so they leave the token list too."""
        self._survival = survival
        try:
            rows = self.decode(tokens, logits="all")
        finally:
            self._survival = ()
        if len(rows) < len(tokens):
            del self.tokens[len(rows) - len(tokens):]
        return rows

    def free_drafts(self, k: int, room: int) -> int:
        """k, or more when the slots that handed in their steps already make the coming tick
        wider than k + 1 rows and this step would be padded to that width anyway."""
        room = min(room, self.draft_room())
        return max(k, min(room, self.shared.free_width(self.seq, k + 1, self.n_past) - 1))

    def sync(self, tokens: Sequence[int], stop=None, grid: int = 0) -> tuple:
        self._prompt = True
        try:
            if grid > 0:
                self._adopt_prefix(tokens, grid)
            return super().sync(tokens, stop, grid)
        finally:
            self._prompt = False

    def _adopt_prefix(self, tokens: Sequence[int], grid: int) -> None:
        """Start from a copy of another slot's rows when it holds at least one more whole
        prompt chunk of `tokens` than this slot does (a shared system prompt or document), as
        a saved state (into cells 0.., as a cold prefill's), rows past the common chunks
        dropped: the prefill that follows equals a cold one. Not llama_memory_seq_cp, which
        llama.cpp runs at the next decode, from what the other slot holds by then."""
        def usable(ctx: Context) -> int:
            return cold_prefix(min(ctx.held_prefix(tokens), len(tokens) - 1),
                               ctx.clean, grid)
        with self.shared.lock:
            best, have = None, usable(self)
            for other in self.shared.slots:
                if other is not self and usable(other) >= max(have, 0) + grid:
                    best, have = other, usable(other)
            if best is None:
                return
            state = Context.save_state(best)       # rows its thread has yet to record too
            Context.clear(self)
            if not _b.C.llama_state_seq_set_data(self._ctx, state.ctypes.data_as(
                    ctypes.POINTER(ctypes.c_uint8)), state.size, self.seq) or \
                    not _b.C.llama_memory_seq_rm(self._mem, self.seq, have, -1):
                _b.drain_log()
                Context.clear(self)
                return
            self.tokens, self._clean = list(best.tokens[:have]), (have, grid)
            self.shared.copies += 1

    def _decode_chunk(self, ctx, tokens: Sequence[int], want: np.ndarray) -> int:
        prompt = self._prompt or len(tokens) > self.shared.row_cap     # runs alone
        work = _Work(self.seq, tokens, self.n_past, want, prompt, self._survival)
        self.shared.submit(work)
        self._rows = work.rows
        return work.rc

    def _logits(self, ctx, n_rows: int) -> np.ndarray:
        rows, self._rows = self._rows, None
        return rows

    def _locked(name):                                          # noqa: N805 (a decorator)
        method = getattr(Context, name)

        def call(self, *args, **kwargs):
            with self.shared.lock:
                return method(self, *args, **kwargs)
        call.__name__, call.__doc__ = name, method.__doc__
        return call

    truncate = _locked("truncate")
    clear = _locked("clear")
    _drop_failed_chunk = _locked("_drop_failed_chunk")
    rows_held = _locked("rows_held")
    reconcile = _locked("reconcile")
    state_size = _locked("state_size")
    save_state = _locked("save_state")
    restore_state = _locked("restore_state")
    del _locked

    def _forget_all(self) -> None:
        _b.C.llama_memory_seq_rm(self._mem, self.seq, -1, -1)

    def _live(self):
        self.shared._live()
        return self._ctx

    def close(self) -> None:
        """Give the slot back: its rows are dropped, the shared context stays."""
        if self.shared.closed:
            return
        with self.shared.lock:
            self._forget_all()
            self.tokens, self._clean = [], (0, 0)

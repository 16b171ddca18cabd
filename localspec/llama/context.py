"""One sequence of KV cache over a Model: batched decode with logits on chosen rows, the tracked
token list and prefix sync, rollback, and saved states."""

from __future__ import annotations

import contextlib
import ctypes
from dataclasses import dataclass
from typing import Optional, Sequence

import numpy as np

from ..errors import LocalspecError
from . import backend as _b
from . import native, rpc
from .argmax import DeviceArgmax
from .exact_rows import exact_for
from .model import Model

_IDLE = native.encode_phase(native.IDLE)

PREFILL_GRID = 64
"""Prompts are evaluated in chunks of this many tokens starting at position 0 (a fixed grid of
absolute positions). llama.cpp's CPU kernels may round differently for batches of other shapes,
so rows reused from an earlier request are kept only where they were computed in exactly the
chunk a cold prefill of the new prompt would use: then a cached prompt gives the same logits,
bit for bit, as a cold one. docs/prompt-cache.md has the measurement behind 256."""


def common_prefix(a: Sequence[int], b: Sequence[int]) -> int:
    """Length of the longest common prefix. Example: common_prefix([1, 2, 3], [1, 2, 4]) == 2."""
    n = min(len(a), len(b))
    diff = np.flatnonzero(np.asarray(a[:n], np.int64) != np.asarray(b[:n], np.int64))
    return int(diff[0]) if diff.size else n


def cold_prefix(common: int, clean: tuple, grid: int) -> int:
    """How many of `common` reusable rows a grid-`grid` prefill may keep, given `clean` =
    (rows computed in whole on-grid chunks from position 0, the grid they were computed on):
    whole chunks only. grid 0: every common row (no equality promise).

    Example: cold_prefix(700, (512, 256), 256) == 512; cold_prefix(700, (768, 256), 256) == 512.
    """
    if grid <= 0:
        return common
    n_clean, clean_grid = clean
    if clean_grid != grid:
        return 0
    return min(common, n_clean) // grid * grid


@dataclass(frozen=True)
class ContextParams:
    """Context settings. n_threads None = every core this process may use."""

    n_ctx: int = 4096
    n_batch: int = 512
    n_threads: Optional[int] = None
    flash_attn: bool = False


def create_context(model: Model, params: ContextParams, n_ctx: int, n_seq: int = 1) -> tuple:
    """A llama_context over `model` holding `n_ctx` cells (n_seq > 1: that many sequences, each
    in its own KV buffer of n_ctx / n_seq cells, laid out as a lone context's). Returns
    (pointer, the params it was made with); one error line when llama.cpp refuses."""
    cp = _b.C.llama_context_default_params()
    cp.n_ctx = n_ctx
    cp.n_batch = cp.n_ubatch = min(params.n_batch, n_ctx)
    if n_seq > 1:                # each sequence its own KV buffer: its attention sums run
        cp.n_seq_max = n_seq     # over its own cells in a lone context's order
        cp.kv_unified = False
    threads = params.n_threads or _b.default_threads()
    cp.n_threads = cp.n_threads_batch = threads
    cp.flash_attn_type = (_b.C.LLAMA_FLASH_ATTN_TYPE_ENABLED if params.flash_attn
                          else _b.C.LLAMA_FLASH_ATTN_TYPE_DISABLED)
    cp.no_perf = True
    cp.n_outputs_max_per_seq = 0    # a backend sampler (device_argmax) serves every row of a batch
    with native.phase(f"in llama.cpp while creating a context of {n_ctx} tokens "
                      f"for {model.path.name} on {model.device} {model.crash_hint}"):
        ctx = _b.C.llama_init_from_model(model.handle(), cp)
    _b.drain_log()
    rpc.secure()                              # a connection it opened: bounded from now
    if not ctx:
        raise LocalspecError(f"llama.cpp could not create a context of {n_ctx} tokens "
                             "(out of memory?); try a smaller --ctx.")
    return ctx, cp


class Handle:
    """A llama_context over a Model and its batch buffer, with zero-copy numpy views over the
    batch's token, position and logits-flag arrays; freed by close() or by closing the model.
    Context (one sequence) and slots.SharedContext (several) are made on it."""

    _ctx = None

    def _open(self, model: Model, params: ContextParams, n_ctx: int, n_seq: int = 1) -> None:
        self.model, self.params = model, params
        ctx, cp = create_context(model, params, n_ctx=n_ctx, n_seq=n_seq)
        self._ctx = ctx
        model._contexts.append(self)              # the model frees it first when it closes
        self.n_batch: int = cp.n_batch
        self.n_threads = cp.n_threads
        self._mem = _b.C.llama_get_memory(ctx)
        self._batch = b = _b.C.llama_batch_init(self.n_batch, 0, 1)
        self._tok = np.ctypeslib.as_array(b.token, shape=(self.n_batch,))
        self._pos = np.ctypeslib.as_array(b.pos, shape=(self.n_batch,))
        self._out = np.ctypeslib.as_array(b.logits, shape=(self.n_batch,))
        np.ctypeslib.as_array(b.n_seq_id, shape=(self.n_batch,))[:] = 1

    @property
    def closed(self) -> bool:
        return self._ctx is None

    def _live(self):
        """The llama_context pointer; raises once this context (or its model) was closed."""
        if self._ctx is None:
            raise LocalspecError("this llama.cpp context was closed (its engine or model was "
                                 "closed); nothing can run on it any more.")
        return self._ctx

    def close(self) -> None:
        """Free the context (idempotent). Its numpy views die with the batch: nothing may use
        them after this."""
        if self._ctx is None:
            return
        ctx, self._ctx, self._mem = self._ctx, None, None
        if self in self.model._contexts:
            self.model._contexts.remove(self)
        self._tok = self._pos = self._out = None
        with native.phase(f"in llama.cpp while freeing a context of {self.model.path.name} "
                          f"{self.model.crash_hint}"):
            _b.C.llama_batch_free(self._batch)
            _b.C.llama_free(ctx)
        _b.drain_log()


class Context(DeviceArgmax, Handle):
    """One sequence (seq 0) of KV cache over a Model, with the batch buffer reused for every decode.

    Invariant: `tokens` are the ids whose KV rows fill positions 0..n_past-1 of seq 0, in order;
    decode() appends at n_past. Every change of the KV cache goes through this class, so `tokens`
    is always what the cache holds, whatever raised in between.
    Lifetime: close() frees it, and so does closing its model; a closed context raises
    LocalspecError rather than call into freed memory (`closed` says which it is).
    """

    seq = 0               # the llama.cpp sequence this object's rows belong to

    def __init__(self, model: Model, params: ContextParams = ContextParams()):
        self._open(model, params, params.n_ctx)
        self._phases: dict = {}                   # batch size -> the crash line's phase
        self.n_ctx: int = _b.C.llama_n_ctx(self._ctx)
        for i in range(self.n_batch):             # seq ids are fixed to 0 once here
            self._batch.seq_id[i][0] = 0
        self.tokens: list = []
        self._clean = (0, 0)      # rows computed in whole on-grid chunks from 0, and that grid

    def hold(self):
        """Marks a generation running (a slot of a shared context, slots.py); nothing here."""
        return contextlib.nullcontext()

    timed = True          # a decode's time is this context's own (a slot's ticks are shared)

    def free_drafts(self, k: int, room: int) -> int:
        """How many drafts a step that chose k may carry at no extra cost: k here (a slot of a
        shared context may say more, when the tick's batch is that wide anyway)."""
        return k

    def draft_room(self) -> int:
        """The most drafts a step may verify here now, whatever the policy wants: a lone
        context has no other sequence to share its batch with, but a verify batch (the last
        token and its drafts) must be one decode chunk."""
        return min(self.n_ctx, self.n_batch - 1)

    def stepping(self) -> int:
        """Sequences whose steps the coming decode carries, this one included: 1 here (a slot
        of a shared context counts the busy slots, whose steps share its ticks)."""
        return 1

    def verify_rows(self, tokens: Sequence[int], survival: Sequence[float] = ()) -> np.ndarray:
        """A verify batch, [last] + drafts, logits on every row. `survival` (each draft's
        predicted chance of being accepted) is for a slot's shared tick, which may keep fewer
        rows; a lone context decodes them all."""
        return self.decode(tokens, logits="all")

    @property
    def clean(self) -> tuple:
        """(n, grid): the first n rows were computed in whole chunks of `grid` tokens starting at
        position 0, as a cold prefill on that grid computes them (n a multiple of grid)."""
        return self._clean

    @property
    def n_past(self) -> int:
        """Positions filled in the KV cache."""
        return len(self.tokens)

    def _decode_phase(self, n: int) -> bytes:
        phase = self._phases.get(n)
        if phase is None:
            phase = self._phases[n] = native.encode_phase(
                f"in llama.cpp while decoding a batch of {n} tokens with "
                f"{self.model.path.name} on {self.model.device} {self.model.crash_hint}")
        return phase

    def decode(self, tokens: Sequence[int], logits: str | Sequence[int] = "last",
               read: bool = True) -> np.ndarray:
        """Append `tokens` at n_past and return logits for the chosen rows.

        logits: "last" (one row: prompt prefill), "all", "none", or row indices into `tokens`.
        Returns a float32 view [n_rows, n_vocab] into llama.cpp's buffer, valid until the next
        decode (copy it if you keep it); read=False returns None (verify_tokens reads the
        device's argmax instead). Long inputs are split into n_batch chunks.
        """
        n = len(tokens)
        if n == 0:
            raise ValueError("decode() needs at least one token")
        ctx = self._live()
        if self.n_past + n > self.n_ctx:
            raise LocalspecError(
                f"the text needs {self.n_past + n} tokens but the context holds {self.n_ctx}; "
                "raise --ctx or shorten the input.")
        if isinstance(logits, str):
            rows = {"last": [n - 1], "all": range(n), "none": []}[logits]
        else:
            rows = logits
        want = np.zeros(n, dtype=np.int8)
        want[list(rows)] = 1
        n_rows = int(want.sum())
        if n_rows and want[:((n - 1) // self.n_batch) * self.n_batch].any():
            raise ValueError("logit rows must all fall in the last n_batch-sized chunk")
        for start in range(0, n, self.n_batch):
            chunk = slice(start, min(n, start + self.n_batch))
            m = chunk.stop - chunk.start
            rc = self._decode_chunk(ctx, tokens[chunk], want[chunk])
            if rc != 0:
                self._drop_failed_chunk()
                raise LocalspecError(f"llama.cpp decode failed (code {rc}); the context may be full.")
            self.tokens.extend(int(t) for t in tokens[chunk])
        if not read:
            return None
        if n_rows == 0:
            return np.empty((0, self.model.n_vocab), dtype=np.float32)
        return self._logits(ctx, n_rows)

    def _decode_chunk(self, ctx, tokens: Sequence[int], want: np.ndarray) -> int:
        """One llama_decode of `tokens` at n_past, logits where `want` is 1; its return code.
        A batch with logits on every row is a verify batch: each row must equal a one-token
        decode, so past 31 rows it runs under a raised invariant limit (exact_for); a prefill
        chunk keeps the fast kernels (a cold run's prefill is the same chunk)."""
        m = len(tokens)
        self._tok[:m] = tokens
        self._pos[:m] = np.arange(self.n_past, self.n_past + m)
        self._out[:m] = want
        self._batch.n_tokens = m
        with exact_for(m) if m >= 32 and want.all() else contextlib.nullcontext():
            native.set_phase(self._decode_phase(m))
            rc = _b.C.llama_decode(ctx, self._batch)
            native.set_phase(_IDLE)
        _b.drain_log()
        _b._state["decoded"] = True
        return rc

    def _logits(self, ctx, n_rows: int) -> np.ndarray:
        """The last decode's logits rows, a view into llama.cpp's buffer (none were copied while
        the device's argmax is on: asking is a bug, not stale rows)."""
        if self.argmax_on:
            raise RuntimeError("logits rows asked for while the argmax runs on the device")
        ptr = _b.C.llama_get_logits(ctx)
        return np.ctypeslib.as_array(ptr, shape=(n_rows, self.model.n_vocab))

    def sync(self, tokens: Sequence[int], stop=None, grid: int = 0) -> tuple:
        """Make the KV cache hold exactly `tokens`: keep a prefix it already holds, drop the
        rest, evaluate what is missing. The last token is always evaluated, since its logits
        row is returned. The one place KV prefix reuse is decided.

        grid > 0 (prompts): keep only whole on-grid chunks (cold_prefix) and evaluate the rest
        in chunks of `grid` from a multiple of it, exactly as sync() into an empty cache would:
        the row returned equals a cold prefill's bit for bit. grid 0 (a draft catching up):
        keep the whole common prefix, evaluate the rest in n_batch chunks.
        Returns (logits row [n_vocab] float32 view, number of rows reused); the row is None when
        `stop` (a threading.Event) was set between two chunks.

        Example: KV holds [5, 6, 7, 8]; sync([5, 6, 9]) drops the rows of 7 and 8, decodes 9
        and returns (row of 9, 2). With grid=2 the rows of 5 and 6 are kept only if they were
        decoded together as one chunk from position 0.
        """
        if len(tokens) == 0:
            raise ValueError("sync() needs at least one token")
        keep = cold_prefix(min(self.held_prefix(tokens), len(tokens) - 1), self._clean, grid)
        if not self.truncate(keep):
            self.clear()              # the memory refuses partial removal: start over
        reused = self.n_past
        step = min(grid, self.n_batch) if grid > 0 else self.n_batch
        while len(tokens) - self.n_past > step:   # whole chunks before the last: no logits
            if stop is not None and stop.is_set():
                return None, reused
            self._prefill_chunk(tokens[self.n_past:self.n_past + step], step, "none")
        if stop is not None and stop.is_set():
            return None, reused
        return self._prefill_chunk(tokens[self.n_past:], step, "last")[0], reused

    def held_prefix(self, tokens: Sequence[int]) -> int:
        """How many leading tokens of `tokens` the cache holds rows for."""
        return common_prefix(self.tokens, tokens)

    def _prefill_chunk(self, tokens: Sequence[int], step: int, logits: str) -> np.ndarray:
        """decode() one prompt chunk; a whole on-grid chunk right after the clean rows extends
        them."""
        start = self.n_past
        out = self.decode(tokens, logits=logits)
        n_clean, clean_grid = self._clean
        if len(tokens) == step and start == n_clean and clean_grid in (0, step):
            self._clean = (start + step, step)
        return out

    def truncate(self, n_keep: int) -> bool:
        """Drop KV rows at positions >= n_keep. Returns False when the model's memory refuses a
        partial removal (recurrent/hybrid models); the cache is left unchanged then."""
        if n_keep < 0:
            raise ValueError(f"truncate() needs n_keep >= 0, got {n_keep}")
        if n_keep >= self.n_past:
            return True
        self._live()
        ok = bool(_b.C.llama_memory_seq_rm(self._mem, self.seq, n_keep, -1))
        if ok:
            del self.tokens[n_keep:]
            n_clean, grid = self._clean
            if n_clean > n_keep:
                self._clean = (n_keep // grid * grid, grid)
        return ok

    def clear(self) -> None:
        self._live()
        self._forget_all()
        self.tokens = []
        self._clean = (0, 0)

    def _forget_all(self) -> None:
        """Drop every KV row (of this sequence; a lone context holds no other)."""
        _b.C.llama_memory_clear(self._mem, True)

    def rows_held(self) -> int:
        """KV rows llama.cpp holds for seq 0 (n_past, unless an interrupt broke bookkeeping)."""
        self._live()
        return int(_b.C.llama_memory_seq_pos_max(self._mem, self.seq)) + 1     # 0 when empty

    def reconcile(self) -> None:
        """Make the cache agree with `tokens` after an interruption: a Ctrl-C that lands between
        llama_decode returning and its rows being recorded leaves rows nobody knows about."""
        held = self.rows_held()
        if held > self.n_past:
            self._drop_failed_chunk()
        elif held < self.n_past:
            self.clear()

    def _drop_failed_chunk(self) -> None:
        """A failed llama_decode may leave part of its batch in the cache: keep the chunks that
        succeeded (`tokens` already lists exactly those), or nothing if that is refused."""
        self._live()
        if not bool(_b.C.llama_memory_seq_rm(self._mem, self.seq, self.n_past, -1)):
            self.clear()

    # -- saved states (what the prompt cache keeps) ------------------------------------------
    def state_size(self) -> int:
        """Bytes save_state() writes now: seq 0's KV rows, their positions, a small header."""
        return int(_b.C.llama_state_seq_get_size(self._live(), self.seq))

    def save_state(self, out: Optional[np.ndarray] = None) -> np.ndarray:
        """Copy seq 0's KV state (positions 0..n_past-1) out of llama.cpp.

        out: a reusable uint8 buffer of at least state_size() bytes. Returns the filled bytes,
        [state_size()] uint8. Logits are not saved: after restore_state(), decode at least one
        token before sampling.
        """
        size = self.state_size()
        if out is None:
            out = np.empty(size, dtype=np.uint8)
        elif out.dtype != np.uint8 or out.size < size or not out.flags.c_contiguous:
            raise ValueError(f"save_state needs a contiguous uint8 buffer of {size} bytes")
        dst = out.ctypes.data_as(ctypes.POINTER(ctypes.c_uint8))
        n = _b.C.llama_state_seq_get_data(self._live(), dst, size, self.seq)
        if n != size:
            raise LocalspecError(f"llama.cpp wrote {n} of {size} bytes of KV state.")
        return out[:size]

    def restore_state(self, data, tokens: Sequence[int], clean: tuple = (0, 0)) -> None:
        """Replace seq 0 with a state save_state() took from a context of the same model and
        settings that held `tokens`; they become `self.tokens`, and `clean` (its `clean` then)
        says which of its rows a grid prefill may keep.

        data: bytes or a uint8 array. Raises LocalspecError, leaving the context empty, when
        llama.cpp refuses the state (other layer count, KV types, too few cells) or the state
        does not hold exactly positions 0..n_tokens-1.
        """
        n_tokens = len(tokens)
        if n_tokens > self.n_ctx:
            self.clear()
            raise LocalspecError(f"a saved state of {n_tokens} tokens does not fit a context of "
                                 f"{self.n_ctx}; raise --ctx.")
        src = np.frombuffer(data, dtype=np.uint8) if not isinstance(data, np.ndarray) else data
        ctx = self._live()
        # Seq 0 is all this context holds: start from an empty cache so the rows land in cells
        # 0..n-1 as a fresh evaluation's would (the same cell layout, the same sums).
        self._forget_all()
        _b._log_state["captured"] = []   # llama.cpp says why it refuses; that goes in our message
        try:
            n = _b.C.llama_state_seq_set_data(
                ctx, src.ctypes.data_as(ctypes.POINTER(ctypes.c_uint8)), src.size, self.seq)
        finally:
            _b.drain_log()
            captured = _b._log_state.pop("captured")
        lo = _b.C.llama_memory_seq_pos_min(self._mem, self.seq)
        hi = _b.C.llama_memory_seq_pos_max(self._mem, self.seq)
        if n == 0 or (n_tokens and (lo, hi) != (0, n_tokens - 1)) or (not n_tokens and hi >= 0):
            self.clear()
            why = " ".join(line.split(":", 1)[-1].strip() for line in "".join(captured)
                           .splitlines() if line.strip()) or \
                f"it holds positions {lo}..{hi}, not 0..{n_tokens - 1}"
            raise LocalspecError(f"llama.cpp refused a saved KV state: {why}.")
        self.tokens = [int(t) for t in tokens]
        n_clean, grid = (int(x) for x in clean)
        self._clean = (min(n_clean, n_tokens) // grid * grid, grid) if grid > 0 else (0, 0)

    def __enter__(self) -> "Context":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

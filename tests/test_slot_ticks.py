"""The slots' ticks (llama/slots.py) against races with the slots' own threads, on the tiny
model: a tick that pads a slot it is not running for (an idle one in the gap between two
steps, or a busy one found stalled) puts its rows where that slot's KV really ends, even while
the slot's thread has yet to record a decode a tick just ran for it (soak bug 2,
docs/soak.md)."""

from __future__ import annotations

import numpy as np

from localspec.llama import Context, ContextParams
from localspec.llama.slots import SharedContext, _Work

SLOT_CTX = 512


def _shared(model, n: int = 3) -> SharedContext:
    shared = SharedContext(model, ContextParams(n_ctx=SLOT_CTX * n, n_threads=2), n, 31)
    shared.row_cost = lambda rows: 1.0 + 0.05 * (rows - 1)     # rows nearly free: gaps padded
    return shared


def _tokens(n: int, salt: int) -> list:
    return [3 + (7 * i + 13 * salt) % 250 for i in range(n)]


def test_a_tick_pads_a_slot_where_its_kv_ends_while_its_thread_records_a_decode(tiny_model):
    """Slot 1's prompt chunk has run in a tick, and its thread has not yet added the tokens
    to its list (it waits for the lock or the CPU) when slots 0 and 2 hand in steps of 2 rows:
    the tick pads the gap, slot 1. Before the fix the pad rows went at slot 1's recorded end
    (0), where its KV already held 39 rows: llama_decode -1, "inconsistent sequence
    positions", and every step of the tick failed. Now the tick succeeds, slot 1 keeps its
    rows and only them, and its next decode equals a lone context's."""
    model = tiny_model
    prompts = [_tokens(n, s) for s, n in enumerate((20, 39, 25))]
    shared = _shared(model)
    try:
        for s in (0, 2):
            shared.slots[s].decode(prompts[s], logits="none")
        chunk = _Work(1, prompts[1], 0, np.eye(1, len(prompts[1]), len(prompts[1]) - 1,
                                               dtype=np.int8)[0], True)
        shared.submit(chunk)                       # as SeqContext.decode hands it in ...
        assert chunk.rc == 0 and shared.slots[1].n_past == 0    # ... not yet recorded
        steps = [_Work(s, [7, 8], len(prompts[s]), np.ones(2, dtype=np.int8), False)
                 for s in (0, 2)]
        with shared.lock:
            shared._pending = {w.seq: w for w in steps}
            shared._tick()
        assert [w.rc for w in steps] == [0, 0]
        assert [w.pad for w in steps] == [0, 0] and shared.ticks >= 3
        assert shared.slots[1].rows_held() == 39      # its rows, no pad row left
        shared.slots[1].tokens.extend(prompts[1])     # the thread records its chunk
        row = shared.slots[1].decode([5], logits="last")[0].copy()
    finally:
        shared.close()
    with Context(model, ContextParams(n_ctx=SLOT_CTX, n_threads=2)) as lone:
        lone.decode(prompts[1], logits="none")
        assert np.array_equal(lone.decode([5], logits="last")[0], row)


def test_a_prompt_copied_from_a_slot_whose_thread_has_not_recorded_a_chunk_drops_it(tiny_model):
    """Slot 0 holds one recorded 64-token chunk and a second chunk that a tick has run but its
    thread has not recorded yet, when slot 1 starts a prompt with the same first chunk: the
    copy of slot 0's KV keeps only the common chunk. Before the fix the unrecorded rows came
    along (the token list said 64, the KV held 103), and slot 1's next chunk failed with
    "inconsistent sequence positions". Its logits now equal a cold prefill's."""
    model = tiny_model
    head, tail0, tail1 = _tokens(64, 0), _tokens(39, 1), _tokens(30, 2)
    shared = _shared(model, 2)
    try:
        shared.slots[0].decode(head, logits="none")
        shared.slots[0]._clean = (64, 64)          # as sync's whole on-grid chunk leaves it
        chunk = _Work(0, tail0, 64, np.zeros(len(tail0), dtype=np.int8), True)
        shared.submit(chunk)
        assert chunk.rc == 0 and shared.slots[0].rows_held() == 103
        row, reused = shared.slots[1].sync(head + tail1, grid=64)
        row = row.copy()
        assert reused == 64 and shared.copies == 1
        assert shared.slots[1].rows_held() == shared.slots[1].n_past == 94
    finally:
        shared.close()
    with Context(model, ContextParams(n_ctx=SLOT_CTX, n_threads=2)) as lone:
        assert np.array_equal(lone.sync(head + tail1, grid=64)[0], row)


def test_a_prompt_copied_from_another_slot_keeps_its_rows_whatever_that_slot_does_next(
        tiny_model):
    """Slot 1 starts from slot 0's first chunk and is cancelled before its first decode; then
    slot 0 restores another prompt's saved state (the prompt cache, for its next request), and
    slot 1 runs its prompt again. llama.cpp defers a copy between two sequences' buffers to
    the next llama_decode, so before the fix that decode copied slot 0's restored rows into
    slot 1, and its logits were another prompt's (soak finding 5: a document's text parted
    from its lone run, every one of that run alike). Slot 2 restores a state over a copy the
    same way. Each now equals a cold prefill's."""
    import threading
    model = tiny_model
    head, tail, other = _tokens(64, 0), _tokens(40, 1), _tokens(100, 3)
    shared = _shared(model)
    cancelled = threading.Event()
    cancelled.set()
    try:
        s0, s1, s2 = shared.slots
        s2.sync(other, grid=64)
        saved = s2.save_state().copy()
        s0.sync(head + _tokens(30, 2), grid=64)
        row, _ = s1.sync(head + tail, stop=cancelled, grid=64)   # copied, then cancelled
        assert row is None and shared.copies == 1 and s1.n_past == 64
        s0.restore_state(saved, other, (64, 64))                 # slot 0's next request
        row1 = s1.sync(head + tail, grid=64)[0].copy()
        s2.sync(head + tail, stop=cancelled, grid=64)            # a copy from slot 1 ...
        assert shared.copies == 2
        s2.restore_state(saved, other, (64, 64))                 # ... then a restore over it
        row2 = s2.sync(other + [9], grid=64)[0].copy()
    finally:
        shared.close()
    with Context(model, ContextParams(n_ctx=SLOT_CTX, n_threads=2)) as lone:
        assert np.array_equal(lone.sync(head + tail, grid=64)[0], row1)
        lone.clear()
        assert np.array_equal(lone.sync(other + [9], grid=64)[0], row2)

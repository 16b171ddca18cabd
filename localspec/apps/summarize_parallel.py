"""`localspec summarize --parallel N`: N documents at a time, each on a slot thread with its own
Summarizer over one of N engines (speculative/parallel.py). The outputs keep the input order:
the slot threads only read and summarise; this thread writes, emits and reports, in order.
"""

from __future__ import annotations

import queue
import threading
from pathlib import Path
from typing import Callable, Optional, Sequence

from .summarize import BatchResult, Delivery, DocumentError, Progress, Source, read_source

POLL_S = 0.2          # how often the waiting thread looks up (Ctrl-C lands between two looks)


class _Batch:
    """The documents to summarise, the slot threads' reports, and the ordered delivery."""

    def __init__(self, sources: Sequence[Source], deliver: Delivery, stdin):
        self.sources, self.deliver, self.stdin = sources, deliver, stdin
        self.todo: "queue.Queue[tuple]" = queue.Queue()
        self.events: "queue.Queue[tuple]" = queue.Queue()     # (kind, index, payload)
        self.outcomes: dict = {}         # index -> ("skipped"|"done"|"failed", payload)
        self.next = 1                    # the first index not delivered yet
        self.cancel = threading.Event()
        self.threads: list = []

    def work(self, summarizer) -> None:
        """A slot thread: take documents until none is left or the batch stops."""
        while not self.cancel.is_set():
            try:
                i, src = self.todo.get_nowait()
            except queue.Empty:
                return
            self.events.put(("started", i, None))
            try:
                text = read_source(src, self.stdin)
                summary = summarizer.summarize(
                    text, lambda s, i=i: self.events.put(("call", i, s)))
                self.events.put(("done", i, summary))
            except DocumentError as e:
                self.events.put(("failed", i, str(e)))
            except BaseException as e:      # stopped (KeyboardInterrupt) or a real error
                self.events.put(("error", i, e))
                return

    def flush(self, gaps: bool = False) -> None:
        """Deliver outcomes in input order, up to the first one not finished (past it too with
        `gaps`: an interrupted batch still writes every finished output under -o)."""
        for i in range(self.next, len(self.sources) + 1):
            if i not in self.outcomes:
                if not gaps:
                    return
                continue
            kind, payload = self.outcomes.pop(i)
            src = self.sources[i - 1]
            if kind == "skipped":
                self.deliver.skipped(i, src)
            elif kind == "failed":
                self.deliver.failed(i, src, payload)
            else:
                self.deliver.done(i, src, payload)
            if not gaps:
                self.next = i + 1

    def wait(self) -> None:
        """Report the slots' progress and deliver what is finished until every document is."""
        progress = self.deliver.progress
        while self.next <= len(self.sources):
            self.flush()
            if self.next > len(self.sources):
                return
            try:
                kind, i, payload = self.events.get(timeout=POLL_S)
            except queue.Empty:
                continue
            src = self.sources[i - 1]
            if kind == "started":
                progress.started(i, src)
            elif kind == "call":
                progress.call_done(src, payload)
            elif kind == "error":
                raise payload
            else:
                self.outcomes[i] = (kind, payload)

    def stop(self) -> None:
        """Stop the slots (a generation ends within one step) and keep what they finished."""
        self.cancel.set()
        for thread in self.threads:
            thread.join()
        while not self.events.empty():
            kind, i, payload = self.events.get_nowait()
            if kind in ("done", "failed"):
                self.outcomes[i] = (kind, payload)


def run_parallel(sources: Sequence[Source], open_summarizers: Callable[[threading.Event], list],
                 emit: Callable[[str], None], out_dir: Optional[Path] = None, fmt: str = "text",
                 force: bool = False, progress: Progress = Progress(), stdin=None) -> BatchResult:
    """run_batch (summarize.py) on the summarizers open_summarizers(cancel) returns, one per
    slot, whose generations stop when `cancel` is set. The model is opened only when a
    document needs it. Ctrl-C stops every slot; the finished outputs are still written (-o)."""
    result = BatchResult(len(sources))
    batch = _Batch(sources, Delivery(result, progress, emit, out_dir, fmt, force), stdin)
    try:
        for i, src in enumerate(sources, 1):
            if batch.deliver.exists(src):
                batch.outcomes[i] = ("skipped", None)
            elif src.error:                  # known before reading: no slot needed
                batch.outcomes[i] = ("failed", src.error)
            else:
                batch.todo.put((i, src))
        if not batch.todo.empty():
            for summarizer in open_summarizers(batch.cancel):
                thread = threading.Thread(target=batch.work, args=(summarizer,), daemon=True,
                                          name=f"localspec-slot-{len(batch.threads)}")
                batch.threads.append(thread)
                thread.start()
        batch.wait()
    except KeyboardInterrupt:
        result.interrupted = True
        batch.stop()
        if out_dir is not None:
            batch.flush(gaps=True)
    finally:
        batch.stop()
    return result

"""Turns accepted tokens into streamed text: never a broken UTF-8 sequence, never a partial stop string.

A token can end in the middle of a multi-byte character (byte-fallback vocabularies do this), and
a stop string can straddle tokens, so text is released only once it can no longer change.
"""

from __future__ import annotations

import codecs
from typing import Callable, Sequence


class TextStream:
    """Feed token pieces (bytes); get back text that is safe to show.

    Example: stops ["\\n\\n"]; feed b"Hi" -> "Hi"; feed b"\\n" -> "" (could start a stop);
    feed b"\\n" -> "" and .stopped is True; the stop string itself is never emitted.
    """

    def __init__(self, piece: Callable[[int], bytes], stops: Sequence[str] = ()):
        self._piece = piece
        self._decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")
        self._stops = [s for s in stops if s]
        self._held = ""          # decoded text not yet released (may begin a stop string)
        self.text = ""           # everything released so far
        self.stopped = False

    def feed(self, token: int) -> str:
        if self.stopped:
            return ""
        self._held += self._decoder.decode(self._piece(token))
        return self._release(final=False)

    def finish(self) -> str:
        """Flush at the end of generation. An unfinished UTF-8 sequence (max_tokens or a cancel
        cut a character's tokens) is held back, never shown as U+FFFD: the text ends before it.
        Bytes that can never be UTF-8 became U+FFFD as they came; only an incomplete tail waits.
        """
        self._decoder.reset()
        return self._release(final=True)

    def _release(self, final: bool) -> str:
        cut = len(self._held)
        for stop in self._stops:
            at = self._held.find(stop)
            if at >= 0 and at < cut:
                cut = at
                self.stopped = True
        if self.stopped:
            out, self._held = self._held[:cut], ""
        elif final:
            out, self._held = self._held, ""
        else:
            keep = self._partial_stop_len()
            out, self._held = self._held[: len(self._held) - keep], self._held[len(self._held) - keep:]
        self.text += out
        return out

    def _partial_stop_len(self) -> int:
        """Length of the longest tail of the held text that is a proper prefix of a stop string."""
        best = 0
        for stop in self._stops:
            for n in range(min(len(stop) - 1, len(self._held)), best, -1):
                if self._held.endswith(stop[:n]):
                    best = n
                    break
        return best

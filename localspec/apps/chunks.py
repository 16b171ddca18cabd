"""Cutting a text into consecutive slices that each fit a token budget, at the coarsest boundary
that works (paragraphs, then lines, then sentences, then anywhere): summarize.py's map step."""

from __future__ import annotations

import re
from typing import Callable

# Boundaries from coarse to fine: paragraphs (blank lines), lines, sentences; then a hard split.
_LEVELS = (re.compile(r"\n[ \t]*\n\s*"), re.compile(r"\n"), re.compile(r"(?<=[.!?;:])\s+"))


def split_chunks(text: str, budget: int, count: Callable[[str], int], _level: int = 0) -> list:
    """Split `text` into consecutive slices with count(slice) <= budget, cutting at the coarsest
    boundary that works; "".join(result) == text (separators stay with the piece before them).

    Example with count=len, budget=12: "aaaa bbbb.\\n\\ncc\\n\\nddddddddddddddd" ->
    ["aaaa bbbb.\\n\\n", "cc\\n\\n", "dddddddddddd", "ddd"]: the first two paragraphs do not fit
    together (10 + 4 > 12), and the last one has no boundary, so it is hard-split.
    """
    pieces = []
    for piece in _pieces(text, _LEVELS[_level]):
        if count(piece) <= budget:
            pieces.append(piece)
        elif _level + 1 < len(_LEVELS):
            pieces.extend(split_chunks(piece, budget, count, _level + 1))
        else:
            pieces.extend(_hard_split(piece, budget, count))
    return _pack(pieces, budget, count)


def _pieces(text: str, boundary: re.Pattern) -> list:
    """Cut after each boundary match: "a\\n\\nb" -> ["a\\n\\n", "b"]."""
    out, start = [], 0
    for m in boundary.finditer(text):
        if m.end() > start and m.start() > start:
            out.append(text[start:m.end()])
            start = m.end()
    if start < len(text):
        out.append(text[start:])
    return out


def _pack(pieces: list, budget: int, count: Callable[[str], int]) -> list:
    """Greedily join consecutive pieces (each within budget) while the joined text fits.
    Counts the joined text itself: token counts of a concatenation are not always additive."""
    chunks, current = [], ""
    for piece in pieces:
        if current and count(current + piece) > budget:
            chunks.append(current)
            current = ""
        current += piece
    if current:
        chunks.append(current)
    return chunks


def _hard_split(text: str, budget: int, count: Callable[[str], int]) -> list:
    """Longest prefixes that fit (binary search on characters); at least one character each.
    The search stops at 32 characters a token, so a huge unbroken line costs no huge counts."""
    out = []
    while text:
        lo, hi = 1, min(len(text), 32 * budget)   # text[:lo] is taken; the fit is <= hi
        while lo < hi:
            mid = (lo + hi + 1) // 2
            if count(text[:mid]) <= budget:
                lo = mid
            else:
                hi = mid - 1
        out.append(text[:lo])
        text = text[lo:]
    return out

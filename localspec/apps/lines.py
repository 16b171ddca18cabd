"""Lines as editors count them: the pieces that '\\n' separates (Vim, Emacs, `wc -l`). The one rule
wherever a line number or a line count crosses a boundary: `edit --region`, the protocol's
`rewrite` region and `complete` prefix_lines/suffix_lines, the plugins. str.splitlines() is not
it: it also breaks at form feed, \\x0b, \\x1c-\\x1e, \\x85, U+2028/U+2029 and a lone \\r, so a file
with a form feed between two functions would have its line numbers shifted against the editor's.
"""

from __future__ import annotations


def split_lines(text: str) -> list:
    """The lines of `text`, each with its '\\n' (the last one without, if the text has none).

    Example: split_lines("a\\n\\x0c\\nb") == ["a\\n", "\\x0c\\n", "b"]; split_lines("") == [].
    """
    parts = text.split("\n")
    lines = [part + "\n" for part in parts[:-1]]
    if parts[-1]:
        lines.append(parts[-1])
    return lines


def head_lines(text: str, n: int) -> tuple:
    """(the first n lines of text, the rest); all of it when n <= 0 or it has no more.

    Example: head_lines("a\\nb\\nc", 2) == ("a\\nb\\n", "c").
    """
    if n <= 0:
        return text, ""
    cut = -1
    for _ in range(n):
        cut = text.find("\n", cut + 1)
        if cut < 0:
            return text, ""
    return text[:cut + 1], text[cut + 1:]


def tail_lines(text: str, n: int) -> tuple:
    """(the last n lines of text, what comes before them); all of it when n <= 0. The text's
    end counts as the end of a line whether or not it is a '\\n'.

    Example: tail_lines("a\\nb\\nc", 2) == ("b\\nc", "a\\n"); tail_lines("a\\nb\\n", 1) == ("", "a\\nb\\n")
    counts the empty line after the last '\\n' (the cursor's line when text is a prefix).
    """
    if n <= 0:
        return text, ""
    cut = len(text)
    for _ in range(n):
        cut = text.rfind("\n", 0, cut)
        if cut < 0:
            return text, ""
    return text[cut + 1:], text[:cut + 1]

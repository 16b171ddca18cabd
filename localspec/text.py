"""Text that enters localspec from outside (argv, stdin, files, chat lines, protocol strings):
one policy for bytes that are not UTF-8, applied everywhere: refuse them with an error that names
the first bad byte and its offset, so nothing is silently changed.

Why refuse rather than replace: the model would see U+FFFD where the user's text had a character,
and a summary or an edit of that text would quietly differ from it. The fix is one `iconv` away.
"""

from __future__ import annotations

from .errors import LocalspecError

FIX = "convert it to UTF-8 first (e.g. `iconv -f latin1 -t utf-8`)"


def decode_utf8(data: bytes, what: str) -> str:
    """`data` as text, or LocalspecError naming the first invalid byte and its offset.

    Example: decode_utf8(b"caf\\xe9", "stdin") raises "stdin is not valid UTF-8: byte 0xe9 at
    offset 3; convert it ...".
    """
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as e:
        raise LocalspecError(f"{what} is not valid UTF-8: byte 0x{data[e.start]:02x} at offset "
                             f"{e.start}; {FIX}.") from None


def check_utf8(text: str, what: str) -> str:
    """A str that came from bytes with Python's surrogateescape (argv, environment), checked:
    undecodable bytes show up as lone surrogates. Returns `text` when it is clean.

    Example: argv b"caf\\xe9" arrives as "caf\\udce9" -> "... byte 0xe9 at offset 3 ...".
    """
    try:
        text.encode("utf-8")
        return text
    except UnicodeEncodeError as e:
        try:
            raw = text.encode("utf-8", "surrogateescape")
        except UnicodeEncodeError:      # a lone surrogate that was never a byte ("\ud800")
            raise LocalspecError(f"{what} is not valid Unicode text: a lone surrogate at "
                                 f"character {e.start}.") from None
        return decode_utf8(raw, what)


def read_text_file(path, what: str) -> str:
    """The whole file as UTF-8 text; unreadable or undecodable files are one-line errors."""
    try:
        with open(path, "rb") as f:
            data = f.read()
    except OSError as e:
        raise LocalspecError(f"cannot read {what} {path}: {e.strerror}.") from None
    return decode_utf8(data, f"{what} {path}")

"""JSON read from files another process may have crafted: nesting depth checked before the
parser recurses (json.loads raises RecursionError past ~1000 levels, which no reader expects),
and only finite numbers (no Infinity, NaN or 1e999, which json.loads turns into inf).

The validators of each format (cache/format.py, speculative/store_file.py, policy/calibrate.py)
check types and ranges on top; this module only guarantees that parsing itself cannot fail in
an unexpected way: every failure is a ValueError.
"""

from __future__ import annotations

import json
import math
import re
from typing import Any, Union

MAX_DEPTH = 32                # deeper than any header localspec writes (a session's: 4)
_MARKS = re.compile(rb'["\\\[\]{}]')    # the only bytes that change string state or depth


def nesting_depth(raw: bytes, stop: int = MAX_DEPTH) -> int:
    """How deep arrays and objects nest in the JSON text `raw` (brackets inside strings do not
    count), counted up to the first level past `stop`. One pass over the quotes, backslashes
    and brackets: linear in the text, however it is crafted.

    >>> nesting_depth(b'{"a": [1, {"b": "[[[\\\\\\"["}]}'), nesting_depth(b'3')
    (3, 0)
    """
    depth = top = 0
    in_string, escaped = False, -1           # escaped: the position a backslash escapes
    for m in _MARKS.finditer(raw):
        i, c = m.start(), raw[m.start()]
        if in_string:
            if i == escaped:
                continue
            if c == 0x5C:                    # backslash: the next byte is escaped
                escaped = i + 1
            elif c == 0x22:
                in_string = False
        elif c == 0x22:
            in_string = True
        elif c in b"[{":
            depth += 1
            if depth > top:
                top = depth
                if top > stop:
                    break
        elif c in b"]}":
            depth -= 1
    return top


def _finite(text: str) -> float:
    value = float(text)
    if not math.isfinite(value):
        raise ValueError(f"number out of range: {text[:20]}")
    return value


def _no_constant(name: str) -> Any:
    raise ValueError(f"{name} is not a number localspec writes")


def loads(raw: Union[bytes, str], max_depth: int = MAX_DEPTH) -> Any:
    """json.loads for files: ValueError (never RecursionError or OverflowError) for text nested
    deeper than `max_depth`, a non-finite number, or anything json.loads refuses.

    >>> loads(b'{"n": 3, "x": 0.5}')
    {'n': 3, 'x': 0.5}
    >>> for bad in (b'{"n": 1e999}', b'[NaN]', b'[' * 100 + b']' * 100):
    ...     try:
    ...         loads(bad)
    ...     except ValueError as e:
    ...         print(e)
    number out of range: 1e999
    NaN is not a number localspec writes
    nested deeper than 32 levels
    """
    data = raw.encode() if isinstance(raw, str) else bytes(raw)
    if nesting_depth(data, max_depth) > max_depth:
        raise ValueError(f"nested deeper than {max_depth} levels")
    return json.loads(data, parse_float=_finite, parse_constant=_no_constant)

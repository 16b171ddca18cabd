"""Benchmark workloads: the JSONL case format, reading each case's source text from the running
Python, and the prompt shape (one user message) every mode is given.
"""

from __future__ import annotations

import importlib
import inspect
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Optional, Sequence

from ..errors import LocalspecError
from ..text import read_text_file

DEFAULT_WORKLOADS = Path(__file__).parent.parent / "data" / "workloads.jsonl"
KINDS = ("code-edit", "summarize", "chat")


@dataclass(frozen=True)
class Case:
    id: str
    kind: str
    instruction: str
    document: Optional[str]           # the source text the prompt quotes (None for chat)
    max_tokens: int
    session: Optional[str] = None     # cases of one session run in file order, each mode
                                      # starting the session with an empty draft store

    def user_message(self) -> str:
        """One user message, shaped as workloads/README.md says.

        Example: kind code-edit, instruction "Add hints.", document "def f(x):\\n    return x\\n"
        -> "Add hints.\\n\\n```python\\ndef f(x):\\n    return x\\n```"
        """
        if self.document is None:
            return self.instruction
        if self.kind == "code-edit":
            body = self.document if self.document.endswith("\n") else self.document + "\n"
            return f"{self.instruction}\n\n```python\n{body}```"
        return f"{self.instruction}\n\n{self.document}"

    def messages(self) -> list:
        return [{"role": "user", "content": self.user_message()}]


def read_source(source: Optional[dict]) -> Optional[str]:
    """The text a case quotes, read from the running interpreter: {"python": "module:qualname"}
    -> inspect.getsource of that object ({"python": "module"}: the whole module);
    {"pydoc_topic": name} -> pydoc_data.topics.topics[name]."""
    if source is None:
        return None
    if "python" in source:
        module_name, _, qualname = source["python"].partition(":")
        try:
            obj = importlib.import_module(module_name)
            for part in filter(None, qualname.split(".")):     # "module" alone: all of it
                obj = getattr(obj, part)
            return inspect.getsource(obj)
        except (ImportError, AttributeError, OSError, TypeError) as e:
            raise LocalspecError(f"cannot read the source of {source['python']} from this Python "
                                 f"({e}); drop that case with --cases.") from None
    if "pydoc_topic" in source:
        from pydoc_data.topics import topics
        try:
            return topics[source["pydoc_topic"]]
        except KeyError:
            raise LocalspecError(f"this Python has no pydoc topic {source['pydoc_topic']!r}; drop "
                                 "that case with --cases.") from None
    raise LocalspecError(f"unknown workload source {source!r}: expected 'python' or 'pydoc_topic'.")


def load_workloads(path: Optional[Path] = None, kinds: Optional[Sequence[str]] = None,
                   ids: Optional[Sequence[str]] = None) -> list:
    """Cases of a workloads JSONL file (default: the copy shipped with localspec), filtered by
    kind and id; in the order of `ids` when given, else in file order."""
    path = Path(path) if path else DEFAULT_WORKLOADS
    lines = read_text_file(path, "workloads file").splitlines()
    cases = []
    for n, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            d = json.loads(line)
            raw = (d["id"], d["kind"], d.get("source"), d["instruction"], int(d["max_tokens"]),
                   d.get("session"))
        except (ValueError, KeyError, TypeError) as e:
            raise LocalspecError(f"{path}:{n}: not a workload case ({e}); see the format in "
                                 "docs/benchmarks.md.") from None
        if (kinds and raw[1] not in kinds) or (ids and raw[0] not in ids):
            continue
        cases.append(Case(raw[0], raw[1], raw[3], read_source(raw[2]), raw[4],
                          str(raw[5]) if raw[5] is not None else None))
    missing = sorted(set(ids or ()) - {c.id for c in cases})
    if missing:
        raise LocalspecError(f"no case called {', '.join(missing)} in {path} (with these kinds).")
    if ids:
        cases.sort(key=lambda c: list(ids).index(c.id))
    if not cases:
        raise LocalspecError(f"no cases selected from {path}.")
    return cases

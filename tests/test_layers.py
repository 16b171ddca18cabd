"""The package's layers: every module imports on its own in a fresh interpreter (no import cycle
hides behind an import order), and no module imports from a layer above its own.

    cli -> apps, bench -> speculative -> policy, cache -> llama, catalog -> errors, files, text
"""

from __future__ import annotations

import ast
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[1] / "localspec"

# (group, layer) of each top-level part of the package: an import may only go to a lower layer,
# or stay inside its own group (two groups on one layer do not import each other).
LAYERS = {
    "cli": ("cli", 5), "__main__": ("cli", 5),
    "apps": ("apps", 4), "bench": ("bench", 4),
    "speculative": ("speculative", 3),
    "policy": ("policy", 2), "cache": ("cache", 2),
    "llama": ("llama", 1), "catalog": ("catalog", 1),
    "errors": ("base", 0), "files": ("base", 0), "text": ("base", 0), "_ngram_c": ("base", 0),
    "__init__": ("base", 0),
}


def modules() -> list[str]:
    names = []
    for path in sorted(PACKAGE.rglob("*.py")):
        parts = list(path.relative_to(PACKAGE.parent).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        names.append(".".join(parts))
    return names


def part_of(module: str) -> str:
    """'localspec.speculative.engine' -> 'spec'; 'localspec' -> '__init__'."""
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else "__init__"


def imports_of(path: Path, module: str, prefix: str = "localspec") -> set[str]:
    """Absolute names of the `prefix` modules (or names) `path` imports, at any depth."""
    package = module if path.name == "__init__.py" else module.rsplit(".", 1)[0]
    found = set()
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.Import):
            found.update(a.name for a in node.names if a.name.split(".")[0] == prefix)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")[:len(package.split(".")) - node.level + 1]
                target = ".".join(base + ([node.module] if node.module else []))
            else:
                target = node.module or ""
            if target.split(".")[0] == prefix:
                found.add(target)
    return found


def test_every_part_has_a_layer():
    unknown = {part_of(m) for m in modules()} - set(LAYERS)
    assert not unknown, f"add {sorted(unknown)} to LAYERS"


def test_no_import_goes_up_or_sideways():
    wrong = []
    for module in modules():
        rel = Path(*module.split(".")[1:])
        path = PACKAGE / rel / "__init__.py" if (PACKAGE / rel).is_dir() else \
            PACKAGE / rel.with_suffix(".py")
        here = LAYERS[part_of(module)]
        for target in imports_of(path, module):
            there = LAYERS[part_of(target)]
            if there[0] != here[0] and there[1] >= here[1]:
                wrong.append(f"{module} ({here[0]}, layer {here[1]}) imports {target} "
                             f"({there[0]}, layer {there[1]})")
    assert not wrong, "\n".join(wrong)


def test_the_checker_sees_an_upward_import(tmp_path):
    """The rule above is not vacuous: a speculative module importing an app is caught."""
    path = tmp_path / "engine.py"
    path.write_text("from ..apps.chat import ChatSession\nfrom .step import step\n")
    assert imports_of(path, "localspec.speculative.engine") == \
        {"localspec.apps.chat", "localspec.speculative.step"}


def _import_alone(module: str) -> tuple[str, str]:
    run = subprocess.run([sys.executable, "-c", f"import {module}"], capture_output=True,
                         text=True, timeout=120)
    return module, run.stderr.strip().splitlines()[-1] if run.returncode else ""


def test_every_module_imports_first_in_a_fresh_interpreter():
    optional = {"localspec.apps.http_server", "localspec.cli.http"}  # the `server` extra
    names = [m for m in modules() if m != "localspec.__main__"]   # runs the CLI when imported
    if any(_missing(m) for m in ("starlette", "uvicorn")):
        names = [m for m in names if m not in optional]
    with ThreadPoolExecutor(max_workers=2) as pool:
        failures = [f"{m}: {err}" for m, err in pool.map(_import_alone, names) if err]
    assert not failures, "\n".join(failures)


def _missing(name: str) -> bool:
    import importlib.util
    return importlib.util.find_spec(name) is None


def test_the_llama_door_has_no_cycle():
    """The issue's example: the context half alone, before the package face."""
    module, err = _import_alone("localspec.llama.context")
    assert not err, err


def test_one_module_imports_llama_cpp():
    holders = [str(p.relative_to(PACKAGE)) for p in PACKAGE.rglob("*.py")
               if imports_of(p, "localspec.x", prefix="llama_cpp")]
    # the bench's peer runs llama-cpp-python's own high-level lookup decoding, by design
    assert set(holders) <= {"llama/backend.py", "bench/peer.py"}, holders


def test_the_readme_layout_table_names_every_folder_and_nothing_gone():
    """README's layout table matches the tree: each package part and top-level folder is named,
    and every path it names exists."""
    import re
    root = PACKAGE.parent
    text = (root / "README.md").read_text(encoding="utf-8")
    table = text[text.index("## Layout"):]
    named = set(re.findall(r"`([\w./-]+)`", table.split("\n\n")[1]))
    tracked = subprocess.run(["git", "ls-files"], cwd=root, capture_output=True, text=True,
                             check=True).stdout.split()
    parts = {f"localspec/{t.split('/')[1]}/" if t.count("/") > 1 else t.split("/")[1]
             for t in tracked if t.startswith("localspec/") and not t.split("/")[1][0] in "_."}
    tops = {t.split("/")[0] + "/" for t in tracked
            if "/" in t and not t.startswith((".", "localspec/"))}
    missing = sorted((parts | tops) - named)
    assert not missing, f"README's layout table does not name {missing}"
    gone = sorted(n for n in named if "/" in n and not (root / n).exists()
                  and not (PACKAGE / n).exists())
    assert not gone, f"README's layout table names paths that are gone: {gone}"

"""The arithmetic of scripts/gpu/gpu_bundle.sh (standard library only, Python >= 3.11).

    python scripts/gpu/gpu_plan.py reqs [--sdist SDIST.tar.gz]      # what the offline install needs
    python scripts/gpu/gpu_plan.py split REPORT.json [--image scripts/gpu/gpu_image_packages.txt]
    python scripts/gpu/gpu_plan.py tree                              # bytes of what travels
    python scripts/gpu/gpu_plan.py halves SIZE FIXED1 FIXED2 [--limit-mib 64] [--margin-mib 2]

reqs: localspec's dependencies, its `server` and `test` extras and its build requirements
(pyproject.toml), plus llama-cpp-python's own dependencies and build requirement (read from the
sdist's pyproject.toml): every requirement the GPU machine's `./install.sh` meets offline, but
llama-cpp-python itself (built there from the sdist).

split: reads a `pip install --dry-run --report` of those requirements and prints, one a line,
`carry FILE` for each resolved wheel the machine's image lacks (or that CARRY_ANYWAY names) and
`image NAME==VERSION FILE` for the rest.

tree: the bytes one call sends besides its carried folders: tracked and untracked-not-ignored
files of the working tree (git ls-files -co --exclude-standard), and shared/ if the checkout has
one.

halves: how to split a file of SIZE bytes over two calls whose other contents (working tree +
the rest of the carried folder) are FIXED1 and FIXED2 bytes: the first part as large as call 1
allows (limit - margin), the rest in call 2; exits 1 when the two do not fit.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import tarfile
import tomllib
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
# In the image, but carried anyway: a build needs scikit-build-core >= 0.9.2, and openai and
# pydantic want recent anyio / typing-extensions / h11 / idna; the image's versions are unknown.
CARRY_ANYWAY = {"scikit-build-core", "anyio", "typing-extensions", "h11", "idna"}
NOT_HERE = {"llama-cpp-python"}          # built on the machine from the carried sdist


def norm(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def req_name(req: str) -> str:
    return norm(re.split(r"[\s\[<>=!~;(]", req.strip(), maxsplit=1)[0])


def requirements(pyproject: Path = REPO / "pyproject.toml", sdist: str | None = None) -> list:
    p = tomllib.loads(pyproject.read_text())
    reqs = list(p["project"]["dependencies"])
    for extra in ("server", "test"):
        reqs += p["project"]["optional-dependencies"][extra]
    reqs += p["build-system"]["requires"]
    if sdist:
        with tarfile.open(sdist) as tar:
            member = next(m for m in tar.getmembers()
                          if m.name.count("/") == 1 and m.name.endswith("/pyproject.toml"))
            lp = tomllib.loads(tar.extractfile(member).read().decode())
        reqs += lp["project"]["dependencies"] + lp["build-system"]["requires"]
    seen, out = set(), []
    for r in reqs:
        r = r.strip()
        if req_name(r) in NOT_HERE or r in seen:
            continue
        seen.add(r)
        out.append(r)
    return out


def image_names(path: Path) -> set:
    return {norm(line.strip()) for line in path.read_text().splitlines()
            if line.strip() and not line.startswith("#")}


def split(report: dict, image: set) -> tuple:
    """(wheel file names to carry, "NAME==VERSION FILE" of what the image provides)."""
    carry, provided = [], []
    for item in report["install"]:
        meta = item["metadata"]
        name = norm(meta["name"])
        fname = item["download_info"]["url"].rsplit("/", 1)[-1]
        if name in image and name not in CARRY_ANYWAY:
            provided.append(f"{name}=={meta['version']} {fname}")
        else:
            carry.append(fname)
    return sorted(carry), sorted(provided)


def tree_bytes(repo: Path = REPO) -> int:
    files = subprocess.run(["git", "ls-files", "-co", "--exclude-standard", "-z"], cwd=repo,
                           capture_output=True, check=True).stdout.split(b"\0")
    total = 0
    for f in files:
        if f:
            try:
                total += os.lstat(repo / os.fsdecode(f)).st_size
            except FileNotFoundError:        # tracked but deleted here: does not travel
                pass
    shared = repo / "shared"
    if shared.is_dir():
        total += sum(p.lstat().st_size for p in shared.rglob("*") if not p.is_dir())
    return total


def halves(size: int, fixed1: int, fixed2: int, limit: int, margin: int) -> tuple:
    """(part1, part2): part1 as large as call 1 can hold."""
    part1 = min(size, limit - margin - fixed1)
    part2 = size - part1
    if part1 <= 0 or fixed2 + part2 > limit - margin:
        raise ValueError(f"a {size}-byte file does not fit two calls (call 1 holds "
                         f"{fixed1} bytes already, call 2 {fixed2}; limit {limit} - {margin})")
    return part1, part2


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    r = sub.add_parser("reqs")
    r.add_argument("--sdist")
    s = sub.add_parser("split")
    s.add_argument("report")
    s.add_argument("--image", default=str(REPO / "scripts" / "gpu" / "gpu_image_packages.txt"))
    sub.add_parser("tree")
    h = sub.add_parser("halves")
    h.add_argument("size", type=int)
    h.add_argument("fixed1", type=int)
    h.add_argument("fixed2", type=int)
    h.add_argument("--limit-mib", type=float, default=64)
    h.add_argument("--margin-mib", type=float, default=2)
    a = ap.parse_args(argv)
    if a.cmd == "reqs":
        print("\n".join(requirements(sdist=a.sdist)))
    elif a.cmd == "split":
        carry, provided = split(json.loads(Path(a.report).read_text()), image_names(Path(a.image)))
        print("\n".join([f"carry {f}" for f in carry] + [f"image {p}" for p in provided]))
    elif a.cmd == "tree":
        print(tree_bytes())
    else:
        try:
            p1, p2 = halves(a.size, a.fixed1, a.fixed2, int(a.limit_mib * 2**20),
                            int(a.margin_mib * 2**20))
        except ValueError as e:
            print(f"error: {e}", file=sys.stderr)
            return 1
        print(p1, p2)
    return 0


if __name__ == "__main__":
    sys.exit(main())

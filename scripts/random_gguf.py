"""Random-weight GGUFs with the exact shapes, tensor types and tokenizer of a real model.

Real weights do not travel to a lent GPU (64 MiB per call); a model's metadata does. Kernel
speed depends on shapes and types, not on values, so a random model of the real shape measures
the real decode time and verify cost curve r(k), and it tokenizes exactly like the real one.

    python scripts/random_gguf.py spec MODEL.gguf -o model.spec.gguf     # metadata only, a few MB
    python scripts/random_gguf.py make model.spec.gguf -o random.gguf [--seed N] [--type q4_k_m]
    python scripts/random_gguf.py check random.gguf MODEL.gguf           # same KVs, tensors, size

A spec is a valid GGUF with every key/value pair of the source (tokenizer and chat template
included) and no tensors; the tensor list (names, ggml types, shapes) rides along in
`localspec.speculative.*` keys. `make` writes random F16/F32 tensors, then llama.cpp's own quantizer
(localspec.llama.quantize) turns them into the source's file type with every tensor pinned to
the source's type, so the result has the real file's byte size.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

import gguf
from gguf import GGMLQuantizationType as QT
from gguf import GGUFValueType as VT

SPEC = "localspec.speculative."
SKIP_KEYS = ("GGUF.", "general.architecture", SPEC)   # header pseudo-keys, writer-owned, ours
UNQUANTIZED = {QT.F32: np.float32, QT.F16: np.float16}
FTYPES = {"f32": 0, "f16": 1, "q4_0": 2, "q4_1": 3, "q8_0": 7, "q5_0": 8, "q5_1": 9, "q2_k": 10,
          "q3_k_s": 11, "q3_k_m": 12,
          "q4_k_s": 14, "q4_k_m": 15, "q5_k_s": 16, "q5_k_m": 17, "q6_k": 18}

# Weight scales, as in tests/tinymodel.py: each block adds about as much to the residual stream as
# the embedding holds, and the logits have std `logit_scale`, so greedy decoding is mostly clear
# of near-ties, like a real model. Measured on the SmolLM2-135M shape (30 layers, 40 greedy tokens
# from two chat prompts): with q/k at 1/sqrt(fan_in) attention is nearly uniform, every position
# converges to the same state and greedy output repeats one token; q/k at 3/sqrt(fan_in) sharpen
# attention: 37-40 distinct tokens in 40, median top-2 gap 1.3-1.6, 2-5 of 40 gaps under 0.25.
QK_STD = 3.0
PROJ_STD = 1.0
LOGIT_SCALE = 8.0


# ---------------------------------------------------------------------------------------------
# Reading


def read_kvs(reader: gguf.GGUFReader) -> list:
    """[(key, value, value type, array item type or None)] of every real key/value pair."""
    out = []
    for key, field in reader.fields.items():
        if key.startswith(SKIP_KEYS):
            continue
        vtype = field.types[0]
        sub = field.types[-1] if vtype == VT.ARRAY else None
        if sub == VT.ARRAY:
            raise SystemExit(f"error: {key} is an array of arrays; not supported")
        out.append((key, field.contents(), vtype, sub))
    return out


def read_source(path: str):
    """(architecture, kvs, tensors [(name, ggml type, ne tuple)], file size) of a real GGUF."""
    reader = gguf.GGUFReader(path)
    arch = reader.fields["general.architecture"].contents()
    tensors = [(t.name, int(t.tensor_type), tuple(int(n) for n in t.shape)) for t in reader.tensors]
    return arch, read_kvs(reader), tensors, os.path.getsize(path)


def read_spec(path: str):
    """(architecture, kvs, tensors, source file size) stored by `spec`."""
    reader = gguf.GGUFReader(path)
    f = reader.fields
    if SPEC + "tensor_names" not in f:
        raise SystemExit(f"error: {path} is not a spec written by `random_gguf.py spec`")
    names = f[SPEC + "tensor_names"].contents()
    types = f[SPEC + "tensor_types"].contents()
    dims = f[SPEC + "tensor_n_dims"].contents()
    flat = f[SPEC + "tensor_ne"].contents()
    tensors = [(n, t, tuple(flat[4 * i: 4 * i + d])) for i, (n, t, d) in
               enumerate(zip(names, types, dims))]
    return (f["general.architecture"].contents(), read_kvs(reader), tensors,
            f[SPEC + "source_bytes"].contents())


# ---------------------------------------------------------------------------------------------
# Writing


def _writer(path: str, arch: str, kvs: list) -> gguf.GGUFWriter:
    w = gguf.GGUFWriter(path, arch)
    for key, value, vtype, sub in kvs:
        if vtype == VT.ARRAY and len(value) == 0:
            continue                         # gguf-py cannot write an empty array
        w.add_key_value(key, value, vtype, sub)
    return w


def first_layers(arch: str, kvs: list, tensors: list, layers: int) -> tuple:
    """kvs and tensors of a model cut to its first `layers` blocks: the same widths, heads,
    vocabulary and weight types (every kernel a full model runs), in fewer decode steps."""
    kvs = [(k, layers if k == f"{arch}.block_count" else v, vt, sub) for k, v, vt, sub in kvs]
    keep = [t for t in tensors
            if not (t[0].startswith("blk.") and int(t[0].split(".")[1]) >= layers)]
    return kvs, keep


def write_spec(source: str, out: str, layers: int | None = None) -> None:
    arch, kvs, tensors, size = read_source(source)
    if layers:
        kvs, tensors = first_layers(arch, kvs, tensors, layers)
    w = _writer(out, arch, kvs)
    w.add_key_value(SPEC + "source_name", Path(source).name, VT.STRING)
    w.add_key_value(SPEC + "source_bytes", size, VT.UINT64)
    w.add_key_value(SPEC + "tensor_names", [t[0] for t in tensors], VT.ARRAY, VT.STRING)
    w.add_key_value(SPEC + "tensor_types", [t[1] for t in tensors], VT.ARRAY, VT.UINT32)
    w.add_key_value(SPEC + "tensor_n_dims", [len(t[2]) for t in tensors], VT.ARRAY, VT.UINT32)
    w.add_key_value(SPEC + "tensor_ne", [n for t in tensors for n in (t[2] + (1,) * 4)[:4]],
                    VT.ARRAY, VT.UINT64)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_ti_data_to_file()
    w.close()


def init_std(name: str, ne: tuple, tied: bool, logit_scale: float):
    """Standard deviation of tensor `name` (ggml shape ne, ne[0] = fan-in), or a constant:
    "ones" for norm weights and other vectors, "zeros" for biases.
    Example: ("blk.0.ffn_down.weight", (8960, 1536)) -> 1/sqrt(8960)."""
    if name.endswith(".bias"):
        return "zeros"
    if len(ne) == 1:
        return "ones"                        # norm weights, rope frequency factors
    fan_in = ne[0]
    if name == "token_embd.weight":
        return logit_scale / np.sqrt(fan_in) if tied else 1.0
    if name == "output.weight":
        return logit_scale / np.sqrt(fan_in)
    if "attn_output" in name or "ffn_down" in name:
        return PROJ_STD / np.sqrt(fan_in)
    if "attn_q" in name or "attn_k" in name:
        return QK_STD / np.sqrt(fan_in)
    return 1.0 / np.sqrt(fan_in)


def _random_tensor(rng, name, ne, dtype, tied, logit_scale) -> np.ndarray:
    shape = tuple(reversed(ne))              # numpy order: ggml's ne reversed
    std = init_std(name, ne, tied, logit_scale)
    if std == "ones":
        return np.ones(shape, dtype)
    if std == "zeros":
        return np.zeros(shape, dtype)
    w = rng.standard_normal(shape, dtype=np.float32)
    w *= np.float32(std)
    return w.astype(dtype, copy=False)


def write_unquantized(spec: tuple, out: str, seed: int, logit_scale: float,
                      file_type: int | None = 1) -> dict:
    """Write random F16 tensors (F32 where the source keeps F32) to `out`, streaming one tensor
    at a time, with general.file_type = `file_type` (1: MOSTLY_F16; None: the source's).
    Returns {tensor name: ggml type in the source} for the quantizer."""
    arch, kvs, tensors, _ = spec
    if file_type is not None:
        kvs = [(k, file_type if k == "general.file_type" else v, t, s) for k, v, t, s in kvs]
    tied = not any(name == "output.weight" for name, _, _ in tensors)
    w = _writer(out, arch, kvs)
    dtypes = {}
    for name, qtype, ne in tensors:
        dtype = UNQUANTIZED.get(qtype, np.float16)
        dtypes[name] = dtype
        w.add_tensor_info(name, tuple(reversed(ne)), np.dtype(dtype),
                          int(np.prod(ne)) * np.dtype(dtype).itemsize)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_ti_data_to_file()
    rng = np.random.default_rng(seed)
    for name, _, ne in tensors:
        w.write_tensor_data(_random_tensor(rng, name, ne, dtypes[name], tied, logit_scale))
    w.close()
    return {name: qtype for name, qtype, _ in tensors}


def make(spec_path: str, out: str, ftype: int | None, seed: int, logit_scale: float,
         threads: int, workdir: str | None, pins: dict | None = None) -> None:
    """Random weights of the spec's shape, quantized to llama_ftype `ftype` (None: the source's
    own, with its exact per-tensor types); `pins` {tensor name: ggml type id} overrides the
    ftype's mixture rules for those tensors."""
    from localspec.llama import quantize

    spec = read_spec(spec_path)
    kv = {k: v for k, v, _, _ in spec[1]}
    if ftype is None:
        ftype = int(kv.get("general.file_type", 1))
    pinned = None
    if ftype == int(kv.get("general.file_type", -1)):
        pinned = spec[2]                     # the source's exact per-tensor types
        if all(qtype in UNQUANTIZED for _, qtype, _ in pinned):
            write_unquantized(spec, out, seed, logit_scale, None)   # nothing to quantize
            return
    with tempfile.TemporaryDirectory(dir=workdir or Path(out).parent) as tmp:
        raw = os.path.join(tmp, "random-f16.gguf")
        t = time.perf_counter()
        types = write_unquantized(spec, raw, seed, logit_scale)
        print(f"random tensors written ({os.path.getsize(raw) / 2**20:.0f} MiB, "
              f"{time.perf_counter() - t:.0f} s); quantizing...", file=sys.stderr)
        t = time.perf_counter()
        exact = {n: types[n] for n, _, _ in pinned} if pinned else {}
        quantize(raw, out, ftype, {**exact, **(pins or {})} or None, threads)
        print(f"quantized in {time.perf_counter() - t:.0f} s", file=sys.stderr)


# ---------------------------------------------------------------------------------------------
# Checking


def compare(a_path: str, b_path: str, ignore=()) -> list:
    """Differences between two GGUFs (key/values, tensor names/types/shapes, file size);
    [] when they match. Either may be a spec."""
    def load(p):
        r = gguf.GGUFReader(p)
        if SPEC + "tensor_names" in r.fields:
            arch, kvs, tensors, size = read_spec(p)
        else:
            arch, kvs, tensors, size = (r.fields["general.architecture"].contents(), read_kvs(r),
                                        [(t.name, int(t.tensor_type),
                                          tuple(int(n) for n in t.shape)) for t in r.tensors],
                                        os.path.getsize(p))
        return arch, {k: v for k, v, _, _ in kvs}, tensors, size

    a, b = load(a_path), load(b_path)
    diffs = [] if a[0] == b[0] else [f"architecture {a[0]} != {b[0]}"]
    for key in sorted(set(a[1]) | set(b[1])):
        if key not in ignore and a[1].get(key) != b[1].get(key):
            diffs.append(f"key {key}: {str(a[1].get(key))[:60]!r} != {str(b[1].get(key))[:60]!r}")
    ta, tb = {t[0]: t[1:] for t in a[2]}, {t[0]: t[1:] for t in b[2]}
    for name in sorted(set(ta) | set(tb)):
        if ta.get(name) != tb.get(name):
            show = [(QT(v[0]).name, v[1]) if v else None for v in (ta.get(name), tb.get(name))]
            diffs.append(f"tensor {name}: {show[0]} != {show[1]}")
    if a[3] != b[3]:
        diffs.append(f"file size {a[3]} != {b[3]}")
    return diffs


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    s = sub.add_parser("spec", help="metadata of a real GGUF -> spec GGUF (no tensor data)")
    s.add_argument("model")
    s.add_argument("-o", "--out", required=True)
    s.add_argument("--layers", type=int, help="keep only the first N blocks (same widths, "
                   "vocabulary and weight types; for slow devices such as lavapipe)")
    m = sub.add_parser("make", help="spec -> random-weight GGUF of the same shapes and types")
    m.add_argument("spec")
    m.add_argument("-o", "--out", required=True)
    m.add_argument("--type", choices=sorted(FTYPES), help="file type (default: the source's)")
    m.add_argument("--seed", type=int, default=0)
    m.add_argument("--logit-scale", type=float, default=LOGIT_SCALE)
    m.add_argument("--threads", type=int, default=0, help="quantizer threads (0: all cores)")
    m.add_argument("--workdir", help="folder for the F16 intermediate (default: next to -o)")
    c = sub.add_parser("check", help="compare two GGUFs (or specs): KVs, tensors, size")
    c.add_argument("a")
    c.add_argument("b")
    a = ap.parse_args()
    if a.cmd == "spec":
        write_spec(a.model, a.out, a.layers)
        print(f"{a.out}: {os.path.getsize(a.out) / 2**20:.2f} MiB", file=sys.stderr)
    elif a.cmd == "make":
        make(a.spec, a.out, FTYPES[a.type] if a.type else None, a.seed, a.logit_scale,
             a.threads, a.workdir)
        print(f"{a.out}: {os.path.getsize(a.out) / 2**20:.1f} MiB", file=sys.stderr)
    else:
        diffs = compare(a.a, a.b)
        for d in diffs:
            print(d)
        print(f"{len(diffs)} differences", file=sys.stderr)
        sys.exit(1 if diffs else 0)


if __name__ == "__main__":
    main()

"""Random-weight models of a real shape with every matrix in one weight type (or the default
model's Q4_K_M mixture), for the kernel checks of tests/test_batch_invariant.py and
tests/test_exact_libs.py (docs/exactness.md).

SmolLM2-135M's shape (30 layers, 576 wide, 9 query and 3 KV heads, 49152-token vocabulary) from
the cached catalog file's metadata (scripts/random_gguf.py spec), random weights quantized to the
type asked for (scripts/random_gguf.py make --type): Q8_0 gives 211 Q8_0 matrices, Q4_0 210 Q4_0
ones (repacked 8x8 on x86) and a Q8_0 embedding/output, F16 211 F16 ones, each multiplied by
the kernels that type gets (docs/exactness.md, "Per weight type"). Q4_K_M is the default model's
mixture on this shape: 16 Q4_K ffn_down matrices (repacked 8x8 on x86, patch 0003's rows),
14 Q6_K ones (the tiled K-quant matmul from 8 rows upstream; patch 0008's tiles), Q5_0 where 576
columns are no multiple of 256 (tinyBLAS, upstream and patched: 0002), Q8_0 in some attn_v and
the embedding. Q5_0, BF16 and F32 (patch 0006) are every matrix in that type; IQ4_NL is 207
IQ4_NL matrices (repacked 8x8 on x86: patch 0004's many-row gemv), 3 Q5_K and a Q8_0
embedding/output. Q6_K gives 30 Q6_K ffn_down matrices (1536 columns, the only ones a multiple
of 256: patch 0008's tiles) and Q8_0 for the rest; Q3_K_S 30 Q3_K ffn_down matrices (0008's
tiles) and repacked Q4_0 for the rest; Q2_K 30 Q2_K ffn_down matrices (pinned: repacked 8x8 on
x86 with AVX-512, patch 0005's many-row gemv) and Q4_0 (repacked) for the rest; MXFP4 210 MXFP4
matrices (pinned: repacked 8x8, patch 0004's many-row gemv) and a Q8_0
embedding/output. Made once per test session in a temporary folder (about 140, 90, 260, 100,
100, 260, 520, 90, 140, 90, 90 and 90 MB; 10-60 s each).
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
TYPES = ("q8_0", "q4_0", "f16", "q4_k_m", "q5_0", "bf16", "f32", "iq4_nl", "q6_k", "q3_k_s", "q2_k",
         "mxfp4")
# llama.cpp file types random_gguf.py has no name for (llama_ftype: LLAMA_FTYPE_MOSTLY_BF16, _IQ4_NL;
# MXFP4 has a file type for MoE experts only, so a Q4_0 file with its matrices pinned, below)
EXTRA_FTYPES = {"bf16": 32, "iq4_nl": 25, "mxfp4": 2}
# Tensors pinned to a ggml type per kernel model, (name, shape) -> pinned: llama.cpp's Q2_K mixture
# gives SmolLM2's only matrices a multiple of 256 wide (ffn_down) Q3_K, so they are pinned to Q2_K
# (type 10), the type that mixture gives most matrices of larger models; MXFP4 (type 39) pins
# every layer matrix.
PINS = {"q2_k": (lambda name, shape: name.endswith("ffn_down.weight"), 10),
        "mxfp4": (lambda name, shape: name.startswith("blk.") and len(shape) == 2, 39)}

_made: dict = {}


def _random_gguf():
    spec = importlib.util.spec_from_file_location("random_gguf", ROOT / "scripts" / "random_gguf.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def random_smollm(source: str, folder: Path, wtype: str, layers: int | None = None) -> Path:
    """A SmolLM2-135M-shaped GGUF with random `wtype` weights (one of TYPES) in `folder`; with
    `layers`, only that many blocks (the same widths, vocabulary and types: the device lane's
    models, since lavapipe decodes SmolLM2 at ~2 tokens/s)."""
    key = (str(folder), wtype, layers)
    if key not in _made:
        rg = _random_gguf()
        folder.mkdir(parents=True, exist_ok=True)
        cut = f"-{layers}l" if layers else ""
        spec = folder / f"smollm2-135m{cut}.spec.gguf"
        if not spec.exists():
            rg.write_spec(source, str(spec), layers)
        out = folder / f"smollm2-135m{cut}-random-{wtype}.gguf"
        if not out.exists():
            pins = None
            if wtype in PINS:
                pinned, ggml_type = PINS[wtype]
                pins = {name: ggml_type for name, _, shape in rg.read_spec(str(spec))[2]
                        if pinned(name, shape)}
            rg.make(str(spec), str(out), {**rg.FTYPES, **EXTRA_FTYPES}[wtype], seed=0, logit_scale=rg.LOGIT_SCALE,
                    threads=2, workdir=None, pins=pins)
        _made[key] = out
    return _made[key]

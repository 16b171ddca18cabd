"""A tiny random llama-architecture GGUF, written with the `gguf` package, for tests.

It owns only the file format: a real model that llama.cpp loads, tokenizes (byte fallback) and runs in
milliseconds. It is not a language model: the weights are random, so the text it makes is noise.
"""

from __future__ import annotations

import pathlib

import numpy as np

import gguf

# ChatML, as shipped by Qwen and SmolLM2; llama.cpp's template detection keys on "<|im_start|>".
CHATML_TEMPLATE = (
    "{% for message in messages %}"
    "{{'<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n'}}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)

UNK_ID, BOS_ID, EOS_ID = 0, 1, 2  # then 256 byte tokens: byte b is token 3 + b

# Extra normal tokens of the "alt" vocabulary: 3 + 256 + 41 = 300 tokens, so n_vocab differs too.
ALT_EXTRA_TOKENS = (
    "\u2581the", "\u2581a", "\u2581of", "\u2581and", "\u2581to", "\u2581in", "\u2581is", "\u2581it",
    "th", "he", "in", "er", "an", "re", "on", "at", "en", "nd", "ti", "es", "or", "te", "of", "ed",
    "is", "it", "al", "ar", "st", "to", "nt", "ng", "se", "ha", "as", "ou", "io", "le", "ve", "ab",
    "the",
)

# Weight scales (standard deviations of the random normal init), chosen by experiment: the blocks
# add as much to the residual stream as the token embedding, so greedy output depends on context and
# wanders (20-29 distinct tokens in 30) instead of falling into a short cycle (PROJ_STD=0.3 gave
# 4-cycles; 1.5-2.0 gave long runs of one token). Logits have std ~1 per unit of logit_scale:
# mean max-prob along greedy paths is ~0.04 at logit_scale=1, 0.36 at 3, 0.59 at 5, 0.74 at 8.
EMBD_STD = 1.0        # token embeddings: residual stream starts at rms ~1
PROJ_STD = 1.0        # v/o and ffn_down, divided by sqrt(fan_in): blocks matter as much as the embedding
OUTPUT_STD = 1.0      # output projection, divided by sqrt(n_embd): logits have std ~1 per unit scale


# fim=True: (llama.cpp's name, token text), appended after the vocabulary in this order.
FIM_TOKENS = (("pre", "<fim_prefix>"), ("suf", "<fim_suffix>"), ("mid", "<fim_middle>"),
              ("pad", "<fim_pad>"), ("rep", "<repo_name>"), ("sep", "<file_sep>"))


def _vocab(vocab: str) -> tuple[list[str], list[float], list[int]]:
    """Token texts, scores and types for the `llama` (SentencePiece) tokenizer model."""
    tokens = ["<unk>", "<s>", "</s>"]
    types = [gguf.TokenType.UNKNOWN, gguf.TokenType.CONTROL, gguf.TokenType.CONTROL]
    tokens += [f"<0x{b:02X}>" for b in range(256)]
    types += [gguf.TokenType.BYTE] * 256
    scores = [0.0] * len(tokens)
    if vocab == "alt":
        tokens += list(ALT_EXTRA_TOKENS)
        types += [gguf.TokenType.NORMAL] * len(ALT_EXTRA_TOKENS)
        # SentencePiece merges the highest-scoring pair first: earlier entries win.
        scores += [-float(i) for i in range(len(ALT_EXTRA_TOKENS))]
    elif vocab != "bytes":
        raise ValueError(f"vocab must be 'bytes' or 'alt', not {vocab!r}")
    return tokens, scores, [int(t) for t in types]


def _weight_specs(n_vocab, n_layer, n_embd, n_ff):
    """(name, numpy shape (out, in), init std or None for an RMSNorm weight of ones), in file order."""
    w_in, w_proj, w_down = 1.0 / np.sqrt(n_embd), PROJ_STD / np.sqrt(n_embd), PROJ_STD / np.sqrt(n_ff)
    specs = [("token_embd.weight", (n_vocab, n_embd), EMBD_STD)]
    for i in range(n_layer):
        specs += [
            (f"blk.{i}.attn_norm.weight", (n_embd,), None),
            (f"blk.{i}.attn_q.weight", (n_embd, n_embd), w_in),
            (f"blk.{i}.attn_k.weight", (n_embd, n_embd), w_in),
            (f"blk.{i}.attn_v.weight", (n_embd, n_embd), w_proj),
            (f"blk.{i}.attn_output.weight", (n_embd, n_embd), w_proj),
            (f"blk.{i}.ffn_norm.weight", (n_embd,), None),
            (f"blk.{i}.ffn_gate.weight", (n_ff, n_embd), w_in),
            (f"blk.{i}.ffn_up.weight", (n_ff, n_embd), w_in),
            (f"blk.{i}.ffn_down.weight", (n_embd, n_ff), w_down),
        ]
    specs += [("output_norm.weight", (n_embd,), None), ("output.weight", (n_vocab, n_embd), OUTPUT_STD / np.sqrt(n_embd))]
    return specs


def make_tiny_gguf(
    path,
    *,
    seed: int = 0,
    vocab: str = "bytes",
    n_layer: int = 2,
    n_embd: int = 64,
    n_head: int = 4,
    n_ff: int = 128,
    n_ctx_train: int = 2048,
    logit_scale: float = 1.0,
    noise: float = 0.0,
    noise_seed: int = 1,
    fim: bool = False,
) -> pathlib.Path:
    """Write a random-weight llama GGUF to `path` and return it as a Path.

    Same arguments give the same bytes, so callers may cache files keyed by the arguments.
    Different seeds give different weights (a draft/target pair that disagrees often); vocab="alt"
    gives an incompatible 300-token vocabulary. `logit_scale` multiplies the output projection:
    1.0 is a flat next-token distribution, 3-8 a peaked one. `noise` > 0 adds noise * std of
    N(0, 1) noise (drawn from `noise_seed`) to every random tensor, making a draft close to the
    seed's model: measured greedy agreement ~0.68 at noise=0.1, 0.41 at 0.2, 0.23 at 0.3, 0.08 at 0.5
    (different seeds: ~0).

    Tokenizer: SentencePiece with byte fallback and no prefix space, so "hi" is [1, 3+ord("h"),
    3+ord("i")]; a space is escaped to U+2581 (three byte tokens) and decodes back as "\u2581".

    fim=True appends six control tokens (FIM_TOKENS) and names them as the GGUF's
    fill-in-the-middle tokens, as a coder model's file does: llama.cpp then reports them.

    Example: make_tiny_gguf(tmp_path / "target.gguf", seed=1, logit_scale=5.0)
    """
    if n_embd % n_head:
        raise ValueError("n_embd must be a multiple of n_head")
    path = pathlib.Path(path)
    tokens, scores, types = _vocab(vocab)
    fim_ids = {}
    if fim:
        for key, text in FIM_TOKENS:
            fim_ids[key] = len(tokens)
            tokens.append(text)
            scores.append(0.0)
            types.append(int(gguf.TokenType.CONTROL))
    n_vocab = len(tokens)
    rng = np.random.default_rng(seed)

    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_name(f"localspec-tiny-s{seed}-{vocab}" + (f"-n{noise}-{noise_seed}" if noise else "")
                    + ("-fim" if fim else ""))
    writer.add_file_type(gguf.LlamaFileType.ALL_F32)
    writer.add_context_length(n_ctx_train)
    writer.add_embedding_length(n_embd)
    writer.add_block_count(n_layer)
    writer.add_feed_forward_length(n_ff)
    writer.add_head_count(n_head)
    writer.add_head_count_kv(n_head)
    writer.add_rope_dimension_count(n_embd // n_head)
    writer.add_rope_freq_base(10000.0)
    writer.add_layer_norm_rms_eps(1e-5)
    writer.add_vocab_size(n_vocab)

    writer.add_tokenizer_model("llama")
    writer.add_token_list(tokens)
    writer.add_token_scores(scores)
    writer.add_token_types(types)
    writer.add_unk_token_id(UNK_ID)
    writer.add_bos_token_id(BOS_ID)
    writer.add_eos_token_id(EOS_ID)
    writer.add_add_bos_token(True)
    writer.add_add_eos_token(False)
    # SentencePiece escapes every space as U+2581; with only byte tokens that stays 3 bytes (E2 96 81)
    # and decodes back as "\u2581", not " ". No prefix space, so text without spaces round-trips.
    writer.add_add_space_prefix(False)
    writer.add_chat_template(CHATML_TEMPLATE)
    for key, tok in fim_ids.items():
        writer.add_uint32(f"tokenizer.ggml.fim_{key}_token_id", tok)

    # numpy shapes are (out, in); gguf reverses them into ggml's ne order.
    noise_rng = np.random.default_rng(noise_seed)
    for name, shape, std in _weight_specs(n_vocab, n_layer, n_embd, n_ff):
        if std is None:
            writer.add_tensor(name, np.ones(shape, np.float32))
            continue
        w = rng.standard_normal(shape) * std
        if noise:
            w += noise_rng.standard_normal(shape) * (noise * std)
        if name == "output.weight":
            w *= logit_scale
        writer.add_tensor(name, w.astype(np.float32))

    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path

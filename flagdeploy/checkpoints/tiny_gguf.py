"""A llama GGUF of random weights at any size, with the tokenizer of another GGUF (the bundled model's).

Tests and benchmarks need GGUF files that no download gives here: tensors in each quantization type, and
models whose rows are whole K-quant super-blocks of 256 values (as a 1-70B model's are; the bundled
SmolLM2-135M's 576-wide rows make llama.cpp fall back to Q5_0 / Q8_0 for most of a Q4_K_M file). The caller
says what each weight holds; the file is written under a temporary name and renamed into place.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Callable

import numpy as np
from gguf import GGMLQuantizationType, GGUFReader, GGUFValueType, GGUFWriter

# A weight's raw content: a float array [rows, cols], or (raw block bytes [rows, bytes], their type)
Weight = "np.ndarray | tuple[np.ndarray, GGMLQuantizationType]"


def write_llama_gguf(path: Path, tokenizer_from: Path, weight: Callable[[str, int, int], Weight], *, hidden: int,
                     layers: int, ffn: int, heads: int, kv_heads: int) -> None:
    """A llama GGUF at `path`: every `tokenizer.*` key of `tokenizer_from`, the given dimensions, norms of ones, and
    each weight as `weight(gguf name, rows, cols)` gives it (the embedding is [vocab, hidden], tied to the head)."""
    src, path = GGUFReader(str(tokenizer_from)), Path(path)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    w = GGUFWriter(str(tmp), "llama")
    for key, field in src.fields.items():
        if key.startswith("tokenizer."):
            sub = field.types[1] if field.types[0] == GGUFValueType.ARRAY else None
            w.add_key_value(key, field.contents(), field.types[0], sub_type=sub)
    vocab, head_dim = len(src.fields["tokenizer.ggml.tokens"].data), hidden // heads
    w.add_block_count(layers), w.add_context_length(4096), w.add_embedding_length(hidden)
    w.add_feed_forward_length(ffn), w.add_head_count(heads), w.add_head_count_kv(kv_heads)
    w.add_layer_norm_rms_eps(1e-5), w.add_rope_freq_base(10000.0), w.add_vocab_size(vocab)

    def add(name: str, rows: int, cols: int) -> None:
        data = weight(name, rows, cols)
        if isinstance(data, tuple):
            w.add_tensor(name, data[0], raw_dtype=data[1])
        else:
            w.add_tensor(name, data)

    add("token_embd.weight", vocab, hidden)
    w.add_tensor("output_norm.weight", np.ones(hidden, np.float32))
    shapes = {"attn_q": (hidden, hidden), "attn_k": (kv_heads * head_dim, hidden), "attn_v": (kv_heads * head_dim, hidden),
              "attn_output": (hidden, hidden), "ffn_gate": (ffn, hidden), "ffn_up": (ffn, hidden), "ffn_down": (hidden, ffn)}
    for layer in range(layers):
        for norm in ("attn_norm", "ffn_norm"):
            w.add_tensor(f"blk.{layer}.{norm}.weight", np.ones(hidden, np.float32))
        for part, (rows, cols) in shapes.items():
            add(f"blk.{layer}.{part}.weight", rows, cols)
    try:
        w.write_header_to_file(), w.write_kv_data_to_file(), w.write_tensors_to_file(), w.close()
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)

"""GGUF files: llama-architecture metadata and weights, dequantised to the run dtype tensor by tensor."""

from __future__ import annotations

import functools
import logging
import re
from pathlib import Path
from typing import Iterator

import numpy as np
import torch
from gguf import GGMLQuantizationType
from gguf.quants import dequantize

from flagdeploy.errors import ModelLoadError
from flagdeploy.models.config import ModelConfig
from flagdeploy.ops.weights import Int4Weight

from .gguf_file import GGUFFile

log = logging.getLogger(__name__)

# GGUF general.architecture → our family. Only architectures whose tensors map onto the family.
GGUF_FAMILIES = {"llama": "llama", "mistral": "llama", "qwen2": "llama"}

_NAME_MAP = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
_BLOCK_MAP = {
    "attn_norm": "input_layernorm", "ffn_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj", "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj", "ffn_down": "mlp.down_proj",
}
_BLOCK_RE = re.compile(r"blk\.(\d+)\.(\w+)\.(weight|bias)$")


def open_gguf(path: Path) -> GGUFFile:
    """The file, its header walked once per process while the file stays the same (a start reads it
    three times: the source check, the config, the weights)."""
    path = Path(path)
    try:
        st = path.stat()
        return _open(path.resolve(), st.st_size, st.st_mtime_ns)
    except Exception as exc:
        raise ModelLoadError(
            f"{path} could not be read as a GGUF file ({exc}). It may be truncated or corrupt: delete it "
            f"and run `flagdeploy pull` again, or pass another --model."
        ) from exc


@functools.lru_cache(maxsize=4)
def _open(path: Path, size: int, mtime_ns: int) -> GGUFFile:
    return GGUFFile(path)


def read_config(reader: GGUFFile) -> ModelConfig:
    arch = reader.get("general.architecture", "")
    if arch not in GGUF_FAMILIES:
        raise ModelLoadError(
            f"This GGUF holds a {arch!r} model; the builtin engine reads GGUF files of the "
            f"{', '.join(sorted(GGUF_FAMILIES))} architectures. Use a supported model, or serve this one "
            f"with llama.cpp through an external engine."
        )
    a = lambda k, d=None: reader.get(f"{arch}.{k}", d)  # noqa: E731
    hidden, heads = a("embedding_length"), a("attention.head_count")
    names = {t.name for t in reader.tensors}
    vocab = a("vocab_size") or reader.array_len("tokenizer.ggml.tokens")
    eos = reader.get("tokenizer.ggml.eos_token_id")
    return ModelConfig(
        architecture=GGUF_FAMILIES[arch],
        vocab_size=vocab,
        hidden_size=hidden,
        intermediate_size=a("feed_forward_length"),
        num_layers=a("block_count"),
        num_heads=heads,
        num_kv_heads=a("attention.head_count_kv", heads),
        head_dim=a("attention.key_length", hidden // heads),
        rms_norm_eps=float(a("attention.layer_norm_rms_epsilon", 1e-6)),
        rope_theta=float(a("rope.freq_base", 10000.0)),
        max_position_embeddings=a("context_length", 4096),
        tie_word_embeddings="output.weight" not in names,
        attention_bias="blk.0.attn_q.bias" in names,
        eos_token_ids=[eos] if eos is not None else [],
        bos_token_id=reader.get("tokenizer.ggml.bos_token_id"),
        source_model_type=arch,
    )


def _unpermute(w: np.ndarray, n_head: int) -> np.ndarray:
    """Undo llama.cpp's q/k row permutation (interleaved rope pairs) back to HF's rotate-half order."""
    return w.reshape(n_head, w.shape[0] // n_head // 2, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def _q4_blocks(data: np.ndarray, qtype: GGMLQuantizationType) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Raw Q4_0 / Q4_1 rows → (q [N, K] 0..15, scales [N, K/32], zeros [N, K/32]) without loss.

    A block is fp16 d (Q4_1: then fp16 m) and 16 bytes of nibbles: element j in the low nibble of
    byte j, element j+16 in the high nibble. Q4_0 means d * (q - 8); Q4_1 means d * q + m.
    """
    n = data.shape[0]
    head = 4 if qtype == GGMLQuantizationType.Q4_1 else 2
    blocks = data.reshape(n, -1, head + 16)
    d = blocks[..., 0:2].copy().view(np.float16)[..., 0].astype(np.float32)
    nib = blocks[..., head:]
    q = np.concatenate((nib & 0x0F, nib >> 4), axis=-1).reshape(n, -1)
    if qtype == GGMLQuantizationType.Q4_1:
        zeros = blocks[..., 2:4].copy().view(np.float16)[..., 0].astype(np.float32) + 8 * d
    else:
        zeros = np.zeros_like(d)
    return q, d, zeros


_Q4 = (GGMLQuantizationType.Q4_0, GGMLQuantizationType.Q4_1)


def iter_tensors(reader: GGUFFile, cfg: ModelConfig, dtype: torch.dtype,
                 keep_int4: bool = False) -> Iterator[tuple[str, "torch.Tensor | Int4Weight"]]:
    """(HF name, tensor) pairs, dequantised one at a time; with keep_int4, 4-bit linears stay 4-bit."""
    for t in reader.tensors:
        if t.name in _NAME_MAP:
            name = _NAME_MAP[t.name]
        else:
            m = _BLOCK_RE.match(t.name)
            if not m or m.group(2) not in _BLOCK_MAP:
                log.debug("skipping GGUF tensor %s", t.name)
                continue
            name = f"model.layers.{m.group(1)}.{_BLOCK_MAP[m.group(2)]}.{m.group(3)}"
        heads = cfg.num_heads if ".q_proj." in name else cfg.num_kv_heads if ".k_proj." in name else 0
        if keep_int4 and t.tensor_type in _Q4 and name.endswith("proj.weight"):
            q, s, z = (_unpermute(a, heads) if heads else a for a in _q4_blocks(np.asarray(t.data), t.tensor_type))
            yield name, Int4Weight(torch.from_numpy(q), torch.from_numpy(s), torch.from_numpy(z), 32, q.shape[0], q.shape[1])
            continue
        if t.tensor_type in (GGMLQuantizationType.F32, GGMLQuantizationType.F16):
            arr = np.asarray(t.data).reshape([int(d) for d in reversed(t.shape)])
        else:
            arr = dequantize(t.data, t.tensor_type)
        if heads:
            arr = _unpermute(arr, heads)
        arr = arr if arr.flags.writeable else arr.copy()
        yield name, torch.from_numpy(np.ascontiguousarray(arr)).to(dtype)

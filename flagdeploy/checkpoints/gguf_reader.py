"""GGUF files: llama-architecture metadata and weights, tensor by tensor: dequantised to the run dtype, or kept in
the quantized bundles the backend's kernels take (4-bit blocks as Int4Weight, wider quantized types as int8)."""

from __future__ import annotations

import functools
import logging
import re
from pathlib import Path
from typing import Iterator

import numpy as np
import torch
from gguf import GGMLQuantizationType
from gguf.quants import Q4_K, dequantize

from flagdeploy.errors import ModelLoadError
from flagdeploy.models.config import ModelConfig
from flagdeploy.ops.weights import Int4Weight, Int8Weight

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


def _f16(raw: np.ndarray) -> np.ndarray:
    """fp16 values from their bytes, the last axis pairs of bytes, as float32."""
    return raw.copy().view(np.float16).astype(np.float32)


def _q4_blocks(data: np.ndarray, qtype: GGMLQuantizationType) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Raw Q4_0 / Q4_1 rows → (q [N, K] 0..15, scales [N, K/32], zeros [N, K/32]) without loss.

    A block is fp16 d (Q4_1: then fp16 m) and 16 bytes of nibbles: element j in the low nibble of
    byte j, element j+16 in the high nibble. Q4_0 means d * (q - 8); Q4_1 means d * q + m.
    """
    n = data.shape[0]
    head = 4 if qtype == GGMLQuantizationType.Q4_1 else 2
    blocks = data.reshape(n, -1, head + 16)
    d = _f16(blocks[..., 0:2])[..., 0]
    nib = blocks[..., head:]
    q = np.concatenate((nib & 0x0F, nib >> 4), axis=-1).reshape(n, -1)
    if qtype == GGMLQuantizationType.Q4_1:
        zeros = _f16(blocks[..., 2:4])[..., 0] + 8 * d
    else:
        zeros = np.zeros_like(d)
    return q, d, zeros


def _q4k_blocks(data: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Raw Q4_K rows → (q [N, K] 0..15, scales [N, K/32], zeros [N, K/32]), Int4Weight's groups of 32.

    A super-block of 256 values is fp16 d and dmin, 12 bytes holding a 6-bit scale sc and min m for each of
    its 8 groups of 32, and 128 bytes of nibbles: 32 bytes per pair of groups, the first group's values in the
    low nibbles, the second's in the high ones. Q4_K means d * sc * q - dmin * m, so scales = d * sc (exact in
    float32) and zeros = 8 * scales - dmin * m (one rounding).
    """
    n = data.shape[0]
    blocks = data.reshape(n, -1, 144)
    d, dmin = (_f16(blocks[..., i:i + 2])[..., 0] for i in (0, 2))
    sc, m = (a.reshape(n, -1, 8).astype(np.float32) for a in Q4_K.get_scale_min(blocks[..., 4:16].reshape(-1, 12)))
    nib = blocks[..., 16:].reshape(n, -1, 4, 1, 32)
    q = np.concatenate((nib & 0x0F, nib >> 4), axis=-2).reshape(n, -1)
    scales = d[..., None] * sc
    zeros = 8 * scales - dmin[..., None] * m
    return q, scales.reshape(n, -1), zeros.reshape(n, -1)


_Q4 = {GGMLQuantizationType.Q4_0: functools.partial(_q4_blocks, qtype=GGMLQuantizationType.Q4_0),
       GGMLQuantizationType.Q4_1: functools.partial(_q4_blocks, qtype=GGMLQuantizationType.Q4_1),
       GGMLQuantizationType.Q4_K: _q4k_blocks}
_FLOAT = (GGMLQuantizationType.F32, GGMLQuantizationType.F16, GGMLQuantizationType.BF16)


# LM heads kept as the file holds them where the backend's int8 kernels hold 6-bit values (`Backend.int8_low_bits`):
# Q6_K (what llama.cpp's K-quant mixes give the output) at its own 6.6 bits a weight, exact, where per-channel int8
# would take 8 and round once more
HEAD_AS_STORED = (GGMLQuantizationType.Q6_K,)


def head_tensor(reader: GGUFFile):
    """The file's LM head: output.weight, or the token embedding it is tied to (None: neither)."""
    by_name = {t.name: t for t in reader.tensors}
    return by_name.get("output.weight", by_name.get("token_embd.weight"))


def head_as_stored(reader: GGUFFile) -> bool:
    """Whether the file's LM head is of HEAD_AS_STORED."""
    head = head_tensor(reader)
    return head is not None and head.tensor_type in HEAD_AS_STORED


def iter_tensors(reader: GGUFFile, cfg: ModelConfig, dtype: torch.dtype, keep_int4: bool = False,
                 keep_int8: bool = False, head_int8: bool = False) -> Iterator[tuple[str, "torch.Tensor | Int4Weight | Int8Weight"]]:
    """(HF name, tensor) pairs, one at a time. With keep_int4, 4-bit linears (Q4_0, Q4_1, Q4_K) stay 4-bit, as
    they are. With keep_int8, the other quantized linears (Q5_*, Q6_K, Q8_0, ...: what a Q4_K_M file holds beside
    its Q4_K) become int8 with a scale per group of 16 or 32 (`_int8_groups`), so that every linear of such a file runs
    on the backend's packed kernels rather than as a dense copy. With head_int8, a head of HEAD_AS_STORED comes as
    such an int8 bundle too, as "lm_head.weight" (also where it is the tied token embedding, which then comes dense
    as well, for the lookups). The rest, and every float tensor, is dequantised to `dtype`."""
    head_t = head_tensor(reader)
    tied = head_t is not None and head_t.name == "token_embd.weight"
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
        head = head_int8 and t.tensor_type in HEAD_AS_STORED and (name == "lm_head.weight" or
                                                                   (tied and name == "model.embed_tokens.weight"))
        linear = name.endswith("proj.weight") or (head and name == "lm_head.weight")
        if keep_int4 and linear and t.tensor_type in _Q4:
            q, s, z = (_unpermute(a, heads) if heads else a for a in _Q4[t.tensor_type](np.asarray(t.data)))
            yield name, Int4Weight(torch.from_numpy(q), torch.from_numpy(s), torch.from_numpy(z), 32, q.shape[0], q.shape[1])
            continue
        if t.tensor_type in (GGMLQuantizationType.F32, GGMLQuantizationType.F16):
            arr = np.asarray(t.data).reshape([int(d) for d in reversed(t.shape)])
        else:
            arr = dequantize(t.data, t.tensor_type)
        if heads:
            arr = _unpermute(arr, heads)
        arr = arr if arr.flags.writeable else arr.copy()
        w = torch.from_numpy(np.ascontiguousarray(arr))
        yield name, _int8_groups(t, w, heads) if keep_int8 and linear and t.tensor_type not in _FLOAT else w.to(dtype)
        if head and name == "model.embed_tokens.weight":
            yield "lm_head.weight", _int8_groups(t, w, 0)


# Types that are exactly int8 times a scale per group: {type: (group, block bytes, the block's scales from its bytes)}.
# Q8_0 is d * q per 32, Q5_0 d * (q - 16) per 32, Q6_K d * sc_i * (q - 32) per 16 (sc_i int8; |q| <= 32 after the
# offset): the scales are exact in float32, and so is w / scale.
_EXACT_INT8 = {
    GGMLQuantizationType.Q8_0: (32, 34, lambda b: _f16(b[..., 0:2])),
    GGMLQuantizationType.Q5_0: (32, 22, lambda b: _f16(b[..., 0:2])),
    GGMLQuantizationType.Q6_K: (16, 210, lambda b: _f16(b[..., 208:210]) * b[..., 192:208].view(np.int8)),
}


def _int8_groups(t, w: torch.Tensor, heads: int) -> Int8Weight:
    """A wider-than-4-bit quantized linear as int8 with a scale per group: exactly where the type is int8 times a
    scale per group (_EXACT_INT8: q = w / scale), else in groups of 32 rounded to nearest from its own values with
    the group's largest at 127 (Q5_1 / Q5_K's minimums, other types: at most half a 254th of the group's largest
    value off)."""
    if t.tensor_type not in _EXACT_INT8:
        return Int8Weight.quantize(w, 32)
    group, size, scales_of = _EXACT_INT8[t.tensor_type]
    n = w.shape[0]
    s = scales_of(np.asarray(t.data).reshape(n, -1, size)).reshape(n, -1)
    s = torch.from_numpy(_unpermute(s, heads) if heads else s)
    safe = torch.where(s == 0, torch.ones_like(s), s)
    q = torch.round(w.unflatten(1, (-1, group)) / safe[..., None]).flatten(1)
    return Int8Weight(q.to(torch.int8), s, n, w.shape[1], group_size=group)

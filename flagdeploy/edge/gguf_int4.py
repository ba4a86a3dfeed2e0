"""int4 from a GGUF's own blocks: the Q4_0/Q4_1 (and Q8_0) weights carried into ORT's MatMulNBits as they are.

Re-quantizing the dequantised weights (the model builder's `-p int4`, RTN) quantizes twice: on the
default model (SmolLM2-135M, Q4_1) that costs a mean next-token KL of ~0.5 nats against the torch
model, which reads the same blocks exactly. Here the blocks are not re-quantized:

    Q4_1:  w[n, k] = d * q + m = d * (q - 8) + z,   z = m + 8 d   (one d, z per 32 k; flagdeploy.ops.weights.Int4Weight)

MatMulNBits (4 bits, block 32, no zero-point input: implicit 8) computes sum_k d (q - 8) x_k; the z part
is sum_b z[n, b] * s_b(x), s_b(x) the sum of x over block b. It rides in the same MatMulNBits: the input is
extended by the block sums (one small MatMul with a 0/1 matrix, then a Concat, once per distinct input) and
each weight row by z, written as two 4-bit blocks per 32 block sums (z ~ hi + lo: hi = z rounded on a grid
of max|z| / 7, lo = the remainder on a grid 14x finer), so z is kept to 1/196 of the row's largest |z|.
(A separate float correction, block sums @ z plus an Add per linear, is exact but took ~1/4 of the decode
step in node dispatch; one 4-bit block for z is too coarse: mean KL 0.14 against 0.005.) Q4_0 has z = 0
and needs no extension. Gate and up (same input) become one MatMulNBits of twice the width followed by a
Split. The LM head, a Q8_0 tensor (d * q, q in [-127, 127]), becomes an 8-bit MatMulNBits with the implicit
zero point 128: also exact. Every rewritten weight is checked against the float graph's initializer before it is
replaced (the d (q - 8) part exactly, z within its bound), so a layout or ordering mistake fails the export
instead of producing a wrong model.

The input is the model builder's fp32 graph of the same GGUF (same names, fused qkv).
"""

from __future__ import annotations

import logging
import re
from pathlib import Path

import numpy as np

log = logging.getLogger(__name__)

BLOCK = 32
LAYOUT_VERSION = 2  # of the rewritten graph; part of the export cache key (2: z in extra blocks)
ZERO_COPIES = 2  # 4-bit blocks per 32 block sums that carry z (hi, lo)
ZERO_TOL = 1 / 150  # the largest error of z allowed, relative to its row's largest |z| (the grid gives <= 1/196)
_LAYER_W = re.compile(r"^model\.layers\.(\d+)\.(attn\.qkv_proj|attn\.o_proj|mlp\.gate_proj|mlp\.up_proj|mlp\.down_proj)"
                      r"\.MatMul\.weight$")
_PARTS = {"attn.qkv_proj": ["self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"],
          "attn.o_proj": ["self_attn.o_proj"], "mlp.gate_proj": ["mlp.gate_proj"], "mlp.up_proj": ["mlp.up_proj"],
          "mlp.down_proj": ["mlp.down_proj"]}


def _pack4(q: np.ndarray) -> np.ndarray:
    """q [N, K] in 0..15 → MatMulNBits B [N, K/32, 16]: element 2j in the low nibble of byte j."""
    n, k = q.shape
    q = q.astype(np.uint8).reshape(n, k // BLOCK, BLOCK)
    return (q[..., 0::2] | (q[..., 1::2] << 4)).astype(np.uint8)


def _q8_0(data: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Raw Q8_0 rows [N, K/32 * 34] → (q [N, K] int8, d [N, K/32] float32)."""
    n = data.shape[0]
    blocks = data.reshape(n, -1, 34)
    d = blocks[..., 0:2].copy().view(np.float16)[..., 0].astype(np.float32)
    q = blocks[..., 2:].copy().view(np.int8).reshape(n, -1)
    return q, d


def _zero_blocks(z: np.ndarray) -> tuple[np.ndarray, np.ndarray, float]:
    """z [N, nb] → the extension of MatMulNBits' B and scales: packed [N, ZERO_COPIES * slabs, 16] and
    scales [N, ZERO_COPIES * slabs] (slabs = ceil(nb / 32), copy-major), and the largest error of z
    relative to its row's largest |z|."""
    n, nb = z.shape
    slabs = -(-nb // BLOCK)
    rest = np.zeros((n, slabs * BLOCK), np.float64)
    rest[:, :nb] = z
    rest = rest.reshape(n, slabs, BLOCK)
    packed, scales = [], []
    for _ in range(ZERO_COPIES):
        s = np.abs(rest).max(-1) / 7.0
        s[s == 0] = 1.0
        q = np.clip(np.round(rest / s[..., None]), -8, 7)
        rest = rest - q * s[..., None]
        packed.append(_pack4((q + 8).reshape(n, slabs * BLOCK)))
        scales.append(s.astype(np.float32))
    err = float((np.abs(rest).max(-1) / np.maximum(np.abs(z).max(-1, keepdims=True), 1e-30)).max())
    return np.concatenate(packed, axis=1), np.concatenate(scales, axis=1), err


def _sum_matrix(k: int) -> np.ndarray:
    """[K, ZERO_COPIES * slabs * 32] of 0/1: x @ it = the block sums of x, once per copy, zero-padded
    to whole blocks (the input extension `_zero_blocks` pairs with)."""
    nb = k // BLOCK
    width = -(-nb // BLOCK) * BLOCK
    m = np.zeros((k, ZERO_COPIES * width), np.float32)
    for c in range(ZERO_COPIES):
        m[np.arange(k), c * width + np.arange(k) // BLOCK] = 1.0
    return m


def gguf_blocks(gguf_path: Path) -> tuple[dict, tuple | None, str]:
    """HF name → Int4Weight for every Q4_0/Q4_1 linear (q/k rows un-permuted), and the Q8_0 token
    embedding's (q, d) if it is Q8_0; plus a description of the source types."""
    from gguf import GGMLQuantizationType

    from flagdeploy.checkpoints import gguf_reader
    from flagdeploy.ops.weights import Int4Weight

    reader = gguf_reader.open_gguf(gguf_path)
    cfg = gguf_reader.read_config(reader)
    import torch

    linears = {}
    types = set()
    for name, t in gguf_reader.iter_tensors(reader, cfg, torch.float32, keep_int4=True):
        if isinstance(t, Int4Weight):
            linears[name] = t
    head = None
    for t in reader.tensors:
        if t.name.startswith("blk.") and len(t.shape) == 2:
            types.add(t.tensor_type.name)
        if t.name == ("output.weight" if not cfg.tie_word_embeddings else "token_embd.weight") \
                and t.tensor_type == GGMLQuantizationType.Q8_0:
            head = _q8_0(np.asarray(t.data))
    return linears, head, "/".join(sorted(types))


def has_q4_linears(gguf_path: Path) -> bool:
    from gguf import GGMLQuantizationType

    from flagdeploy.checkpoints import gguf_reader

    reader = gguf_reader.open_gguf(gguf_path)
    q4 = (GGMLQuantizationType.Q4_0, GGMLQuantizationType.Q4_1)
    return any(t.tensor_type in q4 for t in reader.tensors if t.name.startswith("blk."))


def rewrite(model_dir: Path, gguf_path: Path, accuracy_level: int = 4, tol: float = 1e-5) -> dict:
    """Rewrite model_dir/model.onnx (the builder's fp32 graph of `gguf_path`) in place; returns what was done."""
    import onnx
    from onnx import helper, numpy_helper

    linears, head, types = gguf_blocks(gguf_path)
    model = onnx.load(str(model_dir / "model.onnx"), load_external_data=True)
    graph = model.graph
    inits = {i.name: i for i in graph.initializer}
    consumers: dict[str, list] = {}
    for node in graph.node:
        for i in node.input:
            consumers.setdefault(i, []).append(node)
    new_nodes, drop_inits, add_inits = [], set(), []
    sum_matrices: dict[int, str] = {}  # K → the [K, ...] 0/1 matrix that takes an input's block sums
    extended: dict[str, str] = {}  # input → that input followed by its block sums
    stats = {"int4_gguf": 0, "int8_gguf_head": 0, "left_float": 0}
    by_weight = {nd.input[1]: nd for nd in graph.node if nd.op_type == "MatMul" and len(nd.input) == 2}
    fused_away: set[str] = set()  # up_proj nodes computed with their gate_proj
    for node in graph.node:
        if node.name in fused_away:
            continue
        w_name = node.input[1] if node.op_type == "MatMul" and len(node.input) == 2 else None
        m = _LAYER_W.match(w_name) if w_name else None
        if m and all(f"model.layers.{m.group(1)}.{p}.weight" in linears for p in _PARTS[m.group(2)]):
            parts = [linears[f"model.layers.{m.group(1)}.{p}.weight"] for p in _PARTS[m.group(2)]]
            refs, outs = [numpy_helper.to_array(inits[w_name])], [node.output[0]]  # [K, N] each
            base = w_name.removesuffix(".MatMul.weight")
            up_w, up_name = w_name.replace("mlp.gate_proj", "mlp.up_proj"), f"model.layers.{m.group(1)}.mlp.up_proj.weight"
            up = by_weight.get(up_w) if m.group(2) == "mlp.gate_proj" else None
            if up is not None and up.input[0] == node.input[0] and up_name in linears:
                # gate and up read the same input: one MatMulNBits of N = 2 x intermediate, then a Split
                parts.append(linears[up_name])
                refs.append(numpy_helper.to_array(inits[up_w]))
                outs.append(up.output[0])
                fused_away.add(up.name)
                drop_inits.add(up_w)
                base = f"model.layers.{m.group(1)}.mlp.gate_up_proj"
                stats["int4_gguf"] += 1
            q = np.concatenate([p.q.numpy() for p in parts])
            s = np.concatenate([p.scales.numpy() for p in parts]).astype(np.float32)
            z = np.concatenate([p.zeros.numpy() for p in parts]).astype(np.float32)
            n, k = q.shape
            ref = np.concatenate(refs, axis=1)
            deq = (q.reshape(n, k // BLOCK, BLOCK).astype(np.float32) - 8) * s[..., None] + z[..., None]
            err = float(np.abs(deq.reshape(n, k).T - ref).max())
            if err > tol * max(1.0, float(np.abs(ref).max())):
                raise ValueError(f"{w_name}: the GGUF blocks do not reproduce the float graph's weight (max error {err})")
            packed, scales, x, k_in = _pack4(q), s, node.input[0], k
            if np.any(z):  # Q4_1: z rides in extra blocks against the input's block sums (module docstring)
                zq, zs, zerr = _zero_blocks(z)
                if not zerr <= ZERO_TOL:
                    raise ValueError(f"{w_name}: the zero term's 4-bit blocks miss z by {zerr:.2g} of its largest value")
                stats["zero_term_max_rel_err"] = max(stats.get("zero_term_max_rel_err", 0.0), zerr)
                packed, scales = np.concatenate([packed, zq], axis=1), np.concatenate([s, zs], axis=1)
                if k not in sum_matrices:
                    sum_matrices[k] = f"/flagdeploy/block_sums_{k}"
                    add_inits.append(numpy_helper.from_array(_sum_matrix(k), sum_matrices[k]))
                if x not in extended:  # once per distinct input (gate and up share theirs)
                    extended[x] = f"{node.name}/input_and_block_sums"
                    new_nodes += [
                        helper.make_node("MatMul", [x, sum_matrices[k]], [f"{node.name}/block_sums"],
                                         name=f"{node.name}/BlockSums"),
                        helper.make_node("Concat", [x, f"{node.name}/block_sums"], [extended[x]],
                                         name=f"{node.name}/ExtendInput", axis=-1),
                    ]
                x, k_in = extended[x], k + zq.shape[1] * BLOCK
            add_inits += [numpy_helper.from_array(packed, f"{base}.MatMulNBits.qweight"),
                          numpy_helper.from_array(scales.reshape(-1), f"{base}.MatMulNBits.scales")]
            out = outs[0] if len(outs) == 1 else f"{node.name}/gate_up_out"
            new_nodes.append(helper.make_node(
                "MatMulNBits", [x, f"{base}.MatMulNBits.qweight", f"{base}.MatMulNBits.scales"], [out],
                name=f"{node.name}/MatMulNBits", domain="com.microsoft", K=k_in, N=n, bits=4, block_size=BLOCK,
                accuracy_level=accuracy_level))
            if len(outs) > 1:
                sizes = f"{base}.split_sizes"
                add_inits.append(numpy_helper.from_array(np.array([p.q.shape[0] for p in parts], np.int64), sizes))
                new_nodes.append(helper.make_node("Split", [out, sizes], outs, name=f"{node.name}/Split", axis=-1))
            drop_inits.add(w_name)
            stats["int4_gguf"] += 1
            continue
        if w_name == "lm_head.MatMul.weight" and head is not None:
            q8, d = head  # [V, K] int8, [V, K/32]
            ref = numpy_helper.to_array(inits[w_name])  # [K, V]
            v, k = q8.shape
            err = float(np.abs((q8.reshape(v, -1, BLOCK).astype(np.float32) * d[..., None]).reshape(v, k).T - ref).max())
            if err > tol * max(1.0, float(np.abs(ref).max())):
                raise ValueError(f"{w_name}: the GGUF Q8_0 blocks do not reproduce the float LM head (max error {err})")
            u8 = (q8.astype(np.int16) + 128).astype(np.uint8).reshape(v, k // BLOCK, BLOCK)
            add_inits += [numpy_helper.from_array(u8, "lm_head.MatMulNBits.qweight"),
                          numpy_helper.from_array(d.reshape(-1).astype(np.float32), "lm_head.MatMulNBits.scales")]
            new_nodes.append(helper.make_node(
                "MatMulNBits", [node.input[0], "lm_head.MatMulNBits.qweight", "lm_head.MatMulNBits.scales"],
                list(node.output), name="/lm_head/MatMulNBits", domain="com.microsoft", K=k, N=v, bits=8,
                block_size=BLOCK, accuracy_level=accuracy_level))
            stats["int8_gguf_head"] += 1
            # the embedding read the same initializer through a Transpose: give it its own [V, K] table
            for other in consumers.get(w_name, []):
                if other is not node and other.op_type == "Transpose":
                    add_inits.append(numpy_helper.from_array(np.ascontiguousarray(ref.T), "model.embed_tokens.weight"))
                    for g in consumers.get(other.output[0], []):
                        g.input[0] = "model.embed_tokens.weight"
                    other.op_type = "Identity"  # left dangling-free; removed below
                    other.ClearField("attribute")
                    other.input[0] = "model.embed_tokens.weight"
            drop_inits.add(w_name)
            continue
        if node.op_type == "MatMul" and w_name in inits:
            stats["left_float"] += 1
        new_nodes.append(node)
    # drop the Identity left where the embedding's Transpose was (nothing reads it any more)
    used = {i for nd in new_nodes for i in nd.input}
    new_nodes = [nd for nd in new_nodes if not (nd.op_type == "Identity" and nd.output[0] not in used
                                                 and nd.input[0] == "model.embed_tokens.weight")]
    del graph.node[:]
    graph.node.extend(new_nodes)
    keep = [i for i in graph.initializer if i.name not in drop_inits]
    del graph.initializer[:]
    graph.initializer.extend(keep + add_inits)
    if not any(op.domain == "com.microsoft" for op in model.opset_import):
        model.opset_import.append(helper.make_opsetid("com.microsoft", 1))
    (model_dir / "model.onnx").unlink()
    data = model_dir / "model.onnx.data"
    if data.exists():
        data.unlink()
    onnx.save_model(model, str(model_dir / "model.onnx"), save_as_external_data=True, all_tensors_to_one_file=True,
                    location="model.onnx.data", size_threshold=1024)
    stats["gguf_types"] = types
    log.info("gguf int4 rewrite: %s", stats)
    return stats

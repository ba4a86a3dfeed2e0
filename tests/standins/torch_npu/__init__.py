"""A CPU stand-in for the few torch_npu functions flagdeploy's Ascend backend calls.

Written only from the documented semantics in /work/shared/docs/ascend-torch-npu.md (ADOC below; section
numbers in brackets) and, where ADOC is silent, the op-plugin page it cites (named where used). Each function
computes in plain torch what the real op is documented to compute -- its layouts, its DEFAULTS (including
the ones that give wrong answers, such as FIA's scale=1.0 and num_heads=1) and its return tuples -- and
raises where the real op is documented to reject the call (wrong layout, missing mandatory argument, a
dtype the chip family does not have, FP8 on A2/A3). Anything the real op accepts but this stand-in does not
model raises NotImplementedError, never a silent approximation.

Nothing here has been compared with real silicon. It exists so that the backend's calls can be tested on a
CPU-only machine: a call that passes here is a call that matches the documentation.

Usage: put tests/standins on sys.path, `import torch_npu`. Importing installs a minimal `torch.npu`
namespace (is_available, device_count, ...). The simulated chip family is chosen by the environment
variable FLAGDEPLOY_STANDIN_SOC (a SoC name, default "Ascend910_9391", an A3 die) or by `set_soc(name)`.
`CALLS` counts calls per function so tests can check that the native path actually ran.
"""

from __future__ import annotations

import os
import types
from collections import Counter
from typing import Sequence

import torch
import torch.nn.functional as F

__version__ = "0.0.0+standin"
IS_STANDIN = True

ACL_FORMAT_ND = 2
ACL_FORMAT_FRACTAL_NZ = 29  # ADOC rule 5
_FORMATS = {ACL_FORMAT_ND, ACL_FORMAT_FRACTAL_NZ}

CALLS: Counter = Counter()

_FP8 = tuple(getattr(torch, n) for n in ("float8_e4m3fn", "float8_e5m2") if hasattr(torch, n))
_HALF = (torch.float16, torch.bfloat16)
_FLOAT = (torch.float16, torch.bfloat16, torch.float32)


class NPUError(RuntimeError):
    """What the real op raises (an aclnn/op-plugin error surfaces as a RuntimeError in Python)."""


# ---- the simulated chip ------------------------------------------------------------------------------

_soc_name = os.environ.get("FLAGDEPLOY_STANDIN_SOC", "Ascend910_9391")


def set_soc(name: str) -> None:
    """Simulate another SoC, e.g. "Ascend910B3" (A2), "Ascend910_9391" (A3), "Ascend950DT_9582" (950),
    "Ascend310P3" (310P)."""
    global _soc_name
    family_of(name)  # validates
    _soc_name = name


def family_of(name: str) -> str:
    n = name.lower().replace("ascend", "")
    if n.startswith("910b"):
        return "A2"
    if n.startswith("910_93") or n.startswith("910c"):
        return "A3"
    if n.startswith("950"):
        return "950"
    if n.startswith("310p"):
        return "310P"
    raise ValueError(f"stand-in does not know SoC {name!r}")


def family() -> str:
    return family_of(_soc_name)


# ADOC [1.11]: VA maps 220-225 to A2, 250-255 to A3, 200-205 to 310P, 260 to A5/950.
_SOC_VERSION = {"A2": 223, "A3": 250, "950": 260, "310P": 202}


def _count(name: str) -> None:
    CALLS[name] += 1


def _fail(msg: str):
    raise NPUError(msg)


def _check_dtype(name: str, t: torch.Tensor, allowed: Sequence[torch.dtype], what: str = "input") -> None:
    if t.dtype not in allowed:
        _fail(f"{name}: {what} dtype {t.dtype} not supported (allowed: {list(allowed)})")
    if t.dtype == torch.bfloat16 and family() == "310P":
        _fail(f"{name}: Atlas inference series (310P) has no bfloat16 (ADOC [2])")


def _no_extra(name: str, **kwargs) -> None:
    """Arguments the real op takes but this stand-in does not model must stay at their defaults."""
    for k, v in kwargs.items():
        if v is not None and v is not False and v != [] and v != 0:
            raise NotImplementedError(f"{name}: argument {k!r} is not modelled by the stand-in")


# ---- torch.npu namespace ------------------------------------------------------------------------------


def _device_properties(i: int = 0):
    mem = {"A2": 64, "A3": 64, "950": 96, "310P": 48}[family()] << 30
    return types.SimpleNamespace(name=_soc_name, total_memory=mem, cube_core_num=24, vector_core_num=48,
                                 L2_cache_size=192 << 20)


npu = types.ModuleType("torch_npu.npu")
npu.is_available = lambda: True
npu.device_count = lambda: 1
npu.current_device = lambda: 0
npu.set_device = lambda i: None
npu.synchronize = lambda *a: None
npu.get_device_name = lambda i=0: _soc_name
npu.get_soc_version = lambda: _SOC_VERSION[family()]
npu.get_device_properties = _device_properties
torch.npu = npu  # installed on import, as the real torch_npu does; tests remove it afterwards


# ---- HCCL as torch.distributed's "hccl" backend -----------------------------------------------------------
# The real torch_npu registers its ProcessGroupHCCL under the name "hccl" when imported, which is how
# flagdeploy (and vLLM-Ascend) reach HCCL: `init_process_group("hccl")`, then the ordinary torch.distributed
# collectives. Here the name is backed by gloo, because the stand-in's "NPU" tensors are CPU tensors: what
# this checks is the wiring (the backend's declared library reaches the process group by that name, and
# every collective the parallel layers use goes through it), not HCCL itself.


def _register_hccl() -> None:
    import torch.distributed as dist

    if not dist.is_available() or "hccl" in dist.Backend.backend_list:
        return

    def create(store, rank, size, timeout):
        _count("ProcessGroupHCCL")
        return dist.ProcessGroupGloo(store, rank, size, timeout)

    dist.Backend.register_backend("hccl", create, devices=["cpu"])


_register_hccl()


# ---- formats (ADOC [1.7] npu_format_cast; rule 5) -----------------------------------------------------
# The format is a property of the tensor object: a view (.t(), .view(), slicing) is a new object and so
# reads as ND -- which is the documented trap ("an NZ tensor ... do not .view it").


def npu_format_cast(self: torch.Tensor, acl_format: int, *, customize_dtype=None, input_dtype=None) -> torch.Tensor:
    _count("npu_format_cast")
    _no_extra("npu_format_cast", customize_dtype=customize_dtype, input_dtype=input_dtype)
    if acl_format not in _FORMATS:
        raise NotImplementedError(f"npu_format_cast: format {acl_format} is not modelled (only ND=2, NZ=29)")
    out = self.contiguous().clone()
    out._npu_format = acl_format
    return out


def npu_format_cast_(self: torch.Tensor, acl_format: int) -> torch.Tensor:
    if acl_format not in _FORMATS:
        raise NotImplementedError(f"npu_format_cast_: format {acl_format} is not modelled")
    self._npu_format = acl_format
    return self


def get_npu_format(t: torch.Tensor) -> int:
    return getattr(t, "_npu_format", ACL_FORMAT_ND)


# ---- norms [1.1] --------------------------------------------------------------------------------------


def _rms(x: torch.Tensor, gamma: torch.Tensor, epsilon: float, name: str):
    _check_dtype(name, x, _FLOAT, "x")
    if not 2 <= x.dim() <= 8:
        _fail(f"{name}: x must have 2-8 dims, got {x.dim()}")
    if gamma.dtype != x.dtype:
        _fail(f"{name}: gamma dtype {gamma.dtype} must equal x dtype {x.dtype}")
    if tuple(gamma.shape) != tuple(x.shape[x.dim() - gamma.dim():]):
        _fail(f"{name}: gamma shape {tuple(gamma.shape)} must match the trailing dims of x {tuple(x.shape)}")
    dims = tuple(range(x.dim() - gamma.dim(), x.dim()))
    xf = x.float()
    rstd = torch.rsqrt(xf.pow(2).mean(dims, keepdim=True) + epsilon)
    return (xf * rstd * gamma.float()).to(x.dtype), rstd


def npu_rms_norm(self: torch.Tensor, gamma: torch.Tensor, epsilon: float = 1e-06):
    """-> (y, rstd fp32). Default epsilon 1e-6: a model with eps 1e-5 must pass it."""
    _count("npu_rms_norm")
    return _rms(self, gamma, epsilon, "npu_rms_norm")


def npu_add_rms_norm(x1: torch.Tensor, x2: torch.Tensor, gamma: torch.Tensor, epsilon: float = 1e-06):
    """-> (y, rstd, x_sum) with x_sum = x1 + x2 and y = RMSNorm(x_sum) * gamma."""
    _count("npu_add_rms_norm")
    if x1.shape != x2.shape or x1.dtype != x2.dtype:
        _fail("npu_add_rms_norm: x1 and x2 must share shape and dtype")
    x_sum = (x1.float() + x2.float()).to(x1.dtype)
    y, rstd = _rms(x_sum, gamma, epsilon, "npu_add_rms_norm")
    return y, rstd, x_sum


# ---- rope [1.2] ---------------------------------------------------------------------------------------


def npu_rotary_mul(self: torch.Tensor, r1: torch.Tensor, r2: torch.Tensor, rotary_mode: str = "half", rotate=None):
    """x*cos + rotate(x)*sin with r1=cos, r2=sin shaped like x (broadcast), 3-D/4-D, D even and < 896."""
    _count("npu_rotary_mul")
    _no_extra("npu_rotary_mul", rotate=rotate)
    _check_dtype("npu_rotary_mul", self, _FLOAT, "x")
    if self.dim() not in (3, 4):
        _fail(f"npu_rotary_mul: x must be 3-D or 4-D, got {self.dim()}-D")
    d = self.shape[-1]
    if d % 2 or d >= 896:
        _fail(f"npu_rotary_mul: D={d} must be even and < 896")
    for nm, r in (("r1", r1), ("r2", r2)):
        if r.dtype != self.dtype:  # ADOC lists one dtype set; same-dtype as for npu_apply_rotary_pos_emb (assumed)
            _fail(f"npu_rotary_mul: {nm} dtype {r.dtype} must equal x dtype {self.dtype}")
        if r.dim() != self.dim() or r.shape[-1] != d:
            _fail(f"npu_rotary_mul: {nm} must be shaped like x ({self.dim()}-D, last dim {d}), got {tuple(r.shape)}")
        try:
            torch.broadcast_shapes(r.shape, self.shape)
        except RuntimeError:
            _fail(f"npu_rotary_mul: {nm} {tuple(r.shape)} does not broadcast to x {tuple(self.shape)}")
    x, c, s = self.float(), r1.float(), r2.float()
    if rotary_mode == "half":
        x1, x2 = x.chunk(2, dim=-1)
        rot = torch.cat((-x2, x1), dim=-1)
    elif rotary_mode == "interleave":
        rot = torch.stack((-x[..., 1::2], x[..., 0::2]), dim=-1).flatten(-2)
    else:
        _fail(f"npu_rotary_mul: rotary_mode {rotary_mode!r} (use 'half' or 'interleave')")
    return (x * c + rot * s).to(self.dtype)


# ---- swiglu [1.3] ------------------------------------------------------------------------------------


def npu_swiglu(self: torch.Tensor, dim: int = -1) -> torch.Tensor:
    """A, B = x.chunk(2, dim); silu(A) * B -- the first half is the gate."""
    _count("npu_swiglu")
    _check_dtype("npu_swiglu", self, _FLOAT, "x")
    if not 1 <= self.dim() <= 8 or self.shape[dim] % 2:
        _fail(f"npu_swiglu: x {tuple(self.shape)} must have 1-8 dims and an even size along dim {dim}")
    a, b = self.float().chunk(2, dim=dim)
    return (F.silu(a) * b).to(self.dtype)


# ---- attention [1.4] ----------------------------------------------------------------------------------

_BIG = 2147483647


def _lengths(v, name: str) -> list[int]:
    if isinstance(v, torch.Tensor):
        v = v.tolist()
    if not isinstance(v, (list, tuple)) or not all(isinstance(i, int) for i in v):
        _fail(f"npu_fused_infer_attention_score: {name} must be a list of ints (or an int tensor)")
    return list(v)


def _cumulative(v, total: int, name: str) -> list[tuple[int, int]]:
    """TND: `v` is cumulative (query_start_loc[1:]); returns (start, end) per sequence."""
    ends = _lengths(v, name)
    starts = [0] + ends[:-1]
    if any(e < s for s, e in zip(starts, ends)) or (ends and ends[-1] > total):
        _fail(f"npu_fused_infer_attention_score: in TND, {name} must be CUMULATIVE (non-decreasing, last <= {total}); "
              f"got {ends} -- per-request lengths are the documented trap (ADOC rule 3)")
    return list(zip(starts, ends))


def _split_q(query, layout, num_heads, actual_seq_lengths):
    """Per batch: [S_q, N, D] tensors, and a function that puts per-batch outputs back in the layout."""
    if layout == "TND":
        if query.dim() != 3:
            _fail("npu_fused_infer_attention_score: TND query must be [T, N, D]")
        if actual_seq_lengths is None:
            _fail("npu_fused_infer_attention_score: TND requires actual_seq_lengths (mandatory)")
        if query.shape[1] != num_heads:
            _fail(f"npu_fused_infer_attention_score: num_heads={num_heads} but the TND query has {query.shape[1]} heads")
        segs = _cumulative(actual_seq_lengths, query.shape[0], "actual_seq_lengths")
        parts = [query[s:e] for s, e in segs]

        def join(outs):
            out = query.new_zeros(query.shape)
            for (s, e), o in zip(segs, outs):
                out[s:e] = o
            return out

        return parts, join
    if query.dim() != (3 if layout == "BSH" else 4):
        _fail(f"npu_fused_infer_attention_score: query {tuple(query.shape)} does not match layout {layout}")
    if layout == "BSH":
        b, s, h = query.shape
        if h % num_heads:
            _fail(f"npu_fused_infer_attention_score: H={h} is not a multiple of num_heads={num_heads}")
        q = query.view(b, s, num_heads, h // num_heads)
    elif layout == "BSND":
        q = query
    else:  # BNSD
        q = query.transpose(1, 2)
    if q.shape[2] != num_heads:
        _fail(f"npu_fused_infer_attention_score: num_heads={num_heads} but the {layout} query has {q.shape[2]} heads")
    lens = _lengths(actual_seq_lengths, "actual_seq_lengths") if actual_seq_lengths is not None else [q.shape[1]] * q.shape[0]
    if len(lens) != q.shape[0] or max(lens, default=0) > q.shape[1]:
        _fail(f"npu_fused_infer_attention_score: actual_seq_lengths {lens} does not fit the {layout} query "
              f"{tuple(query.shape)} (one length <= S per batch)")
    parts = [q[i, : lens[i]] for i in range(q.shape[0])]

    def join(outs):
        out = q.new_zeros(q.shape)
        for i, o in enumerate(outs):
            out[i, : o.shape[0]] = o
        if layout == "BSH":
            return out.reshape(query.shape)
        return out if layout == "BSND" else out.transpose(1, 2).contiguous()

    return parts, join


def _split_kv(t, layout, n_kv, d, lens_kv, b):
    """Non-paged KV in the query's layout: per batch [S_kv, N_kv, D]."""
    if layout == "TND":
        if lens_kv is None:
            _fail("npu_fused_infer_attention_score: TND requires actual_seq_lengths_kv (mandatory)")
        if t.dim() != 3 or t.shape[1:] != (n_kv, d):
            _fail(f"npu_fused_infer_attention_score: TND key/value must be [T, {n_kv}, {d}], got {tuple(t.shape)}")
        return [t[s:e] for s, e in _cumulative(lens_kv, t.shape[0], "actual_seq_lengths_kv")]
    if layout == "BSH":
        if t.dim() != 3 or t.shape[2] != n_kv * d:
            _fail(f"npu_fused_infer_attention_score: BSH key/value last dim must be N_kv*D={n_kv * d}, got {tuple(t.shape)}")
        t = t.view(t.shape[0], t.shape[1], n_kv, d)
    elif layout == "BNSD":
        t = t.transpose(1, 2)
    if t.dim() != 4 or t.shape[2:] != (n_kv, d):
        _fail(f"npu_fused_infer_attention_score: {layout} key/value heads/dims must be ({n_kv}, {d}), got {tuple(t.shape)}")
    lens = _lengths(lens_kv, "actual_seq_lengths_kv") if lens_kv is not None else [t.shape[1]] * b
    if len(lens) != b or t.shape[0] != b or max(lens, default=0) > t.shape[1]:
        _fail(f"npu_fused_infer_attention_score: key/value {tuple(t.shape)} and actual_seq_lengths_kv {lens} "
              f"do not fit a batch of {b} in layout {layout}")
    return [t[i, : lens[i]] for i in range(b)]


def _paged_kv(cache, layout, n_kv, d, block_table, block_size, lens_kv):
    """Paged KV (ADOC [1.4]): [num_blocks, block_size, H] for every layout; BNSD/TND also
    [num_blocks, N, block_size, D]. Returns per batch [L, N_kv, D]."""
    if cache.dim() == 3 and cache.shape[1:] == (block_size, n_kv * d):
        c = cache.view(cache.shape[0], block_size, n_kv, d)
    elif cache.dim() == 4 and layout in ("BNSD", "TND") and cache.shape[1:] == (n_kv, block_size, d):
        c = cache.transpose(1, 2)
    else:
        _fail(f"npu_fused_infer_attention_score: paged KV cache {tuple(cache.shape)} is not "
              f"[num_blocks, {block_size}, {n_kv * d}]" + (f" or [num_blocks, {n_kv}, {block_size}, {d}]"
                                                           if layout in ("BNSD", "TND") else "")
              + f" for layout {layout}")
    out = []
    for i, n in enumerate(lens_kv):
        nb = -(-n // block_size)
        if nb > block_table.shape[1]:
            _fail(f"npu_fused_infer_attention_score: sequence {i} needs {nb} blocks, block_table has {block_table.shape[1]}")
        blocks = block_table[i, :nb].long()
        out.append(c[blocks].flatten(0, 1)[:n])
    return out


def _allowed(sparse_mode, atten_mask, sq, skv, i, device):
    """bool [S_q, S_kv], True where a query may attend."""
    if sparse_mode == 0:
        if atten_mask is None:
            return torch.ones(sq, skv, dtype=torch.bool, device=device)
        m = atten_mask if atten_mask.dim() == 2 else atten_mask[i].reshape(atten_mask.shape[-2:])
        if m.shape[-2:] != (sq, skv):
            _fail(f"npu_fused_infer_attention_score: sparse_mode=0 mask must be (S_q, S_kv)=({sq}, {skv})")
        return m == 0
    ones = torch.ones(sq, skv, dtype=torch.bool, device=device)
    if sparse_mode == 2:  # leftUp causal
        return ones.tril(0)
    return ones.tril(skv - sq)  # 3: rightDown causal


def npu_fused_infer_attention_score(
    query, key, value, *, pse_shift=None, atten_mask=None, actual_seq_lengths=None, actual_seq_lengths_kv=None,
    dequant_scale1=None, quant_scale1=None, dequant_scale2=None, quant_scale2=None, quant_offset2=None,
    antiquant_scale=None, antiquant_offset=None, key_antiquant_scale=None, key_antiquant_offset=None,
    value_antiquant_scale=None, value_antiquant_offset=None, block_table=None, query_padding_size=None,
    kv_padding_size=None, key_shared_prefix=None, value_shared_prefix=None, actual_shared_prefix_len=None,
    query_rope=None, key_rope=None, key_rope_antiquant_scale=None, num_heads=1, scale=1.0,
    pre_tokens=_BIG, next_tokens=_BIG, input_layout="BSH", num_key_value_heads=0, sparse_mode=0,
    inner_precise=0, block_size=0, antiquant_mode=0, key_antiquant_mode=0, value_antiquant_mode=0,
    softmax_lse_flag=False,
):
    """FIA v1 (ADOC [1.4]) -> (attention_out, softmax_lse). Every argument after key/value is keyword-only
    and keeps the documented default -- scale=1.0, num_heads=1, input_layout="BSH" -- so a caller that
    forgets one gets the real op's (wrong) answer or its rejection."""
    _count("npu_fused_infer_attention_score")
    _no_extra("npu_fused_infer_attention_score", pse_shift=pse_shift, dequant_scale1=dequant_scale1,
              quant_scale1=quant_scale1, dequant_scale2=dequant_scale2, quant_scale2=quant_scale2,
              quant_offset2=quant_offset2, antiquant_scale=antiquant_scale, antiquant_offset=antiquant_offset,
              key_antiquant_scale=key_antiquant_scale, key_antiquant_offset=key_antiquant_offset,
              value_antiquant_scale=value_antiquant_scale, value_antiquant_offset=value_antiquant_offset,
              query_padding_size=query_padding_size, kv_padding_size=kv_padding_size,
              key_shared_prefix=key_shared_prefix, value_shared_prefix=value_shared_prefix,
              actual_shared_prefix_len=actual_shared_prefix_len, query_rope=query_rope, key_rope=key_rope,
              key_rope_antiquant_scale=key_rope_antiquant_scale, antiquant_mode=antiquant_mode,
              key_antiquant_mode=key_antiquant_mode, value_antiquant_mode=value_antiquant_mode)
    name = "npu_fused_infer_attention_score"
    if family() == "310P":
        _fail(f"{name}: not available on 310P (OPD products: A2, A3)")
    if input_layout not in ("BSH", "BSND", "BNSD", "TND"):
        if input_layout in ("BNSD_BSND", "BSH_NBSD", "BSND_NBSD", "BNSD_NBSD", "TND_NTD", "NTD_TND"):
            raise NotImplementedError(f"{name}: output-transposing layout {input_layout} is not modelled")
        _fail(f"{name}: unknown input_layout {input_layout!r}")
    _check_dtype(name, query, _HALF, "query")
    for nm, t in (("key", key), ("value", value)):
        if t.dtype == torch.int8:
            raise NotImplementedError(f"{name}: int8 KV (antiquant) is not modelled")
        if t.dtype != query.dtype:
            _fail(f"{name}: {nm} dtype {t.dtype} must match the query dtype {query.dtype}")
    if sparse_mode not in (0, 2, 3):
        raise NotImplementedError(f"{name}: sparse_mode {sparse_mode} is not modelled")
    if sparse_mode in (2, 3):
        if atten_mask is None or tuple(atten_mask.shape) != (2048, 2048):
            _fail(f"{name}: sparse_mode={sparse_mode} needs the compressed 2048x2048 causal atten_mask")
    if atten_mask is not None and atten_mask.dtype not in (torch.bool, torch.int8, torch.uint8):
        _fail(f"{name}: atten_mask dtype must be bool/int8/uint8, got {atten_mask.dtype}")
    if inner_precise not in (0, 1, 2, 3):
        _fail(f"{name}: inner_precise must be 0..3")
    if num_heads > 256:
        _fail(f"{name}: N_q={num_heads} > 256")
    n_kv = num_key_value_heads or num_heads
    if num_heads % n_kv or num_heads // n_kv > 64:
        _fail(f"{name}: N_q/N_kv = {num_heads}/{n_kv} must be an integer <= 64")

    q_parts, join = _split_q(query, input_layout, num_heads, actual_seq_lengths)
    d = q_parts[0].shape[-1] if q_parts else query.shape[-1]
    if d > 512 or (d * query.element_size()) % 16:
        _fail(f"{name}: head dim D={d} must be <= 512 and 16-byte aligned")
    if input_layout == "TND" and d == 512 and family() in ("A2", "A3"):
        _fail(f"{name}: A2/A3 cannot run TND with D=512 (ADOC [1.4])")

    if block_table is not None:
        if block_table.dtype != torch.int32 or block_table.dim() != 2:
            _fail(f"{name}: block_table must be int32 [B, max_blocks], got {block_table.dtype} {block_table.dim()}-D")
        if actual_seq_lengths_kv is None:
            _fail(f"{name}: paged attention (block_table) requires actual_seq_lengths_kv (mandatory)")
        if block_size <= 0:
            _fail(f"{name}: paged attention requires block_size")
        prefill = any(p.shape[0] > 1 for p in q_parts)
        if prefill and (block_size % 128 or not 128 <= block_size <= 512):
            _fail(f"{name}: paged prefill (S_q>1) needs block_size a multiple of 128 in [128, 512], got {block_size}")
        if not prefill and block_size > 512:
            _fail(f"{name}: block_size {block_size} > 512")
        lens_kv = _lengths(actual_seq_lengths_kv, "actual_seq_lengths_kv")  # per request, not cumulative
        if len(lens_kv) != len(q_parts) or block_table.shape[0] != len(q_parts):
            _fail(f"{name}: actual_seq_lengths_kv / block_table need one entry per request ({len(q_parts)})")
        k_parts = _paged_kv(key, input_layout, n_kv, d, block_table, block_size, lens_kv)
        v_parts = _paged_kv(value, input_layout, n_kv, d, block_table, block_size, lens_kv)
    else:
        k_parts = _split_kv(key, input_layout, n_kv, d, actual_seq_lengths_kv, len(q_parts))
        v_parts = _split_kv(value, input_layout, n_kv, d, actual_seq_lengths_kv, len(q_parts))
    if len(k_parts) != len(q_parts):
        _fail(f"{name}: {len(q_parts)} query sequences but {len(k_parts)} key sequences")

    outs, lses = [], []
    for i, (q, k, v) in enumerate(zip(q_parts, k_parts, v_parts)):
        rep = num_heads // n_kv
        kf = k.float().repeat_interleave(rep, dim=1)
        vf = v.float().repeat_interleave(rep, dim=1)
        scores = torch.einsum("qhd,khd->hqk", q.float(), kf) * scale
        allowed = _allowed(sparse_mode, atten_mask, q.shape[0], k.shape[0], i, q.device)
        scores = scores.masked_fill(~allowed, float("-inf"))
        lse = torch.logsumexp(scores, dim=-1)  # [N, S_q]
        probs = (scores - lse[..., None]).exp().nan_to_num(0.0)
        outs.append(torch.einsum("hqk,khd->qhd", probs, vf).to(query.dtype))
        lses.append(lse.transpose(0, 1))  # [S_q, N]
    out = join(outs)
    if not softmax_lse_flag:
        return out, torch.zeros(1, dtype=torch.float32, device=query.device)
    if input_layout == "TND":
        return out, torch.cat(lses)[..., None]
    raise NotImplementedError(f"{name}: softmax_lse_flag with {input_layout} is not modelled")


# ---- KV-cache write [1.5] -----------------------------------------------------------------------------


def npu_scatter_pa_kv_cache(key, value, key_cache, value_cache, slot_mapping, *, compress_lens=None,
                            compress_seq_offsets=None, seq_lens=None, cache_mode="PA_NZ"):
    """In place: cache.view(-1, N_kv, D)[slot] = key. The DEFAULT cache_mode is 'PA_NZ' (NZ caches);
    ND caches [num_blocks, block_size, N_kv, D] need cache_mode='Norm', as VA passes."""
    _count("npu_scatter_pa_kv_cache")
    _no_extra("npu_scatter_pa_kv_cache", compress_lens=compress_lens, compress_seq_offsets=compress_seq_offsets,
              seq_lens=seq_lens)
    name = "npu_scatter_pa_kv_cache"
    if family() == "310P":
        _fail(f"{name}: not available on 310P (OPD products: A2/A3)")
    if cache_mode == "PA_NZ":
        if get_npu_format(key_cache) != ACL_FORMAT_FRACTAL_NZ:
            _fail(f"{name}: cache_mode='PA_NZ' (the default) expects FRACTAL_NZ caches; pass cache_mode='Norm' "
                  "for ND caches [num_blocks, block_size, N_kv, D]")
        raise NotImplementedError(f"{name}: the PA_NZ cache layout is not modelled")
    if cache_mode != "Norm":
        raise NotImplementedError(f"{name}: cache_mode {cache_mode!r} is not modelled")
    allowed = (torch.float16, torch.bfloat16, torch.int8, *_FP8)
    for nm, t in (("key", key), ("value", value), ("key_cache", key_cache), ("value_cache", value_cache)):
        _check_dtype(name, t, allowed, nm)
        if not t.is_contiguous():
            _fail(f"{name}: {nm} must be contiguous")
    if key.dtype != key_cache.dtype or value.dtype != value_cache.dtype:
        _fail(f"{name}: key/value dtype must match their caches")
    if key_cache.dim() != 4 or key.dim() != 3 or key.shape[1:] != key_cache.shape[2:]:
        _fail(f"{name}: Norm mode wants key [T, N_kv, D] and caches [num_blocks, block_size, N_kv, D]; "
              f"got {tuple(key.shape)} and {tuple(key_cache.shape)}")
    if slot_mapping.dtype not in (torch.int32, torch.int64) or slot_mapping.shape != (key.shape[0],):
        _fail(f"{name}: slot_mapping must be int32/int64 [T]")
    slots = slot_mapping.long()
    if slots.unique().numel() != slots.numel():
        _fail(f"{name}: slots must be unique")
    n_slots = key_cache.shape[0] * key_cache.shape[1]
    if slots.numel() and (slots.min() < 0 or slots.max() >= n_slots):
        _fail(f"{name}: slot out of range [0, {n_slots})")
    key_cache.view(-1, *key_cache.shape[2:])[slots] = key
    value_cache.view(-1, *value_cache.shape[2:])[slots] = value


# ---- quantization [1.7] --------------------------------------------------------------------------------


def _fp8_allowed(name: str, dtype) -> None:
    if dtype in _FP8 and family() != "950":
        _fail(f"{name}: {dtype} is not supported on {family()} -- FP8 exists only on Ascend 950 (ADOC [2])")


def npu_dynamic_quant(input, *, smooth_scales=None, group_index=None, dst_type=None, quant_mode="pertoken"):
    """Symmetric per-token quantisation -> (y, scale fp32 [shape[:-1]]), scale = rowmax|x| / qmax.
    A2/A3: dst_type int8 (default) or quint4x2 only; 950 adds fp8."""
    _count("npu_dynamic_quant")
    _no_extra("npu_dynamic_quant", smooth_scales=smooth_scales, group_index=group_index)
    name = "npu_dynamic_quant"
    if quant_mode != "pertoken":
        raise NotImplementedError(f"{name}: quant_mode {quant_mode!r} is not modelled")
    _check_dtype(name, input, _HALF, "input")
    dst = torch.int8 if dst_type is None else dst_type
    _fp8_allowed(name, dst)
    xf = input.float()
    amax = xf.abs().amax(dim=-1).clamp(min=1e-12)
    if dst == torch.int8:
        scale = amax / 127.0
        return torch.round(xf / scale[..., None]).clamp(-127, 127).to(torch.int8), scale
    if dst in _FP8:
        qmax = torch.finfo(dst).max
        scale = amax / qmax
        return (xf / scale[..., None]).to(dst), scale
    if dst == getattr(torch, "quint4x2", None):
        raise NotImplementedError(f"{name}: int4 (quint4x2) output is not modelled")
    _fail(f"{name}: dst_type {dst} not supported")


def npu_trans_quant_param(scale, offset=None, round_mode=0):
    raise NotImplementedError("npu_trans_quant_param (int8-output quant_matmul) is not modelled")


def npu_quant_matmul(x1, x2, scale, *, offset=None, pertoken_scale=None, bias=None, output_dtype=None,
                     **unmodelled):
    """x1 @ x2 with an exact integer accumulator, times scale [N] (and pertoken_scale [M]).
    A2/A3: int8 x int8 only (int4 as int32 packing); FP8 only on 950. x2 is (K, N), ND or NZ.
    Default output is int8, which needs an int64 scale from npu_trans_quant_param."""
    _count("npu_quant_matmul")
    name = "npu_quant_matmul"
    _no_extra(name, offset=offset, **unmodelled)
    if bias is not None:
        raise NotImplementedError(f"{name}: bias is not modelled (ADOC does not state its dtype for this path)")
    for nm, t in (("x1", x1), ("x2", x2)):
        if t.dtype == torch.int32:
            raise NotImplementedError(f"{name}: int4 (int32-packed) {nm} is not modelled")
        _fp8_allowed(name, t.dtype)
        if t.dtype not in (torch.int8, *_FP8):
            _fail(f"{name}: {nm} dtype {t.dtype} not supported (int8; fp8 on 950)")
    if x1.dtype != x2.dtype:
        _fail(f"{name}: x1 {x1.dtype} and x2 {x2.dtype} must share a dtype")
    if x2.dim() != 2 or x1.shape[-1] != x2.shape[0]:
        _fail(f"{name}: x2 must be (K, N) with K = x1.shape[-1] = {x1.shape[-1]}; got {tuple(x2.shape)} "
              "(store the weight transposed to (K, N), ADOC rule 5)")
    k, n = x2.shape
    if k > 65535 or n > 65535:
        _fail(f"{name}: K and N must be <= 65535")
    if output_dtype in (None, torch.int8):
        if scale.dtype != torch.int64:
            _fail(f"{name}: the default int8 output needs an int64 scale from npu_trans_quant_param; "
                  "for W8A8 dynamic pass output_dtype=torch.bfloat16")
        raise NotImplementedError(f"{name}: int8 output is not modelled")
    if output_dtype == torch.bfloat16:
        if scale.dtype not in (torch.float32, torch.bfloat16):
            _fail(f"{name}: bf16 output needs a fp32 or bf16 scale, got {scale.dtype}")
        if family() == "310P":
            _fail(f"{name}: 310P has no bfloat16")
    elif output_dtype == torch.float16:
        if scale.dtype != torch.float32:
            _fail(f"{name}: fp16 output needs a fp32 scale, got {scale.dtype}")
    else:
        _fail(f"{name}: output_dtype {output_dtype} not supported")
    if scale.dim() != 1 or scale.shape[0] not in (1, n):
        _fail(f"{name}: scale must be (N,) or (1,), got {tuple(scale.shape)}")
    acc = (x1.double() @ x2.double()).float()  # exact: int8 products summed in float64
    y = acc * scale.float()
    if pertoken_scale is not None:
        if pertoken_scale.dtype != torch.float32 or tuple(pertoken_scale.shape) != tuple(x1.shape[:-1]):
            _fail(f"{name}: pertoken_scale must be fp32 of shape {tuple(x1.shape[:-1])}")
        y = y * pertoken_scale[..., None]
    return y.to(output_dtype)


def npu_weight_quant_batchmatmul(x, weight, antiquant_scale, antiquant_offset=None, quant_scale=None,
                                 quant_offset=None, bias=None, antiquant_group_size=0, inner_precise=0):
    """W8A16: x (M, K) fp16/bf16 @ dequant(weight (K, N) int8). antiquant_scale per-channel (N,) or per
    group (ceil(K/g), N) with antiquant_group_size=g; it must be in x's dtype (assumed; see docs)."""
    _count("npu_weight_quant_batchmatmul")
    name = "npu_weight_quant_batchmatmul"
    _no_extra(name, antiquant_offset=antiquant_offset, quant_scale=quant_scale, quant_offset=quant_offset)
    if bias is not None:
        raise NotImplementedError(f"{name}: bias is not modelled")
    _check_dtype(name, x, _HALF, "x")
    if weight.dtype == torch.int32:
        raise NotImplementedError(f"{name}: int4-packed weights are not modelled")
    if weight.dtype != torch.int8:
        _fail(f"{name}: weight must be int8 (K, N), got {weight.dtype}")
    if x.dim() != 2 or weight.dim() != 2 or x.shape[1] != weight.shape[0]:
        _fail(f"{name}: x (M, K) and weight (K, N) needed; got {tuple(x.shape)} and {tuple(weight.shape)}")
    k, n = weight.shape
    if antiquant_scale.dtype != x.dtype:
        _fail(f"{name}: antiquant_scale dtype {antiquant_scale.dtype} must equal x dtype {x.dtype}")
    g = antiquant_group_size
    if g:
        if tuple(antiquant_scale.shape) != (-(-k // g), n):
            _fail(f"{name}: per-group antiquant_scale must be (ceil(K/g), N) = ({-(-k // g)}, {n})")
        s = antiquant_scale.float().repeat_interleave(g, dim=0)[:k]
    else:
        if antiquant_scale.numel() not in (1, n):
            _fail(f"{name}: per-channel antiquant_scale must be (N,) or per-tensor (1,); got {tuple(antiquant_scale.shape)}"
                  " -- a per-group scale needs antiquant_group_size")
        s = antiquant_scale.float().reshape(1, -1)
    w = (weight.float() * s).to(x.dtype)
    return (x.float() @ w.float()).to(x.dtype)


# ---- MoE [1.6] ----------------------------------------------------------------------------------------


def npu_moe_gating_top_k(x, k, *, bias=None, input_ids=None, tid2eid=None, k_group=1, group_count=1,
                         group_select_mode=0, renorm=0, norm_type=0, out_flag=False, routed_scaling_factor=1.0,
                         eps=1e-20):
    """-> (y, expert_idx int32, norm_out fp32). norm_type 0 softmax / 1 sigmoid; bias steers selection only;
    groups ranked by max (mode 0) or top-2 sum (mode 1); y divided by its sum (+eps) only for norm_type 1;
    times routed_scaling_factor. Only renorm=0."""
    _count("npu_moe_gating_top_k")
    name = "npu_moe_gating_top_k"
    _no_extra(name, input_ids=input_ids, tid2eid=tid2eid)
    if renorm != 0:
        _fail(f"{name}: only renorm=0 is supported")
    _check_dtype(name, x, _FLOAT, "x")
    if x.dim() != 2 or x.shape[1] > 2048:
        _fail(f"{name}: x must be 2-D with at most 2048 experts")
    t, e = x.shape
    if e % group_count or not 1 <= k_group <= group_count or k > k_group * (e // group_count):
        _fail(f"{name}: inconsistent k={k}, k_group={k_group}, group_count={group_count} for {e} experts")
    xf = x.float()
    scores = xf.sigmoid() if norm_type == 1 else xf.softmax(-1) if norm_type == 0 else _fail(f"{name}: norm_type")
    biased = scores + bias.float() if bias is not None else scores
    per_group = biased.view(t, group_count, e // group_count)
    if group_select_mode == 0:
        group_score = per_group.amax(-1)
    elif group_select_mode == 1:
        group_score = per_group.topk(min(2, per_group.shape[-1]), dim=-1).values.sum(-1)
    else:
        _fail(f"{name}: group_select_mode must be 0 or 1")
    keep = torch.zeros_like(group_score, dtype=torch.bool).scatter_(1, group_score.topk(k_group, dim=-1).indices, True)
    masked = biased.masked_fill(~keep.repeat_interleave(e // group_count, dim=1), float("-inf"))
    idx = masked.topk(k, dim=-1).indices
    y = scores.gather(1, idx)
    if norm_type == 1:
        y = y / (y.sum(-1, keepdim=True) + eps)
    y = y * routed_scaling_factor
    return y.to(x.dtype), idx.to(torch.int32), scores


def npu_moe_init_routing_v2(x, expert_idx, *, scale=None, offset=None, active_num=-1, expert_capacity=-1,
                            expert_num=-1, drop_pad_mode=0, expert_tokens_num_type=0, expert_tokens_num_flag=False,
                            quant_mode=-1, active_expert_range=[], row_idx_type=0):
    """-> (expanded_x, expanded_row_idx int32, expert_token_cumsum_or_count int64, expanded_scale).

    Rows are the T*k (token, choice) pairs in token-major order, stably sorted by expert; expanded_x[i] is
    the token of sorted row i, and (row_idx_type 0) expanded_row_idx[src] = i, its position after the sort
    (op-plugin docs/context/torch_npu-npu_moe_init_routing_v2.md, formula step 2). quant_mode -1 none,
    1 dynamic int8 (expanded_scale fp32 per row)."""
    _count("npu_moe_init_routing_v2")
    name = "npu_moe_init_routing_v2"
    _no_extra(name, scale=scale, offset=offset)
    if drop_pad_mode != 0:
        raise NotImplementedError(f"{name}: drop_pad_mode {drop_pad_mode} is not modelled")
    _check_dtype(name, x, (*_FLOAT, torch.int8), "x")
    if x.dim() != 2:
        _fail(f"{name}: x must be 2-D (NUM_ROWS, H)")
    if expert_idx.dtype != torch.int32 or expert_idx.dim() != 2 or expert_idx.shape[0] != x.shape[0]:
        _fail(f"{name}: expert_idx must be int32 [NUM_ROWS, k] (VA: topk_ids must be int32)")
    t, k = expert_idx.shape
    if active_num not in (-1,) and active_num < t * k:
        raise NotImplementedError(f"{name}: active_num < T*k (dropping rows) is not modelled")
    if expert_tokens_num_flag and expert_num <= 0:
        _fail(f"{name}: expert token counts need expert_num")
    if list(active_expert_range) not in ([], [0, expert_num]):
        raise NotImplementedError(f"{name}: a partial active_expert_range is not modelled")
    flat = expert_idx.reshape(-1).long()
    if expert_num > 0 and flat.numel() and (flat.min() < 0 or flat.max() >= expert_num):
        _fail(f"{name}: expert id out of range [0, {expert_num})")
    sorted_row = torch.sort(flat, stable=True).indices
    expanded_x = x[sorted_row // k]
    if row_idx_type == 0:
        expanded_row_idx = torch.empty_like(sorted_row).scatter_(0, sorted_row, torch.arange(flat.numel()))
    elif row_idx_type == 1:
        expanded_row_idx = sorted_row
    else:
        _fail(f"{name}: row_idx_type must be 0 or 1")
    counts = torch.bincount(flat, minlength=max(expert_num, 0))
    if expert_tokens_num_type == 0:
        counts = counts.cumsum(0)
    elif expert_tokens_num_type != 1:
        raise NotImplementedError(f"{name}: expert_tokens_num_type {expert_tokens_num_type} is not modelled")
    expanded_scale = torch.empty(0, dtype=torch.float32)
    if quant_mode == 1:
        expanded_x, expanded_scale = _row_int8(expanded_x)
    elif quant_mode == 0:
        _fail(f"{name}: quant_mode=0 is STATIC int8 and needs `scale`; pass quant_mode=-1 for no quantisation")
    elif quant_mode != -1:
        if family() != "950":
            _fail(f"{name}: quant_mode {quant_mode} (MX/HiF8) exists only on 950")
        raise NotImplementedError(f"{name}: quant_mode {quant_mode} is not modelled")
    return expanded_x, expanded_row_idx.to(torch.int32), counts.to(torch.int64), expanded_scale


def _row_int8(x):
    xf = x.float()
    s = xf.abs().amax(-1).clamp(min=1e-12) / 127.0
    return torch.round(xf / s[:, None]).clamp(-127, 127).to(torch.int8), s


def npu_grouped_matmul(x, weight, *, bias=None, scale=None, offset=None, antiquant_scale=None, antiquant_offset=None,
                       per_token_scale=None, group_list=None, activation_input=None, activation_quant_scale=None,
                       activation_quant_offset=None, split_item=0, group_type=None, group_list_type=0, act_type=0,
                       tuning_config=None, output_dtype=None):
    """y_g = x_g @ weight[g] with weight [E, K, N] (ADOC [1.6]); x split on M (group_type 0) by group_list
    (int64; group_list_type 0 cumsum, 1 counts). int8 x int8: scale=[(E, N)], per_token_scale=[(M,) fp32],
    output_dtype bf16/fp16. Only the one-x, one-weight, split_item 2/3 form is modelled."""
    _count("npu_grouped_matmul")
    name = "npu_grouped_matmul"
    _no_extra(name, bias=bias, offset=offset, antiquant_scale=antiquant_scale, antiquant_offset=antiquant_offset,
              activation_input=activation_input, activation_quant_scale=activation_quant_scale,
              activation_quant_offset=activation_quant_offset, act_type=act_type, tuning_config=tuning_config)
    if not isinstance(x, (list, tuple)) or not isinstance(weight, (list, tuple)):
        _fail(f"{name}: x and weight are List[Tensor]")
    if len(x) != 1 or len(weight) != 1 or split_item not in (2, 3) or group_type != 0:
        raise NotImplementedError(f"{name}: only x=[M,K], weight=[E,K,N], split_item 2/3, group_type 0 are modelled")
    xs, w = x[0], weight[0]
    if w.dim() != 3 or xs.dim() != 2 or xs.shape[1] != w.shape[1]:
        _fail(f"{name}: weight must be [E, K, N] with K = x.shape[1] = {xs.shape[1]}; got {tuple(w.shape)} "
              "(transpose an [E, N, K] bank with .transpose(1, 2))")
    if group_list is None or group_list.dtype != torch.int64 or group_list.shape != (w.shape[0],):
        _fail(f"{name}: group_list must be int64 [E]")
    if group_list_type == 1:
        counts = group_list.tolist()
    elif group_list_type == 0:
        cs = group_list.tolist()
        counts = [b - a for a, b in zip([0] + cs[:-1], cs)]
    else:
        raise NotImplementedError(f"{name}: group_list_type {group_list_type} is not modelled")
    if sum(counts) != xs.shape[0] or min(counts, default=0) < 0:
        _fail(f"{name}: group_list covers {sum(counts)} rows, x has {xs.shape[0]}")
    if xs.dtype == torch.int8:
        if w.dtype != torch.int8 or scale is None or per_token_scale is None or output_dtype not in _HALF:
            _fail(f"{name}: int8 GMM needs int8 weight, scale=[(E, N)], per_token_scale=[(M,)] and output_dtype bf16/fp16")
        sc, pts = scale[0], per_token_scale[0]
        if sc.shape != (w.shape[0], w.shape[2]) or sc.dtype not in (torch.float32, torch.bfloat16):
            _fail(f"{name}: scale must be [(E, N)] fp32/bf16")
        if pts.dtype != torch.float32 or pts.shape != (xs.shape[0],):
            _fail(f"{name}: per_token_scale must be [(M,)] fp32")
        _check_dtype(name, torch.empty(0, dtype=output_dtype), _HALF, "output")
    else:
        _fp8_allowed(name, xs.dtype)
        _check_dtype(name, xs, _FLOAT, "x")
        if w.dtype != xs.dtype:
            _fail(f"{name}: weight dtype {w.dtype} must equal x dtype {xs.dtype}")
        if scale is not None or per_token_scale is not None:
            _fail(f"{name}: scale/per_token_scale belong to the quantized path")
    out_dtype = output_dtype if xs.dtype == torch.int8 else xs.dtype
    y = torch.empty(xs.shape[0], w.shape[2], dtype=out_dtype, device=xs.device)
    start = 0
    for e, n in enumerate(counts):
        rows = slice(start, start + n)
        if xs.dtype == torch.int8:
            acc = (xs[rows].double() @ w[e].double()).float()
            y[rows] = (acc * per_token_scale[0][rows, None] * scale[0][e].float()).to(out_dtype)
        else:
            y[rows] = (xs[rows].float() @ w[e].float()).to(out_dtype)
        start += n
    return [y]


def npu_moe_token_unpermute(permuted_tokens, sorted_indices, probs=None, padded_mode=False, restore_shape=None):
    """O[i] = sum_j probs[i, j] * T[S[i*topK + j]] (op-plugin torch_npu-npu_moe_token_unpermute.md)."""
    _count("npu_moe_token_unpermute")
    name = "npu_moe_token_unpermute"
    if padded_mode or restore_shape is not None:
        _fail(f"{name}: only padded_mode=False / restore_shape=None are supported")
    _check_dtype(name, permuted_tokens, _FLOAT, "permuted_tokens")
    if sorted_indices.dtype != torch.int32 or sorted_indices.dim() != 1:
        _fail(f"{name}: sorted_indices must be 1-D int32")
    n = permuted_tokens.shape[0]
    if sorted_indices.shape[0] != n or sorted_indices.unique().numel() != n or \
            (n and (sorted_indices.min() < 0 or sorted_indices.max() >= n)):
        _fail(f"{name}: sorted_indices must be a permutation of [0, {n})")
    top_k = 1 if probs is None else probs.shape[-1]
    if probs is not None:
        _check_dtype(name, probs, _FLOAT, "probs")
        if probs.dim() != 2 or probs.shape[0] * top_k != n:
            _fail(f"{name}: probs must be (tokens, topK) with tokens*topK = {n}")
    if top_k > 512 and family() in ("A2", "A3"):
        _fail(f"{name}: topK must be <= 512 on A2/A3")
    gathered = permuted_tokens.float()[sorted_indices.long()].view(n // top_k, top_k, -1)
    if probs is not None:
        gathered = gathered * probs.float()[..., None]
    return gathered.sum(1).to(permuted_tokens.dtype)

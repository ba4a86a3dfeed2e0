"""`flagdeploy ops tune --chip cpu`: measure this CPU and return the shape buckets of tune.yaml.

Each tunable is a crossover: which dtype the dense copy of a weight-only linear is in, whether one is worth
keeping beside the backend's own packed kernels at all, and up to some row count the packed GEMV kernel beats it;
up to some tokens x experts the dense all-experts MoE beats the per-expert loop; up to some cache slots read,
torch's fused SDPA beats the backend's two batched matmuls for decode attention; from some output width (and up to
some input width) a column-major dense weight beats the row-major one; and whether a compiled step should freeze its
weights for oneDNN's laid-out matmuls (and autotune them). They are measured at SmolLM2-135M's linear shapes and a
small MoE's, and returned as data for `ops tune` to write, as one table of tune.yaml's `machines`.
"""

from __future__ import annotations

import contextlib

import torch
import torch.nn.functional as F

from flagdeploy.ops import fused
from flagdeploy.ops.check import fastest
from flagdeploy.ops.registry import OPS
from flagdeploy.ops.weights import Int4Weight, Int8Weight

from . import native, ops

ROWS = (1, 2, 3, 4, 6, 8, 12, 16, 24, 32, 48, 64)
PROMPT_ROWS = (128, 512)  # where a dense copy could still pay (`_dense_copy_wins`)
LINEAR_SHAPES = ((960, 576), (3072, 576), (576, 1536))
WIDTHS = (16, 32, 64, 128, 256, 512, 1024, 4096)  # weight widths tried for the dense weights' layout


def _best(fn) -> float:
    return fastest(fn, repeats=7)


def _int4(w: torch.Tensor) -> Int4Weight:
    groups = w.shape[1] // 32
    return Int4Weight(torch.randint(0, 16, w.shape, dtype=torch.uint8), torch.full((w.shape[0], groups), 0.01),
                      torch.zeros(w.shape[0], groups), 32, *w.shape)


# op -> (make a canonical bundle, the backend's prepare, its packed kernel)
_LINEARS = {"linear_w4a16": (_int4, ops.prepare_w4a16, ops.packed_w4a16),
            "linear_w8a16": (Int8Weight.quantize, ops.prepare_w8a16, ops.packed_w8a16)}


def _dense_dtype() -> str:
    """The dtype of the dense copy: bf16 where oneDNN multiplies it faster than MKL does float32 at a
    prompt's 128 rows over one layer's shapes (AVX-512 BF16, AMX), else float32 (bf16 emulated)."""
    if not ops.ONEDNN_BF16:
        return "float32"
    g = torch.Generator().manual_seed(0)
    ws = [torch.randn(n, k, generator=g) * 0.02 for n, k in LINEAR_SHAPES]
    xs = [torch.randn(128, k, generator=g).to(torch.bfloat16) for _, k in LINEAR_SHAPES]
    took = {}
    for dtype in (torch.bfloat16, torch.float32):
        laid = [torch.ops.mkldnn._reorder_linear_weight(w.to(dtype), 16) for w in ws]
        took[dtype] = _best(lambda: [ops._dense_mm(x, w) for x, w in zip(xs, laid)])
    return "bfloat16" if took[torch.bfloat16] < took[torch.float32] else "float32"


def _packed_and_dense(op: str, dense_dtype: str, rows: tuple[int, ...]):
    """(rows, packed kernel's seconds, dense copy's seconds in `dense_dtype`) for each count of `rows` in turn, over
    one layer's shapes."""
    make, prepare, packed = _LINEARS[op]
    g = torch.Generator().manual_seed(0)
    with _dense_copies(dense_dtype):
        ws = [prepare(make(torch.randn(n, k, generator=g) * 0.02)) for n, k in LINEAR_SHAPES]
    for m in rows:
        xs = [torch.randn(m, k).to(torch.bfloat16) for _, k in LINEAR_SHAPES]
        t_packed = _best(lambda: [packed(x, w) for x, w in zip(xs, ws)])
        yield m, t_packed, _best(lambda: [ops._dense_mm(x, w.prepared["dense"]) for x, w in zip(xs, ws)])


def _linear_crossover(op: str, dense_dtype: str) -> int:
    """The largest row count up to which the packed kernel is still faster than the dense copy in
    `dense_dtype`, over one layer's shapes."""
    return max((m for m, t_packed, t_dense in _packed_and_dense(op, dense_dtype, ROWS) if t_packed <= t_dense),
               default=0)


def _dense_copy_wins(op: str, dense_dtype: str) -> bool:
    """Whether a dense copy in `dense_dtype` is worth keeping beside the backend's own packed kernel: it multiplies a
    prompt's 128 or 512 rows faster, over one layer's shapes. Where that kernel does not build, torch's keeps one."""
    return not native.available() or any(t_dense < t_packed for _, t_packed, t_dense
                                         in _packed_and_dense(op, dense_dtype, PROMPT_ROWS))


def _amx_min_rows(kernels=None) -> int | None:
    """The least row count from which q4_linear's AMX path beats its VNNI path by 5% at each count tried up to
    the packed kernel's 16 (None: from none), over one layer's shapes. Both paths give the same bits, so only
    their speed is compared; where the kernel may not use the tiles (a Linux that refuses them) both run the VNNI
    path and none wins. `kernels`: an op namespace with the path (the process's own build where None)."""
    kernels = kernels or torch.ops.flagdeploy_cpu
    g = torch.Generator().manual_seed(0)
    ws = [native.pack_q4(_int4(torch.empty(n, k))) for n, k in LINEAR_SHAPES]
    before, wins = kernels.q4_amx_min_rows(0), {}
    try:
        for m in (r for r in ROWS if r <= 16):
            xs = [torch.randn(m, k, generator=g).to(torch.bfloat16) for _, k in LINEAR_SHAPES]
            took = {}
            for path, rows in (("amx", 1), ("vnni", native.AMX_NEVER)):
                kernels.q4_amx_min_rows(rows)
                took[path] = _best(lambda: [kernels.q4_linear(x, *w) for x, w in zip(xs, ws)])
            wins[m] = took["amx"] < 0.95 * took["vnni"]
    finally:
        kernels.q4_amx_min_rows(before)
    return next((m for m in wins if all(wins[r] for r in wins if r >= m)), None)


@contextlib.contextmanager
def _dense_copies(dtype: str):
    """`prepare_*` makes dense copies, in `dtype`, meanwhile."""
    tables = (ops.TUNE["weight_only_dense"], ops.TUNE["linear_w4a16"], ops.TUNE["linear_w8a16"])
    before = [dict(t) for t in tables]
    tables[0]["dtype"] = dtype
    for t in tables[1:]:
        t["dense_copy"] = True
    try:
        yield
    finally:
        for t, b in zip(tables, before):
            t.clear()
            t.update(b)


def _column_major_wins(n: int, k: int, g: torch.Generator, rows=(1, 4, 8), dtype=torch.float32) -> bool:
    """Whether a column-major [n, k] weight multiplies decode's rows at least as fast as a row-major one."""
    xs = [torch.randn(m, k, generator=g).to(dtype) for m in rows]
    w = torch.randn(n, k, generator=g).to(dtype)
    col = w.t().contiguous().t()
    return _best(lambda: [F.linear(x, col) for x in xs]) <= _best(lambda: [F.linear(x, w) for x in xs])


def _layout_crossovers() -> dict:
    """The smallest output width (at 256 inputs) from which column-major wins at every width tested above
    it too, and the largest input width (at 1024 outputs) up to which it wins at every width below."""
    g = torch.Generator().manual_seed(0)
    min_out = None
    for n in WIDTHS:
        min_out = (min_out or n) if _column_major_wins(n, 256, g) else None
    max_in = 0
    for k in WIDTHS[3:]:
        if not _column_major_wins(1024, k, g):
            break
        max_in = k
    return {"column_major_min_out": min_out or 2 * WIDTHS[-1], "column_major_max_in": max_in}


def _moe_crossover() -> int:
    """The largest tokens x experts for which computing every expert densely beats the expert loop."""
    g = torch.Generator().manual_seed(0)
    e, h, i = 16, 256, 128
    gate_up, down = torch.randn(e, 2 * i, h, generator=g) * 0.05, torch.randn(e, h, i, generator=g) * 0.05
    dense = ops.prepare_moe_banks((gate_up, down))
    last = 0
    for t in (1, 2, 4, 8, 16, 32, 64):
        x = torch.randn(t, h, generator=g)
        picks = torch.stack([torch.randperm(e, generator=g)[:2] for _ in range(t)])
        routing = torch.zeros(t, e).scatter_(1, picks, 0.5)
        if _best(lambda: ops.dense_experts(x, routing, *dense)) <= _best(
                lambda: OPS["moe_experts"].reference(x, routing, gate_up, down, None)):
            last = t * e
    return last


def _column_major_gate_up() -> list[str]:
    """The dtypes whose all-expert gate/up weight ([16 x 256, 256] at decode's 8 rows) multiplies at least
    as fast column-major."""
    g = torch.Generator().manual_seed(0)
    dtypes = (torch.float32, torch.bfloat16) if ops.ONEDNN_BF16 else (torch.float32,)
    return [str(dt).removeprefix("torch.") for dt in dtypes if _column_major_wins(16 * 256, 256, g, rows=(8,), dtype=dt)]


def _attention_crossover() -> int:
    """The most cache slots a decode step may read (sequences x table width x block size) for torch's
    fused SDPA to still beat the batched matmuls, at every size up to it; SmolLM2's heads (9 over 3 key
    heads of 64), bf16 caches of 16-slot blocks, each size as one sequence and as four."""
    g = torch.Generator().manual_seed(0)
    block, heads, kv_heads, dim = 16, 9, 3, 64
    caches = [torch.randn(160, block, kv_heads, dim, generator=g).to(torch.bfloat16) for _ in range(2)]
    last = 0
    for slots in (64, 128, 256, 512, 1024, 2048):
        sdpa = matmuls = 0.0
        for seqs in (1, 4):
            width = slots // block // seqs
            q = torch.randn(seqs, heads, dim, generator=g).to(torch.bfloat16)
            tables = torch.randperm(160, generator=g)[: seqs * width].view(seqs, width).to(torch.int32)
            args = (q, *caches, tables, torch.full((seqs,), width * block, dtype=torch.int32), dim**-0.5)
            sdpa += _best(lambda: fused.paged_attention_decode(*args))
            matmuls += _best(lambda: ops.decode_attention_matmuls(*args))
        if sdpa > matmuls:
            break
        last = slots
    return last


def _native_attention_max_keys() -> int:
    """The most cache slots a decode step's sequences may each read for the backend's own kernel
    (csrc/decode_attention.cpp) to still beat torch's faster form (fused SDPA or the batched matmuls) at
    every size up to it, one sequence and four; SmolLM2's heads, bf16 caches of 16-slot blocks. 0 where the
    kernels are not built."""
    from . import native

    if not native.available():
        return 0
    g = torch.Generator().manual_seed(0)
    block, heads, kv_heads, dim, blocks = 16, 9, 3, 64, 4 * 8192 // 16
    caches = [torch.randn(blocks, block, kv_heads, dim, generator=g).to(torch.bfloat16) for _ in range(2)]
    last = 0
    for slots in (256, 512, 1024, 2048, 4096, 8192):
        own = torch_best = 0.0
        for seqs in (1, 4):
            width = slots // block
            q = torch.randn(seqs, heads, dim, generator=g).to(torch.bfloat16)
            tables = torch.randperm(blocks, generator=g)[: seqs * width].view(seqs, width)
            args = (q, *caches, tables, torch.full((seqs,), slots, dtype=torch.int32), dim**-0.5)
            own += _best(lambda: native.paged_decode_attention(*args))
            torch_best += min(_best(lambda: fused.paged_attention_decode(*args)),
                              _best(lambda: ops.decode_attention_matmuls(*args)))
        if own > torch_best:
            break
        last = slots
    return last


def _freezing_wins() -> bool:
    """Whether oneDNN's laid-out float32 matmul (what a frozen compiled step calls) beats MKL's GEMM on
    plain weights at decode's 8 rows, over a small model's shapes."""
    g = torch.Generator().manual_seed(0)
    ws = [torch.randn(n, k, generator=g) for n, k in ((4096, 256), (1024, 256), (256, 1024), (768, 256))]
    xs = [torch.randn(8, w.shape[1], generator=g) for w in ws]
    packed = [torch.ops.mkldnn._reorder_linear_weight(w, 8) for w in ws]
    onednn = _best(lambda: [torch.ops.mkldnn._linear_pointwise(x, p, None, "none", [], "") for x, p in zip(xs, packed)])
    return onednn < _best(lambda: [F.linear(x, w) for x, w in zip(xs, ws)])


def measure() -> dict:
    """The tune table's values as measured on this machine (the keys of tune.yaml)."""
    dense = _dense_dtype()
    return {"linear": _layout_crossovers(),
            "weight_only_dense": {"dtype": dense},
            "linear_w4a16": {"packed_max_m": _linear_crossover("linear_w4a16", dense),
                             "dense_copy": _dense_copy_wins("linear_w4a16", dense),
                             # where the kernels were built with the AMX path (FLAGDEPLOY_CPU_ISA=amx)
                             **({"amx_min_rows": _amx_min_rows()}
                                if native.available() and torch.ops.flagdeploy_cpu.q4_amx_min_rows(0) else {})},
            "linear_w8a16": {"packed_max_m": _linear_crossover("linear_w8a16", dense),
                             "dense_copy": _dense_copy_wins("linear_w8a16", dense)},
            "moe_experts": {"dense_max_token_experts": _moe_crossover(), "column_major_gate_up": _column_major_gate_up()},
            # float32 caches stay on SDPA by choice, not measurement: the dense float32 mode is batch-invariant
            "paged_attention_decode": {"native_max_keys": _native_attention_max_keys(),
                                       "sdpa_max_keys": _attention_crossover(), "matmul_dtypes": ["bfloat16", "float16"],
                                       # measured with a model (benchmarks/cpu_prompt_rows.py), not here: kept
                                       "prompt_max_keys": ops.TUNE["paged_attention_decode"].get("prompt_max_keys", 0)},
            "compile": _compile_settings(torch.backends.mkldnn.is_available() and _freezing_wins())}


def _compile_settings(freeze: bool) -> dict:
    """Inductor's settings for the compiled decode step. Its CPP GEMM templates (generated GEMMs, timed
    against ATen's kernel at compile time, the faster kept) need the weights frozen into the graph, so
    the one-row graph of a weight-only quantized model is autotuned exactly where freezing is on: the
    autotuner measures itself."""
    autotune = {"max_autotune": True, "max_autotune_gemm_backends": "CPP,ATEN"} if freeze else {}
    return {"freezing": freeze, "weight_only_one_row": autotune}

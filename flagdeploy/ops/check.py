"""Per-op evidence for one backend: each op on its device against the float64 reference, with timings.

`flagdeploy ops check --chip X [--model CONFIG]` and `flagdeploy selftest --chip X` run this. For every
declared op and dtype it builds the op's random inputs (the spec's own, or, with a model config, inputs
at that model's shapes in row buckets: 1 row is decode, 16 a small batch, 256 a prefill chunk), runs the
backend's implementation (its override, a composite of its other ops, else the reference: "native" /
"composite" / "reference") on the backend's device, and compares with the reference run in float64 on the CPU. An op that raises is "missing".
"""

from __future__ import annotations

import time
from dataclasses import asdict, dataclass

import torch

from . import reference as ref
from .registry import OPS, Backend, implementation
from .weights import Fp8BlockWeight, Int4Weight, Int8Weight, W8A8Weight, to_device

DTYPES = (torch.float32, torch.bfloat16)
BUCKETS = (1, 16, 256)


@dataclass
class OpResult:
    op: str
    dtype: str
    shape: str  # "spec" or the bucket label, e.g. "m16 hidden=576"
    impl: str  # native, composite, reference, missing
    max_abs_err: float | None
    max_rel_err: float | None
    tolerance: str
    passed: bool
    time_us: float | None
    error: str = ""


def _to(x, device, dtype=None):
    if isinstance(x, torch.Tensor):
        return x.to(device=device, dtype=dtype if (dtype and x.is_floating_point()) else x.dtype)
    if isinstance(x, (Int4Weight, Int8Weight, Fp8BlockWeight)):
        return to_device(x, device)
    return x


def synchronizer(device: str):
    """What waits for the work queued on `device` (nothing on the CPU, where calls finish before they return)."""
    mod = getattr(torch, device, None)
    return mod.synchronize if device != "cpu" and hasattr(mod, "synchronize") else (lambda: None)


def fastest(fn, repeats: int = 5, device: str = "cpu") -> float:
    """Seconds of the fastest of `repeats` calls of `fn`, after one untimed call (allocations, caches)."""
    sync = synchronizer(device)
    fn()
    sync()
    best = float("inf")
    for _ in range(repeats):
        t = time.perf_counter()
        fn()
        sync()
        best = min(best, time.perf_counter() - t)
    return best


def _time_us(fn, args, kwargs, device: str, repeats: int = 5) -> float:
    sync = synchronizer(device)
    fn(*_fresh(args), **kwargs)
    sync()
    best = float("inf")
    for _ in range(repeats):
        a = _fresh(args)  # in-place ops get fresh inputs each call, outside the timed span
        t = time.perf_counter()
        fn(*a, **kwargs)
        sync()
        best = min(best, time.perf_counter() - t)
    return best * 1e6


def _fresh(args):
    return [a.clone() if isinstance(a, torch.Tensor) else a for a in args]


def check_case(be: Backend, name: str, dtype: torch.dtype, args: tuple, kwargs: dict, label: str) -> OpResult:
    spec = OPS[name]
    impl, fn = implementation(be, name)
    tol = spec.tolerance[dtype]
    tol_s = f"atol={tol.atol:g} rtol={tol.rtol:g}"
    ref_args = _fresh([_to(a, "cpu", torch.float64) for a in args])
    want = [w.double() for w in spec.outputs(spec.reference(*ref_args, **kwargs), ref_args)]  # indices too (argmax)
    dev_args = [_to(a, be.device_type) for a in args]
    prepare = be.prepare.get(name)
    if prepare and name in be.overrides:
        dev_args = [prepare(a) if isinstance(a, (Int4Weight, Int8Weight)) else a for a in dev_args]
    try:
        run_args = _fresh(dev_args)
        got = spec.outputs(fn(*run_args, **kwargs), run_args)
        abs_err = max(float((g.double().cpu() - w).abs().max()) for g, w in zip(got, want))
        rel_err = max(float(((g.double().cpu() - w).abs() / (w.abs() + tol.atol / max(tol.rtol, 1e-12))).max())
                      for g, w in zip(got, want))
        passed = all(torch.allclose(g.double().cpu(), w, atol=tol.atol, rtol=tol.rtol) for g, w in zip(got, want))
        us = _time_us(fn, dev_args, kwargs, be.device_type)
        return OpResult(name, str(dtype).removeprefix("torch."), label, impl, abs_err, rel_err, tol_s, passed, us)
    except Exception as exc:  # noqa: BLE001 - the point is to report what a device cannot run
        return OpResult(name, str(dtype).removeprefix("torch."), label, "missing", None, None, tol_s, False, None,
                        f"{type(exc).__name__}: {exc}"[:300])


def model_cases(config: dict, dtype: torch.dtype, gen: torch.Generator):
    """(op, label, args, kwargs) at a llama-like model's shapes, per row bucket."""
    t = config.get("text_config") or config
    h, heads = t["hidden_size"], t["num_attention_heads"]
    kvh = t.get("num_key_value_heads") or heads
    d = t.get("head_dim") or h // heads
    inter = t.get("moe_intermediate_size") if config.get("model_type") == "glm5_next" else t["intermediate_size"]
    r = lambda *s, scale=1.0: ref._randn(gen, *s, dtype=dtype, device="cpu", scale=scale)  # noqa: E731
    for m in BUCKETS:
        lab = f"m{m} hidden={h}"
        yield "linear", f"{lab} out={2 * inter}", (r(m, h), r(2 * inter, h, scale=h ** -0.5), None), {}
        w8 = Int8Weight.quantize(torch.randn(2 * inter, h, generator=gen) * h ** -0.5)
        yield "linear_w8a16", f"{lab} out={2 * inter}", (r(m, h), w8, None), {}
        yield "linear_w8a8_dynamic", f"{lab} out={2 * inter}", (r(m, h), W8A8Weight(w8.q, w8.scales, w8.out_features,
                                                                                        w8.in_features), None), {}
        if h % 128 == 0 and inter % 64 == 0:
            fp8 = Fp8BlockWeight.quantize(torch.randn(2 * inter, h, generator=gen) * h ** -0.5)
            yield "linear_fp8_block", f"{lab} out={2 * inter}", (r(m, h), fp8, None), {}
        yield "rms_norm", lab, (r(m, h), r(h), 1e-6), {}
        yield "add_rms_norm", lab, (r(m, h), r(m, h), r(h), 1e-6), {}
        yield "swiglu", f"m{m} inter={inter}", (r(m, 2 * inter, scale=3.0),), {}
        cos, sin = ref.rope_tables(d, 4096, 10000.0)
        pos = torch.randint(0, 4096, (m,), generator=gen)
        yield "rope", f"m{m} heads={heads}x{d}", (r(m, heads, d), r(m, kvh, d), cos[pos], sin[pos]), {}
        cu = torch.tensor([0, m], dtype=torch.int32)
        yield "attention_prefill", f"m{m} heads={heads}/{kvh}x{d}", (r(m, heads, d), r(m, kvh, d), r(m, kvh, d), cu, cu,
                                                                     d ** -0.5), {}
        blocks = 64
        tables = torch.randperm(blocks, generator=gen)[: 4 * min(m, 16)].view(min(m, 16), 4).int()
        lens = torch.randint(1, 64, (min(m, 16),), generator=gen).int()
        yield "paged_attention_decode", f"b{min(m, 16)} ctx<=64 heads={heads}/{kvh}x{d}", (
            r(min(m, 16), heads, d), r(blocks, 16, kvh, d), r(blocks, 16, kvh, d), tables, lens, d ** -0.5), {}


def check_backend(be: Backend, dtypes=DTYPES, config: dict | None = None, seed: int = 0) -> list[OpResult]:
    results = []
    for dtype in dtypes:
        gen = torch.Generator().manual_seed(seed)
        if config is None:
            for name, spec in OPS.items():
                args, kwargs = spec.make_inputs(dtype, "cpu", gen)
                results.append(check_case(be, name, dtype, args, kwargs, "spec"))
        else:
            for name, label, args, kwargs in model_cases(config, dtype, gen):
                results.append(check_case(be, name, dtype, args, kwargs, label))
    return results


def format_results(be: Backend, results: list[OpResult]) -> str:
    lines = [f"backend {be.name} ({be.vendor}, device {be.device_type})",
             f"  {'op':<24}{'dtype':<10}{'shape':<34}{'impl':<10}{'max abs err':>12}{'tolerance':>24}  {'ok':<5}{'us':>10}"]
    for r in results:
        err = f"{r.max_abs_err:.2e}" if r.max_abs_err is not None else "-"
        us = f"{r.time_us:.1f}" if r.time_us is not None else "-"
        lines.append(f"  {r.op:<24}{r.dtype:<10}{r.shape[:33]:<34}{r.impl:<10}{err:>12}{r.tolerance:>24}  "
                     f"{'yes' if r.passed else 'NO':<5}{us:>10}" + (f"  {r.error}" if r.error else ""))
    bad = [r for r in results if not r.passed]
    lines.append(f"{len(results) - len(bad)} of {len(results)} passed" + (f"; failing: {sorted({r.op for r in bad})}" if bad else ""))
    return "\n".join(lines)


def as_json(be: Backend, results: list[OpResult], **extra) -> dict:
    return {"backend": be.name, "vendor": be.vendor, "device": be.device_type, **extra,
            "torch": torch.__version__, "results": [asdict(r) for r in results],
            "passed": sum(r.passed for r in results), "total": len(results)}

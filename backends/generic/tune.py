"""`flagdeploy ops tune --chip X` for the generic backend: measure every candidate of every op on the device
and return the choice table (backends/generic/choices.py has the format).

Each candidate runs at each shape bucket's row count and dtype on the backend's device; its outputs are
compared with the reference run in float64 on the CPU within the op's tolerance (flagdeploy.ops.check,
the same check as `ops check`), and it is timed (fastest of a few calls, the device synchronised). A
candidate that raises or misses the tolerance is recorded as failed and never chosen.
"""

from __future__ import annotations

import dataclasses

import torch

from flagdeploy.ops import reference as ref
from flagdeploy.ops.check import check_case
from flagdeploy.ops.registry import Backend

from . import choices
from .candidates import candidates, gems_version

# a small llama's shapes by default (hidden, heads, kv heads, head dim, intermediate, vocabulary, experts);
# the MoE experts are measured with GLM's SwiGLU clamp (glm5_next's swiglu_limit), the calls the engine
# makes: FlagGems' fused experts have no clamp, so its candidate runs the reference there
SHAPES = {"hidden": 1024, "heads": 16, "kv_heads": 4, "head_dim": 64, "inter": 2816, "vocab": 32000, "experts": 8,
          "expert_inter": 256, "top_k": 2, "swiglu_limit": 10.0}
# Llama-3-8B's per-layer shapes (the MoE entries are not used by llama): benchmarks/generic_decode.py and
# FLAGDEPLOY_TUNE_SHAPES=llama-8b in tests/test_flaggems_gpu.py
SHAPES_LLAMA_8B = {"hidden": 4096, "heads": 32, "kv_heads": 8, "head_dim": 128, "inter": 14336, "vocab": 128256,
                   "experts": 16, "expert_inter": 512, "top_k": 4, "swiglu_limit": 10.0}
TUNED_DTYPES = (torch.float32, torch.bfloat16)


def cases(op: str, m: int, dtype: torch.dtype, gen: torch.Generator, s: dict):
    """(args, kwargs) for `op` at `m` rows and the shapes `s`, built on the CPU; None for an op not tuned."""
    r = lambda *shape, scale=1.0: ref._randn(gen, *shape, dtype=dtype, device="cpu", scale=scale)  # noqa: E731
    h, heads, kvh, d = s["hidden"], s["heads"], s["kv_heads"], s["head_dim"]
    if op == "rms_norm":
        return (r(m, h), r(h), 1e-6), {}
    if op == "add_rms_norm":
        return (r(m, h), r(m, h), r(h), 1e-6), {}
    if op == "swiglu":
        return (r(m, 2 * s["inter"], scale=3.0),), {}
    if op == "rope":
        cos, sin = ref.rope_tables(d, 4096, 10000.0)
        pos = torch.randint(0, 4096, (m,), generator=gen)
        return (r(m, heads, d), r(m, kvh, d), cos[pos], sin[pos]), {}
    if op == "write_kv_cache":
        blocks = -(-m // 16) + 4
        slots = torch.randperm(blocks * 16, generator=gen)[:m]
        return (r(m, kvh, d), r(m, kvh, d), torch.zeros(blocks, 16, kvh, d, dtype=dtype),
                torch.zeros(blocks, 16, kvh, d, dtype=dtype), slots), {}
    if op == "attention_prefill":
        # a prefill chunk of several prompts (one per 32 rows): per-sequence kernels pay per sequence, and a
        # chunk of one sequence would hide that
        seqs = max(1, m // 32)
        cu = torch.tensor([m * i // seqs for i in range(seqs + 1)], dtype=torch.int32)
        return (r(m, heads, d), r(m, kvh, d), r(m, kvh, d), cu, cu, d ** -0.5), {}
    if op == "paged_attention_decode":
        width, blocks = 4, 4 * m + 4
        tables = torch.randperm(blocks, generator=gen)[: 4 * m].view(m, width).int()
        lens = torch.randint(1, width * 16 + 1, (m,), generator=gen).int()
        return (r(m, heads, d), r(blocks, 16, kvh, d), r(blocks, 16, kvh, d), tables, lens, d ** -0.5), {}
    if op == "argmax":
        return (r(m, s["vocab"]),), {}
    if op == "embedding":
        return (torch.randint(0, s["vocab"], (m,), generator=gen), r(s["vocab"], h)), {}
    if op == "linear":
        return (r(m, h), r(h, h, scale=h ** -0.5), None), {}
    if op == "moe_experts":
        e, i, k = s["experts"], s["expert_inter"], s["top_k"]
        picks = torch.stack([torch.randperm(e, generator=gen)[:k] for _ in range(m)])
        routing = torch.zeros(m, e).scatter_(1, picks, torch.rand(m, k, generator=gen)).to(dtype)
        return (r(m, h), routing, r(e, 2 * i, h, scale=h ** -0.5), r(e, h, i, scale=i ** -0.5), s.get("swiglu_limit")), {"top_k": k}
    return None


# ops the engine never runs inside a captured decode step
NOT_IN_DECODE = {"attention_prefill"}


def replay_us(be: Backend, fn, args, kwargs, calls: int = 16) -> tuple[bool | None, float | None]:
    """(captured, microseconds per call replayed from a CUDA graph) of `fn(*args)`.

    A decode step the engine captures pays only the kernels' time: no per-call host overhead, which for a
    Triton library such as FlagGems (35-140 us a call eagerly) is most of what eager timing sees at a few
    rows. So decode-sized calls are compared as the engine runs them: `calls` calls captured in one graph,
    replayed, the best of five replays divided by `calls`. (None, None) where the engine captures nothing on
    this device (it captures CUDA graphs on device "cuda" only: model_runner.py); (False, None) where the
    capture fails (a host read-back, a sync or an allocation the capture refuses)."""
    if be.device_type != "cuda":
        return None, None
    import time

    from flagdeploy.engine.cuda_graphs import capture
    from flagdeploy.ops.check import _fresh, _to

    work = _fresh([_to(a, be.device_type) for a in args])  # in-place ops rewrite the same buffers each call
    try:
        graph, _ = capture(lambda: [fn(*work, **kwargs) for _ in range(calls)], None)
        graph.replay()
        torch.cuda.synchronize()
        best = float("inf")
        for _ in range(5):
            t = time.perf_counter()
            graph.replay()
            torch.cuda.synchronize()
            best = min(best, time.perf_counter() - t)
        return True, round(best * 1e6 / calls, 2)
    except Exception:  # noqa: BLE001 - what the capture refuses is the finding, not an error
        try:
            torch.cuda.synchronize()
        except Exception:  # noqa: BLE001
            pass
        return False, None


def measure_op(be: Backend, op: str, dtype: torch.dtype, m: int, shapes: dict, seed: int = 0) -> dict:
    """{candidate: {error, time_us, passed[, capturable, replay_us][, why]}} for `op` at `m` rows. Calls of at
    most the largest decode-graph batch are also timed under graph replay (`replay_us`)."""
    from flagdeploy.engine.cuda_graphs import BUCKETS as GRAPH_BATCHES

    out = {}
    for name, fn in candidates(op).items():
        gen = torch.Generator().manual_seed(seed)  # the same inputs for every candidate
        args, kwargs = cases(op, m, dtype, gen, shapes)
        one = dataclasses.replace(be, overrides={op: fn}, prepare={})
        res = check_case(one, op, dtype, args, kwargs, f"m{m}")
        entry = {"error": None if res.max_abs_err is None else float(f"{res.max_abs_err:.3g}"),
                 "time_us": None if res.time_us is None else round(res.time_us, 2), "passed": bool(res.passed)}
        if res.passed and op not in NOT_IN_DECODE and m <= GRAPH_BATCHES[-1]:
            captured, us = replay_us(be, fn, args, kwargs)
            if captured is not None:
                entry["capturable"] = captured
                if us is not None:
                    entry["replay_us"] = us
        if res.error:
            entry["why"] = res.error[:200]
        elif not res.passed:
            entry["why"] = f"outside {res.tolerance}"
        out[name] = entry
    return out


def measure(be: Backend, chip: str, family: str, shapes: dict | None = None, buckets=choices.BUCKETS,
            dtypes=TUNED_DTYPES, ops=None) -> dict:
    """The choice table of `be` on this host's device (see choices.py for the format)."""
    shapes = {**SHAPES, **(shapes or {})}
    table = {"chip": chip, "family": family, "device": be.device_type, "torch": str(torch.__version__),
             "flag_gems": gems_version(), "buckets": list(buckets), "shapes": shapes, "ops": {}}
    from .candidates import CANDIDATES

    from tqdm import tqdm

    steps = [(op, dtype, m) for op in ops or CANDIDATES for dtype in dtypes for m in buckets]
    for op, dtype, m in tqdm(steps, desc=f"tuning {chip}", unit="case", leave=False):
        results = measure_op(be, op, dtype, m, shapes)
        table["ops"].setdefault(op, {})[choices.key(dtype, m)] = {"choice": choices.choose(results),
                                                                  "candidates": results}
    return table


def summary(table: dict) -> str:
    """Per op and bucket: the choice, and each candidate's error, time and verdict (why it lost or failed)."""
    lines = [f"choice table of {table['chip']} (family {table['family']}, device {table['device']}, torch "
             f"{table['torch']}, flag_gems {table['flag_gems']})"]
    for op, entries in table["ops"].items():
        for k, entry in entries.items():
            parts = []
            for name, r in entry["candidates"].items():
                err = "-" if r["error"] is None else f"{r['error']:.2e}"
                us = "-" if r["time_us"] is None else f"{r['time_us']:.1f}us"
                if r.get("replay_us") is not None:
                    us += f" (graph {r['replay_us']:.1f}us)"
                verdict = "ok" if r["passed"] else f"FAILED ({r.get('why', '')})"
                parts.append(f"{name} err {err} {us} {verdict}")
            lines.append(f"  {op:<24}{k:<16}-> {entry['choice']:<10} " + "; ".join(parts))
    return "\n".join(lines)


def tune_and_write(be: Backend, output: str | None = None, **kw) -> str:
    """`flagdeploy ops tune --chip X`: measure, write the table atomically (to `output`, else where the
    backend loads it from), load it into `be`, and return what to print."""
    state = be.state
    if be.device_type != "cpu":
        from flagdeploy.ops.registry import require_device

        require_device(be, state.chip)
    table = measure(be, state.chip, state.family, **kw)
    path = choices.write(table, output or choices.default_path(state.chip))
    state.load(path)
    return summary(table) + f"\nwrote {path}"

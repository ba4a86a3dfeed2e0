"""The plan as a person reads it (one table, ten seconds) and as a machine reads it (`--json`)."""

from __future__ import annotations

import math
from collections import defaultdict

from .cost import GIB, Estimate, Layout, is_draft_layer
from .ledger import speculative_state_slots
from .search import Plan


def parse_layout(text: str) -> Layout:
    """`tp=4,ep=4,dp=1` (missing keys default to 1; each key at most once, at least one)."""
    fields = {}
    for part in filter(None, text.replace(" ", "").split(",")):
        key, _, value = part.partition("=")
        if key not in ("tp", "dp", "ep", "pp") or not value.isdigit() or int(value) < 1:
            raise ValueError(f"{part!r} in --layout: write it as tp=4,dp=2,ep=8,pp=1 (positive integers)")
        if key in fields:
            raise ValueError(f"--layout {text!r} gives {key} twice; give each of tp, dp, ep, pp at most once")
        fields[key] = int(value)
    if not fields:
        raise ValueError(f"--layout {text!r} is empty; write it as tp=4,dp=2,ep=8,pp=1, or leave it out to let the "
                         "planner choose")
    return Layout(**fields)


def _row(e: Estimate) -> dict:
    return {"tp": e.layout.tp, "dp": e.layout.dp, "ep": e.layout.ep, "pp": e.layout.pp,
            "decode_tokens_s": round(e.decode_tokens_s, 1), "token_latency_ms": round(e.token_latency_ms, 2),
            "prefill_tokens_s": round(e.prefill_tokens_s, 1), "comm_ms": round(e.comm_ms, 2),
            "per_device_bytes": e.memory.as_dict()}


def speculative_summary(plan: Plan) -> dict | None:
    """What --mtp adds to the ledger (model-wide, before any split), and the cost model's acceptance length."""
    r, w = plan.request, plan.workload
    if not r.mtp:
        return None
    kvb = w.kv_dtype_bytes
    slots = speculative_state_slots(w.draft_tokens)
    return {"num_speculative_tokens": r.num_speculative_tokens, "acceptance_length": round(w.tokens_per_round, 3),
            "acceptance_length_source": "given" if r.acceptance_length else "assumed (cost.acceptance_length)",
            "mtp_weight_bytes": sum(g.bytes for g in plan.groups if is_draft_layer(g, plan.cache.layers)),
            "mtp_kv_bytes_per_token": plan.cache.draft_kv_bytes_per_token(kvb),
            "draft_state_slots_per_sequence": slots,
            "draft_state_bytes_per_sequence": slots * plan.cache.state_bytes_per_sequence(kvb)}


def ledger_summary(plan: Plan) -> dict:
    fam: dict[str, dict] = defaultdict(lambda: {"params": 0, "bytes": 0, "dtypes": set()})
    for g in plan.groups:
        f = fam[g.family]
        f["params"] += g.params
        f["bytes"] += g.bytes
        f["dtypes"].add(g.dtype)
    kvb = plan.workload.kv_dtype_bytes
    return {"params": sum(g.params for g in plan.groups), "weight_bytes": plan.weight_bytes,
            "families": {k: {**v, "dtypes": sorted(v["dtypes"])} for k, v in sorted(fam.items())},
            "kv_bytes_per_token": plan.cache.kv_bytes_per_token(kvb),
            "linear_state_bytes_per_sequence": plan.cache.state_bytes_per_sequence(kvb),
            "speculative": speculative_summary(plan)}


def to_json(plan: Plan) -> dict:
    r = plan.request
    return {"model": plan.model_name, "model_type": plan.model_type, "chip": plan.chip.id, "devices": r.devices,
            "nodes": r.nodes, "max_model_len": r.max_model_len, "concurrency": r.concurrency, "objective": r.objective,
            "ledger": ledger_summary(plan), "chosen": _row(plan.chosen) if plan.chosen else None,
            "alternatives": [_row(e) for e in plan.alternatives],
            "rejected": [{"tp": x.layout.tp, "dp": x.layout.dp, "ep": x.layout.ep, "pp": x.layout.pp, "reason": x.reason}
                         for x in plan.rejected],
            "memory_utilization": r.memory_utilization, "notes": plan.notes, "suggestions": plan.suggestions,
            "fits_at": plan.fits_at or None, "max_sequences": plan.max_sequences,
            "max_sequences_without_mtp": plan.max_sequences_without_mtp,
            "memory_lines": [{"item": item, "per_unit": unit, "bytes": n} for item, unit, n in memory_lines(plan)]}


def ledger_line(plan: Plan, weights: bool = True) -> str:
    """The ledger in one line; `weights=False` leaves out the checkpoint's weight bytes (serve reports the
    bytes the backend holds instead, once loaded: flagdeploy/planner/held.py)."""
    s = ledger_summary(plan)
    dtypes = sorted({g.dtype for g in plan.groups})
    held = f", weights {s['weight_bytes'] / GIB:.2f} GiB ({'/'.join(dtypes)})" if weights else ""
    spec = s["speculative"]
    mtp = ""
    if spec:
        mtp = (f"; MTP K={spec['num_speculative_tokens']}: layer weights {spec['mtp_weight_bytes'] / GIB:.2f} GiB, "
               f"layer KV {spec['mtp_kv_bytes_per_token'] / 1024:.2f} KiB/token"
               + (f", KDA draft-state slots {spec['draft_state_slots_per_sequence']} x "
                  f"{s['linear_state_bytes_per_sequence'] / 2**20:.1f} MiB/sequence"
                  if spec["draft_state_bytes_per_sequence"] else ""))
    return (f"{plan.model_name}: {s['params'] / 1e9:.2f}B params{held}, "
            f"KV {s['kv_bytes_per_token'] / 1024:.1f} KiB/token"
            + (f", linear state {s['linear_state_bytes_per_sequence'] / 2**20:.1f} MiB/sequence"
               if s["linear_state_bytes_per_sequence"] else "") + mtp)


def _size(n: float) -> str:
    return f"{n / 2**20:.1f} MiB" if n >= 2**20 else f"{n / 1024:.2f} KiB"


def memory_lines(plan: Plan, estimate: Estimate | None = None) -> list[tuple[str, str, int]]:
    """The chosen (or given) layout's memory per device as ledger lines, (item, per-unit figure, bytes): what
    the weights, each cache and state, and (with --mtp) what speculation adds each take. The per-unit figures
    are per device (after TP splits the heads that have an axis to split)."""
    e = estimate or plan.chosen
    if e is None:
        return []
    m, r = e.memory, plan.request
    seqs = math.ceil(r.concurrency / e.layout.dp)
    tokens = seqs * r.max_model_len
    k = plan.workload.draft_tokens
    out = [("weights", "", m.weights)]
    if r.mtp:
        out.append(("  of which MTP layer weights", "", m.mtp_weights))
    out.append(("KV cache (per token)", f"{_size(m.kv_cache / tokens)} x {tokens} tokens", m.kv_cache))
    if r.mtp:
        out.append(("MTP layer KV (per token)", f"{_size(m.mtp_kv_cache / tokens)} x {tokens} tokens", m.mtp_kv_cache))
    if m.linear_state:
        out.append(("KDA state (per seq)", f"{_size(m.linear_state / seqs)} x {seqs} seqs", m.linear_state))
        if r.mtp:
            out.append((f"KDA draft-state slots ({k} x per seq)", f"{_size(m.draft_state / seqs)} x {seqs} seqs",
                        m.draft_state))
    out.append(("activations", "", m.activations))
    if m.encoder_activations:
        out.append(("vision encoder activations", "", m.encoder_activations))
    out += [("reserve", "", m.reserve), ("free", "", m.free)]
    return out


def _gib(n: int) -> str:
    return f"{n / GIB:7.1f}"


def table(plan: Plan) -> str:
    r = plan.request
    lines = [ledger_line(plan),
             f"on {r.nodes} x {r.devices} {plan.chip.id} ({plan.chip.memory_gib:g} GiB, {r.memory_utilization:.0%} "
             f"of it usable, {r.interconnect or plan.chip.interconnect.kind}), max-model-len {r.max_model_len}, concurrency "
             f"{r.concurrency}, objective {r.objective}"]
    lines += [f"note: {n}" for n in plan.notes]
    head = f"   {'layout':<24}{'decode tok/s':>13}{'ms/token':>10}{'weights':>9}{'KV':>8}{'state':>8}{'free':>8}  GiB/device"
    shown = ([plan.chosen] if plan.chosen else []) + plan.alternatives
    if shown:
        lines.append(head)
        for i, e in enumerate(shown):
            m = e.memory
            lines.append(f"{'->' if i == 0 else '  '} {str(e.layout):<24}{e.decode_tokens_s:13.1f}{e.token_latency_ms:10.2f}"
                         f"{_gib(m.weights):>9}{_gib(m.kv_cache + m.mtp_kv_cache):>8}"
                         f"{_gib(m.linear_state + m.draft_state):>8}{_gib(m.free):>8}")
    if plan.chosen:
        seqs = math.ceil(r.concurrency / plan.chosen.layout.dp)
        lines.append(f"memory per device, {plan.chosen.layout} ({seqs} sequences x {r.max_model_len} tokens per replica):")
        lines += [f"   {item:<38}{unit:>34}{n / GIB:9.2f} GiB" for item, unit, n in memory_lines(plan)]
        if r.mtp:
            w = plan.workload
            lines.append(f"MTP: K={w.num_speculative_tokens} drafts verified as {w.num_speculative_tokens + 1} rows per "
                         f"sequence and step, {w.tokens_per_round:.2f} tokens per sequence and step "
                         f"({'given' if r.acceptance_length else 'assumed: GLM-5 family AL 2.99 at K=3, scaled'})")
        if plan.max_sequences is not None:
            without = (f" (without --mtp: {plan.max_sequences_without_mtp})"
                       if plan.max_sequences_without_mtp is not None else "")
            lines.append(f"capacity: {plan.chosen.layout} holds up to {plan.max_sequences} sequences of "
                         f"{r.max_model_len} tokens{without}")
    if plan.rejected:
        lines.append(f"rejected ({len(plan.rejected)}):")
        lines += [f"   {str(x.layout):<24}{x.reason}" for x in plan.rejected[:8]]
        if len(plan.rejected) > 8:
            lines.append(f"   ... {len(plan.rejected) - 8} more (--json lists all)")
    if not plan.chosen:
        lines.append("nothing fits.")
        lines += [f"  - {s}" for s in plan.suggestions]
    return "\n".join(lines)


def serve_line(plan: Plan, kv_cache_memory: int) -> str:
    """What `flagdeploy serve` prints before loading: the ledger without the weights (the checkpoint's bytes
    are not what a backend holds; serve prints those after loading), the layout, what the KV cache holds."""
    per_token = plan.cache.kv_bytes_per_token(plan.workload.kv_dtype_bytes)
    need = per_token * plan.request.max_model_len * plan.request.concurrency
    r = plan.request
    layout = plan.chosen.layout if plan.chosen else "no layout fits"
    return (f"plan: {ledger_line(plan, weights=False)}; {plan.chip.id} x{r.devices} {layout} in "
            f"{r.memory_utilization:.0%} of {plan.chip.memory_gib:g} GiB; --kv-cache-memory "
            f"{kv_cache_memory / GIB:.2f} GiB holds {kv_cache_memory // max(per_token, 1)} tokens (max-model-len x "
            f"max-num-seqs needs {need / GIB:.2f} GiB)")

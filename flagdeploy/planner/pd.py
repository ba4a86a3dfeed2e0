"""Prefill-decode disaggregation (`flagdeploy plan --pd`): one layout per role, the P:D ratio, and whether PD pays.

Each role is planned as its own deployment on its own devices: the prefill role for time to first token (the
`ttft` objective: the fastest prompt) with the KV of the prompts in flight, the decode role for decode throughput
with the KV of every sequence at the target concurrency. Neither has pipeline stages, and the decode role's TP
pairs with the prefill role's as the connector needs (engines.yaml `pd`). A published recipe whose hardware the
request has (chip, engine, model type, each role's nodes) is preferred when its layouts fit.

The ratio compares the time one request spends in each role: input_len tokens at the prefill instance's rate
against output_len tokens at the decode instance's; the verdict checks what users report PD losing on (engines.yaml
`pd.pays`): one node, short prompts, low concurrency, a small model, a slow KV fabric.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, replace
from fractions import Fraction
from typing import Any

from flagdeploy.chips import get_chip

from .cost import GIB, Layout, interconnects
from .ledger import PlanInputError
from .search import Plan, PlanRequest, make_plan

ROLES = ("prefill", "decode")
# prompts a prefill replica holds: those of one batch step being computed, and those of the previous step whose KV
# waits for decode to pull it
_PREFILL_BATCHES_IN_FLIGHT = 2
_BATCH_TOKENS = 8192  # the token budget of one step the cost model prefills with (search.make_plan's Workload)


def pd_data() -> dict[str, Any]:
    from .emit import _spec

    return _spec()["pd"]


@dataclass(frozen=True)
class PDRequest:
    """base: the model, chip, devices per node, total nodes (when the planner splits them), concurrency (decode's
    target), max_model_len, engine, ... as `plan` takes them. Each role's nodes and devices per node may be given;
    what is left out the planner chooses."""

    base: PlanRequest
    input_len: int = 8192
    output_len: int = 1024
    prefill_nodes: int | None = None
    decode_nodes: int | None = None
    prefill_devices: int | None = None  # per node
    decode_devices: int | None = None
    kv_interconnect: str | None = None  # the link the KV crosses (default: roce between nodes, the chip's own in one)
    connector: str | None = None  # the engine's KV connector (engines.yaml pd.engines.E.connectors)


@dataclass
class Role:
    role: str
    nodes: int
    devices: int  # per node
    plan: Plan
    recipe: str | None = None  # the recipe id whose layout this is (None: the cost model's ranking)

    @property
    def layout(self) -> Layout:
        return self.plan.chosen.layout


@dataclass
class Verdict:
    pays: bool
    reasons: list[str]  # why it does not pay (empty when it pays)


@dataclass
class PDPlan:
    request: PDRequest
    engine: str
    connector: str
    prefill: Role
    decode: Role
    verdict: Verdict
    kv_bytes_per_request: int  # a prompt's KV and linear-attention state, moved from prefill to decode
    transfer_ms: float
    prefill_ms: float  # one prompt of input_len on the prefill role
    ratio: float  # prefill instances one decode instance keeps busy
    link: str
    notes: list[str] = field(default_factory=list)

    def profiles(self) -> dict[str, Any]:
        """Each role's deployment profile (its port from engines.yaml pd.ports)."""
        ports = pd_data()["ports"]
        return {r.role: replace(r.plan.profile(), engine=self.engine, port=ports[r.role],
                                max_model_len=self.request.base.max_model_len)
                for r in (self.prefill, self.decode)}

    def ratio_text(self) -> str:
        if self.ratio <= 0:  # a role has no layout that fits
            return "n/a"
        f = Fraction(self.ratio).limit_denominator(8)
        return f"{f.numerator}:{f.denominator}" if f.numerator else f"1:{round(1 / self.ratio)}"


def default_engine(chip: str) -> str:
    """The chip's first external engine that has PD data (engines.yaml `deploy` order, then the rest)."""
    from .emit import chip_engines

    for engine in chip_engines(chip):
        if engine in pd_data()["engines"]:
            return engine
    raise PlanInputError(f"no engine with a prefill-decode mode runs on {chip} (engines.yaml pd.engines: "
                         f"{', '.join(pd_data()['engines'])}).")


def connector_for(engine: str, backend: str, connector: str | None) -> str:
    data = pd_data()["engines"].get(engine)
    if data is None:
        raise PlanInputError(f"--pd runs in an external engine with a prefill-decode mode: one of "
                             f"{', '.join(pd_data()['engines'])}, not {engine!r}.")
    known = list(data["connectors"])
    if connector is None:
        default = data["default_connector"]
        return default.get(backend, next(iter(default.values()))) if isinstance(default, dict) else default
    if connector not in known:
        raise PlanInputError(f"{engine} has no KV connector {connector!r} here; choose one of {', '.join(known)}.")
    return connector


def _tp_pairing(engine: str, connector: str, model_type: str, hybrid: bool) -> str | None:
    pairing = pd_data()["engines"][engine]["connectors"][connector].get("tp_pairing") or {}
    return pairing.get("all") or (pairing.get("hybrid") if hybrid else None)


def _candidates(total: int, moe: bool, tp_ok=lambda tp: True) -> tuple[Layout, ...]:
    """Every DP x TP split of `total` devices without pipeline stages, EP off and (for a MoE model) on."""
    out = []
    for tp in (d for d in range(1, total + 1) if total % d == 0 and tp_ok(d)):
        dp = total // tp
        out += [Layout(tp, dp, ep, 1) for ep in (sorted({1, tp * dp}) if moe else [1])]
    return tuple(out)


def _recipe(req: PDRequest, engine: str, model_type: str, p_nodes: int, d_nodes: int) -> dict | None:
    for r in pd_data()["recipes"]:
        if (r["engine"] == engine and req.base.chip in r["chips"] and model_type in r["model_types"]
                and r["prefill"]["nodes"] == p_nodes and r["decode"]["nodes"] == d_nodes):
            return r
    return None


def _recipe_layout(entry: dict) -> Layout:
    tp, dp = entry["tp"], entry["dp"]
    return Layout(tp, dp, tp * dp if entry.get("ep") in (True, "on") else 1, 1)


def _plan_role(req: PDRequest, role: str, engine: str, nodes: int, devices: int, recipe: dict | None,
               tp_ok, moe: bool) -> Role:
    b = req.base
    total = nodes * devices
    if role == "prefill":  # the prompts in flight per replica, input_len tokens each (the profile keeps max_model_len)
        per_replica = _PREFILL_BATCHES_IN_FLIGHT * max(1, math.ceil(_BATCH_TOKENS / req.input_len))
        rreq = replace(b, devices=devices, nodes=nodes, engine=engine, objective="ttft", layout=None,
                       max_model_len=req.input_len, avg_context=max(1, req.input_len // 2),
                       replica_concurrency=per_replica)
    else:  # every sequence at the target concurrency, attending to the prompt and half the output on average
        rreq = replace(b, devices=devices, nodes=nodes, engine=engine, layout=None,
                       avg_context=req.input_len + req.output_len // 2)
    candidates = _candidates(total, moe, tp_ok)
    if recipe is not None:
        lay = _recipe_layout(recipe[role])
        if lay in candidates:
            exact = _exact(rreq, lay)
            if exact.chosen is not None:
                return Role(role, nodes, devices, exact, recipe["id"])
    if not candidates:
        raise PlanInputError(f"no {role} layout of {total} devices pairs with the prefill role's TP here")
    plan = make_plan(replace(rreq, candidates=candidates))
    if plan.chosen is None:
        return Role(role, nodes, devices, plan)
    return Role(role, nodes, devices, _exact(rreq, plan.chosen.layout, plan))


def _exact(rreq: PlanRequest, lay: Layout, ranked: Plan | None = None) -> Plan:
    """The plan of exactly `lay`, its concurrency made whole (the prefill role's prompts per replica x dp), the
    cost model's other layouts (from `ranked`) kept as alternatives."""
    if rreq.replica_concurrency is not None:
        rreq = replace(rreq, concurrency=rreq.replica_concurrency * lay.dp, replica_concurrency=None)
    plan = make_plan(replace(rreq, layout=lay, candidates=None))
    if ranked is not None:
        plan.alternatives = ranked.alternatives
    return plan


def make_pd_plan(req: PDRequest) -> PDPlan:
    b = req.base
    if req.input_len < 1 or req.output_len < 1:
        raise PlanInputError("--input-len and --output-len are token counts: at least 1 each.")
    if req.input_len + req.output_len > b.max_model_len:
        raise PlanInputError(f"--input-len {req.input_len} + --output-len {req.output_len} exceeds --max-model-len "
                             f"{b.max_model_len}; raise --max-model-len or shorten them.")
    if b.layout is not None:
        raise PlanInputError("--layout names one layout, --pd plans two (one per role): drop --layout.")
    chip = get_chip(b.chip)
    engine = b.engine or default_engine(chip.id)
    if engine not in pd_data()["engines"]:
        raise PlanInputError(f"--pd runs in an external engine with a prefill-decode mode ({', '.join(pd_data()['engines'])}); "
                             f"{engine} has none here.")
    connector = connector_for(engine, chip.backend, req.connector)
    p_dev = req.prefill_devices or b.devices
    d_dev = req.decode_devices or b.devices
    for name, n in (("--prefill-devices", p_dev), ("--decode-devices", d_dev)):
        if n > chip.devices_per_node:
            raise PlanInputError(f"{name} {n}: a {chip.id} node has {chip.devices_per_node} devices.")
    splits = _splits(req, chip, p_dev, d_dev)
    best = None
    for p_nodes, d_nodes, pd_, dd in splits:
        cand = _plan_split(req, engine, connector, chip, p_nodes, d_nodes, pd_, dd)
        if best is None or _goodput(cand) > _goodput(best):
            best = cand
    return best


def _splits(req: PDRequest, chip, p_dev: int, d_dev: int) -> list[tuple[int, int, int, int]]:
    """(prefill nodes, decode nodes, prefill devices per node, decode devices per node) to try."""
    b = req.base
    pn, dn = req.prefill_nodes, req.decode_nodes
    if pn and dn:
        return [(pn, dn, p_dev, d_dev)]
    if pn or dn:
        if b.nodes <= (pn or dn):
            raise PlanInputError(f"--{'prefill' if pn else 'decode'}-nodes {pn or dn} leaves no node of --nodes "
                                 f"{b.nodes} for the other role: give both --prefill-nodes and --decode-nodes, or "
                                 f"a larger --nodes.")
        return [(pn, b.nodes - pn, p_dev, d_dev)] if pn else [(b.nodes - dn, dn, p_dev, d_dev)]
    if b.nodes >= 2:
        return [(p, b.nodes - p, p_dev, d_dev) for p in range(1, b.nodes)]
    # one node: both roles share its devices
    if req.prefill_devices and req.decode_devices:
        if p_dev + d_dev > b.devices:
            raise PlanInputError(f"--prefill-devices {p_dev} + --decode-devices {d_dev} exceed the node's --devices "
                                 f"{b.devices}.")
        return [(1, 1, p_dev, d_dev)]
    if req.prefill_devices or req.decode_devices:
        given = req.prefill_devices or req.decode_devices
        if given >= b.devices:
            raise PlanInputError(f"on one node of --devices {b.devices} the roles share its devices: give "
                                 f"--prefill-devices/--decode-devices that add up to at most {b.devices}.")
        rest = b.devices - given
        return [(1, 1, given, rest)] if req.prefill_devices else [(1, 1, rest, given)]
    if b.devices < 2:
        raise PlanInputError("prefill-decode disaggregation needs at least two devices (one per role): raise "
                             "--devices or --nodes.")
    return [(1, 1, p, b.devices - p) for p in range(1, b.devices)]


def _goodput(p: PDPlan) -> tuple:
    """Fitting plans first, then a recipe's split (it has been run), then the requests per second the pair
    sustains (the slower role's)."""
    fits = p.prefill.plan.chosen is not None and p.decode.plan.chosen is not None
    if not fits:
        return (0, 0, 0.0)
    recipe = bool(p.prefill.recipe and p.decode.recipe)
    return (1, recipe, min(p.prefill.plan.chosen.prefill_tokens_s * p.prefill.layout.dp / p.request.input_len,
                           p.decode.plan.chosen.decode_tokens_s / p.request.output_len))


def _plan_split(req: PDRequest, engine: str, connector: str, chip, p_nodes: int, d_nodes: int, p_dev: int,
                d_dev: int) -> PDPlan:
    b = req.base
    from .ledger import load_config, text_config

    config = b.config if b.config is not None else load_config(b.model)[1]
    model_type = config.get("model_type", "?")
    recipe = _recipe(req, engine, model_type, p_nodes, d_nodes)
    t = text_config(config)
    moe = bool(t.get("n_routed_experts") or t.get("num_experts") or t.get("num_local_experts"))
    prefill = _plan_role(req, "prefill", engine, p_nodes, p_dev, recipe, lambda tp: True, moe)
    hybrid = bool(prefill.plan.cache.state_fp32 and any(prefill.plan.cache.state_fp32))
    pairing = _tp_pairing(engine, connector, model_type, hybrid)
    p_tp = prefill.layout.tp if prefill.plan.chosen else None
    if p_tp is None or pairing is None:
        tp_ok = lambda tp: True  # noqa: E731
    elif pairing == "equal":
        tp_ok = lambda tp: tp == p_tp  # noqa: E731
    else:  # prefill_multiple: P tp >= D tp and divisible
        tp_ok = lambda tp: p_tp % tp == 0  # noqa: E731
    decode = _plan_role(req, "decode", engine, d_nodes, d_dev, recipe, tp_ok, moe)
    notes = []
    if pairing and p_tp:
        src = pd_data()["engines"][engine]["connectors"][connector]["source"]
        notes.append(f"decode TP {'equals' if pairing == 'equal' else 'divides'} prefill's TP {p_tp} "
                     f"({engine} {connector} connector{', hybrid model' if hybrid and 'hybrid' in str(pairing) else ''}; "
                     f"{src.split(' (')[0]})")
    for r in (prefill, decode):
        if r.recipe:
            src = next(x["source"] for x in pd_data()["recipes"] if x["id"] == r.recipe)
            notes.append(f"{r.role}: the layout of recipe {r.recipe} ({src})")
    # the KV a request moves, over the link between the roles
    plan = prefill.plan
    kvb = plan.workload.kv_dtype_bytes
    kv = req.input_len * (plan.cache.kv_bytes_per_token(kvb) + plan.cache.draft_kv_bytes_per_token(kvb) * b.mtp)
    kv += plan.cache.state_bytes_per_sequence(kvb)
    same_node = req.prefill_nodes is None and req.decode_nodes is None and b.nodes == 1
    link = req.kv_interconnect or (chip.interconnect.kind if same_node else "roce")
    table = interconnects()
    if link not in table:
        raise PlanInputError(f"unknown --kv-interconnect {link!r}; choose one of {', '.join(table)}.")
    bw = chip.interconnect.bandwidth_gbs if link == chip.interconnect.kind else table[link]["bandwidth_gbs"]
    transfer_ms = (kv / (bw * 1e9) + table[link]["latency_us"] * 1e-6) * 1e3
    prefill_ms = req.input_len / plan.chosen.prefill_tokens_s * 1e3 if plan.chosen else 0.0
    if prefill.plan.chosen and decode.plan.chosen:
        per_req_p = req.input_len / (prefill.plan.chosen.prefill_tokens_s * prefill.layout.dp)
        per_req_d = req.output_len / decode.plan.chosen.decode_tokens_s
        ratio = per_req_p / per_req_d
    else:
        ratio = 0.0
    out = PDPlan(req, engine, connector, prefill, decode, Verdict(True, []), int(kv), transfer_ms, prefill_ms,
                 ratio, link, notes)
    out.verdict = verdict(out, same_node)
    return out


def verdict(p: PDPlan, same_node: bool) -> Verdict:
    """Whether PD pays here, by engines.yaml pd.pays (what users report it losing on)."""
    c, r, b = pd_data()["pays"], p.request, p.request.base
    reasons = []
    if same_node:
        reasons.append("one node: both roles share its devices, each gets part of its memory and compute, and the "
                       "KV handoff adds a hop to every request (users report TTFT worse); serve it aggregated")
    if r.input_len < c["min_input_len"]:
        reasons.append(f"short prompts: --input-len {r.input_len} < {c['min_input_len']}; prefills are short "
                       f"enough not to stall decode, and the KV handoff adds to every TTFT (users: 128/128 worse "
                       f"with PD; llm-d recommends it for ~10k-in / 1k-out)")
    if b.concurrency < c["min_concurrency"]:
        reasons.append(f"low concurrency: --concurrency {b.concurrency} < {c['min_concurrency']}; a small decode "
                       f"batch is rarely interrupted by prefills, so there is little tail ITL to win")
    small = make_plan(replace(b, devices=1, nodes=1, layout=None, engine=None, candidates=None,
                              replica_concurrency=None, objective="throughput"))
    if small.chosen is not None:
        reasons.append(f"small model: one {b.chip} device serves it at --concurrency {b.concurrency} and "
                       f"--max-model-len {b.max_model_len}; PD would add a second copy of the weights and a KV "
                       f"handoff for no gain")
    if p.prefill_ms and p.transfer_ms > c["max_transfer_share"] * p.prefill_ms:
        reasons.append(f"slow KV fabric: moving a prompt's KV ({p.kv_bytes_per_request / 2**20:.1f} MiB) over "
                       f"{p.link} takes {p.transfer_ms:.1f} ms, {p.transfer_ms / p.prefill_ms:.0%} of its "
                       f"{p.prefill_ms:.1f} ms prefill (more than {c['max_transfer_share']:.0%}); every TTFT pays it "
                       f"(profiles/interconnects.yaml; --kv-interconnect names a faster link)")
    return Verdict(not reasons, reasons)


# ---- the report -------------------------------------------------------------------------------------------


def table(p: PDPlan) -> str:
    from .report import ledger_line

    r, b = p.request, p.request.base
    lines = [ledger_line(p.prefill.plan),
             f"prefill-decode disaggregation on {b.chip} with {p.engine} ({p.connector} connector): --input-len "
             f"{r.input_len}, --output-len {r.output_len}, --concurrency {b.concurrency}, --max-model-len "
             f"{b.max_model_len}"]
    for role in (p.prefill, p.decode):
        head = f"{role.role}: {role.nodes} node(s) x {role.devices} {b.chip}"
        if role.plan.chosen is None:
            lines.append(f"{head}: nothing fits")
            lines += [f"  - {s}" for s in role.plan.suggestions]
            continue
        e, m = role.plan.chosen, role.plan.chosen.memory
        what = (f"{role.plan.request.concurrency} prompt(s) of {r.input_len} tokens in flight" if role.role == "prefill"
                else f"{b.concurrency} sequences")
        lines.append(f"{head}: {e.layout}{f' (recipe {role.recipe})' if role.recipe else ''}; per device: weights "
                     f"{m.weights / GIB:.1f} GiB, KV {(m.kv_cache + m.mtp_kv_cache) / GIB:.1f} GiB ({what}), "
                     f"state {(m.linear_state + m.draft_state) / GIB:.1f} GiB, activations {m.activations / GIB:.1f} GiB, "
                     f"free {m.free / GIB:.1f} GiB")
        lines.append(f"   prefill {e.prefill_tokens_s * e.layout.dp:,.0f} tok/s ({e.layout.dp} replica(s)), decode "
                     f"{e.decode_tokens_s:,.0f} tok/s, {e.token_latency_ms:.1f} ms/token"
                     + (f"; the cost model ranks first otherwise: {role.plan.alternatives[0].layout}"
                        if role.recipe and role.plan.alternatives else ""))
    if p.prefill.plan.chosen and p.decode.plan.chosen:
        lines.append(f"KV per request: {p.kv_bytes_per_request / 2**20:.1f} MiB over {p.link}, {p.transfer_ms:.1f} ms "
                     f"(prefill of one prompt {p.prefill_ms:.1f} ms)")
        lines.append(f"P:D ratio {p.ratio_text()}: one decode instance keeps {p.ratio:.2f} prefill instance(s) busy "
                     f"({r.input_len} tokens in at the prefill instance's rate vs {r.output_len} out at the decode "
                     f"instance's)")
    lines += [f"note: {n}" for n in p.notes]
    if p.prefill.plan.chosen is None or p.decode.plan.chosen is None:
        lines.append("nothing fits for a role: more nodes (--prefill-nodes/--decode-nodes), or the suggestions above")
    elif p.verdict.pays:
        lines.append("verdict: PD pays here (long prompts, enough concurrency, a model that needs several devices, "
                     "a KV fabric fast enough)")
    else:
        lines.append("verdict: PD does not pay here:")
        lines += [f"  - {why}" for why in p.verdict.reasons]
    return "\n".join(lines)


def to_json(p: PDPlan) -> dict:
    from .report import to_json as plan_json

    r = p.request
    return {"engine": p.engine, "connector": p.connector, "input_len": r.input_len, "output_len": r.output_len,
            "roles": {x.role: {"nodes": x.nodes, "devices": x.devices, "recipe": x.recipe, **plan_json(x.plan)}
                      for x in (p.prefill, p.decode)},
            "kv_bytes_per_request": p.kv_bytes_per_request, "kv_link": p.link, "transfer_ms": round(p.transfer_ms, 3),
            "prefill_ms": round(p.prefill_ms, 3), "ratio": round(p.ratio, 4), "ratio_text": p.ratio_text(),
            "pays": p.verdict.pays, "reasons": p.verdict.reasons, "notes": p.notes}

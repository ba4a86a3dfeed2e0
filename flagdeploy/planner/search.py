"""Layout search: every TP x DP x EP (x PP) split of the devices, the ones that break a rule or do not
fit rejected with the reason, the rest ranked by the objective; and, when nothing fits, what would."""

from __future__ import annotations

from dataclasses import dataclass, field, replace

from flagdeploy.chips import Chip, get_chip
from flagdeploy.checkpoints.source import preset_source

from .cost import GIB, Estimate, Layout, Link, ModelFacts, Workload, estimate, interconnects, is_draft_layer, memory
from .ledger import CacheShape, PlanInputError, WeightGroup, cache_shape, load_config, text_config, weight_groups
from .profile import Profile


@dataclass(frozen=True)
class PlanRequest:
    model: str  # preset name, config.json or model directory
    chip: str
    devices: int  # per node
    nodes: int = 1
    interconnect: str | None = None  # None: the chip's own link
    max_model_len: int = 32768
    concurrency: int = 16
    objective: str = "throughput"  # or latency
    mtp: bool = False  # speculative decoding with the model's multi-token-prediction layer
    num_speculative_tokens: int = 3  # K, drafts verified per sequence and step (only with mtp; as serve's)
    acceptance_length: float | None = None  # measured tokens per sequence and round at K (None: cost.acceptance_length)
    policy: str | None = None  # a quantize policy to plan the converted weights with
    layout: Layout | None = None  # evaluate exactly this one
    avg_context: int | None = None  # default: half of max_model_len
    kv_cache_dtype: str = "bf16"
    config: dict | None = None  # the HF config itself, when there is no file to name (a GGUF's, say)
    memory_utilization: float = 0.9  # share of each device's memory to fill, as vLLM's --gpu-memory-utilization
    memory_gib: float | None = None  # the device's memory where it is known better than the catalog (a host's RAM)
    # rank only the layouts this engine runs (engines.yaml `layouts`: builtin, vllm, vllm-ascend, sglang, mindie);
    # None: every layout the cost model knows, whichever engine runs it
    engine: str | None = None
    # evaluate only these layouts (None: every split of the devices); a PD role restricts them (plan --pd)
    candidates: tuple[Layout, ...] | None = None
    # sequences per DP replica, whatever the replicas (None: `concurrency` over all of them); the PD prefill role
    # holds a fixed number of prompts per replica
    replica_concurrency: int | None = None


@dataclass
class Rejected:
    layout: Layout
    reason: str


@dataclass
class Plan:
    request: PlanRequest
    model_name: str
    model_type: str
    chip: Chip
    groups: list[WeightGroup]
    cache: CacheShape
    workload: Workload
    chosen: Estimate | None
    alternatives: list[Estimate]
    rejected: list[Rejected]
    notes: list[str] = field(default_factory=list)
    suggestions: list[str] = field(default_factory=list)
    # when nothing fits: the largest --concurrency at the asked --max-model-len and the longest
    # --max-model-len at the asked --concurrency that do (None: none does), for --json readers
    fits_at: dict[str, int | None] = field(default_factory=dict)
    # the most sequences of --max-model-len tokens the chosen layout holds (its KV and state capacity)
    max_sequences: int | None = None
    max_sequences_without_mtp: int | None = None  # with --mtp: the same layout's capacity without speculation

    @property
    def weight_bytes(self) -> int:
        return sum(g.bytes for g in self.groups)

    def profile(self, estimate: Estimate | None = None) -> Profile:
        """The deployment profile of the chosen (or the given) layout, in the neutral vocabulary."""
        e = estimate or self.chosen
        if e is None:
            raise PlanInputError("nothing fits, so there is no profile to emit; see the suggestions.")
        r, dtypes = self.request, {g.dtype for g in self.groups}
        quantization = "w8a8" if "int8" in dtypes else ("fp8" if "fp8" in dtypes else None)
        checkpoint = preset_source(r.model)  # a preset's profile runs the checkpoint it describes, under its name
        return Profile(model=checkpoint or r.model, served_model_name=r.model if checkpoint else None,
                       chip=self.chip.id, model_type=self.model_type, engine=r.engine, devices=r.devices, nodes=r.nodes,
                       tp=e.layout.tp, dp=e.layout.dp, ep=e.layout.ep, pp=e.layout.pp, max_model_len=r.max_model_len,
                       max_num_seqs=max(1, r.concurrency // e.layout.dp),
                       kv_cache_dtype="auto" if r.kv_cache_dtype == "bf16" else r.kv_cache_dtype,
                       quantization=quantization, mtp=r.mtp,
                       num_speculative_tokens=r.num_speculative_tokens if r.mtp else Profile.num_speculative_tokens,
                       memory_utilization=r.memory_utilization)


def model_facts(config: dict, groups: list[WeightGroup]) -> ModelFacts:
    t = text_config(config)
    layers = t["num_hidden_layers"]
    heads = t["num_attention_heads"]
    experts = t.get("n_routed_experts") or t.get("num_experts") or t.get("num_local_experts") or 0
    moe_layers = len({g.layer for g in groups if g.family == "experts" and g.layer is not None and g.layer < layers})
    if config.get("model_type") == "glm5_next":
        attn_dim = heads * (t.get("qk_nope_head_dim", 256) + t.get("v_head_dim", 256)) // 2
        linear_heads = t.get("linear_num_heads", 0)
    else:
        attn_dim = heads * (t.get("head_dim") or t["hidden_size"] // heads)
        linear_heads = 0
    from flagdeploy.models import encoder_activation_bytes

    encoder = encoder_activation_bytes(config)
    return ModelFacts(t["hidden_size"], t["vocab_size"], layers, heads, t.get("num_key_value_heads") or heads,
                      linear_heads, experts, t.get("num_experts_per_tok") or 0, moe_layers, attn_dim, encoder)


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def candidate_layouts(total: int, facts: ModelFacts) -> list[Layout]:
    out = []
    for pp in _divisors(total):
        for tp in _divisors(total // pp):
            dp = total // pp // tp
            for ep in sorted({1, tp * dp}) if facts.experts else [1]:
                out.append(Layout(tp, dp, ep, pp))
    return out


def rule_violation(layout: Layout, facts: ModelFacts, devices_per_node: int, concurrency: int,
                   mtp: bool = False, uneven_experts: bool = False) -> str | None:
    """Why `layout` breaks a rule, or None. uneven_experts: the engine splits experts EP does not divide
    (engines.yaml `layouts.uneven_experts`), so only fewer experts than EP ranks is refused."""
    tp = layout.tp
    if tp > devices_per_node:
        return f"TP {tp} would cross nodes ({devices_per_node} devices per node): per-layer all-reduces over the network"
    if facts.attention_heads % tp:
        return f"{facts.attention_heads} attention heads do not divide by TP {tp}"
    if facts.kv_heads % tp and tp % facts.kv_heads:
        return f"{facts.kv_heads} KV heads neither divide by nor divide TP {tp}"
    if facts.linear_heads and facts.linear_heads % tp:
        return f"{facts.linear_heads} KDA heads do not divide by TP {tp}"
    if facts.experts and layout.ep > 1 and facts.experts % layout.ep and not uneven_experts:
        from .emit import uneven_expert_engines

        return (f"{facts.experts} experts do not divide by EP {layout.ep} ({', '.join(uneven_expert_engines())} split "
                f"them unevenly: --engine {uneven_expert_engines()[0]})")
    if facts.experts and layout.ep > facts.experts:
        return f"EP {layout.ep} exceeds the {facts.experts} experts"
    if layout.pp > facts.layers:
        return f"PP {layout.pp} exceeds the {facts.layers} layers"
    if layout.dp > concurrency:
        return f"DP {layout.dp} needs at least {layout.dp} concurrent sequences (--concurrency {concurrency})"
    if mtp and layout.dp > 1 and layout.ep > 1:  # engines.yaml rule no-mtp-with-dp-attention drops it there
        return ("--mtp: DP attention (dp > 1 with expert parallelism) turns MTP off in the engines (not validated "
                "together, shared/docs/glm-5.3-flash.md); use dp=1, or dp replicas without EP")
    return None


def _gib(n: float) -> str:
    return f"{n / GIB:.1f} GiB"


def _links(chip: Chip, kind: str | None) -> tuple[Link, Link]:
    table = interconnects()
    if kind is None or kind == chip.interconnect.kind:
        intra = Link(chip.interconnect.kind, chip.interconnect.bandwidth_gbs, table[chip.interconnect.kind]["latency_us"])
    elif kind in table:
        intra = Link(kind, table[kind]["bandwidth_gbs"], table[kind]["latency_us"])
    else:
        raise PlanInputError(f"unknown interconnect {kind!r}; choose one of {', '.join(table)}.")
    return intra, Link("roce", table["roce"]["bandwidth_gbs"], table["roce"]["latency_us"])


ENGINE_REFUSES = "does not run this layout"  # how a layout the request's engine refuses is reported


def engine_refusal(req: PlanRequest, chip: Chip, layout: Layout, engine: str | None = None) -> str | None:
    """Why `engine` (default: the request's) does not run `layout` for this request, or None (engines.yaml
    `layouts`, the data emit obeys too)."""
    engine = engine or req.engine
    if engine is None:
        return None
    from .emit import layout_refusal

    why = layout_refusal(Profile(model=req.model, chip=chip.id, devices=req.devices, nodes=req.nodes, tp=layout.tp,
                                 dp=layout.dp, ep=layout.ep, pp=layout.pp), engine)
    return None if why is None else f"{engine} {ENGINE_REFUSES}: {why}"


def _evaluate(req: PlanRequest, chip: Chip, groups, cache, facts, load, layouts) -> tuple[list[Estimate], list[Rejected]]:
    intra, inter = _links(chip, req.interconnect)
    from .emit import uneven_expert_engines

    uneven = req.engine in uneven_expert_engines()
    fits, rejected = [], []
    for lay in layouts:
        concurrency = req.concurrency
        if req.replica_concurrency is not None:
            concurrency = req.replica_concurrency * lay.dp
            load = replace(load, concurrency=concurrency)
        why = (rule_violation(lay, facts, req.devices, concurrency, req.mtp, uneven_experts=uneven)
               or engine_refusal(req, chip, lay))
        if why is None:
            est = estimate(groups, cache, facts, chip, lay, load, intra, inter, req.devices)
            m = est.memory
            if m.free < 0:
                spec = (f", MTP layer KV {_gib(m.mtp_kv_cache)}, KDA draft-state slots {_gib(m.draft_state)}"
                        if load.mtp else "")
                why = (f"does not fit: needs {_gib(m.used)} per device (weights {_gib(m.weights)}, KV {_gib(m.kv_cache)}, "
                       f"linear state {_gib(m.linear_state)}{spec}, activations {_gib(m.activations)}, "
                       f"{f'vision encoder {_gib(m.encoder_activations)}, ' if m.encoder_activations else ''}"
                       f"reserve {_gib(m.reserve)}), has {_gib(m.capacity)}; short by {_gib(-m.free)}")
            else:
                fits.append(est)
        if why is not None:
            rejected.append(Rejected(lay, why))
    return fits, rejected


# throughput: decode tokens/s; latency: ms per decode step; ttft: one prompt's prefill (the PD prefill role)
OBJECTIVES = ("throughput", "latency", "ttft")


def _rank(fits: list[Estimate], objective: str) -> list[Estimate]:
    if objective == "ttft":  # the fastest prompt, then no pipeline hops, then the most room for prompts' KV
        return sorted(fits, key=lambda e: (-round(e.prefill_tokens_s, 3), e.layout.pp, -e.memory.free))
    if objective == "latency":
        return sorted(fits, key=lambda e: (e.token_latency_ms, -e.decode_tokens_s))
    return sorted(fits, key=lambda e: (-e.decode_tokens_s, e.token_latency_ms))


def make_plan(req: PlanRequest) -> Plan:
    if req.objective not in OBJECTIVES:
        raise PlanInputError(f"objective must be one of {', '.join(OBJECTIVES)}, not {req.objective!r}.")
    if req.num_speculative_tokens < 1:
        raise PlanInputError(f"num_speculative_tokens (K, drafts per sequence and step) must be at least 1; "
                             f"got {req.num_speculative_tokens}.")
    if req.acceptance_length is not None and not 1 <= req.acceptance_length <= req.num_speculative_tokens + 1:
        raise PlanInputError(f"acceptance length must be between 1 and K+1 = {req.num_speculative_tokens + 1} tokens "
                             f"per sequence and round; got {req.acceptance_length}.")
    if not 0 < req.memory_utilization <= 1:
        raise PlanInputError(f"memory utilization must be in (0, 1], the share of each device's memory to use; "
                             f"got {req.memory_utilization}.")
    chip = get_chip(req.chip)
    if req.memory_gib is not None:
        chip = replace(chip, memory_gib=req.memory_gib)
    if req.engine is not None:
        from .emit import LAYOUT_ENGINES

        if req.engine not in LAYOUT_ENGINES:
            raise PlanInputError(f"unknown engine {req.engine!r}; choose one of {', '.join(LAYOUT_ENGINES)}.")
    name, config = (req.model, req.config) if req.config is not None else load_config(req.model)
    notes = []
    from .shapes import is_exact

    from flagdeploy.edge import edge_info

    edge = edge_info(chip.id)
    if edge:  # an edge chip (profiles/chips.yaml `edge:`): what serves it there and in which weight formats
        notes.append(f"{chip.id} is served by ONNX Runtime's {edge.get('ort_ep')} (pip install {edge.get('package')}; "
                     f"`serve --engine onnxruntime`{' implied by --chip' if edge.get('engine') == 'onnxruntime' else ''}), "
                     f"ONNX weights {'/'.join(edge.get('weights', []))} (`flagdeploy export onnx --weights ...`)"
                     + ("" if edge.get("verified") else "; not yet run on this hardware"))
    if not is_exact(config):
        notes.append(f"model_type {config.get('model_type')!r} is estimated as a generic llama-like decoder "
                     f"(MoE where the config names experts): sizes are approximate")
    policy = None
    from flagdeploy.quantize.policy import default_policy_name, load_policy

    if req.policy:
        policy = load_policy(req.policy)
    else:
        stored = weight_groups(config, include_mtp=req.mtp)
        if any(g.dtype == "fp8" for g in stored) and not chip.supports("fp8"):
            policy = load_policy(default_policy_name(chip))
            notes.append(f"{chip.id} has no FP8 matmuls: planned with the weights converted by policy {policy.name!r} "
                         f"(run `flagdeploy quantize SRC -o DST --chip {chip.id}` first)")
    groups = weight_groups(config, policy=policy, include_mtp=req.mtp)
    if policy is not None and any(g.dtype == "fp8" for g in groups) and not chip.supports("fp8"):
        raise PlanInputError(f"policy {policy.name!r} keeps FP8 weights, but {chip.id} has no FP8 matmuls (`flagdeploy "
                             f"quantize` refuses it for this chip too). Plan with a policy that converts them, e.g. "
                             f"--policy {default_policy_name(chip)}, or leave --policy out.")
    cache = cache_shape(config, include_mtp=req.mtp)
    facts = model_facts(config, groups)
    if req.mtp and not cache.has_draft_layer:
        notes.append(f"--mtp: no MTP layer is known for model_type {config.get('model_type')!r}: its weights and "
                     f"cache are not counted; the K={req.num_speculative_tokens} draft steps are costed as LM-head passes")
    kv_bytes = {"bf16": 2, "fp16": 2, "auto": 2, "fp8": 1, "int8": 1}[req.kv_cache_dtype]
    load = Workload(req.max_model_len, req.concurrency, req.avg_context or max(1, req.max_model_len // 2),
                    min(req.max_model_len, 8192), kv_dtype_bytes=kv_bytes, memory_utilization=req.memory_utilization,
                    mtp=req.mtp, num_speculative_tokens=req.num_speculative_tokens,
                    acceptance_length=req.acceptance_length)
    total = req.devices * req.nodes
    layouts = ([req.layout] if req.layout else list(req.candidates) if req.candidates is not None
               else candidate_layouts(total, facts))
    if req.layout and req.layout.devices != total:
        raise PlanInputError(f"layout {req.layout} uses {req.layout.devices} devices, the request has {total} "
                             f"({req.nodes} node(s) x {req.devices}); make tp x dp x pp equal that.")
    fits, rejected = _evaluate(req, chip, groups, cache, facts, load, layouts)
    ranked = _rank(fits, req.objective)
    rejected.sort(key=lambda r: (not r.reason.startswith("does not fit"), r.reason.startswith("does not fit")
                                 and float(r.reason.rsplit("short by ", 1)[1].split()[0])))
    plan = Plan(req, name, config.get("model_type", "?"), chip, groups, cache, load, ranked[0] if ranked else None,
                ranked[1:4], rejected, notes)
    if ranked:
        plan.max_sequences = max_sequences(groups, cache, facts, chip, ranked[0].layout, load)
        if req.mtp:  # what speculation costs in sequences: the same layout without the MTP layer and its slots
            plain = [g for g in groups if not is_draft_layer(g, facts.layers)]
            plan.max_sequences_without_mtp = max_sequences(plain, cache_shape(config), facts, chip, ranked[0].layout,
                                                           replace(load, mtp=False))
    else:
        plan.suggestions, plan.fits_at = _suggestions(req, chip, config, groups, cache, facts, load, rejected, policy)
    return plan


def max_sequences(groups, cache, facts, chip, layout: Layout, load: Workload) -> int:
    """The most sequences of `load.max_model_len` tokens that `layout` holds (all replicas together): what its
    memory left after the weights gives the KV cache and the linear-attention state (with MTP, the MTP
    layer's cache and the draft-state slots too). 0: not even one per replica."""
    def fits(per_replica: int) -> bool:
        return memory(groups, cache, facts, chip, layout, replace(load, concurrency=per_replica * layout.dp)).free >= 0

    if not fits(1):
        return 0
    lo, hi = 1, 2
    while fits(hi):
        lo, hi = hi, hi * 2
        if hi > 1 << 24:
            return lo * layout.dp
    while hi - lo > 1:  # fits(lo), not fits(hi)
        mid = (lo + hi) // 2
        lo, hi = (mid, hi) if fits(mid) else (lo, mid)
    return lo * layout.dp


def _largest_concurrency(groups, cache, facts, chip, load: Workload, legal: list[Layout]) -> int | None:
    """The most sequences of `load.max_model_len` tokens that fit on any of `legal`, below the asked
    concurrency (None: not even one, or not as few as a layout's DP replicas). Memory grows with the
    sequences per replica, so each layout is a binary search over [dp, concurrency - 1]."""
    best = None
    for lay in legal:
        lo, hi = lay.dp - 1, load.concurrency - 1  # lo: fits (or below the layout's floor), hi: the bound to test
        while lo < hi:
            mid = (lo + hi + 1) // 2
            if memory(groups, cache, facts, chip, lay, replace(load, concurrency=mid)).free >= 0:
                lo = mid
            else:
                hi = mid - 1
        if lo >= lay.dp:
            best = max(best or 0, lo)
    return best


def _longest_context(groups, cache, facts, chip, load: Workload, legal: list[Layout]) -> int | None:
    """The longest --max-model-len (a multiple of 256) at which the asked concurrency fits on any of `legal`."""
    lo, hi = 0, load.max_model_len
    while hi - lo > 256:
        mid = (lo + hi) // 2
        if any(memory(groups, cache, facts, chip, lay, replace(load, max_model_len=mid)).free >= 0 for lay in legal):
            lo = mid
        else:
            hi = mid
    return lo // 256 * 256 if lo >= 256 else None


def _suggestions(req, chip, config, groups, cache, facts, load, rejected, policy) -> tuple[list[str], dict]:
    """How far from fitting, and the nearest changes that would fit: more devices, a policy, fewer
    concurrent sequences at the asked context, a shorter context at the asked concurrency."""
    out = []
    legal = [r.layout for r in rejected if r.reason.startswith("does not fit")]
    refused = [r for r in rejected if ENGINE_REFUSES in r.reason]
    if refused:  # layouts the engine does not run: would one fit, and which engines run it?
        from .emit import chip_engines

        fit = _evaluate(replace(req, engine=None), chip, groups, cache, facts, load, [r.layout for r in refused])[0]
        if fit:
            best = _rank(fit, req.objective)[0].layout
            others = [e for e in chip_engines(chip.id)
                      if e != req.engine and engine_refusal(req, chip, best, e) is None]
            why = engine_refusal(req, chip, best).split(": ", 1)[1].rsplit(" [", 1)[0]
            out.append(f"{len(fit)} layout(s) fit but {req.engine} does not run them on {req.nodes} node(s), e.g. "
                       f"{best}: {why}" + (f"; {', '.join(others)} run it: --engine {others[0]}" if others else ""))
    if not legal:
        if out:
            return out, {}
        return ["no layout passes the divisibility rules for this device count; try a power-of-two device count"], {}
    mems = {lay: memory(groups, cache, facts, chip, lay, load) for lay in legal}
    best = max(legal, key=lambda lay: mems[lay].free)
    out.append(f"closest layout {best} is short by {_gib(-mems[best].free)} per device")
    for nodes in range(req.nodes, req.nodes + 16):
        for per_node in sorted({req.devices, chip.devices_per_node}):
            if nodes * per_node <= req.nodes * req.devices:
                continue
            more = replace(req, nodes=nodes, devices=per_node, layout=None)
            if _evaluate(more, chip, groups, cache, facts, load, candidate_layouts(nodes * per_node, facts))[0]:
                out.append(f"more devices: {nodes} node(s) x {per_node} {chip.id} fit")
                break
        else:
            continue
        break
    if policy is None and chip.supports("int8"):
        from flagdeploy.quantize.policy import load_policy

        q_groups = weight_groups(config, policy=load_policy("no-fp8"), include_mtp=req.mtp)
        if _evaluate(req, chip, q_groups, cache, facts, load, legal)[0]:
            out.append(f"a quantize policy: `flagdeploy quantize --policy no-fp8` (INT8 experts/MLPs) shrinks the weights "
                       f"from {_gib(sum(g.bytes for g in groups))} to {_gib(sum(g.bytes for g in q_groups))} and it fits")
    most = _largest_concurrency(groups, cache, facts, chip, load, legal)
    longest = _longest_context(groups, cache, facts, chip, load, legal)
    if most:
        out.append(f"fewer sequences: --concurrency {most} fits at --max-model-len {req.max_model_len}")
    elif req.concurrency > 1:
        out.append(f"fewer sequences do not help: not even one of --max-model-len {req.max_model_len} tokens fits")
    if longest:
        out.append(f"a shorter context: --max-model-len {longest} fits at --concurrency {req.concurrency}")
    else:
        least = min(mems[lay].weights for lay in legal)
        out.append(f"no context length helps: the weights alone need {_gib(least)} per device at best, "
                   f"{_gib(mems[best].capacity)} is available")
    return out, {"max_concurrency": most, "max_model_len": longest}

"""One layout on one chip: per-device memory, and decode / prefill time from a roofline plus collectives.

Decode is memory-bound: a step reads the device's share of the weights (for MoE, only the experts some
token picked) and of the KV cache, or is bound by its FLOPs, whichever is slower; then TP adds two
all-reduces per layer (attention and MLP outputs) and EP a dispatch and a combine all-to-all per MoE
layer, each costed as bytes over the link's bandwidth plus a latency per hop. That is what makes wide TP
lose on PCIe (slow links, many hops) and win on NVLink/HCCS (the weights' share shrinks, the links are
fast). Efficiencies are fixed fractions of peak: this ranks layouts, it does not promise tokens/s.

With MTP speculative decoding (`Workload.mtp`) a round is one verify step of K+1 rows per sequence through
the main model plus K draft steps through the MTP layer and the LM head, and it yields `acceptance_length`
tokens per sequence on average. Both steps come from the same roofline, so verifying K+1 rows costs about
one plain step while decode is bound by reading the weights (small batches) and about K+1 of them once it
is bound by FLOPs (large batches): speculation pays at small batch and stops paying at large batch.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from functools import lru_cache

import yaml

from flagdeploy.chips import Chip
from flagdeploy.profiles import PROFILES_DIR

from .ledger import CacheShape, WeightGroup, speculative_state_slots

MEM_EFFICIENCY, FLOP_EFFICIENCY = 0.8, 0.5
RESERVE_BYTES = 2 << 30  # runtime context, collective buffers, allocator slack per device
GIB = 1 << 30


@lru_cache(maxsize=1)
def interconnects() -> dict[str, dict]:
    return yaml.safe_load((PROFILES_DIR / "interconnects.yaml").read_text())


@dataclass(frozen=True)
class Layout:
    tp: int = 1
    dp: int = 1
    ep: int = 1
    pp: int = 1

    @property
    def devices(self) -> int:
        return self.tp * self.dp * self.pp

    def __str__(self) -> str:
        return f"tp={self.tp},dp={self.dp},ep={self.ep},pp={self.pp}"


@dataclass(frozen=True)
class Link:
    kind: str
    bandwidth_gbs: float
    latency_us: float


@dataclass(frozen=True)
class Workload:
    """What the deployment must hold and serve: every sequence may reach max_model_len."""

    max_model_len: int
    concurrency: int
    avg_context: int  # tokens of context a decode step attends to, on average
    prefill_tokens: int  # one prompt of this many tokens for the prefill estimate
    max_num_batched_tokens: int = 8192
    kv_dtype_bytes: int = 2
    memory_utilization: float = 0.9
    mtp: bool = False
    num_speculative_tokens: int = 3  # K, drafts verified per sequence and step (only with mtp)
    acceptance_length: float | None = None  # tokens per sequence and round at K; None: acceptance_length()

    @property
    def draft_tokens(self) -> int:
        """K when speculating, else 0."""
        return self.num_speculative_tokens if self.mtp else 0

    @property
    def tokens_per_round(self) -> float:
        """Tokens one sequence advances per decode round: the acceptance length with MTP, else 1."""
        if not self.mtp:
            return 1.0
        return self.acceptance_length or acceptance_length(self.num_speculative_tokens)


# GLM-5.2's MTP layer, K=3: mean acceptance length 2.99 ("golden AL", SPEED-Bench coding, thinking on, B300,
# vLLM; SemiAnalysisAI/InferenceX #2460/#2447, quoted in shared/docs/speculative-multimodal-multinode.md 1.6).
REFERENCE_AL, REFERENCE_K = 2.99, 3


def _geometric_al(a: float, k: int) -> float:
    return float(k + 1) if a >= 1 else (1 - a ** (k + 1)) / (1 - a)


@lru_cache(maxsize=64)
def acceptance_length(k: int, reference_al: float = REFERENCE_AL, reference_k: int = REFERENCE_K) -> float:
    """Expected tokens per sequence and round (1 verified token + accepted drafts) with K MTP drafts.

    Assumption: draft i is accepted, given drafts 1..i-1 were, with one constant probability a, so
    AL(K) = 1 + a + a^2 + ... + a^K. `a` is fitted to the published GLM-5 family figure, AL 2.99 at K=3
    (GLM-5.2 MTP "golden AL" on SPEED-Bench coding, SemiAnalysisAI/InferenceX #2460/#2447; see
    shared/docs/speculative-multimodal-multinode.md 1.6), which gives a ~ 0.81: AL ~ 1.81 at K=1, ~ 2.46 at
    K=2, ~ 3.76 at K=5, never above 1/(1-a) ~ 5.2. Real per-position acceptance falls with the position
    (one MTP layer re-applied to its own output), so large K is if anything optimistic here; and it depends
    on the text (coding and thinking accept more than chat) and on the sampler. Measure it (vLLM's
    `vllm:spec_decode_*` counters: AL = 1 + accepted / drafts) and pass it as `acceptance_length`.
    """
    if k <= 0:
        return 1.0
    lo, hi = 0.0, 1.0  # AL is increasing in a: bisect for the reference
    for _ in range(60):
        mid = (lo + hi) / 2
        if _geometric_al(mid, reference_k) < reference_al:
            lo = mid
        else:
            hi = mid
    return _geometric_al((lo + hi) / 2, k)


@dataclass(frozen=True)
class ModelFacts:
    """What the cost model needs beyond the ledger, read from the config."""

    hidden: int
    vocab: int
    layers: int
    attention_heads: int
    kv_heads: int
    linear_heads: int  # KDA heads (0: none)
    experts: int  # routed experts (0: dense)
    experts_per_token: int
    moe_layers: int
    attn_flops_dim: int  # per attended position and token: ~heads x head dim of q.k and p.v
    encoder_activations: int = 0  # a vision encoder's activation peak (0: text only)


@dataclass
class DeviceMemory:
    """One device's memory (the fullest pipeline stage's). The speculative parts are their own fields:
    mtp_kv_cache (the MTP layer's own cache for every token) and draft_state (the K extra KDA state slots
    per sequence); mtp_weights is the MTP layer's share *of* weights, not added again."""

    weights: int
    kv_cache: int
    linear_state: int
    activations: int
    reserve: int
    capacity: int
    mtp_kv_cache: int = 0
    draft_state: int = 0
    mtp_weights: int = 0  # part of weights
    encoder_activations: int = 0  # the vision encoder's peak, on the first stage (where it runs)

    @property
    def used(self) -> int:
        return (self.weights + self.kv_cache + self.mtp_kv_cache + self.linear_state + self.draft_state
                + self.activations + self.encoder_activations + self.reserve)

    @property
    def free(self) -> int:
        return self.capacity - self.used

    def as_dict(self) -> dict[str, int]:
        """The parts that add up to `used` (mtp_weights is inside weights, so not listed), free and capacity."""
        return {"weights": self.weights, "kv_cache": self.kv_cache, "mtp_kv_cache": self.mtp_kv_cache,
                "linear_state": self.linear_state, "draft_state": self.draft_state, "activations": self.activations,
                "encoder_activations": self.encoder_activations, "reserve": self.reserve, "free": self.free,
                "capacity": self.capacity}


@dataclass
class Estimate:
    layout: Layout
    memory: DeviceMemory
    decode_tokens_s: float  # aggregate over all replicas at the requested concurrency
    token_latency_ms: float  # one decode step, as each sequence sees it
    prefill_tokens_s: float
    comm_ms: float  # collectives in one decode step


def _divisor(split: str, layout: Layout, experts: int = 0) -> float:
    """What a layout divides a weight group by. Experts that EP does not divide evenly (an engine that gives
    the remainder to the first ranks, engines.yaml `layouts.uneven_experts`) are counted on the fullest rank:
    ceil(experts / ep) of them, so the divisor is experts / ceil(experts / ep)."""
    if split == "replicated":
        return 1
    if split == "ep":
        if layout.ep > 1 and experts and experts % layout.ep:
            return experts / math.ceil(experts / layout.ep)
        return layout.ep if layout.ep > 1 else layout.tp
    return layout.tp


def _stage(layer: int | None, family: str, layers: int, pp: int) -> int:
    if layer is None:
        return pp - 1 if family in ("lm_head", "norm") else 0
    return min(layer * pp // layers, pp - 1)


def _kv_div(heads: int, tp: int) -> int:
    return min(tp, heads) if heads else 1


def is_draft_layer(g: WeightGroup, layers: int) -> bool:
    """The MTP layer's weights: checkpoints store it as decoder layer `num_hidden_layers` (and up)."""
    return g.layer is not None and g.layer >= layers


def memory(groups: list[WeightGroup], cache: CacheShape, facts: ModelFacts, chip: Chip, layout: Layout,
           load: Workload) -> DeviceMemory:
    pp = layout.pp
    stages, mtp_w = [0] * pp, [0] * pp
    for g in groups:
        s = _stage(g.layer, g.family, facts.layers, pp)
        stages[s] += int(g.bytes // _divisor(g.split, layout, facts.experts))
        if is_draft_layer(g, facts.layers):
            mtp_w[s] += int(g.bytes // _divisor(g.split, layout, facts.experts))
    seqs = math.ceil(load.concurrency / layout.dp)
    kv, state = [0] * pp, [0] * pp
    for i in range(cache.layers):
        s = _stage(i, "", facts.layers, pp)
        kv[s] += (cache.dense[i] + cache.sparse[i]) * load.kv_dtype_bytes // _kv_div(cache.kv_split[i], layout.tp)
        if cache.state_fp32:
            state[s] += (cache.state_fp32[i] * 4 + cache.state_conv[i] * load.kv_dtype_bytes) // _kv_div(cache.state_split[i], layout.tp)
    # speculation: the MTP layer's own cache lives with it on the last stage; every KDA layer keeps K more
    # state slots per sequence beside its own
    mtp_kv = [0] * pp
    if load.mtp:
        mtp_kv[pp - 1] = cache.draft_kv_bytes_per_token(load.kv_dtype_bytes) // _kv_div(cache.draft_split, layout.tp)
    slots = speculative_state_slots(load.draft_tokens)
    tokens = seqs * load.max_model_len

    def used(s: int) -> int:
        return stages[s] + (kv[s] + mtp_kv[s]) * tokens + state[s] * seqs * (1 + slots) + (encoder if s == 0 else 0)

    encoder = facts.encoder_activations
    worst = max(range(pp), key=used)
    activations = load.max_num_batched_tokens * facts.hidden * 2 * 16 + seqs * math.ceil(facts.vocab / layout.tp) * 4
    return DeviceMemory(stages[worst], kv[worst] * tokens, state[worst] * seqs, activations, RESERVE_BYTES,
                        int(chip.memory_gib * GIB * load.memory_utilization), mtp_kv_cache=mtp_kv[worst] * tokens,
                        draft_state=state[worst] * seqs * slots, mtp_weights=mtp_w[worst],
                        encoder_activations=encoder if worst == 0 else 0)


def _allreduce_s(nbytes: float, n: int, link: Link) -> float:
    if n <= 1:
        return 0.0
    return 2 * (n - 1) / n * nbytes / (link.bandwidth_gbs * 1e9) + 2 * (n - 1) * link.latency_us * 1e-6


def _alltoall_s(nbytes: float, n: int, link: Link) -> float:
    if n <= 1:
        return 0.0
    return (n - 1) / n * nbytes / (link.bandwidth_gbs * 1e9) + link.latency_us * 1e-6 * math.log2(n)


def _peak_flops(chip: Chip, groups: list[WeightGroup]) -> float:
    """The matmul dtype the bulk of the weights run in decides which peak applies."""
    by_dtype: dict[str, int] = {}
    for g in groups:
        by_dtype[g.dtype] = by_dtype.get(g.dtype, 0) + g.params
    main = max(by_dtype, key=by_dtype.get)
    tflops = chip.tflops.get(main) or chip.tflops.get("bf16") or max(chip.tflops.values(), default=1.0)
    return tflops * 1e12 * FLOP_EFFICIENCY


def estimate(groups: list[WeightGroup], cache: CacheShape, facts: ModelFacts, chip: Chip, layout: Layout,
             load: Workload, intra: Link, inter: Link, devices_per_node: int) -> Estimate:
    mem = memory(groups, cache, facts, chip, layout, load)
    pp = layout.pp
    b = math.ceil(load.concurrency / layout.dp)  # sequences per replica
    # PP keeps pp micro-batches in flight: each stage reads its weights once per micro-batch, so a round
    # in which every sequence advances one token takes pp stage steps of b / pp sequences.
    micro = math.ceil(b / pp)
    peak = _peak_flops(chip, groups)
    bandwidth = chip.memory_bandwidth_gbs * 1e9 * MEM_EFFICIENCY
    tp_link = intra if layout.tp <= devices_per_node else inter
    ep_link = intra if layout.ep <= devices_per_node else inter
    share = facts.experts_per_token / facts.experts if facts.experts else 1.0
    main = [g for g in groups if not is_draft_layer(g, facts.layers)]
    # the draft step: the MTP layer, then the LM head it shares with the main model (its embedding lookup
    # reads one row per token, left out)
    draft = [g for g in groups if is_draft_layer(g, facts.layers) or g.family == "lm_head"]
    ctx = load.avg_context

    def step(weights: list[WeightGroup], n: int, rows: int, layers: float, kv_per_seq: float, moe_layers: float,
             ) -> tuple[float, float]:
        """(seconds, of which collectives) for one stage to run `rows` rows of each of n sequences through
        `layers` layers of `weights`. The weights (for MoE, the experts some row picked) are read once for
        all rows, the KV cache once per sequence (the rows of one sequence attend to the same context);
        FLOPs and collectives grow with the rows."""
        t = n * rows
        picked = 1 - (1 - share) ** t if facts.experts else 1.0
        weights_read = flops = 0.0
        for g in weights:
            div = _divisor(g.split, layout, facts.experts) * pp
            weights_read += g.bytes / div * (picked if g.family == "experts" else 1.0)
            flops += 2 * t * g.params / div * (share if g.family == "experts" else 1.0)
        flops += 2 * t * ctx * facts.attn_flops_dim * layers / layout.tp
        act = t * facts.hidden * 2
        comm = 2 * layers * _allreduce_s(act, layout.tp, tp_link)
        comm += moe_layers * 2 * _alltoall_s(act * facts.experts_per_token, layout.ep, ep_link)
        return max((weights_read + n * kv_per_seq) / bandwidth, flops / peak) + comm, comm

    def kv_read(dense: int, sparse: int, split: int) -> float:
        return (dense * ctx + sparse * min(ctx, cache.sparse_topk or ctx)) * load.kv_dtype_bytes / _kv_div(split, layout.tp)

    main_kv = sum(kv_read(cache.dense[i], cache.sparse[i], cache.kv_split[i]) for i in range(cache.layers)) / pp
    k = load.draft_tokens
    stage, comm = step(main, micro, k + 1, facts.layers / pp, main_kv, facts.moe_layers / pp)  # decode / verify
    if k:  # K draft steps through the MTP layer, on the last stage, one row per sequence each
        mtp_moe = 1 if any(g.family == "experts" for g in draft) else 0
        d, d_comm = step(draft, micro, 1, 1 / pp, kv_read(cache.draft_dense, cache.draft_sparse, cache.draft_split) / pp,
                         mtp_moe / pp)
        stage, comm = stage + k * d, comm + k * d_comm
    p2p = micro * facts.hidden * 2 / (inter.bandwidth_gbs * 1e9) + inter.latency_us * 1e-6 if pp > 1 else 0.0
    round_s = pp * stage + (pp - 1) * p2p
    accept = load.tokens_per_round
    tokens_s = layout.dp * b * accept / round_s
    p = load.prefill_tokens
    pre_flops = 2 * p * sum(g.params * (share if g.family == "experts" else 1.0) for g in main) / layout.tp
    pre_flops += 2 * p * min(p, cache.sparse_topk or p) * facts.attn_flops_dim * facts.layers / layout.tp
    pre_comm = 2 * facts.layers * _allreduce_s(p * facts.hidden * 2, layout.tp, tp_link)
    prefill = p / (pre_flops / peak + pre_comm + (pp - 1) * p2p)
    return Estimate(layout, mem, tokens_s, round_s / accept * 1e3, prefill, comm * pp * 1e3)

"""One layout on one chip: per-device memory, and decode / prefill time from a roofline plus collectives.

Decode is memory-bound: a step reads the device's share of the weights (for MoE, only the experts some
token picked) and of the KV cache, or is bound by its FLOPs, whichever is slower; then TP adds two
all-reduces per layer (attention and MLP outputs) and EP a dispatch and a combine all-to-all per MoE
layer, each costed as bytes over the link's bandwidth plus a latency per hop. That is what makes wide TP
lose on PCIe (slow links, many hops) and win on NVLink/HCCS (the weights' share shrinks, the links are
fast). Efficiencies are fixed fractions of peak: this ranks layouts, it does not promise tokens/s.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from functools import lru_cache

import yaml

from flagdeploy.chips import Chip
from flagdeploy.profiles import PROFILES_DIR

from .ledger import CacheShape, WeightGroup

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


@dataclass
class DeviceMemory:
    weights: int
    kv_cache: int
    linear_state: int
    activations: int
    reserve: int
    capacity: int

    @property
    def used(self) -> int:
        return self.weights + self.kv_cache + self.linear_state + self.activations + self.reserve

    @property
    def free(self) -> int:
        return self.capacity - self.used

    def as_dict(self) -> dict[str, int]:
        return {"weights": self.weights, "kv_cache": self.kv_cache, "linear_state": self.linear_state,
                "activations": self.activations, "reserve": self.reserve, "free": self.free, "capacity": self.capacity}


@dataclass
class Estimate:
    layout: Layout
    memory: DeviceMemory
    decode_tokens_s: float  # aggregate over all replicas at the requested concurrency
    token_latency_ms: float  # one decode step, as each sequence sees it
    prefill_tokens_s: float
    comm_ms: float  # collectives in one decode step


def _divisor(split: str, layout: Layout) -> int:
    if split == "replicated":
        return 1
    if split == "ep":
        return layout.ep if layout.ep > 1 else layout.tp
    return layout.tp


def _stage(layer: int | None, family: str, layers: int, pp: int) -> int:
    if layer is None:
        return pp - 1 if family in ("lm_head", "norm") else 0
    return min(layer * pp // layers, pp - 1)


def _kv_div(heads: int, tp: int) -> int:
    return min(tp, heads) if heads else 1


def memory(groups: list[WeightGroup], cache: CacheShape, facts: ModelFacts, chip: Chip, layout: Layout,
           load: Workload) -> DeviceMemory:
    stages = [0] * layout.pp
    for g in groups:
        stages[_stage(g.layer, g.family, facts.layers, layout.pp)] += g.bytes // _divisor(g.split, layout)
    seqs = math.ceil(load.concurrency / layout.dp)
    kv = [0] * layout.pp
    state = [0] * layout.pp
    for i in range(cache.layers):
        s = _stage(i, "", facts.layers, layout.pp)
        kv[s] += (cache.dense[i] + cache.sparse[i]) * load.kv_dtype_bytes // _kv_div(cache.kv_split[i], layout.tp)
        if cache.state_fp32:
            state[s] += (cache.state_fp32[i] * 4 + cache.state_conv[i] * load.kv_dtype_bytes) // _kv_div(cache.state_split[i], layout.tp)
    worst = max(range(layout.pp), key=lambda s: stages[s] + kv[s] * seqs * load.max_model_len + state[s] * seqs)
    activations = load.max_num_batched_tokens * facts.hidden * 2 * 16 + seqs * math.ceil(facts.vocab / layout.tp) * 4
    return DeviceMemory(stages[worst], kv[worst] * seqs * load.max_model_len, state[worst] * seqs, activations,
                        RESERVE_BYTES, int(chip.memory_gib * GIB * load.memory_utilization))


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
    layers = facts.layers / pp

    def step(n: int) -> tuple[float, float]:
        """(seconds, of which collectives) for one stage to decode one token of n sequences."""
        picked = 1 - (1 - facts.experts_per_token / facts.experts) ** n if facts.experts else 1.0
        weights_read = flops = 0.0
        for g in groups:
            div = _divisor(g.split, layout) * pp
            weights_read += g.bytes / div * (picked if g.family == "experts" else 1.0)
            flops += 2 * n * g.params / div * (facts.experts_per_token / facts.experts if g.family == "experts" else 1.0)
        ctx = load.avg_context
        kv_read = n * sum((cache.dense[i] * ctx + cache.sparse[i] * min(ctx, cache.sparse_topk or ctx))
                          * load.kv_dtype_bytes / _kv_div(cache.kv_split[i], layout.tp) for i in range(cache.layers)) / pp
        flops += 2 * n * ctx * facts.attn_flops_dim * layers / layout.tp
        act = n * facts.hidden * 2
        comm = 2 * layers * _allreduce_s(act, layout.tp, tp_link)
        comm += facts.moe_layers / pp * 2 * _alltoall_s(act * facts.experts_per_token, layout.ep, ep_link)
        return max((weights_read + kv_read) / bandwidth, flops / peak) + comm, comm

    stage, comm = step(micro)
    p2p = micro * facts.hidden * 2 / (inter.bandwidth_gbs * 1e9) + inter.latency_us * 1e-6 if pp > 1 else 0.0
    round_s = pp * stage + (pp - 1) * p2p
    accept, verify = (1.6, 1.15) if load.mtp else (1.0, 1.0)  # MTP: tokens per step (assumed), cost of checking them
    tokens_s = layout.dp * b * accept / (round_s * verify)
    p = load.prefill_tokens
    pre_flops = 2 * p * sum(g.params * (facts.experts_per_token / facts.experts if g.family == "experts" else 1.0)
                            for g in groups) / layout.tp
    pre_flops += 2 * p * min(p, cache.sparse_topk or p) * facts.attn_flops_dim * facts.layers / layout.tp
    pre_comm = 2 * facts.layers * _allreduce_s(p * facts.hidden * 2, layout.tp, tp_link)
    prefill = p / (pre_flops / peak + pre_comm + (pp - 1) * p2p)
    return Estimate(layout, mem, tokens_s, round_s * verify / accept * 1e3, prefill, comm * pp * 1e3)

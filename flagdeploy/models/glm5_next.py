"""GLM-5.3-Flash (HF `glm5_next`), text part, on flagdeploy.ops and flagdeploy.ops.glm.

Layers mix two token mixers, KDA linear attention (a recurrent state per sequence) and MLA with the
DSA kpool indexer (NoPE; a latent cache per token), and two FFNs, dense SwiGLU and a sigmoid-routed MoE
with a shared expert; every block sits between manifold-constrained hyper-connections (N residual
streams). Each sequence has a `Glm5SequenceCache`: KDA state held directly, per-token MLA/indexer rows
in one tensor when standalone or in the engine's block pools (`PagedTokenRows`); a step packs any number
of sequences of any lengths (`forward_packed` / `forward_batch`), as flagdeploy's llama path does.
The reference this is checked against is transformers 5.23's `Glm5NextForConditionalGeneration`
(tests/test_glm5_next.py).

Split over several processes (flagdeploy.parallel; tests/test_parallel_glm5.py): tensor parallelism
(--tp) gives each rank whole attention heads (MLA and KDA), a share of every dense MLP / shared expert /
routed expert's intermediate size, and a share of the vocabulary; expert parallelism (--ep) gives each
rank a contiguous block of the routed experts, and tokens travel to them and back by all-to-all.
Everything small or input-side is replicated (norms, mHC, router, the MLA latent projections and the
DSA indexer), so every rank caches the full MLA latent and computes the same top-k selection.
"""

from __future__ import annotations

import logging
import re
from dataclasses import dataclass, field
from typing import Any, Iterable

import torch
import torch.nn.functional as F
from torch import nn

from flagdeploy import ops, parallel
from flagdeploy.errors import ModelLoadError
from flagdeploy.ops import glm as glm_ops
from flagdeploy.ops.weights import FP8_DTYPES, Fp8BlockWeight, Int8Weight, W8A8Weight, fp8_block_dequantize
from flagdeploy.parallel import Shard

from . import overlap
from .linear import Linear, column_parallel, row_parallel, vocab_parallel_embedding, vocab_parallel_head
from .slots import copy_param

log = logging.getLogger(__name__)

# ---- config -------------------------------------------------------------------------------------------


@dataclass
class Glm5Config:
    """The text-model facts, with transformers' defaults (GLM-5.3-Flash) for anything a config omits."""

    vocab_size: int = 154880
    hidden_size: int = 4096
    intermediate_size: int = 12288
    moe_intermediate_size: int = 2048
    num_layers: int = 45
    num_heads: int = 64
    n_shared_experts: int = 1
    n_routed_experts: int = 288
    routed_scaling_factor: float = 2.5
    kv_lora_rank: int = 512
    q_lora_rank: int = 1536
    qk_nope_head_dim: int = 256
    v_head_dim: int = 256
    n_group: int = 1
    topk_group: int = 1
    num_experts_per_tok: int = 8
    norm_topk_prob: bool = True
    rms_norm_eps: float = 1e-5
    tie_word_embeddings: bool = False
    attention_bias: bool = False
    index_topk: int = 2048
    index_head_dim: int = 128
    index_n_heads: int = 32
    index_kpool: int = 16
    index_kpool_always_select_tail: bool = True
    swiglu_limit: float = 10.0
    linear_head_dim: int = 128
    linear_num_heads: int = 64
    linear_conv_kernel_dim: int = 4
    linear_lower_bound: float | None = -5.0
    hc_mult: int = 4
    hc_eps: float = 1e-6
    hc_sinkhorn_iters: int = 20
    max_position_embeddings: int = 1048576
    layer_types: list[str] = field(default_factory=list)
    mlp_layer_types: list[str] = field(default_factory=list)
    indexer_types: list[str] = field(default_factory=list)
    eos_token_ids: list[int] = field(default_factory=list)
    bos_token_id: int | None = None
    architecture: str = "glm5_next"
    # FP8 checkpoints: (rows, cols) of the blocks sharing one `weight_scale_inv` entry; None if not FP8
    fp8_block: tuple[int, int] | None = None


# HF text-config key → our field, where the names differ.
_RENAMED = {"num_hidden_layers": "num_layers", "num_attention_heads": "num_heads"}


def _text_fields(cfg: dict[str, Any]) -> dict[str, Any]:
    """The text part of a `glm5_next` (nested or flat) or `glm5_next_text` config dict."""
    model_type = cfg.get("model_type", "glm5_next")
    if model_type not in ("glm5_next", "glm5_next_text"):
        raise ModelLoadError(f"expected a glm5_next config, got model_type {model_type!r}")
    if model_type == "glm5_next" and cfg.get("text_config") is not None:
        return dict(cfg["text_config"])
    return dict(cfg)  # flat text-only checkpoints keep the text fields at the top level (as transformers reads them)


def from_hf_config(cfg: dict[str, Any]) -> Glm5Config:
    """Our config from an HF config dict: transformers' defaults, schedules and checks, same messages.

    Rejects what transformers' `validate_architecture` rejects, plus what its forward would fail on
    later (a "shared" indexer layer not directly after a "full" indexed layer; a non-SiLU activation).
    """
    t = _text_fields(cfg)
    out = Glm5Config()
    for key, value in t.items():
        name = _RENAMED.get(key, key)
        if name in ("layer_types", "mlp_layer_types", "indexer_types", "eos_token_ids", "architecture"):
            continue
        if hasattr(out, name) and value is not None:
            setattr(out, name, value)
    if "linear_lower_bound" in t:
        out.linear_lower_bound = t["linear_lower_bound"]
    n = out.num_layers
    kv_heads = t.get("num_key_value_heads") or out.num_heads
    if (lin := t.get("linear_attn_config")) is not None:
        out.linear_head_dim = lin.get("head_dim", out.linear_head_dim)
        out.linear_num_heads = lin.get("num_heads", out.linear_num_heads)
        out.linear_conv_kernel_dim = lin.get("short_conv_kernel_size", out.linear_conv_kernel_dim)
        out.linear_lower_bound = lin.get("gate_lower_bound", out.linear_lower_bound)
        if lin.get("safe_gate", True) and out.linear_lower_bound is None:
            out.linear_lower_bound = -5.0
    out.mlp_layer_types = list(t.get("mlp_layer_types") or ["dense"] * min(3, n) + ["sparse"] * max(n - 3, 0))
    layer_types = t.get("layer_types") or ["linear_attention" if i % 4 != 3 else "indexed_attention" for i in range(n)]
    out.layer_types = ["indexed_attention" if lt == "full_attention" else lt for lt in layer_types]
    out.indexer_types = list(t.get("indexer_types") or _indexer_schedule(t, n))
    eos = t.get("eos_token_id", cfg.get("eos_token_id"))
    out.eos_token_ids = [eos] if isinstance(eos, int) else list(eos or [])
    out.bos_token_id = t.get("bos_token_id", cfg.get("bos_token_id"))
    if cfg.get("tie_word_embeddings") is not None and "tie_word_embeddings" not in t:
        out.tie_word_embeddings = bool(cfg["tie_word_embeddings"])
    quant = cfg.get("quantization_config") or t.get("quantization_config") or {}
    if quant.get("quant_method") == "fp8" or quant.get("weight_block_size"):  # FP8 as published, or kept by quantize
        out.fp8_block = tuple(quant.get("weight_block_size") or (128, 128))  # type: ignore[assignment]
    _validate(out, kv_heads, t.get("qk_rope_head_dim", 0), t.get("q_lora_rank", 1), t.get("hidden_act", "silu"))
    return out


def _indexer_schedule(t: dict[str, Any], n: int) -> list[str]:
    """transformers' default: an explicit "FS..." pattern, else "full" every `index_topk_freq` layers."""
    pattern = t.get("index_topk_pattern")
    if pattern is not None:
        return [{"F": "full", "S": "shared"}[c] for c in pattern] if isinstance(pattern, str) else list(pattern)
    freq, offset = max(t.get("index_topk_freq", 1), 1), t.get("index_skip_topk_offset", 2)
    return ["full" if max(i - offset + 1, 0) % freq == 0 else "shared" for i in range(n)]


def _validate(c: Glm5Config, kv_heads: int, rope_dim: int, q_lora_rank, act: str) -> None:
    def bad(msg: str) -> None:
        raise ModelLoadError(msg)

    # transformers' validate_architecture, same wording
    if c.num_heads != kv_heads:
        bad(f"num_attention_heads ({c.num_heads}) must be the same as num_key_value_heads ({kv_heads}).")
    if c.index_kpool < 1:
        bad(f"index_kpool must be positive, got {c.index_kpool}.")
    if c.index_topk % c.index_kpool != 0:
        bad(f"index_topk ({c.index_topk}) must be divisible by index_kpool ({c.index_kpool}).")
    if q_lora_rank is None:
        bad("For DSA usage in the attention layers, the `q_lora_rank` is strictly required!")
    if rope_dim > 0:
        bad(f"Expecting NoPE for the DSA attention layers, but got {rope_dim} as RoPE dim.")
    # what transformers only finds out in forward
    if act != "silu":
        bad(f"hidden_act {act!r} is not supported (GLM-5.3-Flash uses silu).")
    for name, seq in (("layer_types", c.layer_types), ("mlp_layer_types", c.mlp_layer_types),
                      ("indexer_types", c.indexer_types)):
        if len(seq) != c.num_layers:
            bad(f"{name} has {len(seq)} entries, num_hidden_layers is {c.num_layers}.")
    for i, lt in enumerate(c.layer_types):
        if lt not in ("linear_attention", "indexed_attention"):
            bad(f"layer_types[{i}] is {lt!r}; expected 'linear_attention' or 'indexed_attention'.")
        if lt == "indexed_attention" and c.indexer_types[i] == "shared":
            prev_ok = i > 0 and c.layer_types[i - 1] == "indexed_attention" and c.indexer_types[i - 1] == "full"
            if not prev_ok:
                bad(f"layer {i} is a 'shared' indexer layer but layer {i - 1} is not a 'full' indexed layer; "
                    f"transformers only hands top-k indices to the layer directly after a full one.")
    if c.n_routed_experts % c.n_group:
        bad(f"n_routed_experts ({c.n_routed_experts}) must be divisible by n_group ({c.n_group}).")


# ---- caches -------------------------------------------------------------------------------------------


@dataclass
class KdaState:
    """A KDA layer's per-sequence state: the last K-1 conv inputs and the recurrent matrix (float32)."""

    conv: torch.Tensor | None = None  # [K-1, 3 * heads * head_dim]
    recurrent: torch.Tensor | None = None  # [heads, head_dim, head_dim]


def _pool_row(key: str) -> property:
    """A view of this state's row of pool `key`; assigning copies into the row."""
    return property(lambda self: self._pool[key][self.slot],
                    lambda self, value: self._pool[key][self.slot].copy_(value))


class PooledKdaState:
    """A KDA state held as one row (`slot`) of the engine's state pools [max_seqs, ...], so that a decode
    step can gather and scatter every sequence's state by row index (`KdaAttention.decode`). Reads are
    views of the row; assignments copy into it. A new sequence's row is zeroed (`reset`): a zero state is
    what a fresh `KdaState` means."""

    conv = _pool_row("conv")
    recurrent = _pool_row("recurrent")

    def __init__(self, pool: dict[str, torch.Tensor], slot: int):
        self._pool, self.slot = pool, slot

    def reset(self) -> None:
        self._pool["conv"][self.slot].zero_()
        self._pool["recurrent"][self.slot].zero_()


class TokenRows:
    """One sequence's per-token rows of one cached quantity (latent, indexer key, pool gate), grown a
    step at a time and read back whole. Standalone they live in one tensor; inside the engine they live
    in pages of a shared pool (`PagedTokenRows`)."""

    def __init__(self) -> None:
        self.rows: torch.Tensor | None = None

    def append(self, new: torch.Tensor) -> None:
        self.rows = new if self.rows is None else torch.cat([self.rows, new])

    def all(self) -> torch.Tensor:
        return self.rows


class PagedTokenRows(TokenRows):
    """Rows in the engine's block pool: `pool` [num_blocks, block_size, D] shared by all sequences, and
    the sequence's own block table (the block manager's live list, grown before each step)."""

    def __init__(self, pool: torch.Tensor, block_table: list[int], length: int = 0):
        super().__init__()
        self.pool, self.table, self.length = pool, block_table, length

    def _slots(self, start: int, end: int) -> torch.Tensor:
        bs = self.pool.shape[1]
        pos = torch.arange(start, end, device=self.pool.device)
        blocks = torch.tensor(self.table[: -(-end // bs)], dtype=torch.long, device=self.pool.device)
        return blocks[pos // bs] * bs + pos % bs

    def append(self, new: torch.Tensor) -> None:
        end = self.length + new.shape[0]
        self.pool.view(-1, self.pool.shape[-1]).index_copy_(0, self._slots(self.length, end), new.to(self.pool.dtype))
        self.length = end

    def all(self) -> torch.Tensor:
        return self.pool.view(-1, self.pool.shape[-1]).index_select(0, self._slots(0, self.length))


@dataclass
class MlaCache:
    """An indexed layer's per-token cache: the normalised latent, and the indexer key / pool gate."""

    latent: TokenRows = field(default_factory=TokenRows)  # [S, kv_lora_rank]
    index_keys: TokenRows = field(default_factory=TokenRows)  # [S, index_head_dim] (full indexer layers only)
    index_gate: TokenRows = field(default_factory=TokenRows)  # [S, index_head_dim]


@dataclass
class Glm5SequenceCache:
    """Everything one sequence carries between steps; `length` counts the tokens already seen."""

    layers: list[KdaState | MlaCache]
    length: int = 0

    @classmethod
    def empty(cls, cfg: Glm5Config) -> "Glm5SequenceCache":
        return cls([KdaState() if lt == "linear_attention" else MlaCache() for lt in cfg.layer_types])

    @classmethod
    def paged(cls, cfg: Glm5Config, pools: dict[int, dict[str, torch.Tensor]], block_table: list[int],
              state_slot: int, length: int = 0):
        """A view of one sequence in the engine's pools: per-token rows through its block table, KDA
        state in row `state_slot`, `length` tokens already cached (the engine builds one each step)."""
        return cls([PooledKdaState(pools[i], state_slot) if lt == "linear_attention" else
                    MlaCache(**{k: PagedTokenRows(pool, block_table, length) for k, pool in pools[i].items()})
                    for i, lt in enumerate(cfg.layer_types)], length)


@dataclass
class DecodeBatch:
    """One decode step of B sequences (one new token each) in shapes fixed by B and the block-table
    width W alone: every per-sequence quantity is a device tensor and nothing is read back to the host,
    so the step can be captured once as a CUDA graph and replayed (`forward_decode`)."""

    pools: dict[int, dict[str, torch.Tensor]]  # the engine's pools (`cache_pools`)
    state_slots: torch.Tensor  # [B] each sequence's row of the KDA state pools
    slots: torch.Tensor  # [B] flat pool row (block * block_size + offset) of the new token
    block_tables: torch.Tensor  # [B, W]
    lengths: torch.Tensor  # [B] tokens of the sequence including the new one


# ---- layers -------------------------------------------------------------------------------------------

# One sequence of a packed step: its rows [start, end) in the flattened token dimension, and how many of
# its tokens the cache already holds (the position of its first new token).
Span = tuple[int, int, int]


def _param(*shape: int, dtype: torch.dtype) -> nn.Parameter:
    return nn.Parameter(torch.empty(*shape, dtype=dtype), requires_grad=False)


def _lin(out_f: int, in_f: int, dtype: torch.dtype, name: str, bias: bool = False) -> Linear:
    return Linear(out_f, in_f, dtype, (name,), bias=bias)


def _local_heads(heads: int, what: str) -> int:
    """How many of `heads` each TP rank holds (a ValueError naming --tp if they do not split evenly)."""
    return parallel.split(heads, parallel.tp_size(), 0, what, "--tp")[1]


def _head_shard(heads: int, per_head: int, what: str) -> Shard | None:
    """This TP rank's whole heads of a tensor laid out head after head (`per_head` rows each, dim 0);
    None without TP. Splitting by heads (not by rows) keeps a head's rows on one rank."""
    if parallel.tp_size() == 1:
        return None
    start, length = parallel.split(heads, parallel.tp_size(), parallel.tp_rank(), what, "--tp")
    return Shard(0, start * per_head, length * per_head, heads * per_head)


class KdaAttention(nn.Module):
    """Kimi delta attention: short conv on q/k/v, per-channel forget gate, gated delta rule, gated norm."""

    def __init__(self, c: Glm5Config, dtype: torch.dtype):
        super().__init__()
        self.c = c
        h, d, width = c.linear_num_heads, c.linear_head_dim, c.linear_num_heads * c.linear_head_dim
        # Under TP each rank holds whole heads: every per-channel tensor (q/k/v and their convs, the
        # gates' output rows, dt_bias) is cut by `channels`, the per-head ones (beta, A_log) by `heads`;
        # the low-rank input sides (f_a, g_a) and o_norm (one weight shared by all heads) are replicated,
        # and o_proj sums the heads' contributions over the group. The state then holds local heads only.
        what = "linear attention heads (linear_num_heads)"
        self.heads = _local_heads(h, what)
        self.channels, self.head_rows = _head_shard(h, d, what), _head_shard(h, 1, what)
        local = self.heads * d
        # Everything computed from the block input in one matmul: q/k/v (head-split under TP), the low-rank
        # input sides of the forget gate and the output gate (replicated) and beta (per head). At one token
        # each separate skinny matmul is a launch and a split-K reduce of its own.
        self.in_proj = column_parallel(
            {"q_proj": width, "k_proj": width, "v_proj": width, "f_a_proj": d, "g_a_proj": d, "b_proj": h},
            c.hidden_size, dtype, shards={"q_proj": self.channels, "k_proj": self.channels, "v_proj": self.channels,
                                          "f_a_proj": None, "g_a_proj": None, "b_proj": self.head_rows})
        self.in_split = (3 * local, d, d, self.heads)
        # float32 like transformers' _keep_in_fp32_modules: the conv, dt_bias and A_log stay exact
        self.conv_weight = _param(3 * local, c.linear_conv_kernel_dim, dtype=torch.float32)
        self.f_b_proj = column_parallel({"f_b_proj": width}, d, dtype, shards={"f_b_proj": self.channels})
        self.dt_bias = _param(local, dtype=torch.float32)
        self.A_log = _param(self.heads, dtype=torch.float32)
        self.g_b_proj = column_parallel({"g_b_proj": width}, d, dtype, shards={"g_b_proj": self.channels})
        self.o_norm = _param(d, dtype=dtype)
        self.o_proj = row_parallel(c.hidden_size, width, dtype, "o_proj", what=what)

    def _project(self, h: torch.Tensor):
        """(q/k/v before the conv [T, 3 local], log-decay g [T, H, D] float32, beta [T, H], output gate [T, H, D])."""
        mixed, f_a, g_a, b = self.in_proj(h).split(self.in_split, dim=-1)
        g, beta = glm_ops.kda_gates(self.f_b_proj(f_a), b, self.dt_bias, self.A_log, self.c.linear_lower_bound)
        return mixed, g, beta, self.g_b_proj(g_a).view(h.shape[0], self.heads, -1)

    def forward(self, h: torch.Tensor, states: list[KdaState], spans: list[Span]) -> torch.Tensor:
        """Projections run on the packed tokens; the conv and the recurrence per sequence."""
        c = self.c
        t, shape = h.shape[0], (h.shape[0], self.heads, c.linear_head_dim)
        mixed, g, beta, gate = self._project(h)
        out = h.new_empty(shape)
        stepping = [i for i, (a, b, _) in enumerate(spans) if b - a == 1 and states[i].recurrent is not None]
        if len(stepping) > 1:
            self._step_together([states[i] for i in stepping], [spans[i][0] for i in stepping], mixed, g, beta, out)
        done = set(stepping) if len(stepping) > 1 else set()
        for i, (state, (a, b, _)) in enumerate(zip(states, spans)):
            if i in done:
                continue
            conv, state.conv = glm_ops.causal_conv1d(mixed[a:b], self.conv_weight, state.conv)
            q, k, v = (x.reshape(b - a, *shape[1:]) for x in conv.chunk(3, dim=-1))
            kda = glm_ops.kda_recurrent if b - a == 1 and state.recurrent is not None else glm_ops.kda_chunk
            if state.recurrent is None:
                state.recurrent = torch.zeros(self.heads, c.linear_head_dim, c.linear_head_dim,
                                              dtype=torch.float32, device=h.device)
            out[a:b], state.recurrent = kda(q, k, v, g[a:b], beta[a:b], state.recurrent)
        return self.o_proj(glm_ops.gated_rms_norm(out, gate, self.o_norm, c.rms_norm_eps).reshape(t, -1))

    def decode(self, h: torch.Tensor, batch: DecodeBatch, pool: dict[str, torch.Tensor]) -> torch.Tensor:
        """One token of each of B sequences, states read from and written back to the state pools by
        `batch.state_slots`; the conv and the delta rule run as one op call each for the whole batch."""
        c, n = self.c, h.shape[0]
        heads, d = self.heads, c.linear_head_dim
        mixed, g, beta, gate = self._project(h)
        conv = glm_ops.causal_conv1d_update(mixed, self.conv_weight, pool["conv"], batch.state_slots)
        q, k, v = (part.reshape(n, heads, d) for part in conv.chunk(3, dim=-1))
        o = glm_ops.kda_recurrent_update(q, k, v, g, beta, pool["recurrent"], batch.state_slots)
        return self.o_proj(glm_ops.gated_rms_norm(o, gate, self.o_norm, c.rms_norm_eps).reshape(n, -1))

    def _step_together(self, states: list[KdaState], rows: list[int], mixed, g, beta, out) -> None:
        """One decode step of B sequences as one op call each: both the conv and the delta rule act per
        channel / per head independently, so B sequences are B times the channels / heads of one."""
        c, n = self.c, len(rows)
        heads, width = self.heads, mixed.shape[1]
        x = mixed[rows].reshape(1, n * width)
        conv_state = torch.cat([s.conv for s in states], dim=1)
        conv, conv_state = glm_ops.causal_conv1d(x, self.conv_weight.repeat(n, 1), conv_state)
        q, k, v = (part.reshape(1, n * heads, c.linear_head_dim) for part in conv.view(n, width).chunk(3, dim=-1))
        recurrent = torch.cat([s.recurrent for s in states])
        o, recurrent = glm_ops.kda_recurrent(q, k, v, g[rows].reshape(1, n * heads, -1), beta[rows].reshape(1, n * heads),
                                             recurrent)
        out[rows] = o.view(n, heads, -1)
        for i, s in enumerate(states):
            s.conv = conv_state[:, i * width : (i + 1) * width]
            s.recurrent = recurrent[i * heads : (i + 1) * heads]


class DsaIndexer(nn.Module):
    """Per-token indexer key and pool gate (cached), and the query side that picks the pools."""

    def __init__(self, c: Glm5Config, dtype: torch.dtype):
        super().__init__()
        self.c = c
        di = c.index_head_dim
        self.wq_b = _lin(c.index_n_heads * di, c.q_lora_rank, dtype, "wq_b")
        # the three projections of the block input (key, pool gate, head weights) as one matmul, replicated
        parts = {"wk": di, "index_kpool_compress_gate": di, "weights_proj": c.index_n_heads}
        self.in_proj = column_parallel(parts, c.hidden_size, dtype, shards=dict.fromkeys(parts))
        self.in_split = tuple(parts.values())
        self.k_norm_weight = _param(di, dtype=dtype)
        self.k_norm_bias = _param(di, dtype=dtype)
        self.compress_ape = _param(c.index_kpool, di, dtype=dtype)

    def forward(self, h: torch.Tensor, q_resid: torch.Tensor, caches: list[MlaCache], spans: list[Span]):
        """Per sequence, the selection mask [T_i, S_i] of its new tokens over all its tokens."""
        c = self.c
        keys, gate, weights = self._project(h)
        q = self.wq_b(q_resid).view(h.shape[0], c.index_n_heads, c.index_head_dim)
        masks = []
        for cache, (a, b, start) in zip(caches, spans):
            cache.index_keys.append(keys[a:b])
            cache.index_gate.append(gate[a:b])
            masks.append(glm_ops.dsa_indexer_topk(q[a:b], weights[a:b], cache.index_keys.all(), cache.index_gate.all(),
                                                  self.compress_ape, start, c.index_topk,
                                                  c.index_kpool_always_select_tail))
        return masks

    def decode(self, h: torch.Tensor, q_resid: torch.Tensor, batch: DecodeBatch, pool: dict[str, torch.Tensor],
               rows: torch.Tensor) -> torch.Tensor:
        """The selection masks [B, S] of B decoding queries; their key / gate rows join the pools first."""
        c, n = self.c, h.shape[0]
        keys, gate, weights = self._project(h)
        q = self.wq_b(q_resid).view(n, c.index_n_heads, c.index_head_dim)
        keys = _write_and_gather(pool["index_keys"], keys, batch.slots, rows)
        gate = _write_and_gather(pool["index_gate"], gate, batch.slots, rows)
        return glm_ops.dsa_indexer_topk_decode(q, weights, keys, gate, self.compress_ape, batch.lengths,
                                               c.index_topk, c.index_kpool_always_select_tail)

    def _project(self, h: torch.Tensor):
        """(normed index keys [T, D], pool gate logits [T, D], per-head weights [T, Hi]) of the block input."""
        keys, gate, weights = self.in_proj(h).split(self.in_split, dim=-1)
        return F.layer_norm(keys, (self.c.index_head_dim,), self.k_norm_weight, self.k_norm_bias, 1e-6), gate, weights


def _write_and_gather(pool: torch.Tensor, new: torch.Tensor, slots: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
    """Write each sequence's new row at its slot of `pool` [blocks, block_size, D], then read every
    sequence's rows back through its block table (`rows` [B, S] flat pool rows): [B, S, D]."""
    flat = pool.view(-1, pool.shape[-1])
    flat.index_copy_(0, slots, new.to(pool.dtype))
    return flat.index_select(0, rows.flatten()).view(*rows.shape, -1)


class MlaAttention(nn.Module):
    """NoPE multi-head latent attention over the keys the (own or previous layer's) indexer selects."""

    def __init__(self, c: Glm5Config, dtype: torch.dtype, full_indexer: bool):
        super().__init__()
        self.c = c
        hq, dn, dv = c.num_heads, c.qk_nope_head_dim, c.v_head_dim
        # Under TP each rank holds whole heads (q_b and kv_b rows, o_proj columns); the latent side
        # (q_a, kv_a, their norms) is replicated, so every rank caches the full latent and the indexer
        # (which reads q_a's output) picks the same keys on every rank.
        what = "attention heads (num_attention_heads)"
        self.heads = _local_heads(hq, what)
        # q_a and kv_a (both FP8 in the published checkpoint, each ending on a 128-row scale block) as one matmul
        parts = {"q_a_proj": c.q_lora_rank, "kv_a_proj_with_mqa": c.kv_lora_rank}
        self.latent_proj = column_parallel(parts, c.hidden_size, dtype, c.attention_bias, shards=dict.fromkeys(parts))
        self.latent_split = tuple(parts.values())
        self.q_a_norm = _param(c.q_lora_rank, dtype=dtype)
        self.q_b_proj = column_parallel({"q_b_proj": hq * dn}, c.q_lora_rank, dtype,
                                        shards={"q_b_proj": _head_shard(hq, dn, what)})
        self.kv_a_norm = _param(c.kv_lora_rank, dtype=dtype)
        self.kv_b_proj = column_parallel({"kv_b_proj": hq * (dn + dv)}, c.kv_lora_rank, dtype,
                                         shards={"kv_b_proj": _head_shard(hq, dn + dv, what)})
        self.o_proj = row_parallel(c.hidden_size, hq * dv, dtype, "o_proj", c.attention_bias, what=what)
        self.indexer = DsaIndexer(c, dtype) if full_indexer else None
        self.scale = c.qk_nope_head_dim**-0.5

    def forward(self, h: torch.Tensor, caches: list[MlaCache], spans: list[Span], prev_masks: list | None):
        """Returns (output, per-sequence selection masks) so that a following shared layer can reuse them.

        The latent is cached. A prefill re-expands keys and values from it through kv_b; a decode step
        instead absorbs kv_b into the query and the output (attention runs in the latent space), so
        a step costs O(cached tokens x latent rank) rather than a kv_b matmul over every cached token.
        """
        c = self.c
        t = h.shape[0]
        q_a, kv_a = self.latent_proj(h).split(self.latent_split, dim=-1)
        q_resid = ops.rms_norm(q_a, self.q_a_norm, c.rms_norm_eps)
        q = self.q_b_proj(q_resid).view(t, self.heads, c.qk_nope_head_dim)
        latent = ops.rms_norm(kv_a, self.kv_a_norm, c.rms_norm_eps)
        masks = self.indexer(h, q_resid, caches, spans) if self.indexer is not None else prev_masks
        if masks is None:
            raise RuntimeError("a shared DSA layer needs the top-k selection of the full layer before it")
        out = q.new_empty(t, self.heads, c.v_head_dim)
        absorbed = self._absorbed_weights()
        for cache, (a, b, _), mask in zip(caches, spans, masks):
            cache.latent.append(latent[a:b])
            rows = cache.latent.all()
            if b - a == 1 and absorbed is not None:
                w_uk, w_uv = absorbed
                shared = rows.unsqueeze(1).expand(-1, self.heads, -1)  # one latent for all heads
                q_lat = torch.einsum("thd,hdr->thr", q[a:b].to(w_uk.dtype), w_uk)  # an FP8 q_b gives 16 bits
                ctx = glm_ops.sparse_attention(q_lat, shared, shared, mask, self.scale)
                out[a:b] = torch.einsum("thr,hvr->thv", ctx, w_uv)
                continue
            kv = self.kv_b_proj(rows).view(-1, self.heads, c.qk_nope_head_dim + c.v_head_dim)
            k, v = kv.split([c.qk_nope_head_dim, c.v_head_dim], dim=-1)
            out[a:b] = glm_ops.sparse_attention(q[a:b], k, v, mask, self.scale)
        return self.o_proj(out.reshape(t, -1)), masks

    def decode(self, h: torch.Tensor, batch: DecodeBatch, pool: dict[str, torch.Tensor], rows: torch.Tensor,
               prev_mask: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
        """One token of each of B sequences in the latent space (kv_b absorbed, as `forward` decodes one
        sequence); returns (output, selection mask [B, S]) for a following shared layer."""
        c, n = self.c, h.shape[0]
        q_a, kv_a = self.latent_proj(h).split(self.latent_split, dim=-1)
        q_resid = ops.rms_norm(q_a, self.q_a_norm, c.rms_norm_eps)
        q = self.q_b_proj(q_resid).view(n, self.heads, c.qk_nope_head_dim)
        latent = _write_and_gather(pool["latent"], ops.rms_norm(kv_a, self.kv_a_norm, c.rms_norm_eps), batch.slots, rows)
        mask = self.indexer.decode(h, q_resid, batch, pool, rows) if self.indexer is not None else prev_mask
        if mask is None:
            raise RuntimeError("a shared DSA layer needs the top-k selection of the full layer before it")
        w_uk, w_uv = self._absorbed_weights()
        q_lat = torch.einsum("bhd,hdr->bhr", q.to(w_uk.dtype), w_uk)  # an FP8 q_b gives 16 bits
        ctx = glm_ops.latent_attention_decode(q_lat, latent, mask, self.scale)
        return self.o_proj(torch.einsum("bhr,hvr->bhv", ctx, w_uv).reshape(n, -1)), mask

    def _absorbed_weights(self) -> tuple[torch.Tensor, torch.Tensor] | None:
        """kv_b split per head into its key part [H, Dn, R] and value part [H, Dv, R] (this rank's
        heads under TP). A quantized kv_b is dequantized once for this (kv_lora_rank x heads x (Dn + Dv)
        values, small next to the layer); None if its bundle cannot be (then decode expands like prefill)."""
        w = self.kv_b_proj.weight
        if w is None:
            w = getattr(self, "_kv_b_dense", None)
            if w is None:
                dequantize = getattr(self.kv_b_proj.qweight, "dequantize", None)
                if dequantize is None:
                    return None
                w = self._kv_b_dense = dequantize(self.kv_b_proj.dtype)
        c = self.c
        w = w.view(self.heads, c.qk_nope_head_dim + c.v_head_dim, c.kv_lora_rank)
        return w[:, : c.qk_nope_head_dim], w[:, c.qk_nope_head_dim :]


class DenseMlp(nn.Module):
    """Clamped SwiGLU MLP (also the MoE's shared expert).

    Under TP gate/up are column-parallel and down row-parallel (intermediate size split). `partial`
    leaves down's output a partial sum (no all-reduce of its own): the MoE adds it to the routed
    experts' partial sums and reduces both at once.
    """

    def __init__(self, c: Glm5Config, inter: int, dtype: torch.dtype, what: str = "intermediate_size",
                 partial: bool = False):
        super().__init__()
        self.limit = c.swiglu_limit
        self.gate_up_proj = column_parallel({"gate_proj": inter, "up_proj": inter}, c.hidden_size, dtype, what=what)
        self.down_proj = row_parallel(c.hidden_size, inter, dtype, "down_proj", what=what)
        if partial:
            self.down_proj.reduce = False

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        return self.down_proj(ops.swiglu(self.gate_up_proj(h), self.limit))


class ExpertBank(nn.Module):
    """The routed experts' weights, filled expert by expert from the checkpoint.

    Dense experts are copied straight into [E, 2I, H] / [E, H, I] parameters. When a checkpoint stores
    every expert in one quantized scheme (W8A8 or W8A16 int8 of one group size for gate/up and one for
    down, or FP8 block-scaled kept for an FP8 backend), the bank becomes one quantized bundle per
    projection instead, so that `moe_experts` runs that scheme's arithmetic; anything mixed is
    dequantized into the dense parameters.
    """

    _PARTS = ("gate_proj", "up_proj", "down_proj")

    def __init__(self, c: Glm5Config, dtype: torch.dtype):
        super().__init__()
        self.n_total, self.full_inter, self.hidden = c.n_routed_experts, c.moe_intermediate_size, c.hidden_size
        # EP: experts [first, first + n) live here; TP: each of them keeps a share of its intermediate size
        self.first, self.n = parallel.split(self.n_total, parallel.ep_size(), parallel.ep_rank(),
                                            "routed experts (n_routed_experts)", "--ep")
        self.rows = parallel.tp_shard(self.full_inter, 0, "moe_intermediate_size")  # gate/up rows
        self.inter = self.rows.length if self.rows is not None else self.full_inter
        self.gate_up = _param(self.n, 2 * self.inter, self.hidden, dtype=dtype)
        self.down = _param(self.n, self.hidden, self.inter, dtype=dtype)
        self._pending: dict[tuple[int, str], Any] = {}

    def holds(self, e: int) -> bool:
        """Whether routed expert `e` (global id) lives on this rank."""
        return self.first <= e < self.first + self.n

    def shard(self, proj: str) -> Shard | None:
        """This rank's slice of one expert's checkpoint tensor: gate/up rows, down columns (TP)."""
        if self.rows is None:
            return None
        return self.rows if proj != "down_proj" else Shard(1, self.rows.start, self.rows.length, self.rows.full)

    def part_shape(self, part: tuple[int, str]) -> tuple[int, int]:
        """The whole checkpoint tensor's shape (a slice of it is accepted too)."""
        return (self.hidden, self.full_inter) if part[1] == "down_proj" else (self.full_inter, self.hidden)

    def _view(self, e: int, name: str) -> torch.Tensor:
        i, e = self.inter, e - self.first
        return {"gate_proj": self.gate_up[e, :i], "up_proj": self.gate_up[e, i:], "down_proj": self.down[e]}[name]

    def load_part(self, part: tuple[int, str], kind: str, value) -> None:
        """One expert's projection (global expert id), whole or already this rank's slice."""
        shard = self.shard(part[1])
        if shard is not None:
            if not isinstance(value, torch.Tensor):  # quantized bundles are split dense, as Linear does
                value = value.dequantize(self.gate_up.dtype)
            value = shard.take(value)
        if isinstance(value, torch.Tensor):
            dst = self._view(*part)
            if tuple(dst.shape) != tuple(value.shape):
                raise ValueError(f"has shape {tuple(value.shape)}, this rank's slot is {tuple(dst.shape)}")
            dst.copy_(value)
        else:
            self._pending[part] = value

    def narrow_to_bf16(self) -> None:
        """Dense float32 banks whose every value is a bfloat16 number (a BF16 checkpoint's experts, run in
        float32) are stored as bfloat16: the weights are the checkpoint's exactly, in half the memory,
        and a decode step, which reads every expert's weights for a few tokens, reads half the bytes
        (`moe_experts` then rounds the matmuls' inputs to bfloat16). Banks that lose anything stay."""
        banks = (self.gate_up, self.down)
        if not all(isinstance(b, torch.Tensor) and b.dtype == torch.float32 for b in banks):
            return
        narrow = [b.to(torch.bfloat16) for b in banks]
        # expert by expert: the comparison's float32 temporaries stay one expert large
        if all(torch.equal(n[e].float(), b[e]) for n, b in zip(narrow, banks) for e in range(b.shape[0])):
            del self.gate_up, self.down
            self.gate_up, self.down = (nn.Parameter(n, requires_grad=False) for n in narrow)

    def finalize(self) -> None:
        self._join_pending()
        # the backend lays the banks out for its kernels (a Parameter stays a Parameter)
        banks = ops.prepare_weight("moe_experts", (self.gate_up, self.down))
        if banks[0] is not self.gate_up or banks[1] is not self.down:
            del self.gate_up, self.down
            self.gate_up, self.down = banks

    def _join_pending(self) -> None:
        if not self._pending:
            return
        bundles = list(self._pending.values())
        gate_up_groups = {getattr(b, "group_size", None) for (_, name), b in self._pending.items() if name != "down_proj"}
        down_groups = {getattr(b, "group_size", None) for (_, name), b in self._pending.items() if name == "down_proj"}
        kinds = {type(b) for b in bundles}
        banks = None
        if (len(bundles) == 3 * self.n and kinds <= {Int8Weight, W8A8Weight, Fp8BlockWeight}
                and len(kinds) == len(gate_up_groups) == len(down_groups) == 1):
            get = lambda e, name: self._pending[(e, name)]  # noqa: E731
            mine = range(self.first, self.first + self.n)
            kind = type(bundles[0])
            try:
                banks = (kind.stack([kind.cat([get(e, "gate_proj"), get(e, "up_proj")]) for e in mine]),
                         kind.stack([get(e, "down_proj") for e in mine]))
            except ValueError:  # FP8 halves off a scale-block boundary, unequal blocks: dense below
                banks = None
        if banks is not None:
            del self.gate_up, self.down  # the dense parameters give way to the banks
            self.gate_up, self.down = banks
        else:
            for (e, name), b in self._pending.items():
                self._view(e, name).copy_(b.dequantize(self.gate_up.dtype))
        self._pending.clear()


class MoE(nn.Module):
    """Sigmoid-routed experts (group-limited top-k) plus the always-on shared expert.

    The router is replicated: every rank routes every token identically. Under TP the routed and the
    shared experts' outputs are partial sums over the intermediate shard, reduced by one all-reduce.
    Under EP see `_expert_parallel`.
    """

    def __init__(self, c: Glm5Config, dtype: torch.dtype):
        super().__init__()
        self.c = c
        self.router = _param(c.n_routed_experts, c.hidden_size, dtype=dtype)
        self.correction_bias = _param(c.n_routed_experts, dtype=torch.float32)
        self.experts = ExpertBank(c, dtype)
        self.shared = DenseMlp(c, c.moe_intermediate_size * c.n_shared_experts, dtype, "moe_intermediate_size",
                               partial=True)

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        c = self.c
        ep = parallel.ep_size() > 1
        shared = None if ep else overlap.start(self.shared, h)  # beside the router and the routed experts, on a GPU
        routing = glm_ops.moe_router(h, self.router, self.correction_bias, c.num_experts_per_tok, c.n_group,
                                     c.topk_group, c.norm_topk_prob, c.routed_scaling_factor)
        if ep:
            return self._expert_parallel(h, routing)
        x = self.experts
        routed = glm_ops.moe_experts(h, routing, x.gate_up, x.down, c.swiglu_limit, top_k=c.num_experts_per_tok)
        return self._tp_sum(routed + overlap.finish(shared))

    @staticmethod
    def _tp_sum(partial: torch.Tensor) -> torch.Tensor:
        """The one all-reduce of the MoE over the TP group (routed + shared partial sums together)."""
        return ops.all_reduce(partial, parallel.tp_group()) if parallel.tp_size() > 1 else partial

    def _expert_parallel(self, h: torch.Tensor, routing: torch.Tensor) -> torch.Tensor:
        """The MoE with the routed experts spread over the EP group.

        Every EP rank has all T tokens; EP rank r takes the r-th contiguous block of ceil(T / ep) of
        them (the last blocks shorter or empty), so each token is dispatched exactly once. Each of
        the block's (token, expert) choices travels to the rank holding the expert (counts first, then
        the rows and the expert ids, all-to-all), that rank runs its local experts on what arrived,
        the outputs travel back by the inverse all-to-all and are weighted and summed per token here.
        The shared expert runs on the same block; with TP the block's partial sums are reduced once;
        an all-gather over the EP group finally gives every rank all T rows again.
        """
        c, bank, group = self.c, self.experts, parallel.ep_group()
        ep, t = parallel.ep_size(), h.shape[0]
        per = -(-t // ep)
        a, b = min(parallel.ep_rank() * per, t), min((parallel.ep_rank() + 1) * per, t)
        x, mine = h[a:b], routing[a:b]
        # dispatch: this block's choices grouped by owning rank (experts are laid out rank by rank)
        token, expert = mine.nonzero(as_tuple=True)
        order = torch.argsort(expert, stable=True)
        token, expert = token[order], expert[order]
        weight = mine[token, expert]
        owner = expert // bank.n
        send = torch.bincount(owner, minlength=ep)
        recv = parallel.all_to_all(send, [1] * ep, [1] * ep, group)
        send_n, recv_n = send.tolist(), recv.tolist()
        rows = parallel.all_to_all(x[token], send_n, recv_n, group)
        ids = parallel.all_to_all(expert, send_n, recv_n, group) - bank.first
        # the owner: each received row goes to exactly one local expert, with weight 1 (weighted at home)
        pick = torch.zeros(rows.shape[0], bank.n, dtype=rows.dtype, device=rows.device)
        pick.scatter_(1, ids.unsqueeze(1), 1.0)
        done = glm_ops.moe_experts(rows, pick, bank.gate_up, bank.down, c.swiglu_limit)
        back = parallel.all_to_all(done, recv_n, send_n, group)
        # combine: the block's weighted sums plus the shared expert, padded to `per` rows for the gather
        out = h.new_zeros(per, h.shape[1])
        out[: b - a].index_add_(0, token, (back * weight.unsqueeze(1)).to(out.dtype))
        out[: b - a] += self.shared(x)
        out = self._tp_sum(out)
        return parallel.all_gather(out, dim=0, group=group)[:t]


class HyperConnection(nn.Module):
    """The learned mHC weights of one block (projection, biases, three scales)."""

    def __init__(self, c: Glm5Config, dtype: torch.dtype):
        super().__init__()
        n = c.hc_mult
        self.fn = _param((2 + n) * n, n * c.hidden_size, dtype=dtype)
        self.base = _param((2 + n) * n, dtype=torch.float32)
        self.scale = _param(3, dtype=torch.float32)

    def pre(self, streams: torch.Tensor, c: Glm5Config):
        return glm_ops.hc_pre(streams, self.fn, self.base, self.scale, c.rms_norm_eps, c.hc_eps, c.hc_sinkhorn_iters)


class Glm5Layer(nn.Module):
    def __init__(self, c: Glm5Config, idx: int, dtype: torch.dtype):
        super().__init__()
        self.c, self.idx = c, idx
        self.kind = c.layer_types[idx]
        if self.kind == "linear_attention":
            self.attn: nn.Module = KdaAttention(c, dtype)
        else:
            self.attn = MlaAttention(c, dtype, full_indexer=c.indexer_types[idx] == "full")
        self.mlp: nn.Module = MoE(c, dtype) if c.mlp_layer_types[idx] == "sparse" else DenseMlp(c, c.intermediate_size,
                                                                                                 dtype)
        self.input_norm = _param(c.hidden_size, dtype=dtype)
        self.post_norm = _param(c.hidden_size, dtype=dtype)
        self.attn_hc = HyperConnection(c, dtype)
        self.ffn_hc = HyperConnection(c, dtype)

    def forward(self, streams: torch.Tensor, states: list, spans: list[Span], prev_masks: list | None):
        """streams [T, N, D] of the packed tokens → (streams, this layer's selection masks or None)."""
        if self.kind == "linear_attention":
            return self._block(streams, lambda h: (self.attn(h, states, spans), None))
        return self._block(streams, lambda h: self.attn(h, states, spans, prev_masks))

    def decode(self, streams: torch.Tensor, batch: DecodeBatch, rows: torch.Tensor | None,
               prev_mask: torch.Tensor | None):
        """streams [B, N, D], one token per sequence → (streams, this layer's selection mask or None)."""
        pool = batch.pools[self.idx]
        if self.kind == "linear_attention":
            return self._block(streams, lambda h: (self.attn.decode(h, batch, pool), None))
        return self._block(streams, lambda h: self.attn.decode(h, batch, pool, rows, prev_mask))

    def _block(self, streams: torch.Tensor, mix):
        """mHC around the token mixer `mix` (normed input → (output, masks)), then around the FFN."""
        c = self.c
        post, comb, h = self.attn_hc.pre(streams, c)
        h, masks = mix(ops.rms_norm(h, self.input_norm, c.rms_norm_eps))
        streams = glm_ops.hc_post(h, streams, post, comb)
        post, comb, h = self.ffn_hc.pre(streams, c)
        h = self.mlp(ops.rms_norm(h, self.post_norm, c.rms_norm_eps))
        return glm_ops.hc_post(h, streams, post, comb), masks


class Glm5NextForCausalLM(nn.Module):
    def __init__(self, cfg: Glm5Config, dtype: torch.dtype = torch.float32):
        super().__init__()
        self.cfg = cfg
        self.dtype = dtype
        # vocabulary-parallel under TP (rows padded to one width per rank), as the llama family
        self.embed_tokens = _param(parallel.padded_vocab(cfg.vocab_size), cfg.hidden_size, dtype=dtype)
        self.layers = nn.ModuleList(Glm5Layer(cfg, i, dtype) for i in range(cfg.num_layers))
        self.norm = _param(cfg.hidden_size, dtype=dtype)
        self.lm_head = vocab_parallel_head(cfg.vocab_size, cfg.hidden_size, dtype)
        self._plan_slots: dict[str, tuple] | None = None  # `read_plan`'s view of weight_slots, built once

    def new_cache(self) -> Glm5SequenceCache:
        """A standalone cache (its own tensors, grown as tokens arrive): for use outside the engine."""
        return Glm5SequenceCache.empty(self.cfg)

    def engine_cache(self, pools: dict, block_table: list[int], state_slot: int, length: int) -> Glm5SequenceCache:
        """A view of one sequence in the engine's pools with `length` tokens already cached; a sequence
        that starts (length 0: new, or recomputed after preemption) gets its KDA state rows zeroed, so
        stale state can never leak into it."""
        cache = Glm5SequenceCache.paged(self.cfg, pools, block_table, state_slot, length)
        if length == 0:
            for state in cache.layers:
                if isinstance(state, PooledKdaState):
                    state.reset()
        return cache

    def cache_pools(self, num_blocks: int, block_size: int, max_seqs: int) -> dict[int, dict[str, torch.Tensor]]:
        """The engine's pools, per layer: on indexed layers block pools of per-token rows (the latent, and
        the indexer key / pool gate on full-indexer ones), on KDA layers state pools of `max_seqs` rows
        (conv inputs, recurrent matrix in float32). The per-token widths do not depend on TP/EP (the latent
        and the indexer are replicated); the KDA state holds this rank's heads."""
        c = self.cfg
        pools: dict[int, dict[str, torch.Tensor]] = {}
        dev = self.norm.device
        for i, (lt, kind) in enumerate(zip(c.layer_types, c.indexer_types)):
            if lt == "linear_attention":
                attn = self.layers[i].attn
                d, kw = c.linear_head_dim, attn.conv_weight.shape[1]
                pools[i] = {"conv": torch.zeros(max_seqs, kw - 1, attn.conv_weight.shape[0], dtype=self.dtype, device=dev),
                            "recurrent": torch.zeros(max_seqs, attn.heads, d, d, dtype=torch.float32, device=dev)}
                continue
            widths = {"latent": c.kv_lora_rank}
            if kind == "full":  # a shared layer reuses the selection of the full layer before it
                widths.update(index_keys=c.index_head_dim, index_gate=c.index_head_dim)
            pools[i] = {k: torch.zeros(num_blocks, block_size, w, dtype=self.dtype, device=dev)
                        for k, w in widths.items()}
        return pools

    def state_bytes_per_seq(self) -> int:
        """What one sequence's KDA state takes in the state pools (fixed, whatever its length)."""
        size = lambda dt: torch.empty((), dtype=dt).element_size()  # noqa: E731
        total = 0
        for layer in self.layers:
            if layer.kind == "linear_attention":
                w = layer.attn.conv_weight
                total += (w.shape[1] - 1) * w.shape[0] * size(self.dtype)
                total += layer.attn.heads * self.cfg.linear_head_dim ** 2 * size(torch.float32)
        return total

    def can_decode_batched(self) -> bool:
        """Whether `forward_decode` can run: every MLA layer's kv_b can be absorbed."""
        return all(layer.attn._absorbed_weights() is not None for layer in self.layers if layer.kind != "linear_attention")

    def prepare(self, max_positions: int) -> None:
        """Nothing depends on the served context length: the MLA layers use no RoPE (NoPE)."""

    def cache_bytes_per_token(self) -> int:
        """What one more token adds to the block pools (`cache_pools`): the MLA latent on every indexed
        layer, the indexer key and pool gate on full-indexer ones. KDA layers add nothing per token
        (their state is fixed-size per sequence and holds this rank's heads only). The same on every
        rank: the MLA latent and the indexer rows are replicated under TP/EP."""
        c = self.cfg
        values = sum(c.kv_lora_rank + c.index_head_dim * (2 if kind == "full" else 0)
                     for lt, kind in zip(c.layer_types, c.indexer_types) if lt == "indexed_attention")
        return max(values, 1) * torch.empty((), dtype=self.dtype).element_size()

    def forward(self, input_ids: torch.Tensor, cache: Glm5SequenceCache | None = None) -> torch.Tensor:
        """Logits [T, vocab] (float32) for T new tokens of one sequence, continuing from `cache`.

        Prefill passes the prompt (and a fresh cache, or none if nothing continues); decode passes one
        token. The cache is updated in place.
        """
        cache = cache if cache is not None else self.new_cache()
        return self.forward_packed(input_ids, torch.tensor([0, input_ids.shape[0]]), [cache])

    def score(self, input_ids: torch.Tensor) -> torch.Tensor:
        """Logits [T, vocab] at every position of one sequence, from a fresh cache (evaluation)."""
        return self.forward(input_ids)

    def forward_batch(self, input_ids: list[torch.Tensor], caches: list[Glm5SequenceCache]) -> list[torch.Tensor]:
        """Several sequences of unequal lengths (prefill, decode or a mix), each against its own cache."""
        cu = torch.tensor([0, *torch.tensor([len(i) for i in input_ids]).cumsum(0).tolist()])
        logits = self.forward_packed(torch.cat(input_ids), cu, caches)
        return [logits[a:b] for a, b in zip(cu[:-1].tolist(), cu[1:].tolist())]

    @torch.inference_mode()
    def forward_packed(self, input_ids: torch.Tensor, cu_seqlens: torch.Tensor,
                       caches: list[Glm5SequenceCache]) -> torch.Tensor:
        """Logits [T, vocab] for a packed batch: sequence i owns rows cu_seqlens[i]:cu_seqlens[i+1].

        Everything token-wise (projections, MoE, mHC, norms) runs once on all rows; only the KDA
        recurrence, the conv, the indexer and attention loop over sequences.
        """
        bounds = cu_seqlens.tolist()
        spans = [(a, b, cache.length) for a, b, cache in zip(bounds[:-1], bounds[1:], caches)]
        x = vocab_parallel_embedding(input_ids, self.embed_tokens, self.cfg.vocab_size)
        streams = x.unsqueeze(1).expand(-1, self.cfg.hc_mult, -1).contiguous()
        masks = None
        for i, layer in enumerate(self.layers):
            streams, masks = layer(streams, [cache.layers[i] for cache in caches], spans, masks)
        for cache, (a, b, _) in zip(caches, spans):
            cache.length += b - a
        h = ops.rms_norm(streams.mean(1), self.norm, self.cfg.rms_norm_eps)
        return self.lm_head(h)[..., : self.cfg.vocab_size].float()

    def forward_decode(self, input_ids: torch.Tensor, pools: dict, state_slots: torch.Tensor, slots: torch.Tensor,
                       block_tables: torch.Tensor, lengths: torch.Tensor) -> torch.Tensor:
        """Logits [B, vocab] for one new token of each of B sequences held in the engine's pools (the
        fields of `DecodeBatch`).

        Same result as `forward_packed` on one-token spans, but in fixed shapes with no host reads, so the
        engine can capture it as a CUDA graph (flagdeploy/engine/cuda_graphs.py) or compile it whole
        (engine/compiled_step.py). The caller enters inference mode: torch.compile cannot trace a step that
        enters it itself.
        """
        c = self.cfg
        batch = DecodeBatch(pools, state_slots, slots, block_tables, lengths)
        x = vocab_parallel_embedding(input_ids, self.embed_tokens, c.vocab_size)
        streams = x.unsqueeze(1).expand(-1, c.hc_mult, -1).contiguous()
        rows = None
        per_token = [p["latent"] for p in batch.pools.values() if "latent" in p]
        if per_token:  # [B, W * block_size]: the flat pool row of each position of each sequence
            bs = per_token[0].shape[1]
            offsets = torch.arange(bs, device=batch.block_tables.device)
            rows = (batch.block_tables.unsqueeze(-1) * bs + offsets).flatten(1)
        mask = None
        for layer in self.layers:
            streams, mask = layer.decode(streams, batch, rows, mask)
        h = ops.rms_norm(streams.mean(1), self.norm, c.rms_norm_eps)
        return self.lm_head(h)[..., : c.vocab_size].float()

    # ---- weights --------------------------------------------------------------------------------------

    def weight_slots(self) -> dict[str, tuple]:
        """Checkpoint name (prefix-free, real-checkpoint form) → (parameter view, shard or None) or
        (Linear / ExpertBank, part, kind).

        Real-checkpoint form is what the published shards hold: experts one by one, q/k/v convs apart,
        `hc_attn_fn`-style mHC names, the forget-gate projections directly under `self_attn`. The shard
        is this rank's slice of the checkpoint tensor (None: the parameter holds it whole); under EP
        only this rank's experts have slots.
        """
        c = self.cfg
        slots: dict[str, tuple] = {"embed_tokens.weight": (self.embed_tokens, parallel.vocab_shard(c.vocab_size)),
                                   "norm.weight": (self.norm, None)}
        slots["lm_head.weight"] = (self.lm_head, "lm_head", "weight")

        def part(prefix: str, m: Linear, name: str) -> None:
            for kind in ("weight", "bias") if m.has_bias else ("weight",):
                slots[f"{prefix}{name}.{kind}"] = (m, name, kind)

        def lin(prefix: str, m: Linear) -> None:
            for name in m.parts:
                part(prefix, m, name)

        # fused layers' parts are listed in the published checkpoint's order (the tiny-checkpoint generator
        # draws its random weights in this order)

        for i, layer in enumerate(self.layers):
            p = f"layers.{i}."
            slots[p + "input_layernorm.weight"] = (layer.input_norm, None)
            slots[p + "post_attention_layernorm.weight"] = (layer.post_norm, None)
            for tag, hc in (("attn", layer.attn_hc), ("ffn", layer.ffn_hc)):
                for field_ in ("fn", "base", "scale"):
                    slots[f"{p}hc_{tag}_{field_}"] = (getattr(hc, field_), None)
            a, sa = layer.attn, p + "self_attn."
            if isinstance(a, KdaAttention):
                for name in ("q_proj", "k_proj", "v_proj", "f_a_proj"):
                    part(sa, a.in_proj, name)
                lin(sa, a.f_b_proj)
                part(sa, a.in_proj, "b_proj")
                part(sa, a.in_proj, "g_a_proj")
                lin(sa, a.g_b_proj)
                lin(sa, a.o_proj)
                conv = a.conv_weight.view(3, -1, 1, c.linear_conv_kernel_dim)
                for j, name in enumerate(("q", "k", "v")):
                    slots[f"{sa}{name}_conv1d.weight"] = (conv[j], a.channels)
                slots[sa + "dt_bias"] = (a.dt_bias, a.channels)
                slots[sa + "A_log"] = (a.A_log, a.head_rows)
                slots[sa + "o_norm.weight"] = (a.o_norm, None)
            else:
                part(sa, a.latent_proj, "q_a_proj")
                lin(sa, a.q_b_proj)
                part(sa, a.latent_proj, "kv_a_proj_with_mqa")
                lin(sa, a.kv_b_proj)
                lin(sa, a.o_proj)
                slots[sa + "q_a_layernorm.weight"] = (a.q_a_norm, None)
                slots[sa + "kv_a_layernorm.weight"] = (a.kv_a_norm, None)
                if a.indexer is not None:
                    ix, si = a.indexer, sa + "indexer."
                    lin(si, ix.wq_b)
                    part(si, ix.in_proj, "wk")
                    part(si, ix.in_proj, "weights_proj")
                    slots[si + "index_kpool_compress_gate"] = (ix.in_proj, "index_kpool_compress_gate", "weight")
                    slots[si + "index_kpool_compress_ape"] = (ix.compress_ape, None)
                    slots[si + "k_norm.weight"] = (ix.k_norm_weight, None)
                    slots[si + "k_norm.bias"] = (ix.k_norm_bias, None)
            m, sm = layer.mlp, p + "mlp."
            if isinstance(m, MoE):
                slots[sm + "gate.weight"] = (m.router, None)
                slots[sm + "gate.e_score_correction_bias"] = (m.correction_bias, None)
                for e in range(m.experts.first, m.experts.first + m.experts.n):
                    for proj in ExpertBank._PARTS:
                        slots[f"{sm}experts.{e}.{proj}.weight"] = (m.experts, (e, proj), "weight")
                lin(sm + "shared_experts.", m.shared.gate_up_proj)
                lin(sm + "shared_experts.", m.shared.down_proj)
            else:
                lin(sm, m.gate_up_proj)
                lin(sm, m.down_proj)
        if c.tie_word_embeddings:
            del slots["lm_head.weight"]
        return slots

    def read_plan(self, raw_name: str) -> str | Shard | None:
        """How a checkpoint reader should read tensor `raw_name` (as stored, prefixes and all) for this rank.

        "skip": this rank never uses it (a routed expert another EP rank holds, its scale included).
        A Shard: the slice TP cuts (embedding and LM head rows, head-split projections, convs, per-head
        vectors, expert intermediate slices); the reader takes it only from 16/32-bit tensors and reads
        FP8 and int8 weights whole (their blocks must line up with their scales), sliced after dequantising.
        None: read it whole; replicated tensors, quantization scales, transformers' fused
        `mlp.experts.gate_up_proj` / `down_proj` / `conv1d.weight` (split by name after reading), and
        names this model does not use. `load_hf_weights` takes the whole tensor or the slice alike.
        """
        scale = raw_name.endswith((".weight_scale_inv", ".weight_scale"))
        name = _canonical(raw_name[: raw_name.rindex(".weight") + len(".weight")] if scale else raw_name)
        if self._expert_elsewhere(name):
            return "skip"
        if scale:
            return None
        if self._plan_slots is None:
            self._plan_slots = self.weight_slots()
        slot = self._plan_slots.get(name)
        if slot is None:
            return None
        return _slot_shard(slot)

    def _expert_elsewhere(self, name: str) -> bool:
        """Whether prefix-free `name` is a routed expert's tensor of one of our MoE layers that another
        EP rank holds (its tensors are neither read, stored nor reported as missing)."""
        m = _EXPERT_NAME.match(name)
        if m is None or int(m.group(1)) >= len(self.layers):
            return False
        mlp = self.layers[int(m.group(1))].mlp
        return isinstance(mlp, MoE) and not mlp.experts.holds(int(m.group(2)))

    def finalize(self) -> None:
        self._plan_slots = None  # drop read_plan's references to parameters that finalize may replace
        tied_head = self.lm_head if self.cfg.tie_word_embeddings else None
        for m in self.modules():
            if isinstance(m, (ExpertBank, Linear)) and m is not tied_head:
                m.finalize()
        if self.cfg.tie_word_embeddings:
            self.lm_head.weight = self.embed_tokens


# ---- checkpoint names ---------------------------------------------------------------------------------

_PREFIXES = ("model.language_model.", "language_model.model.", "model.", "language_model.")
# transformers' in-memory names → the checkpoint's (the inverse of its glm5_next conversion mapping)
_RENAMES = [
    (re.compile(r"\.self_attn\.forget_gate\.(f_a_proj|f_b_proj|dt_bias|A_log)"), r".self_attn.\1"),
    (re.compile(r"\.(attn|ffn)_hc\.(fn|base|scale)$"), r".hc_\1_\2"),
]


# a routed expert's tensor, prefix-free: layer index, expert index
_EXPERT_NAME = re.compile(r"^layers\.(\d+)\.mlp\.experts\.(\d+)\.")


def _canonical(name: str) -> str:
    """A checkpoint or transformers name in real-checkpoint form, prefix-free (tensor-independent part
    of `checkpoint_names`)."""
    if name in ("lm_head.weight", "language_model.lm_head.weight"):
        return "lm_head.weight"
    for pre in _PREFIXES:
        if name.startswith(pre):
            name = name[len(pre):]
            break
    for pat, rep in _RENAMES:
        name = pat.sub(rep, name)
    return name


def _slot_shard(slot: tuple) -> Shard | None:
    """This rank's slice of the checkpoint tensor a slot takes (None: whole)."""
    if len(slot) == 2:
        return slot[1]
    owner, part, kind = slot
    shard = owner.shards.get(part) if isinstance(owner, Linear) else owner.shard(part[1])
    if kind == "bias" and shard is not None and shard.dim != 0:
        return None  # a row-parallel layer's bias is whole (added once, after the sum)
    return shard


def checkpoint_names(name: str, tensor) -> Iterable[tuple[str, Any]]:
    """One incoming (name, tensor) in real-checkpoint form, prefix-free; transformers' fused tensors
    (`experts.gate_up_proj`, `conv1d.weight`) are split into the per-expert / per-projection pieces.
    Names of other parts (vision, MTP layer, scales) come back unchanged and are then ignored."""
    name = _canonical(name)
    if name == "lm_head.weight":
        yield name, tensor
        return
    if name.endswith(".mlp.experts.gate_up_proj") and isinstance(tensor, torch.Tensor):
        base = name[: -len("gate_up_proj")]
        for e, w in enumerate(tensor):
            gate, up = w.chunk(2, dim=0)
            yield f"{base}{e}.gate_proj.weight", gate
            yield f"{base}{e}.up_proj.weight", up
    elif name.endswith(".mlp.experts.down_proj") and isinstance(tensor, torch.Tensor):
        base = name[: -len("down_proj")]
        for e, w in enumerate(tensor):
            yield f"{base}{e}.down_proj.weight", w
    elif name.endswith(".self_attn.conv1d.weight"):
        base = name[: -len("conv1d.weight")]
        for proj, w in zip(("q", "k", "v"), tensor.chunk(3, dim=0)):
            yield f"{base}{proj}_conv1d.weight", w
    else:
        yield name, tensor


def dequantize_fp8_blocks(tensors: Iterable[tuple[str, Any]], block: tuple[int, int] = (128, 128), keep: bool = False):
    """Pair each FP8 `<name>.weight` with its `<name>.weight_scale_inv` (one float32 factor per block)
    and yield the weight in float32 (keep: as an Fp8BlockWeight, for FP8 matmuls); everything else
    passes through. Which tensors are FP8 is read from
    their dtype, not from `modules_to_not_convert` (whose matching is prefix/suffix-only upstream).
    A weight waits for its scale (or the reverse) only until the partner arrives, usually the next tensor.
    """
    weights: dict[str, torch.Tensor] = {}
    scales: dict[str, torch.Tensor] = {}

    def apply(w: torch.Tensor, s: torch.Tensor):
        try:
            out = fp8_block_dequantize(w, s, block)
            return Fp8BlockWeight(w, s, tuple(block), w.shape[0], w.shape[1]) if keep and w.dim() == 2 else out
        except ValueError as exc:
            raise ModelLoadError(f"{name}: {exc}; the checkpoint's weight_block_size does not match its scales.") from exc

    for name, t in tensors:
        if name.endswith(".weight_scale_inv"):
            w_name = name[: -len("_scale_inv")]
            if w_name in weights:
                yield w_name, apply(weights.pop(w_name), t)
            else:
                scales[w_name] = t
        elif isinstance(t, torch.Tensor) and t.dtype in FP8_DTYPES:
            if name in scales:
                yield name, apply(t, scales.pop(name))
            else:
                weights[name] = t
        else:
            yield name, t
    if weights:
        raise ModelLoadError(f"{len(weights)} FP8 weights have no weight_scale_inv, e.g. {sorted(weights)[:3]}")
    if scales:
        raise ModelLoadError(f"{len(scales)} weight_scale_inv tensors have no FP8 weight beside them, e.g. "
                             f"{sorted(scales)[:3]}; the checkpoint's weights were not stored as FP8 or were "
                             f"converted without their scales. Re-download or re-convert it.")


def load_hf_weights(model: Glm5NextForCausalLM, tensors: Iterable[tuple[str, Any]], quantize_head: bool = False,
                    keep_fp8: bool = False, bf16_experts: bool = False) -> None:
    """Put (HF name, tensor) pairs into the model, then finalize it.

    Takes both the published checkpoint's names and transformers' `state_dict()` names (any of the
    usual prefixes); FP8 block-scaled weights are dequantized to the model's dtype on the way in, or with
    keep_fp8 stay FP8 in the linears and expert banks that take them (other tensors are dequantized).
    bf16_experts: dense expert banks whose every value is a bfloat16 number stay bfloat16
    (`ExpertBank.narrow_to_bf16`). A shape mismatch names the tensor and both shapes; missing tensors are named.

    Under TP/EP (the model built with the current parallel layout) each tensor may arrive whole or
    already as this rank's slice (a reader following `read_plan`); tensors of experts other ranks hold
    are dropped unread by the FP8 pairing and unreported.
    """
    slots = model.weight_slots()
    model._plan_slots = slots  # read_plan below looks names up in the same slots
    missing = set(slots)
    skipped: list[str] = []
    mine = ((n, t) for n, t in tensors if model.read_plan(n) != "skip")
    with torch.no_grad():
        for raw_name, raw in dequantize_fp8_blocks(mine, model.cfg.fp8_block or (128, 128), keep_fp8):
            for name, t in checkpoint_names(raw_name, raw):
                slot = slots.get(name)
                if slot is None:
                    if not model._expert_elsewhere(name):  # pieces of transformers' fused expert tensors
                        skipped.append(raw_name)
                    continue
                try:
                    if len(slot) == 2:
                        copy_param(f"{raw_name} ({name})", slot[0], t, slot[1])
                    else:
                        _load_part(raw_name, name, slot, t)
                except ValueError as exc:  # a tensor that is neither the whole one nor this rank's slice
                    msg = str(exc)
                    raise ModelLoadError(msg if msg.startswith("weight ") else f"weight {raw_name} ({name}) {msg}") from exc
                missing.discard(name)
    if missing:
        few = ", ".join(sorted(missing, key=_natural)[:5])
        raise ModelLoadError(f"{len(missing)} weights are missing from the checkpoint, e.g. {few}")
    if skipped:  # the vision tower and the MTP draft layer: not used when serving text
        log.info("skipped %d checkpoint tensors the text model does not use, e.g. %s", len(skipped),
                 ", ".join(sorted(skipped, key=_natural)[:3]))
    if bf16_experts:
        for m in model.modules():
            if isinstance(m, ExpertBank):
                m.narrow_to_bf16()
    model.finalize()
    if quantize_head:
        model.lm_head.quantize_int8()


def _load_part(raw_name: str, name: str, slot: tuple, t) -> None:
    """A Linear's / the expert bank's part, whole or this rank's slice (either shape is accepted)."""
    owner, part, kind = slot
    full = owner.part_shape(part) if kind == "weight" else None
    got = tuple(t.shape) if isinstance(t, torch.Tensor) else (t.out_features, t.in_features)
    if full is not None:
        ok = {tuple(full)}
        shard = _slot_shard(slot)
        if shard is not None:
            ok.add(tuple(shard.length if d == shard.dim else n for d, n in enumerate(full)))
        if got not in ok:
            raise ModelLoadError(f"weight {raw_name} ({name}) has shape {got}, the config implies {tuple(full)}")
    owner.load_part(part, kind, t)


def _natural(name: str):
    return [int(s) if s.isdigit() else s for s in re.split(r"(\d+)", name)]

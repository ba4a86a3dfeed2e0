"""`Glm5NextForCausalLM`: the stacked blocks with embedding, final norm and LM head; its caches and
engine pools, the packed and the fixed-shape decode forward, and which checkpoint tensor fills which
parameter (`weight_slots`, `read_plan`). Loading itself is in weights.py.
"""

from __future__ import annotations

import logging

import torch
from torch import nn

from flagdeploy import ops, parallel
from flagdeploy.parallel import Shard

from ..linear import Linear, vocab_parallel_embedding, vocab_parallel_head
from .cache import DecodeBatch, Glm5SequenceCache, PooledKdaState
from .common import _param
from .config import Glm5Config
from .kda import KdaAttention
from .layer import Glm5Layer
from .moe import ExpertBank, MoE
from .mtp import Glm5MtpLayer, build_mtp_layer
from .names import _EXPERT_NAME, _canonical, _slot_shard, ffn_slots, mla_slots
from .vision import Glm5VisionConfig, Glm5VisionTower

log = logging.getLogger(__name__)

# patches the vision tower runs at once: the largest image transformers' image processor admits (8,000
# tokens of 2 x 2 patches) fits whole; a longer video goes through in pieces of about this size
ENCODER_CHUNK_PATCHES = 32768


def encoder_activation_bytes(vision_config: dict, dtype_bytes: int = 2) -> int:
    """The vision tower's activation peak on ENCODER_CHUNK_PATCHES patches (what the planner reserves
    beside the text model's): inside a block the residual, its norm and the MLP's gate/up and product
    (or the attention's q, k, v, rotated copies and output, if wider); in the merger, per 2 x 2 block
    the merged row, the projection, the norm and the projector's gate/up and product."""
    c = Glm5VisionConfig.from_hf(vision_config)
    block = max(2 * c.hidden_size + 3 * c.intermediate_size, 8 * c.hidden_size)
    merged = c.spatial_merge_size ** 2
    merger = (merged * c.hidden_size + 2 * c.out_hidden_size + 3 * c.projection_intermediate_size) / merged
    return int(ENCODER_CHUNK_PATCHES * max(block, merger) * dtype_bytes)


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
        self.mtp: Glm5MtpLayer | None = None  # the checkpoint's draft layer, only when asked (`attach_mtp`)
        self.visual: Glm5VisionTower | None = None  # a multimodal checkpoint's vision tower (`encode_media`)
        vision = Glm5VisionConfig.from_hf(cfg.vision) if cfg.vision is not None else None
        if vision is not None and vision.out_hidden_size != cfg.hidden_size:
            # (transformers' default config is such a pair: its vision default was never matched to the text one)
            log.warning("vision_config.out_hidden_size is %d but the text hidden_size is %d: the vision tower's rows "
                        "cannot replace token embeddings, so this checkpoint is served as text only.",
                        vision.out_hidden_size, cfg.hidden_size)
        elif vision is not None:
            self.visual = Glm5VisionTower(vision, dtype)
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
        if self.mtp is not None:  # the draft layer's own latent and indexer rows, after the main layers',
            # plus two draft blocks per state row after the `num_blocks` (engine/mtp.py: a draft chain's rows)
            pools[c.num_layers] = {k: torch.zeros(num_blocks + 2 * max_seqs, block_size, w, dtype=self.dtype, device=dev)
                                   for k, w in self.mtp.cache_widths().items()}
        return pools

    def state_pool_layers(self) -> set[int]:
        """The layers of `cache_pools` whose pools hold one row per sequence (KDA's conv and recurrent
        state) rather than blocks of per-token rows: what a prefill-decode transfer moves by state row."""
        return {i for i, lt in enumerate(self.cfg.layer_types) if lt == "linear_attention"}

    def attach_mtp(self, checkpoint_names=None) -> Glm5MtpLayer:
        """Add the checkpoint's multi-token-prediction draft layer (`mtp.Glm5MtpLayer`, checkpoint tensors
        `layers.{num_layers}.*`) for `--speculative mtp`: its weights join `weight_slots`, its per-token rows
        `cache_pools` / `cache_bytes_per_token`. Without this call the model is exactly the plain one.
        checkpoint_names: the checkpoint's tensor names, to refuse one without the layer before loading."""
        with torch.device(self.norm.device):
            self.mtp = build_mtp_layer(self.cfg, self.dtype, checkpoint_names)
        self._plan_slots = None
        return self.mtp

    @property
    def input_modalities(self) -> tuple[str, ...]:
        """What a prompt may carry: text, and images and video where the checkpoint ships its vision tower."""
        return ("text",) if self.visual is None else ("text", "image", "video")

    def encode_media(self, pixel_values: torch.Tensor, grid_thw: torch.Tensor) -> torch.Tensor:
        """Feature rows of the items of `grid_thw` (their patches packed in `pixel_values`, as the
        processor lays them out): one row per placeholder token, in the text model's width and dtype.

        The tower runs on at most ENCODER_CHUNK_PATCHES patches at once (or one frame, if larger): its
        frames never see one another, so a long video is encoded a few frame pairs at a time with the
        same rows, and the activation peak the planner counts (`encoder_activation_bytes`) holds."""
        out, rows, chunk, at = [], [], [], 0
        for t, h, w in grid_thw.tolist():
            for first in range(0, t, max(1, ENCODER_CHUNK_PATCHES // (h * w))):
                pairs = min(t - first, max(1, ENCODER_CHUNK_PATCHES // (h * w)))
                if chunk and sum(c[0] * c[1] * c[2] for c in chunk) + pairs * h * w > ENCODER_CHUNK_PATCHES:
                    out.append(self.visual(torch.cat(rows), torch.tensor(chunk, device=grid_thw.device)))
                    rows, chunk = [], []
                rows.append(pixel_values[at : at + pairs * h * w])
                chunk.append((pairs, h, w))
                at += pairs * h * w
        out.append(self.visual(torch.cat(rows), torch.tensor(chunk, device=grid_thw.device)))
        return torch.cat(out).to(self.dtype)

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
        if self.mtp is not None:  # the draft layer's latent and indexer rows (`attach_mtp`)
            values += sum(self.mtp.cache_widths().values())
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
                       caches: list[Glm5SequenceCache], return_hidden: bool = False,
                       embeds: tuple[torch.Tensor, torch.Tensor] | None = None):
        """Logits [T, vocab] for a packed batch: sequence i owns rows cu_seqlens[i]:cu_seqlens[i+1].

        Everything token-wise (projections, MoE, mHC, norms) runs once on all rows; only the KDA
        recurrence, the conv, the indexer and attention loop over sequences. return_hidden: also the final
        hidden states [T, H] (before the final norm; what an MTP draft layer reads): (logits, hidden).
        embeds: (packed row indices, rows [n, H]) replacing those rows' token embeddings: the features of
        the images and video whose placeholder tokens they are (`encode_media`), as transformers scatters
        them into `inputs_embeds`. The text model is NoPE, so nothing else about a media position differs.
        """
        bounds = cu_seqlens.tolist()
        spans = [(a, b, cache.length) for a, b, cache in zip(bounds[:-1], bounds[1:], caches)]
        x = vocab_parallel_embedding(input_ids, self.embed_tokens, self.cfg.vocab_size)
        if embeds is not None:
            index, rows = embeds
            x = x.index_copy(0, index.to(x.device), rows.to(x.device, x.dtype))
        streams = x.unsqueeze(1).expand(-1, self.cfg.hc_mult, -1).contiguous()
        masks = None
        for i, layer in enumerate(self.layers):
            streams, masks = layer(streams, [cache.layers[i] for cache in caches], spans, masks)
        for cache, (a, b, _) in zip(caches, spans):
            cache.length += b - a
        return self._head(streams, return_hidden)

    def _head(self, streams: torch.Tensor, return_hidden: bool):
        hidden = streams.mean(1)
        logits = self.lm_head(ops.rms_norm(hidden, self.norm, self.cfg.rms_norm_eps))[..., : self.cfg.vocab_size].float()
        return (logits, hidden) if return_hidden else logits

    def forward_decode(self, input_ids: torch.Tensor, pools: dict, state_slots: torch.Tensor, slots: torch.Tensor,
                       block_tables: torch.Tensor, lengths: torch.Tensor, waves: list | None = None,
                       return_hidden: bool = False):
        """Logits [B, vocab] for one new token of each of B sequences held in the engine's pools (the
        fields of `DecodeBatch`; `waves`: a speculative verify step's KDA stepping order). return_hidden:
        (logits, final hidden states [B, H]).

        Same result as `forward_packed` on one-token spans, but in fixed shapes with no host reads, so the
        engine can capture it as a CUDA graph (flagdeploy/engine/cuda_graphs.py) or compile it whole
        (engine/compiled_step.py). The caller enters inference mode: torch.compile cannot trace a step that
        enters it itself.
        """
        c = self.cfg
        batch = DecodeBatch(pools, state_slots, slots, block_tables, lengths, waves)
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
        return self._head(streams, return_hidden)

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
                slots.update(mla_slots(sa, a))
            slots.update(ffn_slots(p + "mlp.", layer.mlp))
        if self.mtp is not None:  # the draft layer after the main ones (`attach_mtp`)
            slots.update(self.mtp.weight_slots(f"layers.{c.num_layers}."))
        if self.visual is not None:  # replicated under TP/EP: every slot takes the whole tensor
            slots.update(self.visual.weight_slots("visual."))
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

"""The llama family (Llama, Mistral, Qwen2, SmolLM2): GQA + RoPE + RMSNorm + SwiGLU, on flagdeploy.ops.

Weights are fused where that saves matmuls (qkv, gate_up); `weight_slots` maps checkpoint names here.
Under tensor parallelism (flagdeploy.parallel) each rank holds its query heads, their key/value heads,
its share of the MLP and of the vocabulary; o_proj and down_proj sum the partial outputs.
"""

from __future__ import annotations

import torch
from torch import nn

from flagdeploy import ops, parallel

from .attention import AttentionMetadata, paged_attention
from .config import ModelConfig
from .slots import copy_param
from .linear import Linear, column_parallel, row_parallel, vocab_parallel_embedding, vocab_parallel_head


def _param(*shape: int, dtype: torch.dtype) -> nn.Parameter:
    return nn.Parameter(torch.empty(*shape, dtype=dtype), requires_grad=False)


class LlamaLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, dtype: torch.dtype):
        super().__init__()
        self.cfg = cfg
        h, d, tp = cfg.hidden_size, cfg.head_dim, parallel.tp_size()
        self.heads = parallel.split(cfg.num_heads, tp, 0, "attention heads")[1]
        kv = parallel.kv_head_shard(cfg.num_kv_heads, d)
        self.kv_heads = kv.length // d if kv is not None else cfg.num_kv_heads
        self.input_norm = _param(h, dtype=dtype)
        self.qkv_proj = column_parallel({"q_proj": cfg.num_heads * d, "k_proj": cfg.num_kv_heads * d,
                                         "v_proj": cfg.num_kv_heads * d}, h, dtype, bias=cfg.attention_bias,
                                        shards={"k_proj": kv, "v_proj": kv}, what="attention heads")
        self.o_proj = row_parallel(h, cfg.num_heads * d, dtype, "o_proj", what="attention heads")
        self.post_norm = _param(h, dtype=dtype)
        self.gate_up_proj = column_parallel({"gate_proj": cfg.intermediate_size, "up_proj": cfg.intermediate_size},
                                            h, dtype, what="intermediate_size")
        self.down_proj = row_parallel(h, cfg.intermediate_size, dtype, "down_proj", what="intermediate_size")
        self.scale = d**-0.5
        self.splits = (self.heads * d, self.kv_heads * d, self.kv_heads * d)

    def forward(self, x, residual, kv, meta: AttentionMetadata, cos, sin):
        c = self.cfg
        if residual is None:
            residual, h = x, ops.rms_norm(x, self.input_norm, c.rms_norm_eps)
        else:
            h, residual = ops.add_rms_norm(x, residual, self.input_norm, c.rms_norm_eps)
        q, k, v = self.qkv_proj(h).split(self.splits, dim=-1)
        v = v.view(-1, self.kv_heads, c.head_dim)
        q, k = ops.rope_write_kv(q.view(-1, self.heads, c.head_dim), k.view(-1, self.kv_heads, c.head_dim), v, cos, sin,
                                 kv[0], kv[1], meta.slot_mapping)
        a = paged_attention(q, k, v, kv[0], kv[1], meta, self.scale)
        h, residual = ops.add_rms_norm(self.o_proj(a.flatten(1)), residual, self.post_norm, c.rms_norm_eps)
        return self.down_proj(ops.swiglu(self.gate_up_proj(h))), residual


class LlamaForCausalLM(nn.Module):
    def __init__(self, cfg: ModelConfig, dtype: torch.dtype = torch.float32):
        super().__init__()
        self.cfg = cfg
        self.dtype = dtype
        self.embed_tokens = _param(parallel.padded_vocab(cfg.vocab_size), cfg.hidden_size, dtype=dtype)
        self.layers = nn.ModuleList(LlamaLayer(cfg, dtype) for _ in range(cfg.num_layers))
        self.norm = _param(cfg.hidden_size, dtype=dtype)
        self.lm_head = vocab_parallel_head(cfg.vocab_size, cfg.hidden_size, dtype)
        self.rope_cos: torch.Tensor | None = None
        self.rope_sin: torch.Tensor | None = None
        self._slot_cache: dict[str, tuple] | None = None

    def weight_slots(self) -> dict[str, tuple]:
        """Checkpoint (HF) name → (Linear, part, kind) or (parameter, shard or None): where each tensor goes."""
        slots: dict[str, tuple] = {"model.embed_tokens.weight": (self.embed_tokens, parallel.vocab_shard(self.cfg.vocab_size)),
                                   "model.norm.weight": (self.norm, None)}
        if not self.cfg.tie_word_embeddings:
            slots["lm_head.weight"] = (self.lm_head, "lm_head", "weight")
        for i, layer in enumerate(self.layers):
            p = f"model.layers.{i}."
            slots[p + "input_layernorm.weight"] = (layer.input_norm, None)
            slots[p + "post_attention_layernorm.weight"] = (layer.post_norm, None)
            for prefix, lin in (("self_attn.", layer.qkv_proj), ("self_attn.", layer.o_proj),
                                ("mlp.", layer.gate_up_proj), ("mlp.", layer.down_proj)):
                for part in lin.parts:
                    for kind in ("weight", "bias") if lin.has_bias else ("weight",):
                        slots[f"{p}{prefix}{part}.{kind}"] = (lin, part, kind)
        return slots

    def read_plan(self, name: str) -> parallel.Shard | None:
        """The slice of checkpoint tensor `name` this rank keeps (None: all of it, or not ours)."""
        if self._slot_cache is None:
            self._slot_cache = self.weight_slots()
        slot = self._slot_cache.get(name)
        if slot is None:
            return None
        if len(slot) == 2:
            return slot[1]
        lin, part, kind = slot
        shard = lin.shards.get(part)
        return shard if kind == "weight" or (shard is not None and shard.dim == 0) else None

    def finalize(self, quantize_head: bool = False) -> None:
        """After all tensors are in: fuse parts, lay quantized weights out for the backend, tie the head."""
        for m in self.modules():
            if isinstance(m, Linear) and (m is not self.lm_head or not self.cfg.tie_word_embeddings):
                m.finalize()
        if self.cfg.tie_word_embeddings:
            self.lm_head.weight = self.embed_tokens
        if quantize_head:
            self.lm_head.quantize_int8()

    def kv_cache_shape(self, num_blocks: int, block_size: int) -> list[tuple[int, ...]]:
        """Per layer, the shapes of the cache tensors the runner must allocate (k and v)."""
        shape = (num_blocks, block_size, self.layers[0].kv_heads, self.cfg.head_dim)
        return [shape, shape]

    @property
    def kv_cache_dtype(self) -> torch.dtype:
        """What k/v come out as: 16-bit after a weight-only quantized qkv projection."""
        qkv = self.layers[0].qkv_proj
        return ops.a16_dtype(self.dtype) if qkv.qweight is not None else self.dtype

    def prepare(self, max_positions: int) -> None:
        """Build what depends on the served context length (RoPE tables) once, after loading."""
        self.rope_cos, self.rope_sin = ops.rope_tables(
            self.cfg.head_dim, max_positions, self.cfg.rope_theta, dtype=torch.float32, device=self.embed_tokens.device
        )

    @torch.inference_mode()
    def forward(self, input_ids: torch.Tensor, meta: AttentionMetadata, kv_caches: list,
                embeds: tuple[torch.Tensor, torch.Tensor] | None = None) -> torch.Tensor:
        """Logits for the rows in meta.logits_indices, as float32. embeds: (row indices, rows) that replace
        those rows' token embeddings (an image encoder's features, engine/multimodal.py)."""
        return self.forward_step(input_ids, meta, kv_caches, embeds)

    def forward_step(self, input_ids: torch.Tensor, meta: AttentionMetadata, kv_caches: list,
                     embeds: tuple[torch.Tensor, torch.Tensor] | None = None) -> torch.Tensor:
        """`forward` for a caller already in inference mode: what torch.compile traces (dynamo cannot trace
        the grad-mode switch of the decorator around the in-place cache writes)."""
        x = vocab_parallel_embedding(input_ids, self.embed_tokens, self.cfg.vocab_size)
        if embeds is not None:
            index, rows = embeds
            x[index.to(x.device)] = rows.to(device=x.device, dtype=x.dtype)
        cos, sin = self.rope_cos[meta.positions], self.rope_sin[meta.positions]
        residual = None
        for layer, kv in zip(self.layers, kv_caches):
            x, residual = layer(x, residual, kv, meta, cos, sin)
        x = x[meta.logits_indices]
        residual = residual[meta.logits_indices]
        h, _ = ops.add_rms_norm(x, residual, self.norm, self.cfg.rms_norm_eps)
        return self.lm_head(h)[..., : self.cfg.vocab_size].float()

    def score(self, input_ids: torch.Tensor, embeds: tuple[torch.Tensor, torch.Tensor] | None = None) -> torch.Tensor:
        """Logits [T, vocab] at every position of one sequence, through a scratch cache (evaluation);
        `embeds` as for `forward`."""
        t, dev = input_ids.shape[0], input_ids.device
        cu = torch.tensor([0, t], dtype=torch.int32, device=dev)
        pos = torch.arange(t, device=dev)
        meta = AttentionMetadata(positions=pos, slot_mapping=pos, num_prefill_tokens=t, cu_seqlens_q=cu, cu_seqlens_k=cu,
                                 prefill_kv_slots=None, block_tables=None, context_lens=None, logits_indices=pos)
        caches = [[torch.zeros(s, dtype=self.kv_cache_dtype, device=dev) for s in self.kv_cache_shape(t, 1)]
                  for _ in self.layers]
        return self(input_ids, meta, caches, embeds)


def load_hf_weights(model: LlamaForCausalLM, tensors, quantize_head: bool = False, keep_fp8: bool = False,
                    bf16_experts: bool = False) -> None:
    """Put (HF name, tensor or quantized bundle) pairs into the model, then finalize it. (The family has
    no expert banks: `bf16_experts` has nothing to apply to.)

    Each tensor goes straight to its slot, so loading never holds a second full copy of the model.
    Missing weights are an error, named; unknown ones are ignored (rotary buffers and the like).
    """
    slots = model.weight_slots()
    missing = set(slots)
    with torch.no_grad():
        for name, t in tensors:
            slot = slots.get(name)
            if slot is None:
                continue
            if len(slot) == 2:
                copy_param(name, slot[0], t, slot[1])
            else:
                slot[0].load_part(slot[1], slot[2], t)
            missing.discard(name)
    if missing:
        few = ", ".join(sorted(missing)[:5])
        raise ValueError(f"{len(missing)} weights are missing from the checkpoint, e.g. {few}")
    model.finalize(quantize_head)


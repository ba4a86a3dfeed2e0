"""The llama family (Llama, Mistral, Qwen2, SmolLM2): GQA + RoPE + RMSNorm + SwiGLU, on flagdeploy.ops.

Weights are fused where that saves matmuls (qkv, gate_up); `weight_slots` maps checkpoint names here.
"""

from __future__ import annotations

import torch
from torch import nn

from flagdeploy import ops

from .attention import AttentionMetadata, paged_attention
from .config import ModelConfig
from .linear import Linear


def _param(*shape: int, dtype: torch.dtype) -> nn.Parameter:
    return nn.Parameter(torch.empty(*shape, dtype=dtype), requires_grad=False)


class LlamaLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, dtype: torch.dtype):
        super().__init__()
        self.cfg = cfg
        h, d = cfg.hidden_size, cfg.head_dim
        self.input_norm = _param(h, dtype=dtype)
        self.qkv_proj = Linear((cfg.num_heads + 2 * cfg.num_kv_heads) * d, h, dtype, ("q_proj", "k_proj", "v_proj"),
                               bias=cfg.attention_bias)
        self.o_proj = Linear(h, cfg.num_heads * d, dtype, ("o_proj",))
        self.post_norm = _param(h, dtype=dtype)
        self.gate_up_proj = Linear(2 * cfg.intermediate_size, h, dtype, ("gate_proj", "up_proj"))
        self.down_proj = Linear(h, cfg.intermediate_size, dtype, ("down_proj",))
        self.scale = d**-0.5
        self.splits = (cfg.num_heads * d, cfg.num_kv_heads * d, cfg.num_kv_heads * d)

    def forward(self, x, residual, kv, meta: AttentionMetadata, cos, sin):
        c = self.cfg
        if residual is None:
            residual, h = x, ops.rms_norm(x, self.input_norm, c.rms_norm_eps)
        else:
            h, residual = ops.add_rms_norm(x, residual, self.input_norm, c.rms_norm_eps)
        q, k, v = self.qkv_proj(h).split(self.splits, dim=-1)
        q, k = ops.rope(q.view(-1, c.num_heads, c.head_dim), k.view(-1, c.num_kv_heads, c.head_dim), cos, sin)
        a = paged_attention(q, k, v.view(-1, c.num_kv_heads, c.head_dim), kv[0], kv[1], meta, self.scale)
        h, residual = ops.add_rms_norm(self.o_proj(a.flatten(1)), residual, self.post_norm, c.rms_norm_eps)
        return self.down_proj(ops.swiglu(self.gate_up_proj(h))), residual


class LlamaForCausalLM(nn.Module):
    def __init__(self, cfg: ModelConfig, dtype: torch.dtype = torch.float32):
        super().__init__()
        self.cfg = cfg
        self.dtype = dtype
        self.embed_tokens = _param(cfg.vocab_size, cfg.hidden_size, dtype=dtype)
        self.layers = nn.ModuleList(LlamaLayer(cfg, dtype) for _ in range(cfg.num_layers))
        self.norm = _param(cfg.hidden_size, dtype=dtype)
        self.lm_head = Linear(cfg.vocab_size, cfg.hidden_size, dtype, ("lm_head",))
        self.rope_cos: torch.Tensor | None = None
        self.rope_sin: torch.Tensor | None = None

    def weight_slots(self) -> dict[str, tuple]:
        """Checkpoint (HF) name → (Linear, part, kind) or (parameter,): where each tensor goes."""
        slots: dict[str, tuple] = {"model.embed_tokens.weight": (self.embed_tokens,), "model.norm.weight": (self.norm,)}
        if not self.cfg.tie_word_embeddings:
            slots["lm_head.weight"] = (self.lm_head, "lm_head", "weight")
        for i, layer in enumerate(self.layers):
            p = f"model.layers.{i}."
            slots[p + "input_layernorm.weight"] = (layer.input_norm,)
            slots[p + "post_attention_layernorm.weight"] = (layer.post_norm,)
            for prefix, lin in (("self_attn.", layer.qkv_proj), ("self_attn.", layer.o_proj),
                                ("mlp.", layer.gate_up_proj), ("mlp.", layer.down_proj)):
                for part in lin.parts:
                    for kind in ("weight", "bias") if lin.has_bias else ("weight",):
                        slots[f"{p}{prefix}{part}.{kind}"] = (lin, part, kind)
        return slots

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
        shape = (num_blocks, block_size, self.cfg.num_kv_heads, self.cfg.head_dim)
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
    def forward(self, input_ids: torch.Tensor, meta: AttentionMetadata, kv_caches: list) -> torch.Tensor:
        """Logits for the rows in meta.logits_indices, as float32."""
        x = ops.embedding(input_ids, self.embed_tokens)
        cos, sin = self.rope_cos[meta.positions], self.rope_sin[meta.positions]
        residual = None
        for layer, kv in zip(self.layers, kv_caches):
            x, residual = layer(x, residual, kv, meta, cos, sin)
        x = x[meta.logits_indices]
        residual = residual[meta.logits_indices]
        h, _ = ops.add_rms_norm(x, residual, self.norm, self.cfg.rms_norm_eps)
        return self.lm_head(h).float()

    def score(self, input_ids: torch.Tensor) -> torch.Tensor:
        """Logits [T, vocab] at every position of one sequence, through a scratch cache (evaluation)."""
        t, dev = input_ids.shape[0], input_ids.device
        cu = torch.tensor([0, t], dtype=torch.int32, device=dev)
        pos = torch.arange(t, device=dev)
        meta = AttentionMetadata(positions=pos, slot_mapping=pos, num_prefill_tokens=t, cu_seqlens_q=cu, cu_seqlens_k=cu,
                                 prefill_kv_slots=None, block_tables=None, context_lens=None, logits_indices=pos)
        caches = [[torch.zeros(s, dtype=self.kv_cache_dtype, device=dev) for s in self.kv_cache_shape(t, 1)]
                  for _ in self.layers]
        return self(input_ids, meta, caches)


def load_hf_weights(model: LlamaForCausalLM, tensors, quantize_head: bool = False, keep_fp8: bool = False) -> None:
    """Put (HF name, tensor or quantized bundle) pairs into the model, then finalize it.

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
            if len(slot) == 1:
                dst = slot[0]
                if tuple(dst.shape) != tuple(t.shape):
                    raise ValueError(f"weight {name} has shape {tuple(t.shape)}, the config implies {tuple(dst.shape)}")
                dst.copy_(t if isinstance(t, torch.Tensor) else t.dequantize(dst.dtype))
            else:
                slot[0].load_part(slot[1], slot[2], t)
            missing.discard(name)
    if missing:
        few = ", ".join(sorted(missing)[:5])
        raise ValueError(f"{len(missing)} weights are missing from the checkpoint, e.g. {few}")
    model.finalize(quantize_head)

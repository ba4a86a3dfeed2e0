"""GLM-5.3-Flash's multi-token-prediction (MTP) draft layer, for `--speculative mtp`.

The checkpoint's next-N layer (`layers.{num_hidden_layers}.*`) is DeepSeek-V3's MTP module around an
ordinary residual block (no hyper-connections, no KDA): given the target's final hidden state h_i at
position i (before the final norm) and the embedding of the next token t_{i+1},

    x = eh_proj([enorm(embed(t_{i+1})); hnorm(h_i)])
    x = x + mla(input_layernorm(x))          # NoPE latent attention with its own full DSA indexer
    x = x + moe(post_attention_layernorm(x))  # (a dense MLP if the config has no MoE layers)
    logits = lm_head(shared_head.norm(x))     # predicts t_{i+2}

`embed_tokens` and `lm_head` are the target's (passed in, not held). The block output x is the hidden
state of the next draft step when drafting more than one token (vLLM re-applies a one-layer MTP to its own
output). The attention caches, per position i, the latent and the indexer key / pool gate like the
target's full-indexer layers: `MlaCache` rows in the engine's block pools (`cache_pools()[num_layers]`)
through the sequence's block table.

Two ways in: `forward_packed` (variable-length spans, per-sequence caches: a long catch-up such as a
prompt's) and `draft` (the whole draft of a step in fixed shapes, nothing read back, so the engine replays
it as one CUDA graph: `DraftInputs`).
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

import torch
from torch import nn

from flagdeploy import ops
from flagdeploy.errors import ModelLoadError

from ..linear import vocab_parallel_embedding
from .cache import DecodeBatch, MlaCache, PagedTokenRows, Span
from .common import _lin, _param
from .config import Glm5Config
from .mla import MlaAttention
from .moe import DenseMlp, MoE
from .names import _canonical, ffn_slots, mla_slots


def no_mtp_error(num_layers: int, why: str = "") -> ModelLoadError:
    return ModelLoadError(f"this checkpoint has no MTP layer (layers.{num_layers}.eh_proj.weight missing{why}); "
                          "serve with --speculative ngram or off")


def build_mtp_layer(c: Glm5Config, dtype: torch.dtype, checkpoint_names: Iterable[str] | None = None) -> Glm5MtpLayer:
    """The draft layer of config `c`, refused (before any weight is read) when the config says there is
    none or more than one, or when `checkpoint_names` (the checkpoint's tensor names) lack it."""
    n = c.num_nextn_predict_layers
    if n == 0:
        raise no_mtp_error(c.num_layers, "; the config's num_nextn_predict_layers is 0")
    if n is not None and n > 1:
        raise ModelLoadError(f"the checkpoint has {n} MTP layers (num_nextn_predict_layers); --speculative mtp "
                             "supports exactly 1 for now. Serve with --speculative ngram or off.")
    if checkpoint_names is not None:
        want = f"layers.{c.num_layers}.eh_proj.weight"
        if not any(_canonical(name) == want for name in checkpoint_names):
            raise no_mtp_error(c.num_layers)
    return Glm5MtpLayer(c, dtype)


@dataclass
class DraftInputs:
    """One step's drafts for B sequences in shapes fixed by (B, D, W, K), as device tensors.

    Catch-up rows (D per sequence, sequence-major; unused ones are padding on a scratch slot): the MTP
    layer at each position observed since the last draft, `ids` the token after it and `hidden` the
    target's hidden state at it; `last` [B] the row of each sequence's final position, whose argmax is
    draft 1. Then K - 1 chain steps, one row per sequence, at the positions past the computed tokens:
    those rows go to two draft blocks per sequence (`chain_tables` lists them after the sequence's full
    blocks), into which block `copy_src` (the sequence's partly filled last block, after the catch-up
    wrote it) is first copied (`copy_dst`), so the chain reads the real rows before it and never writes a
    block the sequence owns (or may not have yet)."""

    ids: torch.Tensor  # [B * D]
    hidden: torch.Tensor  # [B * D, H]
    slots: torch.Tensor  # [B * D] flat pool rows written
    tables: torch.Tensor  # [B * D, W] block tables of the catch-up rows
    ctx: torch.Tensor  # [B * D] context length of each row (its position + 1)
    last: torch.Tensor  # [B]
    copy_src: torch.Tensor  # [B] blocks
    copy_dst: torch.Tensor  # [B]
    chain_slots: torch.Tensor  # [K - 1, B]
    chain_ctx: torch.Tensor  # [K - 1, B]
    chain_tables: torch.Tensor  # [B, W]


class Glm5MtpLayer(nn.Module):
    def __init__(self, c: Glm5Config, dtype: torch.dtype):
        super().__init__()
        self.c = c
        h = c.hidden_size
        self.eh_proj = _lin(h, 2 * h, dtype, "eh_proj")
        self.enorm = _param(h, dtype=dtype)
        self.hnorm = _param(h, dtype=dtype)
        self.input_norm = _param(h, dtype=dtype)
        self.post_norm = _param(h, dtype=dtype)
        self.head_norm = _param(h, dtype=dtype)  # shared_head.norm
        self.attn = MlaAttention(c, dtype, full_indexer=True)
        sparse = "sparse" in c.mlp_layer_types  # the published layer is the last full-indexer MoE layer's kind
        self.mlp: nn.Module = MoE(c, dtype) if sparse else DenseMlp(c, c.intermediate_size, dtype)

    # ---- caches ---------------------------------------------------------------------------------------

    def cache_widths(self) -> dict[str, int]:
        """Per-token values of its cache (the engine pools' widths): latent, indexer key, pool gate."""
        c = self.c
        return {"latent": c.kv_lora_rank, "index_keys": c.index_head_dim, "index_gate": c.index_head_dim}

    @staticmethod
    def paged_cache(pool: dict[str, torch.Tensor], block_table: list[int], length: int) -> MlaCache:
        """One sequence's rows in the engine's pools (`cache_pools()[num_layers]`), `length` cached."""
        return MlaCache(**{k: PagedTokenRows(p, block_table, length) for k, p in pool.items()})

    # ---- forward --------------------------------------------------------------------------------------

    def block(self, embeds: torch.Tensor, hidden: torch.Tensor, caches: list[MlaCache], spans: list[Span]) -> torch.Tensor:
        """Block outputs x [T, H] of packed rows: `embeds` [T, H] of the next tokens, `hidden` [T, H] the
        target's (or the previous draft step's) hidden states; sequence i owns rows spans[i][0]:spans[i][1]
        and its cache holds spans[i][2] positions (its new rows are appended)."""
        c, eps = self.c, self.c.rms_norm_eps
        x = self.eh_proj(torch.cat([ops.rms_norm(embeds, self.enorm, eps),
                                    ops.rms_norm(hidden.to(embeds.dtype), self.hnorm, eps)], dim=-1))
        a, _ = self.attn(ops.rms_norm(x, self.input_norm, eps), caches, spans, None)
        x = x + a
        return x + self.mlp(ops.rms_norm(x, self.post_norm, c.rms_norm_eps))

    @torch.inference_mode()
    def forward_packed(self, target, input_ids: torch.Tensor, hidden: torch.Tensor, spans: list[Span],
                       caches: list[MlaCache], logits_rows: list[int]) -> tuple[torch.Tensor | None, torch.Tensor]:
        """(logits [len(logits_rows), vocab] float32 at the requested rows (None when none are), block
        outputs [T, H]) for packed rows: row r of sequence i is position spans[i][2] + r - spans[i][0], with
        `input_ids[r]` the token after it and `hidden[r]` the hidden state at it. `target` (Glm5NextForCausalLM) lends the
        embedding and the LM head."""
        c = self.c
        embeds = vocab_parallel_embedding(input_ids, target.embed_tokens, c.vocab_size)
        x = self.block(embeds, hidden, caches, spans)
        if not logits_rows:
            return None, x
        rows = x[torch.tensor(logits_rows, dtype=torch.long, device=x.device)]
        logits = target.lm_head(ops.rms_norm(rows, self.head_norm, c.rms_norm_eps))[..., : c.vocab_size].float()
        return logits, x

    def decode(self, target, ids: torch.Tensor, hidden: torch.Tensor, pool: dict[str, torch.Tensor],
               slots: torch.Tensor, tables: torch.Tensor, ctx: torch.Tensor) -> torch.Tensor:
        """Block outputs [B, H] of B rows in fixed shapes, each written at its slot and attending over its
        table's rows up to `ctx` (the target's `forward_decode`, one layer)."""
        c, eps = self.c, self.c.rms_norm_eps
        bs = next(iter(pool.values())).shape[1]
        rows = (tables.unsqueeze(-1) * bs + torch.arange(bs, device=tables.device)).flatten(1)
        embeds = vocab_parallel_embedding(ids, target.embed_tokens, c.vocab_size)
        x = self.eh_proj(torch.cat([ops.rms_norm(embeds, self.enorm, eps),
                                    ops.rms_norm(hidden.to(embeds.dtype), self.hnorm, eps)], dim=-1))
        a, _ = self.attn.decode(ops.rms_norm(x, self.input_norm, eps), DecodeBatch({}, slots, slots, tables, ctx),
                                pool, rows, None)
        x = x + a
        return x + self.mlp(ops.rms_norm(x, self.post_norm, eps))

    def draft(self, target, pool: dict[str, torch.Tensor], d: DraftInputs) -> torch.Tensor:
        """Drafts [B, K] (greedy): the catch-up rows, then K - 1 chain steps on the layer's own block output
        and the previous draft. Nothing is read back to the host (one CUDA graph on a GPU)."""
        c = self.c
        greedy = lambda x: target.lm_head(ops.rms_norm(x, self.head_norm, c.rms_norm_eps))[..., : c.vocab_size].argmax(-1)  # noqa: E731
        x = self.decode(target, d.ids, d.hidden, pool, d.slots, d.tables, d.ctx).index_select(0, d.last)
        drafts = [greedy(x)]
        for p in pool.values():
            p.index_copy_(0, d.copy_dst, p.index_select(0, d.copy_src))
        for j in range(d.chain_slots.shape[0]):
            x = self.decode(target, drafts[-1], x, pool, d.chain_slots[j], d.chain_tables, d.chain_ctx[j])
            drafts.append(greedy(x))
        return torch.stack(drafts, dim=1)

    # ---- weights --------------------------------------------------------------------------------------

    def weight_slots(self, p: str) -> dict[str, tuple]:
        """Checkpoint name → slot (as `Glm5NextForCausalLM.weight_slots`) under prefix `p`
        ("layers.{num_layers}."): the block's tensors as on a full-indexer layer without mHC, plus
        eh_proj, enorm, hnorm and shared_head.norm (planner/shapes.py's `include_mtp` layout)."""
        slots: dict[str, tuple] = {p + "input_layernorm.weight": (self.input_norm, None),
                                   p + "post_attention_layernorm.weight": (self.post_norm, None)}
        slots.update(mla_slots(p + "self_attn.", self.attn))
        slots.update(ffn_slots(p + "mlp.", self.mlp))
        slots[p + "eh_proj.weight"] = (self.eh_proj, "eh_proj", "weight")
        slots[p + "enorm.weight"] = (self.enorm, None)
        slots[p + "hnorm.weight"] = (self.hnorm, None)
        slots[p + "shared_head.norm.weight"] = (self.head_norm, None)
        return slots

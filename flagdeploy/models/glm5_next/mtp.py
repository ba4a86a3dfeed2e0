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
through the sequence's block table; a draft chain past the sequence's computed tokens reads those rows
and keeps its own in a local tensor (`DraftTokenRows`), so it never writes a block that may not exist.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
from torch import nn

from flagdeploy import ops
from flagdeploy.errors import ModelLoadError

from ..linear import vocab_parallel_embedding
from .cache import MlaCache, PagedTokenRows, Span, TokenRows
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


class DraftTokenRows(TokenRows):
    """A draft chain's view of one cached quantity: the sequence's rows [0, length) as `base` holds them
    (read once, lazily) followed by rows appended during the chain, kept here and never written to the
    engine's pools (the chain's positions lie past the sequence's computed tokens)."""

    def __init__(self, base: TokenRows):
        super().__init__()
        self.base, self._base_rows = base, None

    def all(self) -> torch.Tensor:
        if self._base_rows is None:
            self._base_rows = self.base.all()
        if self.rows is None:
            return self._base_rows
        return torch.cat([self._base_rows, self.rows.to(self._base_rows.dtype)])


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

    @staticmethod
    def draft_cache(base: MlaCache) -> MlaCache:
        """A draft chain's cache over `base`: reads its rows, keeps the chain's own locally."""
        return MlaCache(DraftTokenRows(base.latent), DraftTokenRows(base.index_keys), DraftTokenRows(base.index_gate))

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
                       caches: list[MlaCache], logits_rows: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
        """(logits [len(logits_rows), vocab] float32 at the requested rows, block outputs [T, H]) for packed
        rows: row r of sequence i is position spans[i][2] + r - spans[i][0], with `input_ids[r]` the token
        after it and `hidden[r]` the hidden state at it. `target` (Glm5NextForCausalLM) lends the
        embedding and the LM head."""
        c = self.c
        embeds = vocab_parallel_embedding(input_ids, target.embed_tokens, c.vocab_size)
        x = self.block(embeds, hidden, caches, spans)
        rows = x[torch.tensor(logits_rows, dtype=torch.long, device=x.device)]
        logits = target.lm_head(ops.rms_norm(rows, self.head_norm, c.rms_norm_eps))[..., : c.vocab_size].float()
        return logits, x

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

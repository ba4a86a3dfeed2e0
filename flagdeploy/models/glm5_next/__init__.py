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

Modules, each importing only those before it: config (Glm5Config, from_hf_config), cache (per-sequence
state and rows, DecodeBatch, Span), common (shared construction helpers), kda (linear attention), mla
(DSA indexer and sparse latent attention), moe (dense MLP and MoE), layer (mHC and one block), names
(checkpoint names and slot helpers), mtp (the MTP draft layer for --speculative mtp), vision (the vision
tower: pixels to placeholder-token rows), model (Glm5NextForCausalLM, with the tower when the checkpoint
ships one), weights (FP8 pairing and load_hf_weights). processor (images and video to the tower's
pixels and the prompt's placeholder text, at serve time) imports transformers and is loaded only for a
model that takes media (flagdeploy.models.media_processor).
"""

from .cache import (
    DecodeBatch,
    Glm5SequenceCache,
    KdaState,
    MlaCache,
    PagedTokenRows,
    PooledKdaState,
    Span,
    TokenRows,
)
from .config import Glm5Config, from_hf_config
from .kda import KdaAttention
from .layer import Glm5Layer, HyperConnection
from .mla import DsaIndexer, MlaAttention
from .model import Glm5NextForCausalLM
from .moe import DenseMlp, ExpertBank, MoE
from .mtp import DraftInputs, Glm5MtpLayer
from .names import _canonical, checkpoint_names
from .vision import Glm5VisionConfig, Glm5VisionTower
from .weights import dequantize_fp8_blocks, load_hf_weights

__all__ = [
    "DecodeBatch", "DenseMlp", "DraftInputs", "DsaIndexer", "ExpertBank", "Glm5Config", "Glm5Layer", "Glm5MtpLayer", "Glm5NextForCausalLM",
    "Glm5SequenceCache", "Glm5VisionConfig", "Glm5VisionTower", "HyperConnection", "KdaAttention", "KdaState",
    "MlaAttention", "MlaCache", "MoE",
    "PagedTokenRows", "PooledKdaState", "Span", "TokenRows", "_canonical", "checkpoint_names",
    "dequantize_fp8_blocks", "from_hf_config", "load_hf_weights",
]

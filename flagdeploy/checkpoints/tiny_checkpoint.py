"""A tiny random GLM-5.3-Flash (`glm5_next`) checkpoint directory in the published layout.

`write_tiny_glm5_next(path)` writes what the published checkpoint ships, at toy size: `config.json`
(multimodal `glm5_next` with `text_config` and `vision_config`; with `fp8=True` the published
`quantization_config`), sharded `model-0000i-of-0000n.safetensors` with `model.safetensors.index.json`,
and a word-level tokenizer with a chat template. Tensor names are the published shards' (experts one by
one, q/k/v convs apart, `hc_attn_fn`-style mHC names, the forget-gate projections directly under
`self_attn`); the text names and shapes come from `Glm5NextForCausalLM.weight_slots()` so that this file
does not restate them. Dtypes follow the published checkpoint: BF16 for most tensors, float32 for
`e_score_correction_bias`, `dt_bias`, `A_log` and the mHC base/scale, and with `fp8=True` FP8 e4m3 plus
a float32 `weight_scale_inv` per block for the routed and shared experts, the dense MLPs and the MLA
q_a / q_b / kv_a / o projections. With `mtp=True` it also ships the multi-token-prediction draft layer
(`layers.{num_hidden_layers}.*`, planner/shapes.py's `include_mtp` layout, FP8 where a main layer's
tensor of that name is) and says `num_nextn_predict_layers: 1`.

The directory is written next to `path` under a temporary name and renamed into place at the end, so
`path` either holds a complete checkpoint or does not exist.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import tempfile
from pathlib import Path
from typing import Iterator

import torch
from safetensors.torch import save_file

from flagdeploy.ops.weights import fp8_block_quantize

# Every layer kind (as tests/test_glm5_next.py's TEXT): KDA at 0, 3, 5; indexed attention at 1 (full indexer),
# 2 (shared), 4, 6 (full), 7 (shared); dense FFN at 0, 2, 6, MoE elsewhere (8 experts in 2 groups). q_lora_rank
# is 32 (not 24) so that every FP8 matrix is a whole number of the default 16x16 blocks: transformers derives
# the block size from the scale grid's shape and cannot dequantize partial blocks (pass q_lora_rank=24 to
# get partial blocks, which flagdeploy handles).
TINY_TEXT: dict = dict(
    vocab_size=64, hidden_size=32, intermediate_size=48, moe_intermediate_size=16, num_hidden_layers=8,
    num_attention_heads=2, num_key_value_heads=2, n_shared_experts=1, n_routed_experts=8, n_group=2, topk_group=1,
    num_experts_per_tok=2, kv_lora_rank=16, q_lora_rank=32, qk_nope_head_dim=8, qk_rope_head_dim=0, v_head_dim=8,
    index_topk=8, index_head_dim=8, index_n_heads=8, index_kpool=4, linear_head_dim=8, linear_num_heads=2,
    linear_conv_kernel_dim=4, linear_lower_bound=-5.0, hc_mult=3, hc_sinkhorn_iters=5, pad_token_id=0,
    eos_token_id=1, bos_token_id=None, tie_word_embeddings=False, max_position_embeddings=4096,
    layer_types=["linear_attention", "indexed_attention", "indexed_attention", "linear_attention",
                 "indexed_attention", "linear_attention", "indexed_attention", "indexed_attention"],
    indexer_types=["full", "full", "shared", "full", "full", "full", "full", "shared"],
    mlp_layer_types=["dense", "sparse", "dense", "sparse", "sparse", "sparse", "dense", "sparse"],
)
TINY_VISION: dict = dict(depth=1, hidden_size=16, num_heads=2, intermediate_size=16, out_hidden_size=32,
                         projection_intermediate_size=16, patch_size=14, temporal_patch_size=2, spatial_merge_size=2,
                         in_channels=3)

# config.json key → the token's text, for `write_tiny_glm5_next(media=True)`
_MM_TOKENS = {"image_start_token_id": "<|begin_of_image|>", "image_end_token_id": "<|end_of_image|>",
              "video_start_token_id": "<|begin_of_video|>", "video_end_token_id": "<|end_of_video|>",
              "image_token_id": "<|image|>", "video_token_id": "<|video|>"}

TEXT_PREFIX = "model.language_model."
# Published-checkpoint FP8 modules (module name relative to a text layer); the MLA ones only on indexed layers.
_FP8_MLA = re.compile(r"^self_attn\.(q_a_proj|q_b_proj|kv_a_proj_with_mqa|o_proj)\.weight$")
_FP8_MLP = re.compile(r"^mlp\.((experts\.\d+|shared_experts)\.)?(gate_proj|up_proj|down_proj)\.weight$")
_FP32 = re.compile(r"(e_score_correction_bias|\.dt_bias|\.A_log|\.hc_(attn|ffn)_(base|scale))$")
_NORM = re.compile(r"norm\d?\.weight$")


def write_tiny_glm5_next(path, *, fp8: bool = False, seed: int = 0, block: tuple[int, int] = (16, 16),
                         shard_size_bytes: int = 200_000, mtp: bool = False, media: bool = False,
                         **text_overrides) -> Path:
    """Write a complete tiny `glm5_next` checkpoint directory at `path` and return it.

    fp8: store the published FP8 modules as float8_e4m3fn with a float32 `weight_scale_inv` per
    `block` (rows, cols), and add the published `quantization_config`. seed: the weights' generator.
    shard_size_bytes: a shard is closed once it holds at least this much (a weight and its scale stay
    together). mtp: also write the MTP draft layer (and `num_nextn_predict_layers: 1`). text_overrides:
    any `text_config` field (e.g. `index_kpool=1, index_topk=3`). media: give the multimodal tokens
    (`<|image|>`, its brackets, ...) the last six ids of the vocabulary, in config.json and the tokenizer,
    so that the checkpoint takes images and video through `flagdeploy serve` (its answers are noise).
    `path` must not exist or be an empty directory.
    """
    path = Path(path)
    if path.exists() and (not path.is_dir() or any(path.iterdir())):
        raise FileExistsError(f"{path} exists and is not an empty directory")
    config = _config(fp8, block, {**text_overrides, **({"num_nextn_predict_layers": 1} if mtp else {})}, mtp)
    from flagdeploy.models.glm5_next import from_hf_config

    from_hf_config(config)  # rejects what transformers rejects (same message) before anything is written
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{path.name}.partial-", dir=path.parent))
    try:
        (tmp / "config.json").write_text(json.dumps(config, indent=2) + "\n")
        (tmp / "generation_config.json").write_text(json.dumps(
            {"eos_token_id": config["text_config"].get("eos_token_id"), "pad_token_id": 0}, indent=2) + "\n")
        vocab = config["text_config"]["vocab_size"]
        specials = None
        if media:  # the multimodal ids inside the tiny vocabulary (the published ones are 154830..154855)
            ids = dict(zip(_MM_TOKENS, range(vocab - len(_MM_TOKENS), vocab)))
            config.update(ids)
            (tmp / "config.json").write_text(json.dumps(config, indent=2) + "\n")
            specials = {i: token for token, i in zip(_MM_TOKENS.values(), ids.values())}
        write_word_tokenizer(tmp, vocab, specials=specials)
        _write_shards(tmp, _tensors(config, fp8, block, seed, mtp), shard_size_bytes)
        if path.exists():
            path.rmdir()  # empty (checked above)
        os.rename(tmp, path)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return path


# ---- config ---------------------------------------------------------------------------------------------


def _config(fp8: bool, block: tuple[int, int], text_overrides: dict, mtp: bool = False) -> dict:
    text = {**TINY_TEXT, **text_overrides, "model_type": "glm5_next_text"}
    n = text["num_hidden_layers"]
    for key in ("layer_types", "mlp_layer_types", "indexer_types"):  # a new depth without new schedules: defaults
        if key not in text_overrides and len(text[key]) != n:
            del text[key]
    config = {
        "architectures": ["Glm5NextForConditionalGeneration"],
        "model_type": "glm5_next",
        "dtype": "bfloat16",
        "tie_word_embeddings": bool(text.get("tie_word_embeddings", False)),
        "text_config": text,
        "vision_config": {**TINY_VISION, "model_type": "glm5_next_vision"},
    }
    if fp8:
        config["quantization_config"] = {
            "quant_method": "fp8", "activation_scheme": "dynamic", "fmt": "e4m3",
            "weight_block_size": list(block), "modules_to_not_convert": _not_converted(text, mtp),
        }
    return config


def _text_model(config: dict, mtp: bool = False):
    """Our text model on the meta device: its `weight_slots()` name every text tensor and its shape
    (with mtp: the MTP draft layer's too)."""
    from flagdeploy.models.glm5_next import Glm5NextForCausalLM, from_hf_config

    cfg = from_hf_config(config)
    with torch.device("meta"):
        model = Glm5NextForCausalLM(cfg, torch.bfloat16)
        if mtp:
            model.attach_mtp()
        return cfg, model


def _not_converted(text: dict, mtp: bool = False) -> list[str]:
    """Module names left in BF16, as specific as needed (transformers matches them as name prefix/suffix)."""
    from flagdeploy.models.glm5_next import from_hf_config

    cfg = from_hf_config({"model_type": "glm5_next", "text_config": text})
    out = ["lm_head", TEXT_PREFIX + "embed_tokens", "model.visual"]
    for i, (lt, mt) in enumerate(zip(cfg.layer_types, cfg.mlp_layer_types)):
        p = f"{TEXT_PREFIX}layers.{i}."
        if lt == "linear_attention":
            out.append(p + "self_attn")
        else:
            out += [p + "self_attn.kv_b_proj", p + "self_attn.indexer"]
        if mt == "sparse":
            out.append(p + "mlp.gate")
    if mtp:
        p = f"{TEXT_PREFIX}layers.{cfg.num_layers}."
        out += [p + "self_attn.kv_b_proj", p + "self_attn.indexer", p + "mlp.gate", p + "eh_proj"]
    return out


# ---- tensors --------------------------------------------------------------------------------------------


def _text_shapes(model) -> Iterator[tuple[str, tuple[int, ...]]]:
    for name, slot in model.weight_slots().items():
        if name.startswith("visual."):  # the tower's own names come from transformers (_vision_shapes)
            continue
        if len(slot) == 2:  # (parameter, shard): the shard's full length where the model is split
            param, shard = slot
            shape = tuple(shard.full if shard is not None and d == shard.dim else n for d, n in enumerate(param.shape))
        else:
            lin, part, kind = slot
            rows, cols = lin.part_shape(part)
            shape = (rows, cols) if kind == "weight" else (rows,)
        yield (name if name == "lm_head.weight" else TEXT_PREFIX + name), shape


def _vision_shapes(vision: dict) -> Iterator[tuple[str, tuple[int, ...]]]:
    """The vision tower's tensors as transformers names them (its own module tree, built on meta)."""
    from transformers.models.glm5_next.configuration_glm5_next import Glm5NextVisionConfig
    from transformers.models.glm5_next.modeling_glm5_next import Glm5NextVisionModel

    with torch.device("meta"):
        tower = Glm5NextVisionModel(Glm5NextVisionConfig(**{k: v for k, v in vision.items() if k != "model_type"}))
    for name, t in tower.state_dict().items():
        yield "model.visual." + name, tuple(t.shape)


def _is_fp8(name: str, layer_types: list[str]) -> bool:
    m = re.match(re.escape(TEXT_PREFIX) + r"layers\.(\d+)\.(.*)$", name)
    if m is None:
        return False
    i, rest = int(m.group(1)), m.group(2)
    kind = layer_types[i] if i < len(layer_types) else "indexed_attention"  # past them: the MTP layer (MLA)
    return bool(_FP8_MLP.match(rest)) or (kind == "indexed_attention" and bool(_FP8_MLA.match(rest)))


def _random(name: str, shape: tuple[int, ...], gen: torch.Generator) -> torch.Tensor:
    """Small values that keep a random model's activations sane: norms near 1, matrices ~N(0, 0.05²); the
    LM head ~N(0, 0.5²) so that the logits spread (std ~3) and greedy decoding is not a coin toss."""
    x = torch.randn(shape, generator=gen)
    if name == "lm_head.weight":
        return 0.5 * x
    if _NORM.search(name) or name.endswith((".hc_attn_scale", ".hc_ffn_scale")):
        return 1.0 + 0.1 * x
    if name.endswith(("_base", "bias", "A_log", "index_kpool_compress_ape")):
        return 0.1 * x
    return 0.05 * x


def _tensors(config: dict, fp8: bool, block: tuple[int, int], seed: int,
             mtp: bool = False) -> Iterator[list[tuple[str, torch.Tensor]]]:
    """Groups of tensors that stay in one shard (an FP8 weight with its scale), in a fixed order."""
    cfg, model = _text_model(config, mtp)
    gen = torch.Generator().manual_seed(seed)
    for name, shape in [*_text_shapes(model), *_vision_shapes(config["vision_config"])]:
        w = _random(name, shape, gen)
        if fp8 and _is_fp8(name, cfg.layer_types):
            q, scale = fp8_block_quantize(w, block)
            yield [(name, q), (name + "_scale_inv", scale)]
        elif _FP32.search(name):
            yield [(name, w.float())]
        else:
            yield [(name, w.to(torch.bfloat16))]


def _write_shards(root: Path, groups: Iterator[list[tuple[str, torch.Tensor]]], shard_size_bytes: int) -> None:
    shards: list[dict[str, torch.Tensor]] = [{}]
    size = 0
    for group in groups:
        if shards[-1] and size >= shard_size_bytes:
            shards.append({})
            size = 0
        for name, t in group:
            shards[-1][name] = t.contiguous()
            size += t.numel() * t.element_size()
    n = len(shards)
    weight_map, total = {}, 0
    for i, shard in enumerate(shards, 1):
        fname = f"model-{i:05d}-of-{n:05d}.safetensors"
        save_file(shard, str(root / fname), metadata={"format": "pt"})
        for name, t in shard.items():
            weight_map[name] = fname
            total += t.numel() * t.element_size()
    index = {"metadata": {"total_size": total}, "weight_map": dict(sorted(weight_map.items()))}
    (root / "model.safetensors.index.json").write_text(json.dumps(index, indent=2) + "\n")


# ---- tokenizer ------------------------------------------------------------------------------------------


_WORD_TEMPLATE = "{% for m in messages %}{{ m['content'] }} {% endfor %}{% if add_generation_prompt %}w2 {% endif %}"


def write_word_tokenizer(root: Path, vocab_size: int, eos: str = "w1", specials: dict[int, str] | None = None,
                         template: str | None = _WORD_TEMPLATE) -> None:
    """A word-level tokenizer ("w0".."wN", split on whitespace) with a plain chat template, so that a
    directory of random weights is a servable model. specials: ids whose word is instead a special
    token matched anywhere in the text (a multimodal model's `<|image|>` and its brackets). template:
    None leaves the chat template out of the tokenizer's files (a processor file carries it)."""
    from tokenizers import AddedToken, Tokenizer, models, pre_tokenizers

    words = {i: f"w{i}" for i in range(vocab_size)} | (specials or {})
    tok = Tokenizer(models.WordLevel({w: i for i, w in words.items()}, unk_token="w0"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    # whole words only: a plain added "w1" would also match inside "w13" (-> "w1", "3")
    tok.add_special_tokens([AddedToken(t, single_word=True, special=True) for t in ("w0", eos)])
    tok.add_special_tokens([AddedToken(t, special=True) for t in (specials or {}).values()])
    tok.save(str(root / "tokenizer.json"))
    (root / "tokenizer_config.json").write_text(json.dumps(
        {"tokenizer_class": "PreTrainedTokenizerFast", "eos_token": eos, "pad_token": "w0",
         **({"chat_template": template} if template is not None else {})}))

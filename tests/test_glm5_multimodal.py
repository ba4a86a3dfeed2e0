"""Images and video into the builtin glm5_next: the tower's rows replace the placeholder tokens'
embeddings, and the logits equal transformers' `Glm5NextForConditionalGeneration` given the same
pixels (prefill, decode through our caches, and greedy tokens through the engine with chunked prefill,
preemption and the encoder cache in play).

A tiny random configuration whose multimodal token ids lie inside its 64-word vocabulary; every weight,
the vision tower's included, is redrawn at a scale where mistakes show (see tests/test_glm5_vision.py).
"""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("transformers.models.glm5_next")
from PIL import Image  # noqa: E402
from test_glm5_next import TEXT, _checkpoint_form  # noqa: E402
from test_glm5_vision import _video  # noqa: E402
from transformers import (  # noqa: E402
    Glm5NextConfig,
    Glm5NextForConditionalGeneration,
    Glm5NextImageProcessorPil,
)

from flagdeploy.engine import EngineConfig, SamplingParams  # noqa: E402
from flagdeploy.engine.replica import build_llm_engine  # noqa: E402
from flagdeploy.engine.multimodal import MediaItem  # noqa: E402
from flagdeploy.checkpoints.tiny_checkpoint import write_word_tokenizer  # noqa: E402
from flagdeploy.models.glm5_next import (  # noqa: E402
    Glm5NextForCausalLM,
    from_hf_config,
    load_hf_weights,
)

VISION = dict(depth=2, hidden_size=16, num_heads=2, intermediate_size=24, out_hidden_size=TEXT["hidden_size"],
              projection_intermediate_size=24, swiglu_limit=2.0)
# inside the vocabulary (the published ids are 154830..154855)
IDS = dict(image_start_token_id=56, image_end_token_id=57, video_start_token_id=58, video_end_token_id=59,
           image_token_id=60, video_token_id=61)
IMG, BOI, EOI, BOV, EOV = IDS["image_token_id"], IDS["image_start_token_id"], IDS["image_end_token_id"], \
    IDS["video_start_token_id"], IDS["video_end_token_id"]
ATOL = RTOL = 1e-4  # float32 both sides (as tests/test_glm5_next.py)
STEPS = 8


def _hf_model() -> Glm5NextForConditionalGeneration:
    torch.manual_seed(0)
    cfg = Glm5NextConfig(text_config={**TEXT, "eos_token_id": None}, vision_config=VISION, **IDS)
    model = Glm5NextForConditionalGeneration(cfg).eval()
    gen = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for name, t in [*model.named_parameters(), *model.named_buffers()]:
            if "visual" in name and name.endswith("inv_freq"):  # the rotary frequencies are not weights
                continue
            if "visual" in name:  # unit gain, norms around one, biases around zero
                r = torch.randn(t.shape, generator=gen)
                t.copy_(r * t[0].numel() ** -0.5 if t.dim() > 1 else r * 0.2 + (1.0 if name.endswith("weight") else 0.0))
            elif "language_model" in name or name == "lm_head.weight":
                t.add_(torch.randn(t.shape, generator=gen) * 0.1)
    return model


@pytest.fixture(scope="module")
def hf():
    return _hf_model()


@pytest.fixture(scope="module")
def ours(hf):
    model = Glm5NextForCausalLM(from_hf_config(hf.config.to_dict()))
    load_hf_weights(model, _checkpoint_form(hf.state_dict()))
    assert model.input_modalities == ("text", "image", "video")
    return model


def _image(width: int, height: int, seed: int):
    gen = torch.Generator().manual_seed(seed)
    img = Image.fromarray(torch.randint(0, 256, (height, width, 3), generator=gen, dtype=torch.uint8).numpy())
    out = Glm5NextImageProcessorPil()(images=[img], return_tensors="pt")
    return out["pixel_values"], out["image_grid_thw"]


def _image_prompt(grids, text=(5, 9, 13, 22), between=(7, 31)) -> list[int]:
    """Text, then per image <|begin_of_image|> + its placeholders + <|end_of_image|> and more text."""
    ids = list(text)
    for g in grids:
        ids += [BOI] + [IMG] * (int(g.prod()) // 4) + [EOI] + list(between)
    return ids


def _video_prompt(grid, stamps=(3, 4)) -> list[int]:
    """As transformers' processor writes a video: per temporal pair an image group and its timestamp text."""
    t, h, w = grid[0].tolist()
    ids = [5, 9, BOV]
    for i in range(t):
        ids += [BOI] + [IMG] * (h * w // 4) + [EOI, stamps[i % len(stamps)]]
    return ids + [EOV, 11, 17]


def _hf_logits(hf, ids, **pixels) -> torch.Tensor:
    with torch.no_grad():
        return hf(input_ids=torch.tensor([ids]), **pixels).logits[0].float()


def _embeds(ours, ids, pv, grid):
    feats = ours.encode_media(pv, grid)
    where = torch.tensor([i for i, t in enumerate(ids) if t == IMG])
    assert len(where) == feats.shape[0]
    return where, feats


def test_image_prompt_prefill_matches_transformers(hf, ours):
    pv1, g1 = _image(90, 60, 1)
    pv2, g2 = _image(56, 112, 2)
    pv, grid = torch.cat([pv1, pv2]), torch.cat([g1, g2])
    ids = _image_prompt(grid)
    want = _hf_logits(hf, ids, pixel_values=pv, image_grid_thw=grid)
    got = ours.forward_packed(torch.tensor(ids), torch.tensor([0, len(ids)]), [ours.new_cache()],
                              embeds=_embeds(ours, ids, pv, grid))
    torch.testing.assert_close(got, want, atol=ATOL, rtol=RTOL)
    # the image matters: the text-only logits after it are far from these
    assert (ours(torch.tensor(ids))[-1] - want[-1]).abs().max() > 100 * ATOL


def test_video_prompt_then_decode_matches_transformers(hf, ours):
    pv, grid = _video(frames=4, height=56, width=84)
    ids = _video_prompt(grid) + [19, 23, 29]
    want = _hf_logits(hf, ids, pixel_values_videos=pv, video_grid_thw=grid)
    where, feats = _embeds(ours, ids, pv, grid)
    cache, n = ours.new_cache(), len(ids) - 3
    first = ours.forward_packed(torch.tensor(ids[:n]), torch.tensor([0, n]), [cache], embeds=(where, feats))
    steps = [ours(torch.tensor(ids[i : i + 1]), cache) for i in range(n, len(ids))]  # decode after the video
    torch.testing.assert_close(torch.cat([first, *steps]), want, atol=ATOL, rtol=RTOL)


# ---- through the engine ----------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def ckpt(hf, tmp_path_factory):
    path = tmp_path_factory.mktemp("glm5_next_vl")
    hf.save_pretrained(path)
    write_word_tokenizer(path, TEXT["vocab_size"])
    return path


def _item(ids, pv, grid, key, kind="image", after=0) -> MediaItem:
    """The item of `ids` whose placeholders follow `after` others: its positions, in order."""
    n = int(grid.prod()) // 4
    positions = [i for i, tok in enumerate(ids) if tok == IMG][after : after + n]
    assert len(positions) == n
    return MediaItem(kind, key, positions, pv, grid)


def greedy(hf, ids, steps: int = STEPS, **pixels) -> list[int]:
    """transformers' own greedy generation (the pixels enter at prefill only: a sampled token that happens
    to be a placeholder id is an ordinary token; the mask is explicit, as a prompt may hold the pad id)."""
    with torch.no_grad():
        out = hf.generate(torch.tensor([ids]), attention_mask=torch.ones(1, len(ids), dtype=torch.long), **pixels,
                          max_new_tokens=steps, min_new_tokens=steps, do_sample=False)
    return out[0, len(ids):].tolist()


@pytest.mark.parametrize("budget,blocks", [(512, 512), (7, 512), (7, 20)], ids=["one-shot", "chunked", "preempted"])
def test_engine_greedy_with_media_matches_transformers(hf, ckpt, budget, blocks):
    """Two images in one prompt, a video in another, the first image again in a third with other text:
    chunked prefill splits the placeholder runs across steps; preemption recomputes them. The same image
    is encoded once."""
    pv1, g1 = _image(90, 60, 1)
    pv2, g2 = _image(56, 112, 2)
    vpv, vg = _video(frames=4, height=56, width=84)
    two = _image_prompt(torch.cat([g1, g2]))
    again = _image_prompt(g1, text=(40, 41))
    video = _video_prompt(vg)
    want = [greedy(hf, two, pixel_values=torch.cat([pv1, pv2]), image_grid_thw=torch.cat([g1, g2])),
            greedy(hf, video, pixel_values_videos=vpv, video_grid_thw=vg),
            greedy(hf, again, pixel_values=pv1, image_grid_thw=g1)]
    probe = build_llm_engine(ckpt, "safetensors", EngineConfig(max_model_len=64), chip="cpu", progress=False)
    per_block, state = probe.runner.bytes_per_block(probe.model, 4), probe.runner.state_bytes(probe.model, 16)
    engine = build_llm_engine(ckpt, "safetensors", EngineConfig(
        max_model_len=64, max_num_batched_tokens=budget, block_size=4, kv_cache_memory=state + blocks * per_block),
        chip="cpu", progress=False)
    params = SamplingParams(max_tokens=STEPS, temperature=0, ignore_eos=True)
    media = [[_item(two, pv1, g1, "a"), _item(two, pv2, g2, "b", after=int(g1.prod()) // 4)], [_item(video, vpv, vg, "v", "video")],
             [_item(again, pv1, g1, "a")]]
    for i, (ids, items) in enumerate(zip([two, video, again], media)):
        engine.add_request(f"r{i}", ids, params, media=items)
    got = {}
    while engine.has_work():
        for out in engine.step():
            got.setdefault(out.request_id, []).extend(out.token_ids)
    assert [got[f"r{i}"] for i in range(3)] == want
    stats = engine.stats()
    if blocks < 512:
        assert stats["preemptions"] > 0
    # "a" twice, "b", "v": three encoded; a recompute after preemption finds them cached
    assert stats["mm_items_encoded"] == 3 and stats["mm_encoder_cache_hits"] >= 1
    assert engine.runner.state_rows == {}


def test_engine_refuses_media_a_model_cannot_take(ckpt):
    engine = build_llm_engine(ckpt, "safetensors", EngineConfig(max_model_len=64), chip="cpu", progress=False)
    pv, g = _image(56, 56, 3)
    ids = _image_prompt(g)
    params = SamplingParams(max_tokens=2, temperature=0)
    with pytest.raises(ValueError, match="outside the prompt"):
        engine.add_request("x", ids[:5], params, media=[_item(ids, pv, g, "k")])
    with pytest.raises(ValueError, match="prompt logprobs"):
        engine.add_request("y", ids, SamplingParams(max_tokens=2, prompt_logprobs=1), media=[_item(ids, pv, g, "k")])
    engine.model.visual = None  # a text-only glm5_next
    with pytest.raises(ValueError, match="takes text input, not image"):
        engine.add_request("z", ids, params, media=[_item(ids, pv, g, "k")])


def test_prefix_cache_blocks_are_keyed_by_the_media_they_show():
    """Blocks of placeholder tokens match only a block that showed the same medium: same image → hit,
    same text with another image → no hit past the text before it."""
    from flagdeploy.engine.block_manager import BlockManager
    from flagdeploy.engine.sequence import Sequence

    ids = [5, 9, 13, 22] + [BOI] + [IMG] * 8 + [EOI, 7, 31, 40]  # blocks of 4: text, then image from block 1
    pixels, grid = torch.zeros(32, 1), torch.tensor([[1, 4, 8]])

    def seq(key: str) -> Sequence:
        item = MediaItem("image", key, [i for i, t in enumerate(ids) if t == IMG], pixels, grid)
        return Sequence(key, ids, SamplingParams(max_tokens=1), 1, [item])

    blocks = BlockManager(16, 4)
    first = seq("image:aaa")
    blocks.match_prefix(first)
    blocks.ensure_slots(first, len(ids))
    first.num_computed = len(ids)
    blocks.register_full_blocks(first)
    same, other = seq("image:aaa"), seq("image:bbb")
    blocks.match_prefix(same)
    blocks.match_prefix(other)
    assert same.num_cached_tokens == 16  # every full block before the last token
    assert other.num_cached_tokens == 4  # the text block only


def test_long_videos_are_encoded_in_pieces_with_the_same_rows(ours, monkeypatch):
    """encode_media runs the tower on at most ENCODER_CHUNK_PATCHES patches at once (one frame if larger):
    frames never see one another, so the rows are those of one whole call."""
    from flagdeploy.models.glm5_next import model as glm_model

    vpv, vg = _video(frames=6, height=56, width=84)  # 3 pairs of 24 patches
    pv, g = _image(90, 60, 1)  # 80 patches
    pixels, grid = torch.cat([vpv, pv, vpv]), torch.cat([vg, g, vg])
    whole = ours.encode_media(pixels, grid)
    calls = []
    forward = ours.visual.forward
    monkeypatch.setattr(glm_model, "ENCODER_CHUNK_PATCHES", 50)
    monkeypatch.setattr(ours.visual, "forward", lambda p, gr: calls.append(gr.tolist()) or forward(p, gr))
    pieces = ours.encode_media(pixels, grid)
    assert max(sum(t * h * w for t, h, w in c) for c in calls) == 80 and len(calls) > 3
    torch.testing.assert_close(pieces, whole, atol=1e-5, rtol=1e-5)

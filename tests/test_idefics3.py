"""Idefics3 (SmolVLM) in the builtin engine: a llama-family text model behind a SigLIP encoder, checked
against transformers' `Idefics3ForConditionalGeneration` and `Idefics3Processor` on a tiny random
checkpoint in the published layout (`write_tiny_idefics3`): the same tiles and prompt tokens, the same
logits for image + text prompts (prefill and decode through our paged cache), and the same greedy
tokens through the engine with chunked prefill, preemption and the encoder cache in play."""

from __future__ import annotations

import pytest
import torch
from PIL import Image
from transformers import AutoTokenizer, Idefics3ForConditionalGeneration, Idefics3ImageProcessorPil, Idefics3Processor

from flagdeploy.engine import EngineConfig, SamplingParams
from flagdeploy.engine.replica import build_llm_engine
from flagdeploy.engine.model_loading import load_model
from flagdeploy.engine.multimodal import MediaItem
from flagdeploy.checkpoints import safetensors_reader
from flagdeploy.checkpoints.tiny_idefics3 import write_tiny_idefics3
from flagdeploy.models import media_processor
from flagdeploy.tokenizer import Tokenizer

ATOL = RTOL = 1e-4  # float32 both sides
STEPS = 8


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    return write_tiny_idefics3(tmp_path_factory.mktemp("idefics3") / "smolvlm-tiny")


@pytest.fixture(scope="module")
def hf(ckpt):
    return Idefics3ForConditionalGeneration.from_pretrained(ckpt, dtype=torch.float32).eval()


@pytest.fixture(scope="module")
def ours(ckpt):
    model, tokenizer = load_model(ckpt, "safetensors", torch.float32, "cpu", progress=False)
    model.prepare(128)
    processor = media_processor(model, ckpt, safetensors_reader.raw_config(ckpt))
    return model, tokenizer, processor


def _picture(width: int, height: int, seed: int) -> Image.Image:
    gen = torch.Generator().manual_seed(seed)
    return Image.fromarray(torch.randint(0, 256, (height, width, 3), generator=gen, dtype=torch.uint8).numpy())


def _hf_processor(ckpt) -> Idefics3Processor:
    import json

    cfg = json.loads((ckpt / "preprocessor_config.json").read_text())
    return Idefics3Processor(Idefics3ImageProcessorPil.from_dict(cfg), AutoTokenizer.from_pretrained(ckpt),
                             image_seq_len=json.loads((ckpt / "processor_config.json").read_text())["image_seq_len"])


def _prompt(tokenizer: Tokenizer, n_images: int, text: str = "w5 w9 w13") -> str:
    content = [{"type": "image"}] * n_images + [{"type": "text", "text": text}]
    return tokenizer.apply_chat_template([{"role": "user", "content": content}])


def _prepared(ours, images, text="w5 w9 w13"):
    """(ids, items) as the server makes them: the template's `<image>`s expanded, each image's positions."""
    _, tokenizer, processor = ours
    pairs = [(processor.image_inputs(img), None) for img in images]
    ids = tokenizer.encode(processor.expand(_prompt(tokenizer, len(images), text), pairs))
    return ids, [(inputs, pos) for (inputs, _), pos in zip(pairs, processor.positions(ids, pairs))]


@pytest.mark.parametrize("sizes", [[(20, 30)], [(100, 40), (32, 32)], [(33, 97)]], ids=["small", "two", "tall"])
def test_tiles_and_prompt_tokens_are_transformers(ckpt, ours, sizes):
    """Split and unsplit images: the same pixels bit for bit, the same prompt token ids."""
    images = [_picture(w, h, i) for i, (w, h) in enumerate(sizes)]
    ids, items = _prepared(ours, images)
    want = _hf_processor(ckpt)(text=_prompt(ours[1], len(images)), images=images, return_tensors="pt")
    assert ids == want["input_ids"][0].tolist()
    got = torch.cat([inputs.pixel_values for inputs, _ in items])
    real = want["pixel_values"][0].flatten(1).ne(0).any(1)  # the batch pads with all-zero tiles
    assert got.shape[0] == int(real.sum()) and got.shape[0] > len(images)  # some image was split into tiles
    torch.testing.assert_close(got, want["pixel_values"][0][real], atol=0, rtol=0)


def _embeds(model, ids, items):
    pv = torch.cat([inputs.pixel_values for inputs, _ in items])
    grid = torch.cat([inputs.grid_thw for inputs, _ in items])
    rows = model.encode_media(pv, grid)
    return torch.tensor([p for _, pos in items for p in pos]), rows, pv


def test_image_prompt_logits_match_transformers(hf, ours):
    model = ours[0]
    ids, items = _prepared(ours, [_picture(100, 40, 1), _picture(20, 30, 2)])
    where, rows, pv = _embeds(model, ids, items)
    with torch.no_grad():
        want = hf(input_ids=torch.tensor([ids]), pixel_values=pv[None]).logits[0]
    got = model.score(torch.tensor(ids), embeds=(where, rows))
    torch.testing.assert_close(got, want, atol=ATOL, rtol=RTOL)
    # the images matter: the logits of the same tokens without them are far from these
    assert (model.score(torch.tensor(ids))[-1] - want[-1]).abs().max() > 100 * ATOL


def _greedy(hf, ids, pv) -> list[int]:
    with torch.no_grad():
        out = hf.generate(torch.tensor([ids]), attention_mask=torch.ones(1, len(ids), dtype=torch.long),
                          pixel_values=pv[None], max_new_tokens=STEPS, min_new_tokens=STEPS, do_sample=False)
    return out[0, len(ids):].tolist()


@pytest.mark.parametrize("budget,blocks", [(512, 512), (7, 512), (7, 18)], ids=["one-shot", "chunked", "preempted"])
def test_engine_greedy_with_images_matches_transformers(hf, ckpt, ours, budget, blocks):
    """Two images in one prompt, the first again with other text: chunked prefill splits the image-token
    runs across steps, preemption recomputes them, and each image is encoded once."""
    a, b = _picture(100, 40, 1), _picture(20, 30, 2)
    two, two_items = _prepared(ours, [a, b])
    again, again_items = _prepared(ours, [a], text="w40 w41")
    want = [_greedy(hf, two, _embeds(ours[0], two, two_items)[2]),
            _greedy(hf, again, _embeds(ours[0], again, again_items)[2])]
    probe = build_llm_engine(ckpt, "safetensors", EngineConfig(max_model_len=72), chip="cpu", progress=False)
    per_block = probe.runner.bytes_per_block(probe.model, 4)
    engine = build_llm_engine(ckpt, "safetensors", EngineConfig(
        max_model_len=72, max_num_batched_tokens=budget, block_size=4, kv_cache_memory=blocks * per_block),
        chip="cpu", progress=False)
    params = SamplingParams(max_tokens=STEPS, temperature=0, ignore_eos=True)
    for i, (ids, items, keys) in enumerate([(two, two_items, "ab"), (again, again_items, "a")]):
        media = [MediaItem("image", key, pos, inputs.pixel_values, inputs.grid_thw)
                 for key, (inputs, pos) in zip(keys, items)]
        engine.add_request(f"r{i}", ids, params, media=media)
    got: dict[str, list[int]] = {}
    while engine.has_work():
        for out in engine.step():
            got.setdefault(out.request_id, []).extend(out.token_ids)
    assert [got["r0"], got["r1"]] == want
    stats = engine.stats()
    if blocks < 512:
        assert stats["preemptions"] > 0
    assert stats["mm_items_encoded"] == 2 and stats["mm_encoder_cache_hits"] >= 1


def test_image_prompt_under_tensor_parallelism_matches_transformers(hf, ckpt, ours):
    """--tp 2 (gloo): rank 0 encodes, the rows travel to rank 1 inside the step, chunked prefill splits the
    image-token runs; the tokens are transformers'."""
    ids, items = _prepared(ours, [_picture(100, 40, 1)])
    want = _greedy(hf, ids, _embeds(ours[0], ids, items)[2])
    engine = build_llm_engine(ckpt, "safetensors", EngineConfig(max_model_len=72, max_num_batched_tokens=7, block_size=4,
                                                                kv_cache_memory=1 << 20, tp=2), chip="cpu", progress=False)
    try:
        (inputs, where), = items
        engine.add_request("r", ids, SamplingParams(max_tokens=STEPS, temperature=0, ignore_eos=True),
                           media=[MediaItem("image", "k", where, inputs.pixel_values, inputs.grid_thw)])
        out = []
        while engine.has_work():
            out += [t for o in engine.step() for t in o.token_ids]
    finally:
        engine.close()
    assert out == want

def test_many_tiles_are_encoded_in_pieces_with_the_same_rows(ours, monkeypatch):
    """The encoder runs at most ENCODER_CHUNK_PATCHES patches at once; tiles never see one another."""
    from flagdeploy.models.idefics3 import model as idefics3_model

    model = ours[0]
    _, items = _prepared(ours, [_picture(100, 40, 1), _picture(20, 30, 2)])
    pv = torch.cat([inputs.pixel_values for inputs, _ in items])
    grid = torch.cat([inputs.grid_thw for inputs, _ in items])
    whole = model.encode_media(pv, grid)
    monkeypatch.setattr(idefics3_model, "ENCODER_CHUNK_PATCHES", 2 * model.cfg.vision.patches_per_side ** 2)
    torch.testing.assert_close(model.encode_media(pv, grid), whole, atol=1e-6, rtol=1e-6)


def test_the_planner_counts_every_tensor_of_the_checkpoint(ckpt):
    """`plan` sizes SmolVLM from config.json alone: the same names and shapes as the checkpoint holds, the
    encoder's replicated and outside the decoder layers, and its activation peak in the ledger."""
    import json

    from safetensors import safe_open

    from flagdeploy.models import encoder_activation_bytes
    from flagdeploy.planner.ledger import weight_groups
    from flagdeploy.planner.shapes import checkpoint_tensors

    config = json.loads((ckpt / "config.json").read_text())
    with safe_open(str(ckpt / "model.safetensors"), "pt") as f:
        stored = {name: tuple(f.get_slice(name).get_shape()) for name in f.keys()}
    assert dict(checkpoint_tensors(config)) == stored
    vision = [g for g in weight_groups(config) if g.family == "vision"]
    assert vision and all(g.layer is None and g.split == "replicated" for g in vision)
    assert encoder_activation_bytes(config) > 0

# ---- through `flagdeploy serve`, with the real SDKs ----------------------------------------------------


def _png(img: Image.Image) -> str:
    import base64
    import io

    buf = io.BytesIO()
    img.save(buf, format="PNG")
    return base64.b64encode(buf.getvalue()).decode()


def test_serve_answers_image_questions_as_transformers(ckpt, hf, ours):
    """`flagdeploy serve --model <SmolVLM directory>`: the OpenAI and Anthropic SDKs send a PNG; the answer
    is transformers' greedy answer for the same picture and text; a video is refused by name; a text-only
    request still renders through the typed-parts template."""
    import anthropic
    import openai
    from test_cli import _free_port, _serve, wait_ready

    picture = _picture(100, 40, 1)
    ids, items = _prepared(ours, [picture], text="w5 w9")
    want = ours[1].decode(_greedy(hf, ids, _embeds(ours[0], ids, items)[2]))
    port = _free_port()
    proc = _serve("--model", str(ckpt), "--served-model-name", "m", "--port", str(port), "--max-model-len", "128")
    try:
        url = wait_ready(proc, port)
        client = openai.OpenAI(base_url=f"{url}/v1", api_key="x", max_retries=0)
        chat = client.chat.completions.create(model="m", max_tokens=STEPS, messages=[{"role": "user", "content": [
            {"type": "image_url", "image_url": {"url": f"data:image/png;base64,{_png(picture)}"}},
            {"type": "text", "text": "w5 w9"}]}], extra_body={"ignore_eos": True})
        assert chat.choices[0].message.content == want
        msg = anthropic.Anthropic(base_url=url, api_key="x", max_retries=0).messages.create(
            model="m", max_tokens=STEPS, extra_body={"ignore_eos": True}, messages=[{"role": "user", "content": [
                {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": _png(picture)}},
                {"type": "text", "text": "w5 w9"}]}])
        assert msg.content[0].text == want
        with pytest.raises(openai.BadRequestError, match="takes image and text only"):
            client.chat.completions.create(model="m", max_tokens=2, messages=[{"role": "user", "content": [
                {"type": "video_url", "video_url": {"url": "data:video/mp4;base64,AAAA"}}]}])
        text = client.chat.completions.create(model="m", max_tokens=2, messages=[{"role": "user", "content": "w5"}])
        assert text.usage.prompt_tokens == len(ours[1].encode(_prompt(ours[1], 0, "w5")))
    finally:
        proc.terminate()
        proc.wait(timeout=30)

"""Images and video through `flagdeploy serve` (builtin engine, tiny random GLM-5.3-Flash with its vision
tower), driven by the real OpenAI and Anthropic SDKs with real PNG / JPEG / MP4 bytes: the answers equal
transformers' greedy generation on the same pixels; a repeated image is encoded once; every refusal is a
400 in the protocol's own error shape that names the limit, and leaves the server serving.
"""

from __future__ import annotations

import base64
import http.server
import io
import re
import threading

import anthropic
import httpx
import openai
import pytest
import torch

pytest.importorskip("transformers.models.glm5_next")
from PIL import Image  # noqa: E402
from test_cli import _free_port, _serve, wait_ready  # noqa: E402
from test_glm5_multimodal import IDS, TEXT, _hf_model, greedy  # noqa: E402
from tokenizers import Tokenizer  # noqa: E402
from transformers import Glm5NextImageProcessorPil  # noqa: E402

from flagdeploy.checkpoints.tiny_checkpoint import write_word_tokenizer  # noqa: E402

STEPS = 6
SPECIALS = {IDS["image_start_token_id"]: "<|begin_of_image|>", IDS["image_end_token_id"]: "<|end_of_image|>",
            IDS["video_start_token_id"]: "<|begin_of_video|>", IDS["video_end_token_id"]: "<|end_of_video|>",
            IDS["image_token_id"]: "<|image|>", IDS["video_token_id"]: "<|video|>"}


def _picture(width: int, height: int, seed: int, fmt: str = "PNG") -> bytes:
    gen = torch.Generator().manual_seed(seed)
    img = Image.fromarray(torch.randint(0, 256, (height, width, 3), generator=gen, dtype=torch.uint8).numpy())
    buf = io.BytesIO()
    img.save(buf, format=fmt)
    return buf.getvalue()


PNG = _picture(84, 56, 1)
OTHER_PNG = _picture(84, 56, 2)
JPEG = _picture(70, 98, 3, "JPEG")


def _data_url(data: bytes, kind: str = "image/png") -> str:
    return f"data:{kind};base64,{base64.b64encode(data).decode()}"


@pytest.fixture(scope="module")
def hf():
    return _hf_model()


@pytest.fixture(scope="module")
def picture_host():
    """A loopback HTTP server holding the PNG: an allowed media host."""
    class Handler(http.server.BaseHTTPRequestHandler):
        def do_GET(self):
            self.send_response(200)
            self.send_header("Content-Type", "image/png")
            self.send_header("Content-Length", str(len(PNG)))
            self.end_headers()
            self.wfile.write(PNG)

        def log_message(self, *args):
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    yield f"http://127.0.0.1:{server.server_address[1]}/cat.png"
    server.shutdown()


@pytest.fixture(scope="module")
def server(hf, tmp_path_factory):
    path = tmp_path_factory.mktemp("glm5_vl_serve")
    hf.save_pretrained(path)
    write_word_tokenizer(path, TEXT["vocab_size"], specials=SPECIALS)
    port = _free_port()
    proc = _serve("--model", str(path), "--served-model-name", "m", "--port", str(port), "--max-model-len", "160",
                  "--limit-mm-per-prompt", "image=2,video=1", "--allowed-media-domains", "127.0.0.1")
    try:
        yield wait_ready(proc, port), path
    finally:
        proc.terminate()
        proc.wait(timeout=30)


def _want(hf, path, text: str, images: list[bytes]) -> str:
    """transformers' greedy answer: the chat template's text, each image placeholder widened as
    transformers' processor widens it, the pixels from its own image processor."""
    tok = Tokenizer.from_file(str(path / "tokenizer.json"))
    proc = Glm5NextImageProcessorPil()
    pix = proc(images=[Image.open(io.BytesIO(b)).convert("RGB") for b in images], return_tensors="pt")
    counts = iter((pix["image_grid_thw"].prod(-1) // 4).tolist())
    text = re.sub(re.escape("<|image|>"), lambda _: "<|image|>" * next(counts), text)
    ids = tok.encode(text).ids
    return tok.decode(greedy(hf, ids, STEPS, pixel_values=pix["pixel_values"], image_grid_thw=pix["image_grid_thw"]))


def _image_tag() -> str:
    return "<|begin_of_image|><|image|><|end_of_image|>"


def _openai(url: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{url}/v1", api_key="x", max_retries=0)


def _anthropic(url: str) -> anthropic.Anthropic:
    return anthropic.Anthropic(base_url=url, api_key="x", max_retries=0)


def _encoded(url: str) -> tuple[int, int]:
    text = httpx.get(f"{url}/metrics").text
    values = [float(re.search(rf"^flagdeploy:{name}_total (\S+)$", text, re.M).group(1))
              for name in ("mm_items_encoded", "mm_encoder_cache_hits")]
    return int(values[0]), int(values[1])


def test_openai_and_anthropic_image_answers_are_transformers(server, hf, picture_host):
    url, path = server
    want = _want(hf, path, f"w5 w9{_image_tag()}w13 w2 ", [PNG])
    client = _openai(url)
    chat = client.chat.completions.create(model="m", max_tokens=STEPS, messages=[{"role": "user", "content": [
        {"type": "text", "text": "w5 w9"}, {"type": "image_url", "image_url": {"url": _data_url(PNG)}},
        {"type": "text", "text": "w13"}]}])
    assert chat.choices[0].message.content == want
    encoded, hits = _encoded(url)
    # the same picture from an allowed host, and as an Anthropic base64 block: the encoder cache answers
    again = client.chat.completions.create(model="m", max_tokens=STEPS, messages=[{"role": "user", "content": [
        {"type": "text", "text": "w5 w9"}, {"type": "image_url", "image_url": {"url": picture_host}},
        {"type": "text", "text": "w13"}]}])
    assert again.choices[0].message.content == want
    msg = _anthropic(url).messages.create(model="m", max_tokens=STEPS, messages=[{"role": "user", "content": [
        {"type": "text", "text": "w5 w9"},
        {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": base64.b64encode(PNG).decode()}},
        {"type": "text", "text": "w13"}]}])
    assert msg.content[0].text == want
    assert _encoded(url) == (encoded, hits + 2)


def test_two_images_and_a_jpeg_in_a_stream(server, hf):
    url, path = server
    want = _want(hf, path, f"{_image_tag()}w7{_image_tag()} w2 ", [JPEG, OTHER_PNG])
    stream = _openai(url).chat.completions.create(model="m", max_tokens=STEPS, stream=True, messages=[
        {"role": "user", "content": [{"type": "image_url", "image_url": {"url": _data_url(JPEG, "image/jpeg")}},
                                     {"type": "text", "text": "w7"},
                                     {"type": "image_url", "image_url": {"url": _data_url(OTHER_PNG)}}]}])
    assert "".join(c.choices[0].delta.content or "" for c in stream if c.choices) == want


def test_same_text_with_another_image_is_another_answer(server, hf):
    url, path = server
    answers = {_want(hf, path, f"w5 w9{_image_tag()}w13 w2 ", [img]) for img in (PNG, OTHER_PNG)}
    got = {_openai(url).chat.completions.create(model="m", max_tokens=STEPS, messages=[{"role": "user", "content": [
        {"type": "text", "text": "w5 w9"}, {"type": "image_url", "image_url": {"url": _data_url(img)}},
        {"type": "text", "text": "w13"}]}]).choices[0].message.content for img in (PNG, OTHER_PNG)}
    assert got == answers and len(answers) == 2


def test_video_answer_is_transformers(server, hf):
    av = pytest.importorskip("av")
    from flagdeploy.media import FetchLimits, decode_video
    from flagdeploy.models.glm5_next.processor import Glm5MediaProcessor

    url, path = server
    buf = io.BytesIO()
    with av.open(buf, "w", format="mp4") as out:
        stream = out.add_stream("mpeg4", rate=4)
        stream.width, stream.height = 112, 84
        for i in range(8):  # 2 s at 4 fps: four frames at 2 fps, two temporal pairs
            img = Image.fromarray(torch.randint(0, 256, (84, 112, 3), generator=torch.Generator().manual_seed(i),
                                                dtype=torch.uint8).numpy())
            for packet in stream.encode(av.VideoFrame.from_image(img)):
                out.mux(packet)
        for packet in stream.encode():
            out.mux(packet)
    video = buf.getvalue()
    # the oracle's pixels and prompt from our processor (checked against transformers' in
    # tests/test_glm5_processor.py), the answer from transformers
    processor = Glm5MediaProcessor.from_checkpoint(path, hf.config.to_dict())
    frames = decode_video(video, FetchLimits(), "the video")
    inputs, stamps = processor.video_inputs(frames.frames, frames.timestamps)
    text = processor.expand(f"w5{processor.placeholder('video')}w9 w2 ", [(inputs, stamps)])
    tok = Tokenizer.from_file(str(path / "tokenizer.json"))
    want = greedy(hf, tok.encode(text).ids, STEPS, pixel_values_videos=inputs.pixel_values, video_grid_thw=inputs.grid_thw)
    chat = _openai(url).chat.completions.create(model="m", max_tokens=STEPS, messages=[{"role": "user", "content": [
        {"type": "text", "text": "w5"}, {"type": "video_url", "video_url": {"url": _data_url(video, "video/mp4")}},
        {"type": "text", "text": "w9"}]}])
    assert chat.choices[0].message.content == tok.decode(want)


@pytest.mark.parametrize("part,code,names", [
    ({"type": "image_url", "image_url": {"url": _data_url(PNG[: len(PNG) // 2])}}, "media_corrupt", "Image 1"),
    ({"type": "image_url", "image_url": {"url": _data_url(b"GIF87a not really")}}, "media_corrupt", "Image 1"),
    ({"type": "image_url", "image_url": {"url": _data_url(b"%PDF-1.4 hello")}}, "media_unsupported_format", "PNG"),
    ({"type": "image_url", "image_url": {"url": "https://example.com/cat.png"}}, "media_url_not_allowed",
     "--allowed-media-domains"),
    ({"type": "image_url", "image_url": {"url": "http://127.0.0.1:9/missing.png"}}, "media_fetch_failed", "Image 1"),
    ({"type": "input_audio", "input_audio": {"data": "AAAA", "format": "wav"}}, "unsupported_content", "image and text"),
], ids=["truncated", "corrupt", "pdf", "host-not-allowed", "unreachable", "audio"])
def test_refusals_are_400s_naming_the_problem(server, part, code, names):
    url, _ = server
    with pytest.raises(openai.BadRequestError) as exc:
        _openai(url).chat.completions.create(model="m", max_tokens=2, messages=[
            {"role": "user", "content": [{"type": "text", "text": "w5"}, part]}])
    err = exc.value.body
    assert err["code"] == code and names in err["message"], err


def test_too_many_images_in_each_protocol(server):
    url, _ = server
    three = [{"type": "image_url", "image_url": {"url": _data_url(PNG)}}] * 3
    with pytest.raises(openai.BadRequestError, match="image=2"):
        _openai(url).chat.completions.create(model="m", max_tokens=2, messages=[{"role": "user", "content": three}])
    block = {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": base64.b64encode(PNG).decode()}}
    with pytest.raises(anthropic.BadRequestError) as exc:
        _anthropic(url).messages.create(model="m", max_tokens=2, messages=[{"role": "user", "content": [block] * 3}])
    assert exc.value.body["type"] == "error" and "image=2" in exc.value.body["error"]["message"]
    r = httpx.post(f"{url}/v1/responses", json={"model": "m", "max_output_tokens": 2, "input": [{"role": "user", "content": [
        {"type": "input_image", "image_url": _data_url(PNG)}] * 3}]})
    assert r.status_code == 400 and "image=2" in r.json()["error"]["message"]
    # and the server still answers
    ok = _openai(url).chat.completions.create(model="m", max_tokens=2, messages=[{"role": "user", "content": [
        {"type": "image_url", "image_url": {"url": _data_url(PNG)}}]}])
    assert ok.choices[0].finish_reason == "length"


def test_the_builtin_limit_holds_for_a_modality_the_operator_left_out():
    from flagdeploy.media_policy import MediaPolicy
    from flagdeploy.server.errors import APIError
    from flagdeploy.server.media import BUILTIN_LIMITS, MediaSettings

    part = {"type": "image_url", "image_url": {"url": _data_url(PNG)}}
    body = {"messages": [{"role": "user", "content": [part] * (BUILTIN_LIMITS["image"] + 1)}]}
    with pytest.raises(APIError, match=f"image={BUILTIN_LIMITS['image']}"):
        MediaSettings().checked_policy().check(body)
    MediaSettings(MediaPolicy({"image": 32})).checked_policy().check(body)  # the operator's own limit wins


def test_media_that_cannot_fit_are_refused_before_the_rest_is_decoded(server):
    """The first image already fills more positions than the context (160 here): refused at once, the second
    never decoded; on /v1/responses the error names `input`, that route's field."""
    url, _ = server
    big = _data_url(_picture(560, 560, 4))
    with pytest.raises(openai.BadRequestError) as exc:
        _openai(url).chat.completions.create(model="m", max_tokens=2, messages=[{"role": "user", "content": [
            {"type": "image_url", "image_url": {"url": big}}, {"type": "image_url", "image_url": {"url": big}}]}])
    err = exc.value.body
    assert err["code"] == "context_length_exceeded" and "first 1 image(s)" in err["message"], err
    r = httpx.post(f"{url}/v1/responses", json={"model": "m", "max_output_tokens": 2, "input": [{"role": "user", "content": [
        {"type": "input_image", "image_url": big}]}]})
    assert r.status_code == 400 and r.json()["error"]["param"] == "input", r.text

"""Media through the gateway, and the engines' media flags (issue 30).

A recording engine (a small OpenAI chat server on loopback that keeps every body it is sent) stands
behind a real uvicorn running the gateway; the `anthropic` and `openai` SDKs are the clients. What
the engine receives is compared with what the client sent: Anthropic image blocks and Responses
input_image parts arrive as OpenAI image parts in their place among the text, with the image data
byte for byte; OpenAI chat media parts arrive unchanged; what the media policy refuses never
reaches the engine. The emitted vLLM / SGLang / MindIE launches carry each engine's own media flags
(or a warning naming the flag), only when set; bad flag values are refused with what to write.
"""

from __future__ import annotations

import base64
import json
import os

import anthropic
import openai
import pytest
import yaml
from click.testing import CliRunner
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, StreamingResponse
from starlette.routing import Route
from test_server import _free_port, _serve, _wait_ready

from flagdeploy.cli import main
from flagdeploy.gateway import ModelPool, parse_config
from flagdeploy.gateway.app import Gateway
from flagdeploy.gateway.launch import launch_plan
from flagdeploy.gateway.proxy import Timeouts
from flagdeploy.gateway.supervisor import AttachedUpstream
from flagdeploy.media_policy import MediaPolicy, MediaPolicyError, parse_limits
from flagdeploy.planner.emit import emit
from flagdeploy.planner.profile import Profile

API_KEY = "sk-media-test"
HOST = "img.example.com"
# Image bytes of every value (a JPEG-sized payload), so that any re-encoding on the way would show.
PNG = base64.b64encode(bytes(range(256)) * 24 + os.urandom(1024)).decode()
JPEG = base64.b64encode(os.urandom(4096)).decode()


# ---- the recording engine ----------------------------------------------------------------------------


class RecordingEngine:
    """An OpenAI chat server that answers "seen" and keeps each chat body it was sent."""

    def __init__(self) -> None:
        self.bodies: list[dict] = []
        self.app = Starlette(routes=[Route("/v1/models", self.models), Route("/v1/chat/completions", self.chat,
                                                                             methods=["POST"])])

    async def models(self, request: Request) -> JSONResponse:
        return JSONResponse({"object": "list", "data": [{"id": "vlm-engine", "object": "model"}]})

    async def chat(self, request: Request):
        body = await request.json()
        self.bodies.append(body)
        base = {"id": "chatcmpl-1", "created": 1, "model": "vlm-engine"}
        usage = {"prompt_tokens": 7, "completion_tokens": 1, "total_tokens": 8}
        if not body.get("stream"):
            return JSONResponse(base | {"object": "chat.completion", "usage": usage, "choices": [
                {"index": 0, "message": {"role": "assistant", "content": "seen"}, "finish_reason": "stop"}]})

        async def events():
            chunk = base | {"object": "chat.completion.chunk"}
            yield f"data: {json.dumps(chunk | {'choices': [{'index': 0, 'delta': {'content': 'seen'}}]})}\n\n"
            yield f"data: {json.dumps(chunk | {'choices': [{'index': 0, 'delta': {}, 'finish_reason': 'stop'}]})}\n\n"
            yield f"data: {json.dumps(chunk | {'choices': [], 'usage': usage})}\n\n"
            yield "data: [DONE]\n\n"

        return StreamingResponse(events(), media_type="text/event-stream")


@pytest.fixture(scope="module")
def engine():
    recorder = RecordingEngine()
    live = _serve(recorder.app)
    yield recorder, live.url
    live.stop()


def _gateway(engine_url: str, media: MediaPolicy):
    pool = ModelPool(["vlm"], [AttachedUpstream(engine_url, interval=0.5)], media=media)
    live = _serve(Gateway([pool], api_key=API_KEY, timeouts=Timeouts(connect=2.0, read=30.0)))
    assert _wait_ready(live.url, timeout=30).status_code == 200
    return live


@pytest.fixture(scope="module")
def gateway(engine):
    """The recording engine attached as `vlm`, http(s) images allowed from HOST, at most 3 images."""
    live = _gateway(engine[1], MediaPolicy.parse("image=3,video=1", HOST))
    yield live
    live.stop()


@pytest.fixture(scope="module")
def default_gateway(engine):
    """The same engine with the default policy: no limit, no host (data: URLs only)."""
    live = _gateway(engine[1], MediaPolicy())
    yield live
    live.stop()


def _received(engine, since: int) -> list[dict]:
    recorder = engine[0]
    assert len(recorder.bodies) == since + 1, "the engine did not get exactly one request"
    return recorder.bodies[-1]["messages"]


# ---- translation: Anthropic and Responses media as OpenAI image parts -----------------------------------


def test_anthropic_image_blocks_arrive_as_image_parts_in_order(engine, gateway):
    client = anthropic.Anthropic(base_url=gateway.url, api_key=API_KEY, max_retries=0)
    before = len(engine[0].bodies)
    answer = client.messages.create(model="vlm", max_tokens=8, system="Describe images.", messages=[
        {"role": "user", "content": [
            {"type": "text", "text": "First this one:"},
            {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": PNG}},
            {"type": "text", "text": "then"},
            {"type": "text", "text": "this one:"},
            {"type": "image", "source": {"type": "url", "url": f"https://{HOST}/cat.jpg"}},
            {"type": "text", "text": "Compare."}]}])
    assert answer.content[0].text == "seen" and answer.stop_reason == "end_turn"
    assert _received(engine, before) == [
        {"role": "system", "content": "Describe images."},
        {"role": "user", "content": [
            {"type": "text", "text": "First this one:"},
            {"type": "image_url", "image_url": {"url": f"data:image/png;base64,{PNG}"}},
            {"type": "text", "text": "then\nthis one:"},
            {"type": "image_url", "image_url": {"url": f"https://{HOST}/cat.jpg"}},
            {"type": "text", "text": "Compare."}]}]


def test_anthropic_tool_result_images_reach_the_tool_turn(engine, gateway):
    """Claude Code's screenshot tools answer with image blocks inside tool_result: they stay with it."""
    client = anthropic.Anthropic(base_url=gateway.url, api_key=API_KEY, max_retries=0)
    before = len(engine[0].bodies)
    with client.messages.stream(model="vlm", max_tokens=8, tools=[
            {"name": "screenshot", "description": "Take one.", "input_schema": {"type": "object"}}], messages=[
        {"role": "user", "content": "What is on screen?"},
        {"role": "assistant", "content": [{"type": "tool_use", "id": "toolu_1", "name": "screenshot", "input": {}}]},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "toolu_1", "content": [
            {"type": "text", "text": "screen:"},
            {"type": "image", "source": {"type": "base64", "media_type": "image/jpeg", "data": JPEG}}]}]}]) as stream:
        assert stream.get_final_message().content[0].text == "seen"
    assert _received(engine, before)[-1] == {"role": "tool", "tool_call_id": "toolu_1", "content": [
        {"type": "text", "text": "screen:"},
        {"type": "image_url", "image_url": {"url": f"data:image/jpeg;base64,{JPEG}"}}]}


def test_responses_input_image_arrives_as_an_image_part(engine, gateway):
    client = openai.OpenAI(base_url=f"{gateway.url}/v1", api_key=API_KEY, max_retries=0)
    before = len(engine[0].bodies)
    response = client.responses.create(model="vlm", instructions="Be brief.", input=[
        {"role": "user", "content": [
            {"type": "input_text", "text": "What differs between"},
            {"type": "input_image", "image_url": f"data:image/png;base64,{PNG}", "detail": "high"},
            {"type": "input_text", "text": "and"},
            {"type": "input_image", "image_url": f"https://{HOST}/b.png", "detail": "auto"}]}])
    assert response.output_text == "seen"
    assert _received(engine, before) == [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": [
            {"type": "text", "text": "What differs between"},
            {"type": "image_url", "image_url": {"url": f"data:image/png;base64,{PNG}", "detail": "high"}},
            {"type": "text", "text": "and"},
            {"type": "image_url", "image_url": {"url": f"https://{HOST}/b.png", "detail": "auto"}}]}]


# ---- passthrough ----------------------------------------------------------------------------------------


def test_openai_media_parts_pass_through_unchanged(engine, gateway):
    client = openai.OpenAI(base_url=f"{gateway.url}/v1", api_key=API_KEY, max_retries=0)
    messages = [{"role": "user", "content": [
        {"type": "text", "text": "Two pictures, a clip and a sound:"},
        {"type": "image_url", "image_url": {"url": f"data:image/png;base64,{PNG}", "detail": "low"}},
        {"type": "image_url", "image_url": {"url": f"https://{HOST}/x.webp"}, "uuid": "img-x"},
        {"type": "video_url", "video_url": {"url": f"https://{HOST}/clip.mp4"}},
        {"type": "input_audio", "input_audio": {"data": JPEG, "format": "wav"}},
        {"type": "text", "text": "Which is loudest?"}]}]
    for stream in (False, True):
        before = len(engine[0].bodies)
        if stream:
            text = "".join(c.choices[0].delta.content or "" for c in client.chat.completions.create(
                model="vlm", messages=messages, stream=True) if c.choices)
        else:
            text = client.chat.completions.create(model="vlm", messages=messages).choices[0].message.content
        assert text == "seen"
        assert _received(engine, before) == messages  # the same parts, the same bytes, the same order


# ---- the media policy at the gateway ----------------------------------------------------------------------


def _image(url: str) -> dict:
    return {"type": "image_url", "image_url": {"url": url}}


def test_urls_of_hosts_not_allowed_never_reach_the_engine(engine, gateway, default_gateway):
    chat = openai.OpenAI(base_url=f"{gateway.url}/v1", api_key=API_KEY, max_retries=0)
    before = len(engine[0].bodies)
    for url, why in ((f"http://169.254.169.254/latest/meta-data/{HOST}", "host '169.254.169.254'"),
                     (f"https://{HOST}.evil.test/a.png", f"host '{HOST}.evil.test'"),  # hosts match exactly
                     (f"http://evil.test\\@{HOST}/a.png", "ambiguously"),  # parsers disagree on the host
                     ("file:///etc/passwd", "neither a data: URL nor an http(s) URL")):
        with pytest.raises(openai.BadRequestError) as err:
            chat.chat.completions.create(model="vlm", messages=[{"role": "user", "content": [_image(url)]}])
        error = err.value.body
        assert why in error["message"] and f"http(s) URLs of {HOST}" in error["message"], error
        assert error["code"] == "media_url_not_allowed" and "--allowed-media-domains" in error["message"]
    claude = anthropic.Anthropic(base_url=default_gateway.url, api_key=API_KEY, max_retries=0)
    with pytest.raises(anthropic.BadRequestError) as err:  # default: no host at all, data: URLs only
        claude.messages.create(model="vlm", max_tokens=8, messages=[{"role": "user", "content": [
            {"type": "image", "source": {"type": "url", "url": f"https://{HOST}/cat.jpg"}}]}])
    assert err.value.body["error"]["type"] == "invalid_request_error"
    assert "takes data: URLs only" in err.value.body["error"]["message"]
    with pytest.raises(anthropic.BadRequestError, match="takes data: URLs only"):  # counting would fetch it too
        claude.messages.count_tokens(model="vlm", messages=[{"role": "user", "content": [
            {"type": "image", "source": {"type": "url", "url": f"https://{HOST}/cat.jpg"}}]}])
    assert len(engine[0].bodies) == before
    ok = openai.OpenAI(base_url=f"{default_gateway.url}/v1", api_key=API_KEY, max_retries=0)
    ok.chat.completions.create(model="vlm", messages=[{"role": "user", "content": [
        _image(f"data:image/png;base64,{PNG}")]}])
    assert len(engine[0].bodies) == before + 1


def test_limits_per_request_and_bad_sources_are_400s(engine, gateway):
    chat = openai.OpenAI(base_url=f"{gateway.url}/v1", api_key=API_KEY, max_retries=0)
    claude = anthropic.Anthropic(base_url=gateway.url, api_key=API_KEY, max_retries=0)
    before = len(engine[0].bodies)
    images = [_image(f"data:image/png;base64,{PNG}")] * 2
    with pytest.raises(openai.BadRequestError) as err:  # 4 images over two turns, 3 allowed
        chat.chat.completions.create(model="vlm", messages=[{"role": "user", "content": images},
                                                            {"role": "assistant", "content": "ok"},
                                                            {"role": "user", "content": images}])
    assert err.value.body["code"] == "too_many_media_items"
    assert "carries 4 image items" in err.value.body["message"] and "image=3" in err.value.body["message"]
    with pytest.raises(anthropic.BadRequestError) as err:
        claude.messages.create(model="vlm", max_tokens=8, messages=[{"role": "user", "content": [
            {"type": "image", "source": {"type": "file", "file_id": "file_011"}}]}])
    assert "Files API" in err.value.body["error"]["message"] and '"type": "base64"' in err.value.body["error"]["message"]
    with pytest.raises(openai.BadRequestError) as err:
        chat.responses.create(model="vlm", input=[{"role": "user", "content": [
            {"type": "input_image", "file_id": "file-abc"}]}])
    assert "file_id" in err.value.body["message"] and "data: URL" in err.value.body["message"]
    assert len(engine[0].bodies) == before


# ---- the flags: one spelling, each engine's own name ---------------------------------------------------------


def test_both_spellings_mean_the_same_and_bad_values_say_what_to_write():
    assert parse_limits("image=2,video=0") == parse_limits('{"image":2,"video":0}') == {"image": 2, "video": 0}
    assert parse_limits(" image = 2 ") == {"image": 2}
    for bad, says in (("image", "is not MODALITY=COUNT"), ("image=two", 'image="two"'),
                      ("image=-1", "0 or more"), ("picture=2", "unknown modality 'picture'"),
                      ("image=1,image=2", "image is given twice"), ('{"image": 2', "is not valid JSON"),
                      ('{"image": {"count": 8}}', "not a per-item size"), ('{"image": true}', "whole number"),
                      ("", "gives no limit")):
        with pytest.raises(MediaPolicyError) as err:
            parse_limits(bad)
        assert says in str(err.value), (bad, str(err.value))
    for bad in ("https://img.example.com", "img.example.com:443", "*.example.com", " , "):
        with pytest.raises(MediaPolicyError):
            MediaPolicy.parse(None, bad)


def test_serve_refuses_bad_media_flags_before_starting():
    run = CliRunner().invoke
    out = run(main, ["serve", "--engine", "vllm", "--chip", "h200", "--model", "org/m",
                     "--limit-mm-per-prompt", "image=lots"])
    assert out.exit_code == 2, out.output
    assert "Invalid value for '--limit-mm-per-prompt'" in out.output and "image=2,video=0" in out.output
    out = run(main, ["serve", "--upstream", "http://h:1", "--allowed-media-domains", "https://img.example.com/"])
    assert out.exit_code == 2 and "without scheme, port, path" in out.output
    config = parse_config({"models": [{"names": ["v"], "engine": "vllm", "model": "org/m", "chip": "h200",
                                       "args": {"limit_mm_per_prompt": {"image": 1}}}]})
    with pytest.raises(ValueError, match="go beside `args`"):
        launch_plan(config.models[0], 8000)


def test_serve_flags_reach_the_gateway(engine, monkeypatch):
    """`serve --upstream URL --limit-mm-per-prompt ... --allowed-media-domains ...` builds the gateway that a
    user gets; only uvicorn's blocking run is left out: the app it would run is served here instead."""
    import flagdeploy.server

    apps = []
    monkeypatch.setattr(flagdeploy.server, "make_server",
                        lambda app, *a, **k: apps.append(app) or type("S", (), {"run": lambda self: None})())
    out = CliRunner().invoke(main, ["serve", "--upstream", engine[1], "--served-model-name", "vlm", "--port",
                                    str(_free_port()), "--limit-mm-per-prompt", '{"image":1}',
                                    "--allowed-media-domains", HOST])
    assert out.exit_code == 0, out.output
    live = _serve(apps[0])
    try:
        assert _wait_ready(live.url, timeout=30).status_code == 200
        chat = openai.OpenAI(base_url=f"{live.url}/v1", api_key="unused", max_retries=0)
        before = len(engine[0].bodies)
        allowed = _image(f"https://{HOST}/a.png")
        chat.chat.completions.create(model="vlm", messages=[{"role": "user", "content": [allowed]}])
        for content, code in (([_image("https://other.example.com/a.png")], "media_url_not_allowed"),
                              ([allowed, allowed], "too_many_media_items")):
            with pytest.raises(openai.BadRequestError) as err:
                chat.chat.completions.create(model="vlm", messages=[{"role": "user", "content": content}])
            assert err.value.body["code"] == code
        assert len(engine[0].bodies) == before + 1
    finally:
        live.stop()


def test_serve_config_with_media_flags_points_to_serve_yaml(tmp_path):
    path = tmp_path / "serve.yaml"
    path.write_text("models:\n  - {names: [q], engine: upstream, upstreams: ['http://127.0.0.1:9']}\n")
    out = CliRunner().invoke(main, ["serve", "--config", str(path), "--allowed-media-domains", HOST])
    assert out.exit_code == 1 and "set limit_mm_per_prompt / allowed_media_domains on the models" in out.output


def _value(argv: list[str], flag: str) -> str:
    return argv[argv.index(flag) + 1]


def test_launched_engines_get_their_own_media_flags_only_when_set():
    models = [{"names": ["v"], "engine": "vllm", "model": "org/vlm", "chip": "h200",
               "limit_mm_per_prompt": "image=2,video=0", "allowed_media_domains": f"{HOST},cdn.example.com"},
              {"names": ["s"], "engine": "sglang", "model": "org/vlm", "chip": "h200",
               "limit_mm_per_prompt": {"image": 4}, "allowed_media_domains": [HOST]},
              {"names": ["plain"], "engine": "vllm", "model": "org/vlm", "chip": "h200"}]
    vllm, sglang, plain = (launch_plan(m, 8000) for m in parse_config({"models": models}).models)
    assert json.loads(_value(vllm.argv, "--limit-mm-per-prompt")) == {"image": 2, "video": 0}
    at = vllm.argv.index("--allowed-media-domains")  # a list flag: one argument per host
    assert vllm.argv[at + 1:at + 3] == [HOST, "cdn.example.com"] and vllm.argv[at + 3].startswith("--")
    assert vllm.env["VLLM_MEDIA_URL_ALLOW_REDIRECTS"] == "0" and not vllm.warnings
    assert json.loads(_value(sglang.argv, "--limit-mm-data-per-request")) == {"image": 4}
    assert "--allowed-media-domains" not in sglang.argv
    (warning,) = sglang.warnings
    assert "no equivalent of --allowed-media-domains" in warning and "sglang-no-media-domains" in warning
    assert not any("media" in a or "mm" in a for a in plain.argv) and "VLLM_MEDIA_URL_ALLOW_REDIRECTS" not in plain.env


def test_engines_without_an_equivalent_get_a_warning_naming_the_flag(default_model):
    media = {"limit_mm_per_prompt": {"image": 1}, "allowed_media_domains": [HOST]}
    mindie = emit(Profile(model="/m", chip="ascend910b", **media), "mindie")
    assert "limit" not in mindie.files["mindie-config.fragment.json"]
    limit, domains = [w for w in mindie.warnings if "mindie-no-media" in w]
    assert "no equivalent of --limit-mm-per-prompt" in limit and "no equivalent of --allowed-media-domains" in domains
    llama = parse_config({"models": [{"names": ["t"], "engine": "llama.cpp", **media}]}).models[0]
    plan = launch_plan(llama, 8123)
    assert [w.split(":")[0] for w in plan.warnings] == [
        "llama.cpp (llama_cpp.server) has no equivalent of --limit-mm-per-prompt",
        "llama.cpp (llama_cpp.server) has no equivalent of --allowed-media-domains"]
    assert not any("mm" in a or "media" in a for a in plan.argv)


def test_plan_emit_and_profiles_carry_the_same_flags(tmp_path):
    plan = ["plan", "--model", "glm-5.3-flash", "--chip", "h200", "--layout", "tp=8", "--emit"]
    out = CliRunner().invoke(main, [*plan, "vllm", "--limit-mm-per-prompt", '{"image":2,"video":0}',
                                    "--allowed-media-domains", HOST])
    assert out.exit_code == 0, out.output
    last = out.output.strip().splitlines()[-1]
    assert f"""--limit-mm-per-prompt '{{"image":2,"video":0}}' --allowed-media-domains {HOST}""" in last
    assert last.startswith("VLLM_MEDIA_URL_ALLOW_REDIRECTS=0 ")
    out = CliRunner().invoke(main, [*plan, "profile", "--limit-mm-per-prompt", "image=2,video=0"])
    path = tmp_path / "p.yaml"
    path.write_text(out.output)
    profile = Profile.load(path)
    assert profile.limit_mm_per_prompt == {"image": 2, "video": 0} and profile.allowed_media_domains is None
    assert _value(emit(profile, "sglang").argv, "--limit-mm-data-per-request") == '{"image":2,"video":0}'
    data = yaml.safe_load(path.read_text())
    data["profile"]["limit_mm_per_prompt"] = "image=1,video=0"  # serve's spelling in a hand-written profile
    path.write_text(yaml.safe_dump(data))
    assert Profile.load(path).limit_mm_per_prompt == {"image": 1, "video": 0}
    data["profile"]["limit_mm_per_prompt"] = "image=nine"
    path.write_text(yaml.safe_dump(data))
    with pytest.raises(ValueError, match='limit_mm_per_prompt: image="nine"'):
        Profile.load(path)

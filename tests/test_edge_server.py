"""The OpenAI endpoint served from ONNX (`serve --engine onnxruntime` in-process): the same API tests as
the builtin engine, taken from tests/test_server.py, against a live uvicorn whose engine is the ONNX one.
Only the `live` fixture differs; `client` and `http` are test_server's own and resolve to this module's
`live`.

The fp32 export is served: test_server checks exact greedy content ("Paris" for the capital of France),
and the default model's margin there is 0.08 logits ("The" 25.33 against "L" 25.24), which the int4
export's int8 activations (accuracy_level 4) flip. The int4 engine is checked in tests/test_edge.py;
FLAGDEPLOY_EDGE_API_WEIGHTS=int4 runs this module on it (then that test and LangChain's, which asks the same question, fail).

Skips without the `edge` extra locally; fails when FLAGDEPLOY_REQUIRE_ONNXRUNTIME=1 (CI).
"""

from __future__ import annotations

import os

import openai
import pytest

import test_server
from test_edge import _require_ort
from test_server import CHAT, MAX_MODEL_LEN, NAMES, LiveServer, start_observed
from test_server import client, http  # noqa: F401 - the fixtures, over this module's `live`

# Every API test of the builtin engine's server module, collected here again.
globals().update({name: fn for name, fn in vars(test_server).items() if name.startswith("test_")})


@pytest.fixture(scope="module")
def live(default_model) -> LiveServer:
    """The ONNX server, observed while it loads (503) exactly as test_server's `live` is."""
    _require_ort()
    from flagdeploy.edge.engine import build_onnx_engine
    from flagdeploy.edge.export import cached_export
    from flagdeploy.engine import AsyncEngine, EngineConfig

    weights = os.environ.get("FLAGDEPLOY_EDGE_API_WEIGHTS", "fp32")
    export = cached_export(default_model, weights)  # before the server: the first export takes ~30 s
    config = EngineConfig(max_model_len=MAX_MODEL_LEN, max_num_seqs=8, kv_cache_memory=256 << 20)
    engines = []

    def load():
        engines.append(AsyncEngine(build_onnx_engine(export, config)))
        return engines[0]

    srv = start_observed(load, "ONNX engine")
    srv.observed["engine"] = engines[0]
    yield srv
    srv.stop()


def test_served_by_onnxruntime(live: LiveServer, client: openai.OpenAI) -> None:  # noqa: F811
    """The engine behind this endpoint really is the ONNX one, and it answered the requests above."""
    from flagdeploy.edge.engine import OnnxLLMEngine

    engine = live.observed["engine"].engine
    assert isinstance(engine, OnnxLLMEngine) and engine.decoder.manifest["weights"] == os.environ.get("FLAGDEPLOY_EDGE_API_WEIGHTS", "fp32")
    before = engine.stats()["generation_tokens"]
    client.chat.completions.create(model=NAMES[0], messages=CHAT, max_tokens=2)
    assert engine.stats()["generation_tokens"] > before


def test_logprobs_and_echo_prompt_logprobs(client: openai.OpenAI) -> None:  # noqa: F811
    r = client.completions.create(model=NAMES[0], prompt="The capital of France is", max_tokens=3, temperature=0,
                                  logprobs=2, echo=True)
    lp = r.choices[0].logprobs
    assert lp.token_logprobs[0] is None and all(x <= 0 for x in lp.token_logprobs[1:])
    assert len(lp.top_logprobs[-1]) == 2


def test_json_schema_response_format(client: openai.OpenAI) -> None:  # noqa: F811
    schema = {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"],
              "additionalProperties": False}
    r = client.chat.completions.create(
        model=NAMES[0], max_tokens=24, temperature=0,
        messages=[{"role": "user", "content": "What is the capital of France? Answer in JSON."}],
        response_format={"type": "json_schema", "json_schema": {"name": "a", "schema": schema, "strict": True}})
    import json

    assert set(json.loads(r.choices[0].message.content)) == {"city"}

"""Tools, structured output and logprobs, driven by the real clients against a real server.

The default model's chat template knows nothing of tools, so these requests go through the fallback
(tools in the system prompt, hermes convention); `tool_choice` required / named and `response_format`
are enforced by grammar, which is what makes a 135M model's calls and JSON reliable enough to assert.
"""

from __future__ import annotations

import json
import math

import anthropic
import pytest
import test_server
from langchain_core.tools import tool
from langchain_openai import ChatOpenAI
from pydantic import BaseModel, Field
from test_server import API_KEY, NAMES

from flagdeploy.server.tools import (
    ToolParser,
    ToolSet,
    detect_parser,
    forced_call_grammar,
    get_parser,
    parse_tool_calls,
)

live, http, client = test_server.live, test_server.http, test_server.client  # the module's server and clients

WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "The current weather in a city.",
    "parameters": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 24}}, "required": ["city"]}}}
ASK = [{"role": "user", "content": "What is the weather in Paris?"}]


# ---- the parsers, on text ------------------------------------------------------------------------

TOOLS = ToolSet.from_openai([{"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}, "days": {"type": "integer"}}}}}])


def _stream(spec, text: str, step: int):
    """Feed `text` in pieces of `step` characters; (content, {index: (names, arguments)})."""
    parser = ToolParser(spec, TOOLS)
    content, calls = "", {}
    events = [parser.feed(text[i:i + step]) for i in range(0, len(text), step)] + [parser.finish()]
    for e in events:
        content += e.content
        for d in e.calls:
            names, args = calls.setdefault(d["index"], ([], []))
            if "name" in d["function"]:
                names.append(d["function"]["name"])
                assert d["id"].startswith("call_") and d["type"] == "function"
            else:
                assert set(d) == {"index", "function"}  # id/type/name only in a call's first delta
            args.append(d["function"]["arguments"])
    return content, {i: (names, "".join(args)) for i, (names, args) in calls.items()}


@pytest.mark.parametrize("step", [1, 3, 1000])
def test_hermes_calls_stream_like_whole(step):
    text = ('Sure.<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "days": 2}}\n</tool_call>\n'
            '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Rome \\"old\\" {x}"}}\n</tool_call>')
    content, calls = _stream(get_parser("hermes"), text, step)
    assert content == "Sure."
    assert calls[0] == (["get_weather"], '{"city": "Paris", "days": 2}')
    assert json.loads(calls[1][1]) == {"city": 'Rome "old" {x}'}
    whole_content, whole = parse_tool_calls(get_parser("hermes"), TOOLS, text)
    assert whole_content == content and [c.arguments for c in whole] == [calls[0][1], calls[1][1]]


@pytest.mark.parametrize("name,text", [
    ("glm47", "Let me look.<tool_call>get_weather<arg_key>city</arg_key><arg_value>Paris</arg_value>"
              "<arg_key>days</arg_key><arg_value>3</arg_value></tool_call>"),
    ("glm45", "Let me look.<tool_call>get_weather\n<arg_key>city</arg_key>\n<arg_value>Paris</arg_value>\n"
              "<arg_key>days</arg_key>\n<arg_value>3</arg_value>\n</tool_call>"),
])
@pytest.mark.parametrize("step", [1, 7])
def test_glm_calls(name, text, step):
    content, calls = _stream(get_parser(name), text, step)
    assert content == "Let me look."
    names, args = calls[0]
    assert names == ["get_weather"]
    assert json.loads(args) == {"city": "Paris", "days": 3}  # typed by the schema: string stays text, integer is JSON


def test_a_call_cut_short_stands_as_sent():
    """max_tokens can end a forced call mid-arguments: the call stands with the arguments as sent
    (what a stream already showed), not silently dropped."""
    text = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Par'
    content, calls = parse_tool_calls(get_parser("hermes"), TOOLS, text)
    assert content == "" and [(c.name, c.arguments) for c in calls] == [("get_weather", '{"city": "Par')]
    assert _stream(get_parser("hermes"), text, 4)[1][0] == (["get_weather"], '{"city": "Par')


def test_not_a_call_stays_text():
    spec = get_parser("hermes")
    assert parse_tool_calls(spec, TOOLS, "a <tool_ b") == ("a <tool_ b", [])
    assert parse_tool_calls(spec, TOOLS, "x <tool_call>{oops}</tool_call>") == ("x <tool_call>{oops}</tool_call>", [])


def test_parser_follows_the_template():
    assert detect_parser("{{ '<tool_call>' }}{% for k, v in a %}<arg_key>{{ k }}</arg_key><arg_value>").name == "glm47"
    assert detect_parser("<tool_call>\n{{ name }}\n<arg_key>").name == "glm45"
    assert detect_parser("<tool_call>{{ tool_call | tojson }}</tool_call>").name == "hermes"
    assert detect_parser(None).name == "hermes"


@pytest.mark.parametrize("name", ["hermes", "glm47", "glm45"])
def test_forced_call_grammars_compile(llm_engine, name):
    from flagdeploy.engine.grammar import validate

    spec = forced_call_grammar(get_parser(name), TOOLS, ["get_weather"], llm_engine.tokenizer)
    validate(llm_engine.tokenizer, spec)


# ---- OpenAI SDK ----------------------------------------------------------------------------------


def test_required_tool_call_round_trip(client):
    r = client.chat.completions.create(model=NAMES[0], messages=ASK, tools=[WEATHER], tool_choice="required",
                                       max_tokens=60)
    choice = r.choices[0]
    assert choice.finish_reason == "tool_calls"
    call = choice.message.tool_calls[0]
    assert call.type == "function" and call.function.name == "get_weather" and call.id.startswith("call_")
    assert isinstance(json.loads(call.function.arguments)["city"], str)
    # the result goes back; the model answers in text (tool_choice defaults to auto)
    history = ASK + [choice.message.model_dump(exclude_none=True),
                     {"role": "tool", "tool_call_id": call.id, "content": "Sunny, 21 C"}]
    r2 = client.chat.completions.create(model=NAMES[0], messages=history, tools=[WEATHER], max_tokens=20)
    assert r2.choices[0].finish_reason in ("stop", "length", "tool_calls")
    assert r2.usage.prompt_tokens > r.usage.prompt_tokens


def test_streamed_named_tool_call(client):
    chunks = list(client.chat.completions.create(
        model=NAMES[0], messages=ASK, tools=[WEATHER], max_tokens=60, stream=True,
        tool_choice={"type": "function", "function": {"name": "get_weather"}}))
    deltas = [tc for c in chunks if c.choices for tc in c.choices[0].delta.tool_calls or []]
    assert deltas and all(d.index == 0 for d in deltas)
    assert [d.function.name for d in deltas if d.function.name] == ["get_weather"]  # the name once
    assert deltas[0].id and all(d.id is None for d in deltas[1:])
    assert len(deltas) >= 3  # header, then the arguments in fragments
    assert "city" in json.loads("".join(d.function.arguments or "" for d in deltas))
    assert chunks[-1].choices[0].finish_reason == "tool_calls"


def test_tool_choice_none_and_unknown_name(client, http):
    r = client.chat.completions.create(model=NAMES[0], messages=ASK, tools=[WEATHER], tool_choice="none", max_tokens=8)
    assert r.choices[0].message.tool_calls is None
    bad = http.post("/v1/chat/completions", json={"messages": ASK, "tools": [WEATHER],
                                                  "tool_choice": {"type": "function", "function": {"name": "nope"}}})
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "tool_choice"


class City(BaseModel):
    name: str = Field(max_length=40)
    country: str = Field(max_length=40)
    is_capital: bool


def test_json_schema_response_format(client):
    r = client.chat.completions.parse(model=NAMES[0], messages=[{"role": "user", "content": "Describe Paris."}],
                                      response_format=City, max_tokens=80)
    city = r.choices[0].message.parsed
    assert isinstance(city, City) and r.choices[0].finish_reason == "stop"


def test_json_object_and_bad_schema(client, http):
    r = client.chat.completions.create(model=NAMES[0], messages=[{"role": "user", "content": "A JSON object about cats."}],
                                       response_format={"type": "json_object"}, max_tokens=60)
    if r.choices[0].finish_reason == "stop":
        assert isinstance(json.loads(r.choices[0].message.content), dict)
    else:  # cut by max_tokens: still the beginning of an object
        assert r.choices[0].message.content.startswith("{")
    bad = http.post("/v1/chat/completions", json={"messages": ASK, "response_format": {
        "type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "objectx"}}}})
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "response_format"


def test_chat_logprobs(client):
    r = client.chat.completions.create(model=NAMES[0], messages=ASK, max_tokens=5, logprobs=True, top_logprobs=3)
    content = r.choices[0].logprobs.content
    assert len(content) == r.usage.completion_tokens
    for entry in content:
        assert entry.logprob <= 0 and len(entry.top_logprobs) == 3
        assert entry.token == entry.top_logprobs[0].token  # greedy: the chosen token is the most likely
        assert math.isclose(entry.logprob, entry.top_logprobs[0].logprob, abs_tol=1e-6)
    assert "".join(e.token for e in content) == r.choices[0].message.content


def test_echo_logprobs_score_the_prompt_like_decoding(client):
    """Prompt logprobs (one scoring pass) and a generated token's logprob (the paged decode path)
    must agree: score "prompt + generated token" and compare."""
    prompt = "The capital of France is"
    first = client.completions.create(model=NAMES[0], prompt=prompt, max_tokens=1, logprobs=2)
    token, logprob = first.choices[0].logprobs.tokens[0], first.choices[0].logprobs.token_logprobs[0]
    scored = client.completions.create(model=NAMES[0], prompt=prompt + token, max_tokens=1, logprobs=2, echo=True)
    lp = scored.choices[0].logprobs
    assert scored.choices[0].text.startswith(prompt + token)
    assert lp.token_logprobs[0] is None and lp.text_offset[0] == 0
    n_prompt = scored.usage.prompt_tokens
    assert len(lp.tokens) == n_prompt + 1
    assert lp.tokens[n_prompt - 1] == token
    # Where the prompt is computed as decode rows (the CPU's AVX2 table: backends/cpu/tune.yaml prompt_max_keys), so
    # is the scoring pass, and the two agree bit for bit; where a prefill computes it, the scoring pass's prefill
    # has one more row, and the two agree to a few 1e-3.
    assert math.isclose(lp.token_logprobs[n_prompt - 1], logprob, abs_tol=1e-2)
    assert all(v <= 0 for v in lp.token_logprobs[1:])


# ---- Anthropic SDK -------------------------------------------------------------------------------

CLAUDE_TOOL = {"name": "get_weather", "description": "The current weather in a city.",
               "input_schema": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 24}},
                                "required": ["city"]}}


def test_anthropic_tool_use_round_trip(live):
    claude = anthropic.Anthropic(base_url=live.url, api_key=API_KEY, max_retries=0, timeout=60)
    msg = claude.messages.create(model="SmolLM2-135M-Instruct[1m]", max_tokens=60, messages=ASK, tools=[CLAUDE_TOOL],
                                 tool_choice={"type": "tool", "name": "get_weather"})
    assert msg.stop_reason == "tool_use"
    use = [b for b in msg.content if b.type == "tool_use"][0]
    assert use.name == "get_weather" and isinstance(use.input["city"], str) and use.id.startswith("toolu_")
    with claude.messages.stream(model=NAMES[0], max_tokens=60, messages=ASK, tools=[CLAUDE_TOOL],
                                tool_choice={"type": "any"}) as stream:
        streamed = stream.get_final_message()
    assert streamed.stop_reason == "tool_use"
    assert [b for b in streamed.content if b.type == "tool_use"][0].input["city"]
    history = ASK + [{"role": "assistant", "content": [b.model_dump() for b in msg.content]},
                     {"role": "user", "content": [{"type": "tool_result", "tool_use_id": use.id, "content": "Sunny, 21 C"}]}]
    answer = claude.messages.create(model=NAMES[0], max_tokens=20, messages=history, tools=[CLAUDE_TOOL])
    assert answer.stop_reason in ("end_turn", "max_tokens", "tool_use")
    count = claude.messages.count_tokens(model=NAMES[0], messages=history, tools=[CLAUDE_TOOL])
    assert count.input_tokens > msg.usage.input_tokens


# ---- LangChain -----------------------------------------------------------------------------------


class WeatherArgs(BaseModel):
    city: str = Field(max_length=24)  # bounded: a forced call's string cannot run on to max_tokens


@tool(args_schema=WeatherArgs)
def get_weather(city: str) -> str:
    """The current weather in a city."""
    return "Sunny"


def test_langchain_bind_tools_and_structured_output(live):
    llm = ChatOpenAI(base_url=f"{live.url}/v1", api_key=API_KEY, model=NAMES[0], max_retries=0, max_tokens=60,
                     temperature=0)
    bound = llm.bind_tools([get_weather], tool_choice="get_weather")
    ai = bound.invoke("What is the weather in Paris?")
    assert ai.tool_calls and ai.tool_calls[0]["name"] == "get_weather" and "city" in ai.tool_calls[0]["args"]
    merged = None
    for chunk in bound.stream("What is the weather in Rome?"):
        merged = chunk if merged is None else merged + chunk
    assert [c["name"] for c in merged.tool_calls] == ["get_weather"]  # not "get_weatherget_weather"
    city = llm.with_structured_output(City).invoke("Describe Paris.")
    assert isinstance(city, City)


# ---- Responses API (Codex) -----------------------------------------------------------------------

RESPONSES_TOOL = {"type": "function", "name": "get_weather", "description": "The current weather in a city.",
                  "parameters": WEATHER["function"]["parameters"]}


def test_responses_chat_and_stream(client):
    r = client.responses.create(model=NAMES[0], instructions="Answer briefly.", input="What is the capital of France?",
                                max_output_tokens=12)
    assert r.status in ("completed", "incomplete") and r.output[0].type == "message"
    assert r.output_text and r.usage.output_tokens <= 12 and r.usage.input_tokens > 0
    events = list(client.responses.create(model=NAMES[0], instructions="Answer briefly.",
                                          input="What is the capital of France?", max_output_tokens=12, stream=True))
    kinds = [e.type for e in events]
    assert kinds[:2] == ["response.created", "response.in_progress"]
    assert kinds[-1] in ("response.completed", "response.incomplete") and kinds.count(kinds[-1]) == 1
    assert [e.sequence_number for e in events] == list(range(len(events)))
    text = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    assert text == events[-1].response.output[0].content[0].text == r.output_text  # greedy: same answer


def test_responses_function_call_round_trip(client):
    r = client.responses.create(model=NAMES[0], input=ASK, tools=[RESPONSES_TOOL], tool_choice="required",
                                max_output_tokens=60)
    calls = [item for item in r.output if item.type == "function_call"]
    assert calls and calls[0].name == "get_weather" and isinstance(json.loads(calls[0].arguments)["city"], str)
    with client.responses.stream(model=NAMES[0], input=ASK, tools=[RESPONSES_TOOL], max_output_tokens=60,
                                 tool_choice={"type": "function", "name": "get_weather"}) as stream:
        final = stream.get_final_response()
    streamed = [item for item in final.output if item.type == "function_call"]
    assert streamed and json.loads(streamed[0].arguments)["city"]
    follow_up = ASK + [{"type": "function_call", "call_id": calls[0].call_id, "name": "get_weather",
                        "arguments": calls[0].arguments},
                       {"type": "function_call_output", "call_id": calls[0].call_id, "output": "Sunny, 21 C"}]
    answer = client.responses.create(model=NAMES[0], input=follow_up, tools=[RESPONSES_TOOL], max_output_tokens=16)
    assert answer.status in ("completed", "incomplete") and answer.usage.input_tokens > r.usage.input_tokens


def test_responses_refuses_server_state(http):
    r = http.post("/v1/responses", json={"input": "hi", "previous_response_id": "resp_1"})
    assert r.status_code == 400 and r.json()["error"]["param"] == "previous_response_id"
    assert http.post("/v1/responses", json={"input": []}).status_code == 400


# ---- a template that renders tools itself ------------------------------------------------------------

# The shape of GLM-4.7's template, reduced to what matters here: tools in the system turn, earlier calls
# written back in the kv convention (which needs the arguments as a mapping), and a generation prompt.
GLM_LIKE = (
    "[gMASK]<sop>{% if tools %}<|system|>\n# Tools\n{% for tool in tools %}{{ tool | tojson }}\n{% endfor %}{% endif %}"
    "{% for m in messages %}<|{{ m.role }}|>{{ m.content }}{% for tc in m.tool_calls or [] %}"
    "<tool_call>{{ tc.function.name }}{% for k, v in tc.function.arguments.items() %}<arg_key>{{ k }}</arg_key>"
    "<arg_value>{{ v }}</arg_value>{% endfor %}</tool_call>{% endfor %}{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% endif %}")


@pytest.fixture()
def glm_tokenizer(llm_engine):
    tok = llm_engine.tokenizer
    saved = tok.hf.chat_template
    tok.hf.chat_template = GLM_LIKE
    yield tok
    tok.hf.chat_template = saved


def test_a_tools_template_renders_them_and_a_forced_kv_call_parses(glm_tokenizer, llm_engine):
    from flagdeploy.engine import SamplingParams
    from flagdeploy.server.tools import plan_tools

    plan = plan_tools(glm_tokenizer, [WEATHER], "get_weather")
    assert plan.spec.name == "glm47" and not plan.fallback
    history = ASK + [{"role": "assistant", "content": "", "tool_calls": [
        {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Rome"}'}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "Rain"}, {"role": "user", "content": "And Paris?"}]
    text = glm_tokenizer.apply_chat_template(plan.messages(history), tools=plan.template_tools())
    assert '"name": "get_weather"' in text  # the tools, rendered by the template
    assert "<tool_call>get_weather<arg_key>city</arg_key><arg_value>Rome</arg_value></tool_call>" in text
    params = SamplingParams(max_tokens=40, temperature=0, grammar=plan.grammar(glm_tokenizer))
    out = glm_tokenizer.decode(llm_engine.generate([glm_tokenizer.encode(text)], params)[0])
    content, calls = parse_tool_calls(plan.spec, plan.tools, out)
    assert out.startswith("<tool_call>get_weather<arg_key>city</arg_key><arg_value>")
    assert calls and calls[0].name == "get_weather" and isinstance(json.loads(calls[0].arguments)["city"], str)

"""Tool calls: rendering tools into the prompt, finding calls in the output, forcing them by grammar.

The calling conventions are data (profiles/tool_parsers.yaml). The parser is incremental: the same
code serves streams (deltas as the text arrives: `index` on every tool-call delta, id and name
once, arguments in fragments, which is what LangChain and the OpenAI SDK merge correctly) and
whole answers (one feed, one finish).

`tool_choice` "required" or a named function is enforced, not hoped for: the output is
constrained by a grammar that only admits a call in the model's own convention, with arguments
matching the tool's JSON schema (flagdeploy.engine.grammar).
"""

from __future__ import annotations

import functools
import json
import re
import uuid
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import jinja2
import yaml

from flagdeploy.engine.grammar import GrammarSpec
from flagdeploy.profiles import PROFILES_DIR

if TYPE_CHECKING:
    from flagdeploy.tokenizer import Tokenizer

PARSERS_FILE = PROFILES_DIR / "tool_parsers.yaml"


@dataclass(frozen=True)
class ParserSpec:
    """One calling convention (see the header of tool_parsers.yaml)."""

    name: str
    call_start: str
    call_end: str
    body: str  # "json" or "kv"
    detect: tuple[str, ...] = ()
    name_end: str = "\n"
    pair_end: str = "\n"
    prompt: str | None = None
    call: str | None = None
    tool_result: str | None = None
    source: str = ""


@functools.cache
def _catalog() -> tuple[str, dict[str, ParserSpec]]:
    data = yaml.safe_load(PARSERS_FILE.read_text())
    specs = {name: ParserSpec(name=name, **{**entry, "detect": tuple(entry.get("detect", ()))})
             for name, entry in data["parsers"].items()}
    return data["default"], specs


def get_parser(name: str) -> ParserSpec:
    default, specs = _catalog()
    if name not in specs:
        raise ValueError(f"Unknown tool-call parser {name!r}; known: {', '.join(specs)} (or `auto`).")
    return specs[name]


def detect_parser(chat_template: str | None) -> ParserSpec:
    """The convention a chat template writes tool calls in; the default when it shows none."""
    default, specs = _catalog()
    for spec in specs.values():
        if chat_template and any(marker in chat_template for marker in spec.detect):
            return spec
    return specs[default]


def fallback_parser() -> ParserSpec:
    """For templates that ignore `tools`: the default convention, which carries its own prompt."""
    default, specs = _catalog()
    return specs[default]


def new_call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


# ---- the tools of a request ----------------------------------------------------------------------


@dataclass
class ToolSet:
    """The request's function tools by name (their JSON schemas type the kv convention's values)."""

    functions: dict[str, dict[str, Any]]

    @classmethod
    def from_openai(cls, tools: list[dict[str, Any]] | None) -> "ToolSet":
        functions = {}
        for tool in tools or []:
            fn = tool.get("function") if tool.get("type", "function") == "function" else None
            if isinstance(fn, dict) and isinstance(fn.get("name"), str):
                functions[fn["name"]] = fn
        return cls(functions)

    def schema(self, name: str) -> dict[str, Any]:
        params = self.functions[name].get("parameters")
        return params if isinstance(params, dict) and params else {"type": "object", "properties": {}}

    def call_schema(self, name: str) -> dict[str, Any]:
        """The arguments a forced call may write: the declared parameters and no others, unless the
        schema says otherwise (what OpenAI's strict mode means; without it a small model invents
        extra arguments until max_tokens)."""
        schema = self.schema(name)
        return schema if "additionalProperties" in schema else {**schema, "additionalProperties": False}

    def property_type(self, name: str, key: str) -> Any:
        fn = self.functions.get(name)
        if fn is None:
            return None
        prop = self.schema(name).get("properties", {}).get(key)
        return prop.get("type") if isinstance(prop, dict) else None


# ---- parsing -------------------------------------------------------------------------------------


@dataclass
class ToolCall:
    id: str
    name: str
    arguments: str  # a JSON object, as text


@dataclass
class ToolEvents:
    """What one feed produced: content text, and per call index its header and argument fragments."""

    content: str = ""
    calls: list[dict[str, Any]] = field(default_factory=list)  # OpenAI tool-call deltas, each with index

    def __bool__(self) -> bool:
        return bool(self.content or self.calls)


_NAME = re.compile(r'"name"\s*:\s*"((?:[^"\\]|\\.)*)"')
_ARGS = re.compile(r'"(?:arguments|parameters)"\s*:\s*')
_PAIR = re.compile(r"<arg_key>(.*?)</arg_key>\s*<arg_value>(.*?)</arg_value>", re.DOTALL)


def _json_value_end(text: str, start: int) -> tuple[int, bool]:
    """Scan a JSON object/array from `start`: (index reached, whether it closed)."""
    depth, in_string, escaped = 0, False, False
    for i in range(start, len(text)):
        ch = text[i]
        if in_string:
            if escaped:
                escaped = False
            elif ch == "\\":
                escaped = True
            elif ch == '"':
                in_string = False
        elif ch == '"':
            in_string = True
        elif ch in "{[":
            depth += 1
        elif ch in "}]":
            depth -= 1
            if depth == 0:
                return i + 1, True
    return len(text), False


class _Call:
    """One call being read: its body so far and what has been sent of it."""

    def __init__(self, index: int):
        self.index = index
        self.id = new_call_id()
        self.body = ""
        self.name: str | None = None
        self.args_sent = ""
        self.pairs_done = 0


class ToolParser:
    """Splits model output into content and tool calls, incrementally."""

    def __init__(self, spec: ParserSpec, tools: ToolSet):
        self.spec = spec
        self.tools = tools
        self._pending = ""  # outside a call: text that may be the start of a call tag
        self._call: _Call | None = None
        self.calls: list[ToolCall] = []
        self._after_call = False

    # -- public --

    def feed(self, text: str) -> ToolEvents:
        events = ToolEvents()
        self._pending += text
        while self._pending:
            if self._call is None:
                if not self._outside(events):
                    break
            elif not self._inside(events):
                break
        return events

    def finish(self) -> ToolEvents:
        """End of output: an unclosed call is completed if its body parses, else given back as text."""
        events = ToolEvents()
        if self._call is not None:
            call, self._call = self._call, None
            if not self._close(call, events):
                events.content += self.spec.call_start + call.body
        elif self._pending:
            if not (self._after_call and not self._pending.strip()):
                events.content += self._pending
        self._pending = ""
        return events

    # -- states --

    def _outside(self, events: ToolEvents) -> bool:
        start = self._pending.find(self.spec.call_start)
        if start < 0:
            keep = _partial_suffix(self._pending, self.spec.call_start)
            text, self._pending = self._pending[: len(self._pending) - keep], self._pending[len(self._pending) - keep :]
            self._emit_content(events, text)
            return False
        self._emit_content(events, self._pending[:start])
        self._pending = self._pending[start + len(self.spec.call_start):]
        self._call = _Call(len(self.calls))
        return True

    def _inside(self, events: ToolEvents) -> bool:
        call = self._call
        assert call is not None
        end = self._pending.find(self.spec.call_end)
        if end < 0:
            keep = _partial_suffix(self._pending, self.spec.call_end)
            call.body += self._pending[: len(self._pending) - keep]
            self._pending = self._pending[len(self._pending) - keep:]
            self._progress(call, events)
            return False
        call.body += self._pending[:end]
        self._pending = self._pending[end + len(self.spec.call_end):]
        self._call = None
        if not self._close(call, events):
            events.content += self.spec.call_start + call.body + self.spec.call_end
        return True

    def _emit_content(self, events: ToolEvents, text: str) -> None:
        if self._after_call and not text.strip():
            return  # the separators between and after calls are not an answer
        if text:
            self._after_call = False
        events.content += text

    # -- one call --

    def _begin(self, call: _Call, events: ToolEvents, name: str) -> None:
        call.name = name
        events.calls.append({"index": call.index, "id": call.id, "type": "function",
                             "function": {"name": name, "arguments": ""}})

    def _args(self, call: _Call, events: ToolEvents, fragment: str) -> None:
        if fragment:
            call.args_sent += fragment
            events.calls.append({"index": call.index, "function": {"arguments": fragment}})

    def _progress(self, call: _Call, events: ToolEvents) -> None:
        """Send what is certain so far: the name once known, then argument text as it grows."""
        if self.spec.body == "json":
            if call.name is None:
                m = _NAME.search(call.body)
                if m is None:
                    return
                self._begin(call, events, json.loads(f'"{m.group(1)}"'))
            m = _ARGS.search(call.body)
            if m is not None and call.body[m.end():m.end() + 1] in ("{", "["):
                reached, _ = _json_value_end(call.body, m.end())
                self._args(call, events, call.body[m.end() + len(call.args_sent):reached])
        else:
            if call.name is None:
                cut = [i for i in (call.body.find("<arg_key>"), call.body.find("\n")) if i >= 0]
                if not cut:
                    return
                self._begin(call, events, call.body[: min(cut)].strip())
            pairs = _PAIR.findall(call.body)
            for key, value in pairs[call.pairs_done:]:
                sep = "{" if call.pairs_done == 0 else ", "
                self._args(call, events, f"{sep}{json.dumps(key.strip())}: {self._kv_value(call.name, key.strip(), value)}")
                call.pairs_done += 1

    def _kv_value(self, name: str, key: str, raw: str) -> str:
        """A kv value as JSON: raw text for string parameters, JSON for the rest (text if it is not)."""
        kind = self.tools.property_type(name, key)
        if kind != "string":
            try:
                return json.dumps(json.loads(raw), ensure_ascii=False)
            except json.JSONDecodeError:
                pass
        return json.dumps(raw.strip("\n") if kind == "string" else raw.strip(), ensure_ascii=False)

    def _close(self, call: _Call, events: ToolEvents) -> bool:
        """The call's end tag arrived: complete it, or report that it is not a call after all."""
        if self.spec.body == "json":
            try:
                obj = json.loads(call.body)
            except json.JSONDecodeError:
                return self._give_up(call)
            if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
                return self._give_up(call)
            args = obj.get("arguments", obj.get("parameters", {}))
            if call.name is None:
                self._begin(call, events, obj["name"])
            m = _ARGS.search(call.body)
            raw = call.body[m.end():_json_value_end(call.body, m.end())[0]] if m is not None else ""
            if isinstance(args, str):
                final = args
            elif raw.startswith(call.args_sent) and raw:
                final = raw
            else:
                final = json.dumps(args, ensure_ascii=False)
            if not final.startswith(call.args_sent):  # cannot happen with a well-formed body
                return self._give_up(call)
            self._args(call, events, final[len(call.args_sent):])
        else:
            self._progress(call, events)
            if call.name is None:
                name = call.body.strip()
                if not name:
                    return self._give_up(call)
                self._begin(call, events, name)
            self._args(call, events, "}" if call.pairs_done else "{}")
        self.calls.append(ToolCall(call.id, call.name, call.args_sent))
        self._after_call = True
        return True

    def _give_up(self, call: _Call) -> bool:
        """A call that does not parse (cut off by max_tokens, or malformed): text if nothing of it was
        sent yet; otherwise the call stands with the arguments as sent (a client sees what a stream
        showed, and LangChain files unparseable arguments under invalid_tool_calls)."""
        if call.name is None:
            return False
        self.calls.append(ToolCall(call.id, call.name, call.args_sent))
        self._after_call = True
        return True


def _partial_suffix(text: str, tag: str) -> int:
    """Length of the longest end of `text` that is a beginning of `tag` (held back, maybe a tag)."""
    for n in range(min(len(text), len(tag) - 1), 0, -1):
        if tag.startswith(text[-n:]):
            return n
    return 0


def parse_tool_calls(spec: ParserSpec, tools: ToolSet, text: str) -> tuple[str, list[ToolCall]]:
    """Content and calls of a whole answer."""
    parser = ToolParser(spec, tools)
    events = parser.feed(text)
    content = events.content + parser.finish().content
    return content, parser.calls


# ---- prompt --------------------------------------------------------------------------------------


_env = jinja2.Environment(undefined=jinja2.StrictUndefined)
_env.filters["tojson"] = lambda v: json.dumps(v, ensure_ascii=False)


def template_messages(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Messages for a template that understands tools: HF templates read call arguments as a mapping
    (`arguments | tojson`, `arguments.items()`), OpenAI clients send them as a JSON string."""
    out = []
    for msg in messages:
        calls = msg.get("tool_calls")
        if calls:
            msg = {**msg, "tool_calls": [_call_for_template(c) for c in calls]}
        out.append(msg)
    return out


def _call_for_template(call: dict[str, Any]) -> dict[str, Any]:
    fn = dict(call.get("function") or {})
    args = fn.get("arguments")
    if isinstance(args, str):
        try:
            fn["arguments"] = json.loads(args) if args.strip() else {}
        except json.JSONDecodeError:
            pass
    return {**call, "function": fn}


def fallback_messages(spec: ParserSpec, messages: list[dict[str, Any]], tools: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """For a template that ignores tools: the tool list goes into the system prompt, earlier calls
    into the assistant text and tool answers into user turns, all in the parser's own convention."""
    functions = [t.get("function", t) for t in tools]
    prompt = _env.from_string(spec.prompt or "").render(tools=functions)
    out: list[dict[str, Any]] = []
    for msg in messages:
        role = msg.get("role")
        if role == "tool":
            text = _env.from_string(spec.tool_result or "{{ content }}").render(content=msg.get("content") or "")
            out.append({"role": "user", "content": text})
        elif role == "assistant" and msg.get("tool_calls"):
            calls = [_call_for_template(c)["function"] for c in msg["tool_calls"]]
            rendered = "\n".join(_env.from_string(spec.call or "").render(call=c) for c in calls)
            out.append({"role": "assistant", "content": "\n".join(p for p in (msg.get("content") or "", rendered) if p)})
        else:
            out.append(msg)
    if out and out[0].get("role") == "system":
        out[0] = {**out[0], "content": f"{out[0].get('content') or ''}\n\n{prompt}".strip()}
    else:
        out.insert(0, {"role": "system", "content": prompt})
    return out


# ---- forcing a call ------------------------------------------------------------------------------


def _literal(tokenizer: "Tokenizer", text: str) -> str:
    """A grammar literal for `text`: a special token where the tokenizer has one for it (Qwen's and
    GLM's `<tool_call>`), else the text."""
    if not text:
        return '""'
    ids = tokenizer.encode(text)
    special = set(getattr(tokenizer.hf, "all_special_ids", []) or []) | set(getattr(tokenizer.hf, "added_tokens_decoder", {}) or {})
    if len(ids) == 1 and ids[0] in special:
        return f"<[{ids[0]}]>"
    return json.dumps(text)


def forced_call_grammar(spec: ParserSpec, tools: ToolSet, names: list[str], tokenizer: "Tokenizer") -> GrammarSpec:
    """A grammar that admits exactly one call to one of `names`, in the model's convention."""
    start, end = _literal(tokenizer, spec.call_start), _literal(tokenizer, spec.call_end)
    if spec.body == "json":
        variants = [{"type": "object", "properties": {"name": {"const": n}, "arguments": tools.call_schema(n)},
                     "required": ["name", "arguments"], "additionalProperties": False} for n in names]
        schema = variants[0] if len(variants) == 1 else {"anyOf": variants}
        body = f'"\\n" %json{json.dumps(schema)} "\\n"'
        return GrammarSpec("lark", f"start: {start} {body} {end}\n")
    rules, alts = [], []
    for i, n in enumerate(names):
        schema = tools.schema(n)
        props = schema.get("properties", {}) or {}
        parts = [json.dumps(n), json.dumps(spec.name_end)]
        for key in [k for k in schema.get("required", []) if k in props]:
            if props[key].get("type") == "string":  # raw text up to the closing tag, as long as the schema allows
                limit = props[key].get("maxLength")
                value = f"/[^<]{{0,{int(limit)}}}/" if isinstance(limit, int) else "/[^<]*/"
            else:
                value = f"%json{json.dumps(props[key])}"
            parts += [json.dumps(f"<arg_key>{key}</arg_key>"), json.dumps(spec.pair_end), '"<arg_value>"', value,
                      '"</arg_value>"', json.dumps(spec.pair_end)]
        rules.append(f"call{i}: " + " ".join(p for p in parts if p != '""'))
        alts.append(f"call{i}")
    return GrammarSpec("lark", f"start: {start} ({' | '.join(alts)}) {end}\n" + "\n".join(rules) + "\n")


# ---- one request's use of tools ------------------------------------------------------------------


@dataclass
class ToolPlan:
    """How one request uses its tools: how they reach the prompt, how its output is read, and which
    calls (if any) a grammar forces."""

    spec: ParserSpec
    tools: ToolSet
    definitions: list[dict[str, Any]]  # OpenAI shape: {"type": "function", "function": {...}}
    fallback: bool  # the chat template ignores tools: they go into the system prompt instead
    forced: list[str]  # function names one of which must be called ([]: the model decides)

    def messages(self, messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
        if self.fallback:
            return fallback_messages(self.spec, messages, self.definitions)
        return template_messages(messages)

    def template_tools(self) -> list[dict[str, Any]] | None:
        return None if self.fallback else self.definitions

    def parser(self) -> ToolParser:
        return ToolParser(self.spec, self.tools)

    def grammar(self, tokenizer: "Tokenizer") -> GrammarSpec | None:
        return forced_call_grammar(self.spec, self.tools, self.forced, tokenizer) if self.forced else None


def plan_tools(tokenizer: "Tokenizer", definitions: list[dict[str, Any]] | None, choice: str | None,
               parser: str = "auto") -> ToolPlan | None:
    """None when tools are off for this request (none given, or `tool_choice: "none"`). `choice` is
    "auto", "required", "none", a function name (forced) or None (auto); `parser` a catalog name
    or "auto" (from the chat template). Raises ValueError for a named function that is not among
    the tools."""
    tools = ToolSet.from_openai(definitions)
    if not tools.functions or choice == "none":
        return None
    template = getattr(tokenizer.hf, "chat_template", None) or ""
    fallback = "tools" not in template
    if fallback:
        spec = fallback_parser()
    else:
        spec = detect_parser(template) if parser == "auto" else get_parser(parser)
    if choice in (None, "auto"):
        forced: list[str] = []
    elif choice == "required":
        forced = list(tools.functions)
    elif choice in tools.functions:
        forced = [choice]
    else:
        raise ValueError(f"tool_choice names the function {choice!r}, which is not among the request's tools "
                         f"({', '.join(tools.functions)}).")
    definitions = [{"type": "function", "function": fn} for fn in tools.functions.values()]
    return ToolPlan(spec, tools, definitions, fallback, forced)

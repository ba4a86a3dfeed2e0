"""What the model's text becomes: thinking, the answer's text, and tool calls.

The two splits run in order (a `<think>` section first, then tool calls inside what remains) and the
same object serves a stream (feed each increment) and a whole answer (one feed, then finish), so that
both ways of asking give the same result.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from .reasoning import RequestReasoning
from .tools import ToolCall, ToolParser, ToolPlan, parse_tool_calls


@dataclass
class AnswerDelta:
    thought: str = ""
    content: str = ""
    tool_calls: list[dict[str, Any]] = field(default_factory=list)  # OpenAI deltas, `index` on each

    def __bool__(self) -> bool:
        return bool(self.thought or self.content or self.tool_calls)


class AnswerParser:
    def __init__(self, reasoning: RequestReasoning | None, tools: ToolPlan | None):
        self._reasoning = reasoning.parser() if reasoning is not None else None
        self._tools: ToolParser | None = tools.parser() if tools is not None else None

    def feed(self, text: str, finished: bool = False) -> AnswerDelta:
        thought, content = self._reasoning.feed(text) if self._reasoning is not None else ("", text)
        if finished and self._reasoning is not None:
            more_thought, more_content = self._reasoning.finish()
            thought, content = thought + more_thought, content + more_content
        delta = AnswerDelta(thought=thought)
        if self._tools is None:
            delta.content = content
        else:
            events = self._tools.feed(content)
            if finished:
                tail = self._tools.finish()
                events.content += tail.content
                events.calls += tail.calls
            delta.content, delta.tool_calls = events.content, events.calls
        return delta

    @property
    def calls(self) -> list[ToolCall]:
        return self._tools.calls if self._tools is not None else []


def parse_answer(text: str, reasoning: RequestReasoning | None, tools: ToolPlan | None) -> tuple[str | None, str, list[ToolCall]]:
    """(thinking, or None when there was none, text, tool calls) of a whole answer."""
    thought, content = reasoning.split(text) if reasoning is not None else (None, text)
    if tools is None:
        return thought, content, []
    content, calls = parse_tool_calls(tools.spec, tools.tools, content)
    return thought, content, calls

"""Splitting a reasoning model's output into (reasoning, content).

Reasoning models write their chain of thought between tags (`<think>` … `</think>`); clients want
it apart from the answer: OpenAI-style clients read `reasoning_content` / `reasoning`, Claude Code
reads a `thinking` block. Whether a model thinks is a property of the served model, so the parser
is chosen per model (`serve --reasoning-parser think`) and is off by default.

Styles are data: a new tag pair is one entry in REASONING_PARSERS.

Two cases matter besides the plain one:
- the chat template opened the tag itself (Qwen3, DeepSeek-R1 and GLM templates end the prompt with
  `<think>`), so the output starts inside the reasoning with no start tag: `started=True`;
- streaming: a tag may be split over deltas (`</th` + `ink>`), so text that could still be the
  start of a tag is held back until the next delta decides it, and nothing of a tag ever leaks.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class ReasoningStyle:
    start: str
    end: str


REASONING_PARSERS: dict[str, ReasoningStyle] = {
    "think": ReasoningStyle("<think>", "</think>"),  # DeepSeek-R1, Qwen3, GLM-4.5+, SmolLM3, ...
}


def get_style(name: str | None) -> ReasoningStyle | None:
    """The style called `name`; None (or "none") means the parser is off."""
    if name is None or name == "none":
        return None
    try:
        return REASONING_PARSERS[name]
    except KeyError:
        raise ValueError(f"unknown reasoning parser {name!r}; known: {', '.join(sorted(REASONING_PARSERS))}, "
                         "or none (off)") from None


def prompt_opens_reasoning(prompt: str, style: ReasoningStyle) -> bool:
    """True when the rendered prompt leaves a reasoning section open (the template wrote the start
    tag), so that the generated text begins inside it. A template that disabled thinking writes
    an empty closed pair (`<think></think>`), which is not open."""
    return prompt.rfind(style.start) > prompt.rfind(style.end)


def _held_back(text: str, tag: str) -> int:
    """Length of the longest suffix of `text` that is a proper prefix of `tag` (a tag in progress)."""
    for n in range(min(len(tag) - 1, len(text)), 0, -1):
        if tag.startswith(text[-n:]):
            return n
    return 0


class ReasoningParser:
    """Incremental splitter: `feed` each delta, `finish` at the end; each returns the
    (reasoning, content) text that is now certain. Concatenated, the results equal `split`."""

    def __init__(self, style: ReasoningStyle, started: bool = False):
        self.style = style
        self.state = "reasoning" if started else "begin"  # begin -> reasoning -> content
        self.entered = started  # whether the output has a reasoning section at all
        self.buf = ""
        self.strip_content = False  # drop the blank line(s) the model puts after the end tag

    def feed(self, delta: str) -> tuple[str, str]:
        self.buf += delta
        reasoning = content = ""
        if self.state == "begin":
            head = self.buf.lstrip()
            if head.startswith(self.style.start):
                self.buf, self.state, self.entered = head[len(self.style.start):], "reasoning", True
            elif self.style.start.startswith(head):
                return "", ""  # could still be the start tag (or only whitespace so far)
            else:
                self.state = "content"  # no reasoning section: everything is the answer
        if self.state == "reasoning":
            end = self.buf.find(self.style.end)
            if end < 0:
                keep = _held_back(self.buf, self.style.end)
                reasoning, self.buf = self.buf[:len(self.buf) - keep], self.buf[len(self.buf) - keep:]
                return reasoning, ""
            reasoning, self.buf = self.buf[:end], self.buf[end + len(self.style.end):]
            self.state, self.strip_content = "content", True
        if self.state == "content":
            content, self.buf = self.buf, ""
            if self.strip_content:
                content = content.lstrip()
                self.strip_content = not content
        return reasoning, content

    def finish(self) -> tuple[str, str]:
        """Flush what was held back. Output that ends inside the reasoning (no end tag: the token
        budget ran out while thinking) is all reasoning, as vLLM and SGLang report it."""
        rest, self.buf = self.buf, ""
        if self.state == "reasoning":
            return rest, ""
        if self.state == "begin":  # only whitespace or a partial start tag: that is the answer
            self.state = "content"
            return "", rest
        return "", rest.lstrip() if self.strip_content else rest


def split(text: str, style: ReasoningStyle, started: bool = False) -> tuple[str | None, str]:
    """(reasoning or None when the output has no reasoning section, content) of a whole output."""
    parser = ReasoningParser(style, started)
    r1, c1 = parser.feed(text)
    r2, c2 = parser.finish()
    return (r1 + r2 if parser.entered else None), c1 + c2


@dataclass(frozen=True)
class RequestReasoning:
    """The reasoning split for one request: the model's style, and whether its prompt left the
    reasoning section open."""

    style: ReasoningStyle
    started: bool

    @classmethod
    def for_prompt(cls, style: ReasoningStyle | None, prompt: str) -> "RequestReasoning | None":
        return None if style is None else cls(style, prompt_opens_reasoning(prompt, style))

    def parser(self) -> ReasoningParser:
        return ReasoningParser(self.style, self.started)

    def split(self, text: str) -> tuple[str | None, str]:
        return split(text, self.style, self.started)

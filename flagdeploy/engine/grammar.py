"""Constrained decoding: a grammar per request, a token mask per step, through llguidance.

Structured output (`response_format` json_object / json_schema) and forced tool calls
(`tool_choice` required or named) are the same thing to the engine: the next token must keep the
output inside a grammar. llguidance computes the allowed-token set from the tokenizer's own
vocabulary in about a millisecond per step, so a small model's output parses every time instead of
"usually".

The grammar is compiled once per request on the server (so that a bad schema is a 400 before
anything is queued) and matched per sequence on the engine thread.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Literal

import torch

if TYPE_CHECKING:
    from flagdeploy.tokenizer import Tokenizer

GrammarKind = Literal["json_schema", "regex", "lark"]


class GrammarError(ValueError):
    """The grammar or schema cannot be compiled; the message says what the library rejected."""


@dataclass(frozen=True)
class GrammarSpec:
    """What the output must match: a JSON schema (as a dict), a regular expression or a Lark grammar
    (llguidance's dialect, which can embed JSON schemas with `%json{...}`)."""

    kind: GrammarKind
    value: Any

    def source(self) -> str:
        """The llguidance grammar text."""
        import llguidance

        try:
            if self.kind == "json_schema":
                return llguidance.LLMatcher.grammar_from_json_schema(self.value)
            if self.kind == "regex":
                return llguidance.LLMatcher.grammar_from_regex(self.value)
            return llguidance.LLMatcher.grammar_from_lark(self.value)
        except (ValueError, TypeError, RuntimeError) as exc:
            raise GrammarError(f"the {self.kind.replace('_', ' ')} could not be compiled: {exc}") from None


_lock = threading.Lock()


def ll_tokenizer(tokenizer: "Tokenizer"):
    """llguidance's view of the vocabulary, built once per tokenizer (it takes about half a second)."""
    cached = getattr(tokenizer, "_ll_tokenizer", None)
    if cached is None:
        import llguidance.hf

        with _lock:
            cached = getattr(tokenizer, "_ll_tokenizer", None)
            if cached is None:
                try:
                    cached = llguidance.hf.from_tokenizer(tokenizer.hf)
                except (ValueError, TypeError, AttributeError) as exc:
                    cached = GrammarError(f"this model's tokenizer cannot drive constrained decoding ({exc})")
                tokenizer._ll_tokenizer = cached
    if isinstance(cached, GrammarError):
        raise cached
    return cached


def validate(tokenizer: "Tokenizer", spec: GrammarSpec) -> None:
    """Raise GrammarError for a grammar the matcher would refuse, before the request is queued."""
    import llguidance

    failed, messages = llguidance.LLMatcher.validate_grammar_with_warnings(spec.source(), ll_tokenizer(tokenizer))
    if failed:
        raise GrammarError(f"the {spec.kind.replace('_', ' ')} is not supported: {'; '.join(messages)}")


class Matcher:
    """One sequence's position in its grammar: which tokens may come next, and whether it is over."""

    def __init__(self, tokenizer: "Tokenizer", spec: GrammarSpec):
        import llguidance

        self._ll = ll_tokenizer(tokenizer)
        self._m = llguidance.LLMatcher(self._ll, spec.source())
        if self._m.is_error():
            raise GrammarError(self._m.get_error())

    @property
    def vocab_size(self) -> int:
        return self._ll.vocab_size

    def allowed(self, width: int) -> torch.Tensor:
        """Bool [width]: the tokens that keep the output in the grammar (ids past the tokenizer's
        vocabulary, padding rows of the embedding, are never allowed)."""
        import llguidance.torch as lt

        words = lt.allocate_token_bitmask(1, self._ll.vocab_size)
        lt.fill_next_token_bitmask(self._m, words, 0)
        bits = (words[0].unsqueeze(-1) >> torch.arange(32, dtype=torch.int32)) & 1
        mask = torch.zeros(width, dtype=torch.bool)
        n = min(width, self._ll.vocab_size)
        mask[:n] = bits.flatten()[:n].bool()
        return mask

    def accept(self, token_id: int) -> bool:
        """Advance by the sampled token; False when the grammar refuses it (it cannot, after masking)."""
        return bool(self._m.consume_token(token_id))

    @property
    def stopped(self) -> bool:
        """Nothing but the end can follow: the request is complete."""
        return bool(self._m.is_stopped())

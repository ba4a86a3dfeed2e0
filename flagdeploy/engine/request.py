"""What a request asks of generation, and what the engine hands back as it goes."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from .grammar import GrammarSpec

MAX_LOGPROBS = 20  # OpenAI's bound on top_logprobs
GREEDY_BELOW = 1e-5


@dataclass
class SamplingParams:
    """Per-request decoding settings, in the OpenAI vocabulary.

    temperature 0 means greedy. A seed makes sampling reproducible per request (its own generator),
    independent of whatever else is batched with it.
    """

    max_tokens: int = 256
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # 0: off
    seed: int | None = None
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    logprobs: int | None = None  # None: off; k: the chosen token's logprob and the k most likely
    prompt_logprobs: int | None = None  # the same for every prompt token (perplexity, `echo`)
    grammar: "GrammarSpec | None" = None  # the output must match it (structured output, forced tools)
    # OpenAI's and vLLM's logits adjustments (sampler.adjust_logits), greedy requests included
    presence_penalty: float = 0.0  # minus this for every token already in the output
    frequency_penalty: float = 0.0  # minus this times the token's count in the output
    repetition_penalty: float = 1.0  # tokens of the prompt and output: positive logits / it, negative ones x it
    logit_bias: dict[int, float] = field(default_factory=dict)  # token id -> added to its logit
    min_p: float = 0.0  # sampled only: tokens below min_p x the top probability are dropped
    # prefill-decode disaggregation (engine/kv_transfer.py), vLLM's field: {"do_remote_decode": true} on the
    # prefill request; a prefill instance's answer on the decode request
    kv_transfer_params: dict | None = None

    def __post_init__(self) -> None:
        if self.max_tokens < 1:
            raise ValueError(f"max_tokens must be at least 1, got {self.max_tokens}")
        if self.temperature < 0:
            raise ValueError(f"temperature must be >= 0, got {self.temperature}")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.top_k < 0:
            raise ValueError(f"top_k must be >= 0 (0 turns it off), got {self.top_k}")
        for name in ("presence_penalty", "frequency_penalty"):
            if not -2 <= getattr(self, name) <= 2:
                raise ValueError(f"{name} must be between -2 and 2, got {getattr(self, name)}")
        if not 0 < self.repetition_penalty <= 2:
            raise ValueError(f"repetition_penalty must be in (0, 2] (1 turns it off), got {self.repetition_penalty}")
        if not 0 <= self.min_p <= 1:
            raise ValueError(f"min_p must be between 0 and 1, got {self.min_p}")
        for token, bias in self.logit_bias.items():
            if token < 0 or not -100 <= bias <= 100:
                raise ValueError(f"logit_bias maps token ids (>= 0) to biases between -100 and 100, got {token}: {bias}")
        for name in ("logprobs", "prompt_logprobs"):
            k = getattr(self, name)
            if k is not None and not 0 <= k <= MAX_LOGPROBS:
                raise ValueError(f"{name} must be between 0 and {MAX_LOGPROBS}, got {k}")

    @property
    def adjusts_logits(self) -> bool:
        """Whether the logits are changed before the token is chosen (penalties, logit_bias): row j of a
        verify step would then depend on the drafts before it, so such requests do not speculate."""
        return bool(self.presence_penalty or self.frequency_penalty or self.repetition_penalty != 1.0
                    or self.logit_bias)

    @property
    def greedy(self) -> bool:
        """Temperatures below 1e-5 are greedy (vLLM's epsilon): dividing logits by a denormal makes
        them infinite, and the softmax NaN (found by the schema fuzzer)."""
        return self.temperature < GREEDY_BELOW or self.top_k == 1


@dataclass
class TokenLogprob:
    """A token's log-probability under the model (before temperature, top-p or a grammar mask,
    as vLLM reports it), and the `top` most likely alternatives at that position."""

    token_id: int
    logprob: float
    top: list[tuple[int, float]] = field(default_factory=list)


@dataclass
class RequestOutput:
    """One increment of a request's output.

    `text` is the new text since the previous output (already cut at a stop string); `token_ids`
    are the new tokens. The final output has `finished=True` and a `finish_reason` of
    "stop", "length" or "abort".
    """

    request_id: str
    text: str
    token_ids: list[int]
    finished: bool
    finish_reason: str | None
    num_prompt_tokens: int
    num_output_tokens: int
    num_cached_tokens: int = 0
    logprobs: list[TokenLogprob] | None = None  # one per entry of token_ids, when asked for
    prompt_logprobs: list[TokenLogprob | None] | None = None  # first output only; None for token 0
    scheduled_at: float | None = None  # time.perf_counter() when the request was first scheduled
    kv_transfer_params: dict | None = None  # final output of a prefill for a remote decode: where its caches are

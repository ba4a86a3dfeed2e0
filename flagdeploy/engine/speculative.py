"""Speculative decoding: what proposes draft tokens, and how the engine is told to use them.

The shape (docs/speculative.md, DESIGN.md "Where the next capabilities live"):

- a *proposer* drafts up to K tokens per decoding sequence before a step (`Proposer.propose`): the prompt
  lookup (`ngram`) proposer here costs no weights; a model's own MTP layer (`engine/mtp.py`) drafts from
  the target's hidden states; the engine picks one (`llm_engine.build_proposer`);
- the *scheduler* only learns that a sequence may advance by 1 + k tokens in a step (the verify rows count
  in the token budget; drafts are dropped, never preempting anything, when budget or blocks are short);
- the *runner* computes the 1 + k positions as decode rows of the same sequence and returns logits for
  each; the *engine* accepts the longest prefix of the drafts that agrees with the target's greedy choice
  (sampled requests: by rejection sampling, `engine/rejection.py`) and appends the target's own token after;
- *rollback* is owned by the caches: paged KV slots of rejected drafts are overwritten next step and the
  blocks taken only for them go back to the pool (`BlockManager.trim`); drafts never enter
  `Sequence.token_ids` before they are accepted, so the prefix cache never hashes a rejected token. A
  linear-attention state keeps one row per draft position and the next step starts from the row of the
  last accepted token (`SequenceStateRunner`).
"""

from __future__ import annotations

import json
from dataclasses import dataclass, fields

import numpy as np

METHODS = ("off", "ngram", "mtp")
# vLLM's spellings of a model's own draft layer: all of them mean "the checkpoint's MTP layer" here
_MTP_ALIASES = {"mtp", "deepseek_mtp", "glm5_next_mtp", "glm4_moe_mtp", "nextn", "eagle_mtp"}


@dataclass
class SpeculativeConfig:
    """How a replica speculates. `num_speculative_tokens` is K, the most drafts verified per sequence and
    step. `prompt_lookup_min/max` are the n-gram sizes the `ngram` proposer matches (vLLM's names; when
    neither is given both are 5, vLLM's default; when one is given the other takes its value).
    `max_batch_rows`: drafts are only added while a step's decode rows (1 + k per speculating sequence,
    1 per other one) stay at or below it. Speculation pays in small batches; and on the CPU backend a step
    of at most 16 rows keeps every int4 linear in the packed kernel a plain decode row of a small batch
    uses (backends/cpu/tune.yaml packed_max_m), so verify rows are computed by the same kernel."""

    method: str = "off"
    num_speculative_tokens: int = 3
    prompt_lookup_min: int | None = None
    prompt_lookup_max: int | None = None
    max_batch_rows: int = 16

    def __post_init__(self) -> None:
        method = (self.method or "off").lower()
        if method in _MTP_ALIASES:
            method = "mtp"
        if method not in METHODS:
            raise ValueError(f"speculative method must be one of {', '.join(METHODS)} (got {self.method!r})")
        self.method = method
        if self.method != "off" and not 1 <= self.num_speculative_tokens <= 15:
            raise ValueError(f"num_speculative_tokens must be between 1 and 15 (got {self.num_speculative_tokens})")
        lo, hi = self.prompt_lookup_min, self.prompt_lookup_max
        if lo is None and hi is None:
            lo = hi = 5
        elif lo is None:
            lo = hi
        elif hi is None:
            hi = lo
        if not 1 <= lo <= hi:
            raise ValueError(f"need 1 <= prompt_lookup_min <= prompt_lookup_max (got {lo}, {hi})")
        self.prompt_lookup_min, self.prompt_lookup_max = lo, hi
        if self.max_batch_rows < 2:
            raise ValueError(f"max_batch_rows must be at least 2 (got {self.max_batch_rows})")

    @property
    def enabled(self) -> bool:
        return self.method != "off"

    @classmethod
    def parse(cls, method: str | None = None, num_tokens: int | None = None, config_json: str | None = None
              ) -> SpeculativeConfig:
        """From the CLI: `--speculative off|ngram|mtp`, `--num-speculative-tokens K`, and/or vLLM's
        `--speculative-config '{"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 4}'`.
        Explicit flags win over the JSON's fields; keys we do not use are refused by name."""
        args: dict = {}
        if config_json:
            try:
                data = json.loads(config_json)
            except json.JSONDecodeError as e:
                raise ValueError(f"--speculative-config is not valid JSON: {e}") from None
            if not isinstance(data, dict):
                raise ValueError("--speculative-config must be a JSON object, e.g. "
                                 '\'{"method": "ngram", "num_speculative_tokens": 3}\'')
            known = {f.name for f in fields(cls)}
            unknown = sorted(set(data) - known)
            if unknown:
                raise ValueError(f"--speculative-config: unsupported key(s) {', '.join(unknown)}; "
                                 f"supported: {', '.join(sorted(known))}")
            args.update(data)
        if method is not None:
            args["method"] = method
        elif num_tokens is not None and "method" not in args:
            raise ValueError("--num-speculative-tokens needs a method: add --speculative ngram")
        if num_tokens is not None:
            args["num_speculative_tokens"] = num_tokens
        return cls(**args)

    def as_json(self) -> str:
        """The vLLM spelling of this config (what a builtin replica is started with)."""
        return json.dumps({f.name: getattr(self, f.name) for f in fields(self)}, separators=(",", ":"))


class Proposer:
    """Drafts tokens for decoding sequences. `propose` gets the sequences and the most drafts each may have
    (k_i >= 1) and returns a list of at most k_i token ids per sequence (empty: no draft this step).
    `release` forgets a sequence (finished, aborted). A model-based proposer (MTP) drafts from the target's
    final hidden states: it sets `needs_hidden` and the engine hands them over through `observe`."""

    needs_hidden = False  # whether `observe` wants the target's final hidden states (a model-based proposer)

    def propose(self, seqs: list, limits: list[int]) -> list[list[int]]:
        raise NotImplementedError

    def observe(self, seq, start: int, hidden) -> None:
        """After a step (only when `needs_hidden`): the target's final hidden states [n, H] of positions
        start..start+n-1 of `seq`, now final (accepted). start == 0: the sequence (re)starts from scratch."""

    def release(self, seq) -> None:
        """A sequence left the engine."""

    # prefill-decode disaggregation: what the proposer holds per sequence beyond the token ids, handed from a
    # prefill instance to a decode one (engine/kv_transfer.py); nothing, for a proposer that drafts from tokens
    def export_state(self, seq) -> tuple[list, dict]:
        return [], {}

    def state_shapes(self, meta: dict) -> list:
        return []

    def import_state(self, seq, tensors: list, meta: dict) -> None:
        """Take what `export_state` gave on the prefill instance."""


class NgramProposer(Proposer):
    """Prompt lookup: find the most recent earlier occurrence of the sequence's last n tokens (prompt and
    output), longest n first from `prompt_lookup_max` down to `prompt_lookup_min`, and draft the tokens that
    followed it. Vectorised over the whole history with numpy: one comparison per n-gram position, so a 4k
    context costs some tens of microseconds; the token array is kept per sequence and only extended."""

    def __init__(self, nmin: int, nmax: int):
        self.nmin, self.nmax = nmin, nmax

    def propose(self, seqs: list, limits: list[int]) -> list[list[int]]:
        return [self.lookup(self._tokens(seq), k) for seq, k in zip(seqs, limits)]

    def _tokens(self, seq) -> np.ndarray:
        buf, n = seq.draft_state if seq.draft_state is not None else (np.empty(0, dtype=np.int64), 0)
        total = seq.num_tokens
        if total > buf.shape[0]:
            grown = np.empty(max(2 * buf.shape[0], total + 64), dtype=np.int64)
            grown[:n] = buf[:n]
            buf = grown
        if total > n:
            buf[n:total] = seq.token_ids[n:total]
        seq.draft_state = (buf, total)
        return buf[:total]

    def lookup(self, t: np.ndarray, k: int) -> list[int]:
        """Drafts for token array `t`: at most `k` tokens, empty when no n-gram of the allowed sizes recurs."""
        last = t.shape[0] - 1
        if k <= 0 or last < self.nmin:
            return []
        # ends[e]: the `length` tokens ending at e (e < last) equal the last `length` tokens of t
        ends = t[:last] == t[last]
        length, best = 1, -1
        while True:
            hits = np.flatnonzero(ends)
            if not hits.size:
                break
            if length >= self.nmin:
                best = int(hits[-1])  # the longest match so far; its most recent occurrence
            if length == self.nmax or length >= last:
                break
            nxt = np.zeros_like(ends)  # one token longer: t[e - length] must equal t[last - length]
            nxt[length:] = ends[length:] & (t[: last - length] == t[last - length])
            ends, length = nxt, length + 1
        if best < 0:
            return []
        return t[best + 1 : best + 1 + k].tolist()

"""Speculative decoding as the server counts it: acceptance length and acceptance rates from /metrics.

A client cannot see how many tokens a verify step accepted (a stream chunk may carry several tokens for
other reasons), so the numbers come from the server's own counters, read before and after a run:

- ours and vLLM (v1) count, as Prometheus counters (`_total` samples):
  `<prefix>spec_decode_num_drafts` (verify steps of a sequence that had a draft),
  `<prefix>spec_decode_num_draft_tokens`, `<prefix>spec_decode_num_accepted_tokens`, and
  `<prefix>spec_decode_num_accepted_tokens_per_pos{position="i"}`, with prefix `flagdeploy:` or `vllm:`.
  From the deltas: mean acceptance length = 1 + accepted / drafts (tokens a sequence gains per verify
  step, the bonus token included), draft acceptance rate = accepted / draft tokens, and the acceptance
  rate at position i = accepted at i / drafts (vLLM's definitions). Labels such as `model_name` or
  `engine` (data-parallel ranks) are summed away.
- SGLang exposes gauges instead, `sglang:spec_accept_length` and `sglang:spec_accept_rate`, computed by
  the server over its own recent window: they are reported as read after the run (the mean over label
  sets, e.g. several data-parallel ranks), not as a delta.

The counters are server-wide: other traffic to the same server during the run is counted too.
A server without /metrics, or without any of these names, gives None and the reports leave the
speculation rows out.
"""

from __future__ import annotations

import logging
from dataclasses import asdict, dataclass, field

from prometheus_client.parser import text_string_to_metric_families

from flagdeploy.bench.client import Endpoint

log = logging.getLogger(__name__)

COUNTER_ENGINES = (("flagdeploy", "flagdeploy:"), ("vllm", "vllm:"))
DRAFTS = "spec_decode_num_drafts"
DRAFT_TOKENS = "spec_decode_num_draft_tokens"
ACCEPTED = "spec_decode_num_accepted_tokens"
PER_POS = "spec_decode_num_accepted_tokens_per_pos"
SGLANG_LENGTH = "sglang:spec_accept_length"
SGLANG_RATE = "sglang:spec_accept_rate"


@dataclass
class SpecScrape:
    """The speculation samples of one /metrics read. Counter names lose `_total`; `_created` samples
    (prometheus_client's creation timestamps) are dropped."""

    counters: dict[str, float] = field(default_factory=dict)  # e.g. "vllm:spec_decode_num_drafts" -> sum
    per_pos: dict[str, dict[int, float]] = field(default_factory=dict)  # counter name -> position -> sum
    gauges: dict[str, list[float]] = field(default_factory=dict)  # SGLang gauge name -> one value per label set


@dataclass
class SpecStats:
    """Speculative decoding over one measured stretch of load."""

    engine: str  # whose names were found: flagdeploy, vllm, sglang
    source: str  # "counters" (deltas over the run) or "gauges" (the server's own window, read after the run)
    drafts: float | None = None
    draft_tokens: float | None = None
    accepted_tokens: float | None = None
    acceptance_length: float | None = None  # mean tokens per verify step: 1 + accepted / drafts
    acceptance_rate: float | None = None  # accepted / draft tokens
    per_position: list[float] | None = None  # acceptance rate at draft position 0, 1, ...

    def to_dict(self) -> dict:
        return asdict(self)

    def describe(self) -> str:
        """One line for the terminal."""
        if self.source == "gauges":
            return (f"acceptance length {_num(self.acceptance_length, '.2f')}, acceptance rate "
                    f"{_pct(self.acceptance_rate)} (SGLang's gauges, read after the run)")
        if not self.drafts:
            return (f"no drafts during the run ({self.engine} counters did not move: speculation off, or nothing "
                    "to draft)")
        line = (f"acceptance length {_num(self.acceptance_length, '.2f')}, draft acceptance rate "
                f"{_pct(self.acceptance_rate)} ({self.drafts:g} drafts, {_num(self.draft_tokens, 'g')} draft tokens, "
                f"{_num(self.accepted_tokens, 'g')} accepted)")
        if self.per_position:
            line += "; per position: " + " ".join(f"{r:.2f}" for r in self.per_position)
        return line


def _num(v: float | None, spec: str) -> str:
    return "-" if v is None else format(v, spec)


def _pct(v: float | None) -> str:
    return "-" if v is None else f"{100 * v:.1f}%"


def _tracked(name: str) -> bool:
    return name in (SGLANG_LENGTH, SGLANG_RATE) or any(name.startswith(prefix + "spec_decode_num_")
                                                      for _, prefix in COUNTER_ENGINES)


def parse_spec(text: str) -> SpecScrape:
    """The speculation samples of a Prometheus text exposition (prometheus_client's parser). Raises
    ValueError on text that is not the exposition format."""
    out = SpecScrape()
    for family in text_string_to_metric_families(text):
        if not _tracked(family.name):
            continue
        for s in family.samples:
            if s.name.endswith("_created"):
                continue
            if s.name in (SGLANG_LENGTH, SGLANG_RATE):
                out.gauges.setdefault(s.name, []).append(s.value)
                continue
            name = s.name.removesuffix("_total")
            if name.endswith(PER_POS):
                try:
                    pos = int(s.labels.get("position", ""))
                except ValueError:
                    continue
                by_pos = out.per_pos.setdefault(name, {})
                by_pos[pos] = by_pos.get(pos, 0.0) + s.value
            elif name.endswith((DRAFTS, DRAFT_TOKENS, ACCEPTED)):
                out.counters[name] = out.counters.get(name, 0.0) + s.value
    return out


def read_spec(ep: Endpoint) -> SpecScrape | None:
    """One /metrics read; None when the server has no readable /metrics."""
    text = ep.metrics_text()
    if text is None:
        return None
    try:
        return parse_spec(text)
    except ValueError as exc:
        log.warning("cannot parse %s/metrics: %s", ep.root, exc)
        return None


def spec_stats(before: SpecScrape | None, after: SpecScrape | None) -> SpecStats | None:
    """Speculation between two reads; None when either read failed, or the server exposes none of the
    known names, or a counter went down (the server restarted between the reads)."""
    if before is None or after is None:
        return None
    for engine, prefix in COUNTER_ENGINES:
        names = {k: prefix + k for k in (DRAFTS, DRAFT_TOKENS, ACCEPTED)}
        if not any(n in after.counters for n in names.values()):
            continue
        delta: dict[str, float | None] = {}
        for key, name in names.items():
            if name not in after.counters:
                delta[key] = None
                continue
            delta[key] = after.counters[name] - before.counters.get(name, 0.0)  # absent before: not yet counted
            if delta[key] < 0:
                log.warning("%s went down between the reads (server restarted?): no speculation numbers", name)
                return None
        drafts, draft_tokens, accepted = delta[DRAFTS], delta[DRAFT_TOKENS], delta[ACCEPTED]
        st = SpecStats(engine=engine, source="counters", drafts=drafts, draft_tokens=draft_tokens,
                       accepted_tokens=accepted)
        if drafts and accepted is not None:
            st.acceptance_length = 1 + accepted / drafts
        if draft_tokens and accepted is not None:
            st.acceptance_rate = accepted / draft_tokens
        pos_after = after.per_pos.get(prefix + PER_POS)
        if drafts and pos_after:
            pos_before = before.per_pos.get(prefix + PER_POS, {})
            st.per_position = [(pos_after.get(i, 0.0) - pos_before.get(i, 0.0)) / drafts
                               for i in range(max(pos_after) + 1)]
        return st
    if SGLANG_LENGTH in after.gauges or SGLANG_RATE in after.gauges:
        def last(name: str) -> float | None:
            vals = after.gauges.get(name)
            return sum(vals) / len(vals) if vals else None

        return SpecStats(engine="sglang", source="gauges", acceptance_length=last(SGLANG_LENGTH),
                         acceptance_rate=last(SGLANG_RATE))
    return None

"""`bench ab`: the same load against two endpoints, one table side by side with the B/A ratio.

For speculative decoding (MTP off / on, ngram vs MTP, k=1 vs k=3) and any other one-variable change:
the prompts, their order, the seed and the arrivals are identical on both sides (the `bench serve`
load generator runs twice), so the ratio column shows what the one change did. The numbers of each
side are the `bench serve` summary (median of the rounds after warm-up), and the acceptance rows
come from each server's /metrics (`specdecode`).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from flagdeploy.bench.report import UNSTEADY


@dataclass(frozen=True)
class Row:
    key: str  # the name in the JSON ratios
    label: str
    kind: str  # "ms", "rate" (tokens/s, requests/s), "len", "pct", "count"
    get: Callable[[dict], float | None]


def _spec(field: str) -> Callable[[dict], float | None]:
    return lambda s: (s.get("speculative") or {}).get(field)


def _pos(i: int) -> Callable[[dict], float | None]:
    def get(s: dict) -> float | None:
        per = (s.get("speculative") or {}).get("per_position") or []
        return per[i] if i < len(per) else None
    return get


SPEC_ROWS = (Row("acceptance_length", "acceptance length", "len", _spec("acceptance_length")),
             Row("acceptance_rate", "draft acceptance rate", "pct", _spec("acceptance_rate")))
SERVE_ROWS = (
    Row("ttft_mean", "TTFT mean (ms)", "ms", lambda s: s.get("ttft_mean")),
    Row("ttft_p99", "TTFT P99 (ms)", "ms", lambda s: s.get("ttft_p99")),
    Row("tpot_mean", "TPOT mean (ms)", "ms", lambda s: s.get("tpot_mean")),
    Row("tpot_p99", "TPOT P99 (ms)", "ms", lambda s: s.get("tpot_p99")),
    Row("output_throughput", "output tokens/s", "rate", lambda s: s.get("output_throughput")),
    Row("request_throughput", "requests/s", "rate", lambda s: s.get("request_throughput")),
    Row("e2e_p99", "E2E P99 (ms)", "ms", lambda s: s.get("e2e_p99")),
)
ERRORS = Row("errors", "errors", "count", lambda s: s.get("errors"))


def rows_for(a: dict | None, b: dict | None) -> list[Row]:
    """The rows of one concurrency: the speculation rows only where either side's server reported a value."""
    sides = [s for s in (a, b) if s]
    rows = [r for r in SPEC_ROWS if any(r.get(s) is not None for s in sides)]
    positions = max((len((s.get("speculative") or {}).get("per_position") or []) for s in sides), default=0)
    rows += [Row(f"acceptance_pos{i}", f"  accepted at position {i}", "pct", _pos(i)) for i in range(positions)]
    return rows + list(SERVE_ROWS) + [ERRORS]


def ratio(a: float | None, b: float | None) -> float | None:
    return b / a if a is not None and b is not None and a != 0 else None


def compare(summaries_a: list[dict], summaries_b: list[dict]) -> list[dict]:
    """B/A of every row, per concurrency measured on both sides (errors: none, they are counts)."""
    by_b = {s["concurrency"]: s for s in summaries_b}
    out = []
    for a in summaries_a:
        b = by_b.get(a["concurrency"])
        if b is None:
            continue
        entry: dict[str, object] = {"concurrency": a["concurrency"]}
        for row in rows_for(a, b):
            if row.kind != "count":
                entry[row.key] = ratio(row.get(a), row.get(b))
        out.append(entry)
    return out


def _cell(row: Row, v: float | None) -> str:
    if v is None:
        return "-"
    if row.kind == "ms":
        return f"{v * 1000:.1f}"
    if row.kind == "pct":
        return f"{100 * v:.1f}%"
    if row.kind == "len":
        return f"{v:.2f}"
    if row.kind == "count":
        return f"{v:g}"
    return f"{v:.2f}" if v < 100 else f"{v:.1f}"


def format_ab(side_a: dict, side_b: dict, concurrencies: list[int]) -> str:
    """The side-by-side table. `side_x`: {"label", "base_url", "model", "summary": [...]}."""
    la, lb = (side["label"] if side["label"] == name else f"{side['label']} ({name})"
              for side, name in ((side_a, "A"), (side_b, "B")))
    w = max(len(la), len(lb), 10)
    lines = [f"A = {side_a['label']}: {side_a['base_url']} (model {side_a['model']})",
             f"B = {side_b['label']}: {side_b['base_url']} (model {side_b['model']})",
             "same prompts, order, seed and arrivals on both; median of the rounds after warm-up"]
    sa = {s["concurrency"]: s for s in side_a["summary"]}
    sb = {s["concurrency"]: s for s in side_b["summary"]}
    for c in concurrencies:
        a, b = sa.get(c), sb.get(c)
        if a is None and b is None:
            continue
        lines += ["", f"{'concurrency ' + str(c):<26} {la:>{w}} {lb:>{w}} {'B/A':>8}"]
        for row in rows_for(a, b):
            va = row.get(a) if a else None
            vb = row.get(b) if b else None
            r = ratio(va, vb) if row.kind != "count" else None
            lines.append(f"{row.label:<26} {_cell(row, va):>{w}} {_cell(row, vb):>{w}} "
                         f"{'-' if r is None else f'{r:.3f}x':>8}")
        for name, s in (("A", a), ("B", b)):
            if s is None:
                lines.append(f"  ({name} has no finished round at this concurrency)")
                continue
            if s.get("from_warmup"):
                lines.append(f"  ({name}: warm-up round only; use --rounds 3 or more)")
            spread = s.get("throughput_spread") or 1
            if spread > UNSTEADY:
                lines.append(f"  ({name}: rounds differ {spread:.1f}x in throughput: unsteady, add rounds)")
            spec = s.get("speculative")
            if spec and spec.get("source") == "counters" and not spec.get("drafts"):
                lines.append(f"  ({name}: the server's speculation counters did not move: no drafts)")
    lines += ["", ("B/A: below 1 is lower for B (better for latencies), above 1 higher for B (better for "
                   "throughput and acceptance)")]
    return "\n".join(lines)

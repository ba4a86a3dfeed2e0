"""What a benchmark leaves behind: a terminal table, CSV files, a JSON summary and PNG plots.

Every file is written to a temporary name and renamed into place, so an interrupted run or a full disk
never leaves a half-written CSV that a later script would read as complete.
"""

from __future__ import annotations

import csv
import io
import json
import logging
import os
import uuid
from pathlib import Path

from flagdeploy.bench.specdecode import SpecStats
from flagdeploy.bench.stats import RequestRecord, RoundStats

log = logging.getLogger(__name__)

UNSTEADY = 1.5  # measured rounds whose output throughput differs more than this are flagged in the table


def atomic_write(path: str | Path, data: str | bytes) -> Path:
    """Write `data` to `path` through a temporary file in the same directory, then rename."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.{uuid.uuid4().hex[:8]}.tmp")  # same filesystem: rename is atomic
    try:
        with open(tmp, "xb") as f:  # not mkstemp: that would make the file 0600 instead of honouring umask
            f.write(data.encode("utf-8") if isinstance(data, str) else data)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    return path


def write_json(path: str | Path, obj: object) -> Path:
    return atomic_write(path, json.dumps(obj, indent=2, default=str) + "\n")


def _csv_text(rows: list[dict]) -> str:
    buf = io.StringIO()
    if rows:
        w = csv.DictWriter(buf, fieldnames=list(rows[0]))
        w.writeheader()
        w.writerows(rows)
    return buf.getvalue()


def request_row(r: RequestRecord) -> dict:
    return {"concurrency": r.concurrency, "round": r.round, "index": r.index, "ok": r.ok, "error": r.error or "",
            "prompt_tokens": r.prompt_tokens, "output_tokens": r.output_tokens, "chunks": len(r.chunk_times),
            "ttft_s": r.ttft, "tpot_s": r.tpot, "e2e_s": r.e2e,
            "itl_mean_s": (sum(r.itl) / len(r.itl)) if r.itl else None}


def _ms(v: float | None) -> str:
    return "-" if v is None else f"{v * 1000:.1f}"


def format_table(summaries: list[dict], rounds: list[RoundStats]) -> str:
    """The terminal table: one line per concurrency (median of measured rounds), warm-up rounds apart."""
    head = (f"{'conc':>5} {'req/s':>7} {'out tok/s':>10} {'TTFT p50':>9} {'p90':>8} {'p99':>8} {'TPOT p50':>9} "
            f"{'p90':>8} {'p99':>8} {'ITL p50':>8} {'E2E p50':>9} {'p99':>9} {'err':>4}")
    lines = ["summary: median of the rounds after warm-up (latencies in ms)", head]
    for s in summaries:
        lines.append(f"{s['concurrency']:>5} {s['request_throughput'] or 0:>7.2f} {s['output_throughput'] or 0:>10.1f} "
                     f"{_ms(s['ttft_p50']):>9} {_ms(s['ttft_p90']):>8} {_ms(s['ttft_p99']):>8} {_ms(s['tpot_p50']):>9} "
                     f"{_ms(s['tpot_p90']):>8} {_ms(s['tpot_p99']):>8} {_ms(s['itl_p50']):>8} {_ms(s['e2e_p50']):>9} "
                     f"{_ms(s['e2e_p99']):>9} {s['errors']:>4}" + ("  (warm-up only)" if s.get("from_warmup") else "")
                     + (f"  (rounds differ {s['throughput_spread']:.1f}x: unsteady, add rounds)"
                        if (s.get("throughput_spread") or 1) > UNSTEADY else ""))
    warm = [r for r in rounds if r.warmup]
    if warm:
        lines.append("warm-up rounds (not in the summary):")
        for r in warm:
            lines.append(f"{r.concurrency:>5} {r.request_throughput:>7.2f} {r.output_throughput:>10.1f} "
                         f"{_ms(r.ttft['p50']):>9} {_ms(r.ttft['p90']):>8} {_ms(r.ttft['p99']):>8} "
                         f"{_ms(r.tpot['p50']):>9} {_ms(r.tpot['p90']):>8} {_ms(r.tpot['p99']):>8} "
                         f"{_ms(r.itl['p50']):>8} {_ms(r.e2e['p50']):>9} {_ms(r.e2e['p99']):>9} {r.errors:>4}")
    lines += format_speculative(summaries)
    return "\n".join(lines)


def format_speculative(summaries: list[dict]) -> list[str]:
    """Speculative decoding per concurrency, as the server's /metrics counted it; no lines at all when the
    server exposes none of the known metrics (docs/bench.md)."""
    # counters that did not move (ours exposes them with speculation off) say nothing worth a line here;
    # summary.json keeps them, and `bench ab` notes them
    rows = [s for s in summaries if (spec := s.get("speculative")) and (spec["source"] == "gauges" or spec["drafts"])]
    if not rows:
        return []
    engines = sorted({s["speculative"]["engine"] for s in rows})
    lines = [f"speculative decoding (the server's /metrics, {', '.join(engines)}; over the rounds of the summary):"]
    for s in rows:
        lines.append(f"{s['concurrency']:>5} {SpecStats(**s['speculative']).describe()}")
    return lines


def write_serve_outputs(out_dir: Path, *, config: dict, rounds: list[RoundStats], records: list[RequestRecord],
                        summaries: list[dict], interrupted: bool, plots: bool = True) -> dict[str, Path]:
    """rounds.csv (one row per concurrency x round), requests.csv (one row per request), summary.json,
    and the plots. Returns the paths written."""
    out_dir.mkdir(parents=True, exist_ok=True)
    paths = {
        "rounds_csv": atomic_write(out_dir / "rounds.csv", _csv_text([r.flat() for r in rounds])),
        "requests_csv": atomic_write(out_dir / "requests.csv", _csv_text([request_row(r) for r in records])),
    }
    errors = sorted({r.error for r in records if r.error})
    paths["summary_json"] = write_json(out_dir / "summary.json", {
        "config": config, "interrupted": interrupted, "summary": summaries,
        "warmup": [r.flat() for r in rounds if r.warmup], "rounds": [r.flat() for r in rounds],
        "error_messages": errors[:20]})
    if plots and summaries:
        paths.update(plot_serve(out_dir, summaries))
    return paths


def _save_figure(fig, path: Path) -> Path:
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=110, bbox_inches="tight")
    return atomic_write(path, buf.getvalue())


def plot_serve(out_dir: Path, summaries: list[dict]) -> dict[str, Path]:
    """throughput.png (output tok/s and req/s vs concurrency) and latency.png (TTFT and TPOT P50/P90/P99
    vs concurrency), from the summaries (medians of measured rounds)."""
    import matplotlib

    matplotlib.use("Agg")  # no display needed; safe on servers and in CI
    import matplotlib.pyplot as plt

    xs = [s["concurrency"] for s in summaries]
    fig, ax = plt.subplots(figsize=(6.4, 4.2))
    ax.plot(xs, [s["output_throughput"] or 0 for s in summaries], "o-", label="output tokens/s")
    ax.set_xlabel("concurrency")
    ax.set_ylabel("output tokens/s")
    ax.set_xscale("log", base=2)
    ax.set_xticks(xs, [str(x) for x in xs])
    ax2 = ax.twinx()
    ax2.plot(xs, [s["request_throughput"] or 0 for s in summaries], "s--", color="tab:orange", label="requests/s")
    ax2.set_ylabel("requests/s")
    ax.set_title("Throughput vs concurrency (median of measured rounds)")
    ax.legend(handles=ax.get_lines() + ax2.get_lines(), loc="upper left")
    ax.grid(True, alpha=0.3)
    out = {"throughput_png": _save_figure(fig, out_dir / "throughput.png")}
    plt.close(fig)

    fig, axes = plt.subplots(1, 2, figsize=(11, 4.2))
    for ax, metric, title in ((axes[0], "ttft", "TTFT"), (axes[1], "tpot", "TPOT")):
        for q, style in (("p50", "o-"), ("p90", "s--"), ("p99", "^:")):
            ys = [(s[f"{metric}_{q}"] or float("nan")) * 1000 for s in summaries]
            ax.plot(xs, ys, style, label=q.upper())
        ax.set_xscale("log", base=2)
        ax.set_xticks(xs, [str(x) for x in xs])
        ax.set_xlabel("concurrency")
        ax.set_ylabel(f"{title} (ms)")
        ax.set_title(f"{title} percentiles vs concurrency")
        ax.grid(True, alpha=0.3)
        ax.legend()
    out["latency_png"] = _save_figure(fig, out_dir / "latency.png")
    plt.close(fig)
    return out

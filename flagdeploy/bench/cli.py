"""`flagdeploy bench ...` and `flagdeploy eval ...`: the click groups (registered by flagdeploy/cli.py).

Each command checks the endpoint (reachable, lists the model, streams where it matters) before any
load, and treats Ctrl-C as "stop and keep what was measured": the partial results are written and the
command exits 130.
"""

from __future__ import annotations

import asyncio
import logging
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import click
import httpx

from flagdeploy.bench.client import BenchError, Endpoint

log = logging.getLogger(__name__)


def _fail(message: str) -> None:
    click.echo(f"error: {message}", err=True)
    sys.exit(1)


def _why(exc: Exception) -> str:
    """A BenchError says it all; a transport error mid-run gets its kind named (a bare timeout's text is empty)."""
    if isinstance(exc, BenchError):
        return str(exc)
    return f"the server stopped answering: {exc.__class__.__name__}: {exc or 'no details'}"


def _int_list(text: str) -> list[int]:
    try:
        vals = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise click.BadParameter(f"{text!r} is not a comma-separated list of integers, e.g. 1,4,8") from None
    if not vals or any(v < 1 for v in vals):
        raise click.BadParameter(f"{text!r}: give one or more positive integers, e.g. 1,4,8")
    return vals


def _client_options(f):
    """The options of every command but the endpoint URL(s)."""
    f = click.option("--log-level", default="warning", show_default=True,
                     type=click.Choice(["debug", "info", "warning", "error"]))(f)
    f = click.option("--progress/--no-progress", default=None,
                     help="Progress bars (default: only on a terminal).")(f)
    f = click.option("--api-key", default=None, envvar="FLAGDEPLOY_API_KEY", help="Bearer key, if the server wants one.")(f)
    f = click.option("--model", default=None,
                     help="Served model name (default: the first one /v1/models lists).")(f)
    return f


def _endpoint_options(f):
    f = _client_options(f)
    f = click.option("--base-url", default="http://127.0.0.1:8000", show_default=True, envvar="FLAGDEPLOY_BASE_URL",
                     help="OpenAI-compatible server, with or without /v1 (ours, vLLM, SGLang, vLLM-Ascend, MindIE).")(f)
    return f


def _connect(base_url: str, model: str | None, api_key: str | None, log_level: str, *,
             stream_check: tuple[str, dict] | None = ("/completions", {}), side: str = "") -> Endpoint:
    """The checks before load, as one clear error each (`side`, e.g. "endpoint A: ", starts each message)."""
    logging.basicConfig(level=log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        ep = Endpoint(base_url, model or "", api_key)
        if not model:
            try:
                ep.check_model()
            except BenchError:
                if not ep.served_ids:
                    raise
            ep.model = ep.served_ids[0]
            click.echo(f"{side}model: {ep.model} (the first one {ep.api}/models lists; pass --model to choose)",
                       err=True)
        ep.check_model()
        if stream_check is not None:
            path, body = stream_check
            ep.check_streaming(path, ({"model": ep.model, "max_tokens": 2, "stream": True, **body}
                                      if body else None))
    except (BenchError, httpx.HTTPError) as exc:
        _fail(side + _why(exc))
    return ep


def _run_async(coro_factory):
    """asyncio.run; True when Ctrl-C stopped it (asyncio cancels the task, whose partial results stay
    in the objects the caller passed in)."""
    try:
        asyncio.run(coro_factory())
    except KeyboardInterrupt:
        click.echo("\ninterrupted: keeping what was measured", err=True)
        return True
    return False


@click.group(context_settings={"help_option_names": ["-h", "--help"]})
def bench() -> None:
    """Serving benchmarks against any OpenAI-compatible endpoint (docs/bench.md)."""


def _load_options(f):
    """The load of `bench serve`, shared with `bench ab` (which runs it on both sides)."""
    f = click.option("--ignore-eos/--no-ignore-eos", default=True, show_default=True,
                     help="Ask the server for exactly --output-len tokens (vLLM/SGLang/ours honour ignore_eos).")(f)
    f = click.option("--vocab-size", default=32000, show_default=True, type=click.IntRange(min=101),
                     help="Random prompt token ids are drawn from 100..vocab-size-1; keep it within the model's "
                          "vocabulary.")(f)
    f = click.option("--seed", default=0, show_default=True, type=int)(f)
    f = click.option("--request-rate", default=None, type=click.FloatRange(min=0, min_open=True),
                     help="Poisson arrivals at this many requests/s (capped by the concurrency); default: closed "
                          "loop.")(f)
    f = click.option("--dataset", default=None, type=click.Path(exists=True, dir_okay=False),
                     help="JSONL of {\"prompt\": ...} or {\"messages\": [...]} instead of random token prompts.")(f)
    f = click.option("--num-prompts", default=0, show_default=True, type=click.IntRange(min=0),
                     help="Requests per round (0: 4 x concurrency).")(f)
    f = click.option("--rounds", default=3, show_default=True, type=click.IntRange(min=1),
                     help="Rounds per concurrency; the first is warm-up and stays out of the summary.")(f)
    f = click.option("--output-len", default=64, show_default=True, type=click.IntRange(min=1),
                     help="Output tokens per request.")(f)
    f = click.option("--input-len", default=128, show_default=True, type=click.IntRange(min=1),
                     help="Prompt tokens (random prompts).")(f)
    f = click.option("--concurrency", "concurrency", default="1,4,8,16,32", show_default=True,
                     help="Comma-separated concurrencies; each gets its own rounds.")(f)
    return f


@dataclass
class _Load:
    """The load both `bench serve` and `bench ab` send: the same prompts (deterministic in the seed) in
    the same order with the same arrivals, however often it is run."""

    levels: list[int]
    cfg: object  # loadgen.LoadConfig
    make: object  # n -> list[Prompt]
    check: tuple[str, dict]  # the streaming check: path and body of a request shaped like the load's
    dataset: str | None
    input_len: int
    output_len: int

    def config(self) -> dict:
        c = self.cfg
        return {"concurrency": self.levels, "input_len": None if self.dataset else self.input_len,
                "output_len": self.output_len, "rounds": c.rounds, "num_prompts": c.num_prompts,
                "dataset": self.dataset, "request_rate": c.request_rate, "seed": c.seed, "ignore_eos": c.ignore_eos}


def _load(concurrency, input_len, output_len, rounds, num_prompts, dataset, request_rate, seed, vocab_size,
          ignore_eos) -> _Load:
    from flagdeploy.bench.loadgen import LoadConfig, dataset_prompts, random_prompts

    levels = _int_list(concurrency)
    cfg = LoadConfig(concurrencies=levels, rounds=rounds, num_prompts=num_prompts, request_rate=request_rate,
                      seed=seed, ignore_eos=ignore_eos)
    try:
        if dataset:
            sample = dataset_prompts(dataset, 1, output_len, seed)[0]
            make = lambda n: dataset_prompts(dataset, n, output_len, seed)
        else:
            sample = None
            make = lambda n: random_prompts(n, input_len, output_len, seed, vocab_size)
    except (BenchError, httpx.HTTPError) as exc:
        _fail(_why(exc))
    check = (("/chat/completions", {"messages": sample.messages}) if sample and sample.messages is not None
             else ("/completions", {"prompt": sample.prompt if sample else [100] * 4}))
    if rounds == 1:
        click.echo("warning: --rounds 1 has only the warm-up round; the summary will include warm-up effects.", err=True)
    return _Load(levels, cfg, make, check, dataset, input_len, output_len)


def _ready_for_load(ep: Endpoint, load: _Load, side: str = "") -> None:
    """The prompts fit the server's context window, and it streams a request shaped like the load's."""
    if not load.dataset and ep.max_model_len and load.input_len + load.output_len > ep.max_model_len:
        _fail(f"{side}--input-len {load.input_len} + --output-len {load.output_len} exceeds the server's "
              f"max_model_len {ep.max_model_len}; shorten them.")
    try:
        ep.check_streaming(load.check[0], {"model": ep.model, "max_tokens": 2, "stream": True, **load.check[1]})
    except (BenchError, httpx.HTTPError) as exc:
        _fail(side + _why(exc))


def _measure(ep: Endpoint, load: _Load, progress: bool | None):
    """Run the load against `ep`: the results (`interrupted` set when Ctrl-C stopped it)."""
    from flagdeploy.bench.loadgen import ServeResults, run_serve

    results = ServeResults()
    results.interrupted = _run_async(lambda: run_serve(ep, load.make, load.cfg, results, progress=progress))
    return results


def _error_lines(results, side: str = "") -> None:
    for e in sorted({r.error for r in results.records if r.error})[:5]:
        click.echo(f"{side}request error: {e}", err=True)


@bench.command("serve")
@_endpoint_options
@_load_options
@click.option("--output-dir", default=None, type=click.Path(file_okay=False),
              help="Where CSV, JSON and plots go (default: bench-results/serve-<time>).")
@click.option("--no-plots", is_flag=True, help="Skip the PNG plots.")
def bench_serve(base_url, model, api_key, progress, log_level, concurrency, input_len, output_len, rounds, num_prompts,
                dataset, request_rate, seed, vocab_size, ignore_eos, output_dir, no_plots) -> None:
    """Load test: TTFT, TPOT, ITL, end-to-end latency and throughput at each concurrency, and speculative
    decoding's acceptance length where the server's /metrics counts it."""
    from flagdeploy.bench.report import format_table, write_serve_outputs

    load = _load(concurrency, input_len, output_len, rounds, num_prompts, dataset, request_rate, seed, vocab_size,
                 ignore_eos)
    ep = _connect(base_url, model, api_key, log_level, stream_check=None)
    _ready_for_load(ep, load)
    out = Path(output_dir or f"bench-results/serve-{time.strftime('%Y%m%d-%H%M%S')}")
    results = _measure(ep, load, progress)
    if not results.rounds:
        _fail("interrupted before any request finished; nothing was written")
    summaries = results.summaries(load.levels)
    config = {"base_url": ep.base_url, "model": ep.model, **load.config(), "time": time.time()}
    paths = write_serve_outputs(out, config=config, rounds=results.rounds, records=results.records,
                                summaries=summaries, interrupted=results.interrupted, plots=not no_plots)
    click.echo(format_table(summaries, results.rounds))
    _error_lines(results)
    click.echo("wrote: " + ", ".join(str(p) for p in paths.values()))
    if results.interrupted:
        sys.exit(130)


@bench.command("ab")
@click.option("--a", "url_a", required=True, metavar="URL",
              help="Endpoint A, the reference (e.g. speculation off), with or without /v1.")
@click.option("--b", "url_b", required=True, metavar="URL",
              help="Endpoint B, the same deployment with one thing changed (e.g. --speculative mtp).")
@click.option("--label-a", default="A", show_default=True, help="Name of A in the table and the JSON, e.g. off.")
@click.option("--label-b", default="B", show_default=True, help="Name of B in the table and the JSON, e.g. mtp.")
@click.option("--model-a", default=None, help="Model name on A (default: --model, else A's first listed model).")
@click.option("--model-b", default=None, help="Model name on B (default: --model, else B's first listed model).")
@_client_options
@_load_options
@click.option("--output", default=None, type=click.Path(dir_okay=False),
              help="Also write both results and the B/A ratios as JSON.")
def bench_ab(url_a, url_b, label_a, label_b, model_a, model_b, model, api_key, progress, log_level, concurrency,
             input_len, output_len, rounds, num_prompts, dataset, request_rate, seed, vocab_size, ignore_eos,
             output) -> None:
    """A/B: the same load (prompts, order, seed, arrivals) against A, then B; one table side by side with
    the B/A ratio: acceptance length where the servers expose it, TTFT, TPOT, throughput, E2E P99.

    One server with two configurations: start it twice, on two ports (docs/bench.md)."""
    from flagdeploy.bench.ab import compare, format_ab
    from flagdeploy.bench.report import write_json

    load = _load(concurrency, input_len, output_len, rounds, num_prompts, dataset, request_rate, seed, vocab_size,
                 ignore_eos)
    # both endpoints are checked before either gets any load: a typo in B fails now, not after A's run
    ep_a = _connect(url_a, model_a or model, api_key, log_level, stream_check=None, side="endpoint A: ")
    ep_b = _connect(url_b, model_b or model, api_key, log_level, stream_check=None, side="endpoint B: ")
    if ep_a.base_url == ep_b.base_url:
        click.echo(f"warning: A and B are the same endpoint ({ep_a.base_url}): this measures run-to-run noise. "
                   f"To compare two configurations of one server, start it twice on two ports.", err=True)
    _ready_for_load(ep_a, load, "endpoint A: ")
    _ready_for_load(ep_b, load, "endpoint B: ")
    sides = {}
    for key, label, ep in (("a", label_a, ep_a), ("b", label_b, ep_b)):
        click.echo(f"running {key.upper()} ({label}): {ep.base_url}", err=True)
        res = _measure(ep, load, progress)
        sides[key] = {"label": label, "base_url": ep.base_url, "model": ep.model, "interrupted": res.interrupted,
                      "summary": res.summaries(load.levels), "rounds": [r.flat() for r in res.rounds],
                      "error_messages": sorted({r.error for r in res.records if r.error})[:20]}
        _error_lines(res, f"{key.upper()}: ")
        if res.interrupted:
            break
    side_b = sides.get("b") or {"label": label_b, "base_url": ep_b.base_url, "model": ep_b.model, "interrupted": True,
                                "summary": [], "rounds": [], "error_messages": []}
    if not sides["a"]["rounds"]:
        _fail("interrupted before any request finished; nothing was written")
    click.echo(format_ab(sides["a"], side_b, load.levels))
    interrupted = sides["a"]["interrupted"] or side_b["interrupted"]
    if output:
        path = write_json(output, {"config": {**load.config(), "time": time.time()}, "interrupted": interrupted,
                                   "a": sides["a"], "b": side_b,
                                   "ratios": compare(sides["a"]["summary"], side_b["summary"])})
        click.echo(f"wrote: {path}")
    if interrupted:
        sys.exit(130)


@bench.command("prefix-cache")
@_endpoint_options
@click.option("--prompt-words", default=300, show_default=True, type=click.IntRange(min=20),
              help="Length of the fixed prompt in words (a few hundred tokens; caches work in blocks).")
@click.option("--repeats", default=3, show_default=True, type=click.IntRange(min=1), help="Identical requests after the cold one.")
@click.option("--min-speedup", default=1.1, show_default=True, type=float,
              help="Cold TTFT / median warm TTFT needed to count as a client-side hit.")
@click.option("--output", default=None, type=click.Path(dir_okay=False), help="Also write the result as JSON.")
def bench_prefix(base_url, model, api_key, progress, log_level, prompt_words, repeats, min_speedup, output) -> None:
    """Is prefix caching really working? Cold vs warm TTFT and the server's own hit counters."""
    from flagdeploy.bench.prefix import format_prefix, run_prefix
    from flagdeploy.bench.report import write_json

    ep = _connect(base_url, model, api_key, log_level)
    box = {}

    async def go():
        box["res"] = await run_prefix(ep, prompt_words=prompt_words, repeats=repeats, min_speedup=min_speedup)

    try:
        interrupted = _run_async(go)
    except (BenchError, httpx.HTTPError) as exc:
        _fail(_why(exc))
    if interrupted or "res" not in box:
        sys.exit(130)
    res = box["res"]
    click.echo(format_prefix(res))
    if output:
        write_json(output, res.to_dict())
    sys.exit(0 if res.evidence_complete else 2)


@bench.command("needle")
@_endpoint_options
@click.option("--lengths", default="4k,32k", show_default=True, help="Context lengths in tokens (k = 1024).")
@click.option("--depths", default="10,50,90", show_default=True, help="Needle depths, percent of the context.")
@click.option("--seed", default=0, show_default=True, type=int)
@click.option("--max-tokens", default=32, show_default=True, type=click.IntRange(min=4), help="Answer length allowed.")
@click.option("--output", default=None, type=click.Path(dir_okay=False), help="Also write the cells as JSON.")
def bench_needle(base_url, model, api_key, progress, log_level, lengths, depths, seed, max_tokens, output) -> None:
    """Long-context retrieval: a unique identifier at each depth, asked back; found / not found per cell."""
    from flagdeploy.bench.needle import (
        cells_to_dict,
        format_needle,
        parse_depths,
        parse_lengths,
        run_needle,
    )
    from flagdeploy.bench.report import write_json

    try:
        lens, deps = parse_lengths(lengths), parse_depths(depths)
    except (BenchError, httpx.HTTPError) as exc:
        _fail(_why(exc))
    ep = _connect(base_url, model, api_key, log_level,
                  stream_check=("/chat/completions", {"messages": [{"role": "user", "content": "Hi"}]}))
    cells: list = []
    try:
        interrupted = _run_async(lambda: run_needle(ep, lens, deps, seed=seed, max_tokens=max_tokens,
                                                    progress=progress, cells=cells))
    except (BenchError, httpx.HTTPError) as exc:
        _fail(_why(exc))
    click.echo(format_needle(cells, lens, deps))
    if output:
        write_json(output, {"model": ep.model, "base_url": ep.base_url, "interrupted": interrupted,
                            "cells": cells_to_dict(cells)})
    if interrupted:
        sys.exit(130)


# ---- eval ---------------------------------------------------------------------------------------


@click.group("eval", context_settings={"help_option_names": ["-h", "--help"]})
def eval_group() -> None:
    """Accuracy checks: greedy baselines with logprobs, perplexity (docs/bench.md)."""


@eval_group.group("baseline")
def baseline_group() -> None:
    """Save a greedy baseline, then compare later runs (a quantisation, driver or engine upgrade) to it."""


def _baseline_options(f):
    f = click.option("--dir", "directory", default="flagdeploy-baselines", show_default=True,
                     envvar="FLAGDEPLOY_BASELINE_DIR", type=click.Path(file_okay=False), help="Where baselines live.")(f)
    f = click.option("--limit", default=None, type=click.IntRange(min=1), help="Only the first N prompts of the set.")(f)
    return f


@baseline_group.command("save")
@click.argument("name")
@_endpoint_options
@_baseline_options
@click.option("--max-tokens", default=32, show_default=True, type=click.IntRange(min=1))
@click.option("--top-logprobs", default=5, show_default=True, type=click.IntRange(min=0, max=20))
@click.option("--temperature", default=0.0, show_default=True, type=click.FloatRange(min=0), help="0: greedy.")
@click.option("--seed", default=0, show_default=True, type=int)
@click.option("--overwrite", is_flag=True, help="Replace a saved baseline of that name.")
def baseline_save(name, base_url, model, api_key, progress, log_level, directory, limit, max_tokens, top_logprobs,
                  temperature, seed, overwrite) -> None:
    """Run the fixed prompt set and save every token and logprob as NAME."""
    from flagdeploy.bench.baseline import (
        baseline_path,
        new_baseline,
        run_prompts,
        save_baseline,
    )

    try:
        path = baseline_path(directory, name)
    except (BenchError, httpx.HTTPError) as exc:
        _fail(_why(exc))
    if path.exists() and not overwrite:  # a baseline is what later runs are judged against: never replaced silently
        _fail(f"a baseline {name!r} is already saved ({path}); compare against it with `flagdeploy eval baseline "
              f"compare {name}`, save under another name, or pass --overwrite")
    ep = _connect(base_url, model, api_key, log_level, stream_check=None)
    base = new_baseline(ep, name, temperature=temperature, seed=seed, max_tokens=max_tokens, top_logprobs=top_logprobs)
    try:
        run_prompts(ep, base, limit=limit, progress=progress)
    except (BenchError, httpx.HTTPError) as exc:
        _fail(_why(exc))
    except KeyboardInterrupt:
        base.name = f"{name}.partial"
        path = save_baseline(base, directory)
        click.echo(f"\ninterrupted: {len(base.answers)} answers kept in {path} (not saved as {name!r})", err=True)
        sys.exit(130)
    path = save_baseline(base, directory)
    click.echo(f"saved baseline {name!r}: {len(base.answers)} prompts, model {ep.model}, -> {path}")


@baseline_group.command("compare")
@click.argument("name")
@_endpoint_options
@_baseline_options
@click.option("--temperature", default=None, type=click.FloatRange(min=0), help="Default: the baseline's.")
@click.option("--seed", default=None, type=int, help="Default: the baseline's.")
@click.option("--output", default=None, type=click.Path(dir_okay=False), help="Also write the comparison as JSON.")
def baseline_compare(name, base_url, model, api_key, progress, log_level, directory, limit, temperature, seed,
                     output) -> None:
    """Run the prompt set now and compare with baseline NAME: first divergent token, agreement, logprob drift.
    Exits 0 on full agreement, 2 on any divergence."""
    from flagdeploy.bench.baseline import (
        compare,
        format_comparison,
        load_baseline,
        new_baseline,
        run_prompts,
    )
    from flagdeploy.bench.report import write_json

    try:
        base = load_baseline(directory, name)
    except (BenchError, httpx.HTTPError) as exc:
        _fail(_why(exc))
    ep = _connect(base_url, model or base.model, api_key, log_level, stream_check=None)
    n = min(limit or len(base.answers), len(base.answers))
    cur = new_baseline(ep, f"{name}-now", temperature=base.temperature if temperature is None else temperature,
                       seed=base.seed if seed is None else seed, max_tokens=base.max_tokens,
                       top_logprobs=base.top_logprobs)
    interrupted = False
    try:
        run_prompts(ep, cur, limit=n, progress=progress)
    except (BenchError, httpx.HTTPError) as exc:
        _fail(_why(exc))
    except KeyboardInterrupt:
        interrupted = True
        click.echo(f"\ninterrupted: comparing the {len(cur.answers)} prompts answered", err=True)
    try:
        cmp = compare(base, cur)
    except (BenchError, httpx.HTTPError) as exc:
        _fail(_why(exc))
    click.echo(format_comparison(cmp))
    if output:
        write_json(output, {**cmp.to_dict(), "interrupted": interrupted, "current": cur.to_dict()})
    sys.exit(130 if interrupted else (0 if cmp.full_agreement else 2))


@eval_group.command("ppl")
@click.argument("file", type=click.Path(exists=True, dir_okay=False))
@_endpoint_options
@click.option("--chunk-chars", default=2000, show_default=True, type=click.IntRange(min=50),
              help="Characters per request; each chunk must fit the server's context window.")
def eval_ppl(file, base_url, model, api_key, progress, log_level, chunk_chars) -> None:
    """Perplexity of FILE from prompt logprobs on /v1/completions (echo + logprobs)."""
    from flagdeploy.bench.baseline import Perplexity, perplexity

    ep = _connect(base_url, model, api_key, log_level, stream_check=None)
    try:
        text = Path(file).read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        _fail(f"cannot read {file}: {exc}")
    total = Perplexity(tokens=0, nll=0.0, chunks=0)
    interrupted = False
    try:
        perplexity(ep, text, chunk_chars=chunk_chars, progress=progress, into=total)
    except (BenchError, httpx.HTTPError) as exc:
        _fail(_why(exc))
    except KeyboardInterrupt:
        interrupted = True
        click.echo("\ninterrupted: perplexity of the chunks scored so far", err=True)
    if not total.tokens:
        _fail("no tokens were scored")
    click.echo(f"perplexity {total.ppl:.4f} over {total.tokens} tokens in {total.chunks} chunk(s) "
               f"(mean NLL {total.nll / total.tokens:.4f} nats/token), model {ep.model}")
    if interrupted:
        sys.exit(130)

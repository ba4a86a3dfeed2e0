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


def _endpoint_options(f):
    f = click.option("--log-level", default="warning", show_default=True,
                     type=click.Choice(["debug", "info", "warning", "error"]))(f)
    f = click.option("--progress/--no-progress", default=None,
                     help="Progress bars (default: only on a terminal).")(f)
    f = click.option("--api-key", default=None, envvar="FLAGDEPLOY_API_KEY", help="Bearer key, if the server wants one.")(f)
    f = click.option("--model", default=None,
                     help="Served model name (default: the first one /v1/models lists).")(f)
    f = click.option("--base-url", default="http://127.0.0.1:8000", show_default=True, envvar="FLAGDEPLOY_BASE_URL",
                     help="OpenAI-compatible server, with or without /v1 (ours, vLLM, SGLang, vLLM-Ascend, MindIE).")(f)
    return f


def _connect(base_url: str, model: str | None, api_key: str | None, log_level: str, *,
             stream_check: tuple[str, dict] | None = ("/completions", {})) -> Endpoint:
    """The checks before load, as one clear error each."""
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
            click.echo(f"model: {ep.model} (the first one {ep.api}/models lists; pass --model to choose)", err=True)
        ep.check_model()
        if stream_check is not None:
            path, body = stream_check
            ep.check_streaming(path, ({"model": ep.model, "max_tokens": 2, "stream": True, **body}
                                      if body else None))
    except (BenchError, httpx.HTTPError) as exc:
        _fail(_why(exc))
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


@bench.command("serve")
@_endpoint_options
@click.option("--concurrency", "concurrency", default="1,4,8,16,32", show_default=True,
              help="Comma-separated concurrencies; each gets its own rounds.")
@click.option("--input-len", default=128, show_default=True, type=click.IntRange(min=1), help="Prompt tokens (random prompts).")
@click.option("--output-len", default=64, show_default=True, type=click.IntRange(min=1), help="Output tokens per request.")
@click.option("--rounds", default=3, show_default=True, type=click.IntRange(min=1),
              help="Rounds per concurrency; the first is warm-up and stays out of the summary.")
@click.option("--num-prompts", default=0, show_default=True, type=click.IntRange(min=0),
              help="Requests per round (0: 4 x concurrency).")
@click.option("--dataset", default=None, type=click.Path(exists=True, dir_okay=False),
              help="JSONL of {\"prompt\": ...} or {\"messages\": [...]} instead of random token prompts.")
@click.option("--request-rate", default=None, type=click.FloatRange(min=0, min_open=True),
              help="Poisson arrivals at this many requests/s (capped by the concurrency); default: closed loop.")
@click.option("--seed", default=0, show_default=True, type=int)
@click.option("--vocab-size", default=32000, show_default=True, type=click.IntRange(min=101),
              help="Random prompt token ids are drawn from 100..vocab-size-1; keep it within the model's vocabulary.")
@click.option("--ignore-eos/--no-ignore-eos", default=True, show_default=True,
              help="Ask the server for exactly --output-len tokens (vLLM/SGLang/ours honour ignore_eos).")
@click.option("--output-dir", default=None, type=click.Path(file_okay=False),
              help="Where CSV, JSON and plots go (default: bench-results/serve-<time>).")
@click.option("--no-plots", is_flag=True, help="Skip the PNG plots.")
def bench_serve(base_url, model, api_key, progress, log_level, concurrency, input_len, output_len, rounds, num_prompts,
                dataset, request_rate, seed, vocab_size, ignore_eos, output_dir, no_plots) -> None:
    """Load test: TTFT, TPOT, ITL, end-to-end latency and throughput at each concurrency."""
    from flagdeploy.bench.loadgen import (
        ServeConfig,
        ServeResults,
        dataset_prompts,
        random_prompts,
        run_serve,
    )
    from flagdeploy.bench.report import format_table, write_serve_outputs
    from flagdeploy.bench.stats import median_of_rounds

    levels = _int_list(concurrency)
    cfg = ServeConfig(concurrencies=levels, rounds=rounds, num_prompts=num_prompts, request_rate=request_rate,
                      seed=seed, ignore_eos=ignore_eos)
    try:
        if dataset:
            sample = dataset_prompts(dataset, 1, output_len, seed)[0]
            make = lambda n: dataset_prompts(dataset, n, output_len, seed)  # noqa: E731
        else:
            sample = None
            make = lambda n: random_prompts(n, input_len, output_len, seed, vocab_size)  # noqa: E731
    except (BenchError, httpx.HTTPError) as exc:
        _fail(_why(exc))
    check = (("/chat/completions", {"messages": sample.messages}) if sample and sample.messages is not None
             else ("/completions", {"prompt": sample.prompt if sample else [100] * 4}))
    ep = _connect(base_url, model, api_key, log_level, stream_check=None)
    if not dataset and ep.max_model_len and input_len + output_len > ep.max_model_len:
        _fail(f"--input-len {input_len} + --output-len {output_len} exceeds the server's max_model_len "
              f"{ep.max_model_len}; shorten them.")
    try:
        ep.check_streaming(check[0], {"model": ep.model, "max_tokens": 2, "stream": True, **check[1]})
    except (BenchError, httpx.HTTPError) as exc:
        _fail(_why(exc))
    if rounds == 1:
        click.echo("warning: --rounds 1 has only the warm-up round; the summary will include warm-up effects.", err=True)
    out = Path(output_dir or f"bench-results/serve-{time.strftime('%Y%m%d-%H%M%S')}")
    results = ServeResults()
    interrupted = _run_async(lambda: run_serve(ep, make, cfg, results, progress=progress))
    results.interrupted = interrupted
    if not results.rounds:
        _fail("interrupted before any request finished; nothing was written")
    summaries = []
    for c in levels:
        rs = [r for r in results.rounds if r.concurrency == c]
        if rs:
            summaries.append(median_of_rounds(rs))
    config = {"base_url": ep.base_url, "model": ep.model, "concurrency": levels, "input_len": None if dataset else input_len,
              "output_len": output_len, "rounds": rounds, "num_prompts": num_prompts, "dataset": dataset,
              "request_rate": request_rate, "seed": seed, "ignore_eos": ignore_eos, "time": time.time()}
    paths = write_serve_outputs(out, config=config, rounds=results.rounds, records=results.records,
                                summaries=summaries, interrupted=interrupted, plots=not no_plots)
    click.echo(format_table(summaries, results.rounds))
    errs = sorted({r.error for r in results.records if r.error})
    for e in errs[:5]:
        click.echo(f"request error: {e}", err=True)
    click.echo("wrote: " + ", ".join(str(p) for p in paths.values()))
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
def baseline_save(name, base_url, model, api_key, progress, log_level, directory, limit, max_tokens, top_logprobs,
                  temperature, seed) -> None:
    """Run the fixed prompt set and save every token and logprob as NAME."""
    from flagdeploy.bench.baseline import (
        baseline_path,
        new_baseline,
        run_prompts,
        save_baseline,
    )

    try:
        baseline_path(directory, name)
    except (BenchError, httpx.HTTPError) as exc:
        _fail(_why(exc))
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

"""Needle in a haystack: can the served model still read its whole context window?

A unique identifier is planted at a given depth of filler text, and the model is asked for it back.
Context that is accepted but not attended to (a wrong RoPE scaling, a sliding window set too small, a
KV-cache quantisation that is too lossy) shows up as "not found" at long lengths or deep positions,
even while short prompts look fine. TTFT per length shows what the prefill of that much context costs.
"""

from __future__ import annotations

import logging
import random
import statistics
import time
from dataclasses import asdict, dataclass

import httpx

from flagdeploy.bench.client import BenchError, Endpoint, stream_request

log = logging.getLogger(__name__)

_SUBJECTS = ("The old farmer", "A quiet student", "The harbor pilot", "My neighbour", "The museum guide",
             "A travelling baker", "The night nurse", "The young painter")
_VERBS = ("walked to", "wrote about", "looked at", "talked about", "cleaned", "visited", "photographed", "repaired")
_OBJECTS = ("the stone bridge", "a red bicycle", "the village market", "an empty barn", "the river bank",
            "a wooden boat", "the train station", "the apple orchard")
_TAILS = ("in the morning.", "before the rain came.", "with great care.", "on a cold day.", "after lunch.",
          "without saying a word.", "for the second time.", "as the sun went down.")

QUESTION = "What is the secret code mentioned in the text above? Reply with the code only."


def parse_lengths(text: str) -> list[int]:
    """'4k,32k,1000' -> [4096, 32768, 1000] (k = 1024 tokens, m = 1024k)."""
    out = []
    for part in text.split(","):
        p = part.strip().lower()
        if not p:
            continue
        mult = {"k": 1024, "m": 1 << 20}.get(p[-1], 1)
        try:
            n = int(float(p[:-1] if mult > 1 else p) * mult)
        except ValueError:
            raise BenchError(f"--lengths: {part!r} is not a token count; write e.g. 4k,32k,128k") from None
        if n < 64:
            raise BenchError(f"--lengths: {part!r} is too short to hide anything in (at least 64 tokens)")
        out.append(n)
    if not out:
        raise BenchError("--lengths is empty")
    return out


def parse_depths(text: str) -> list[float]:
    out = []
    for part in text.split(","):
        if part.strip():
            try:
                d = float(part)
            except ValueError:
                raise BenchError(f"--depths: {part!r} is not a percentage") from None
            if not 0 <= d <= 100:
                raise BenchError(f"--depths: {d:g} is outside 0..100")
            out.append(d)
    if not out:
        raise BenchError("--depths is empty")
    return out


def filler_sentences(n: int, seed: int) -> list[str]:
    rng = random.Random(seed)
    return [f"{rng.choice(_SUBJECTS)} {rng.choice(_VERBS)} {rng.choice(_OBJECTS)} {rng.choice(_TAILS)}"
            for _ in range(n)]


def make_identifier(rng: random.Random) -> str:
    """Something no filler or training text contains: letters then digits, e.g. 'QBXT-4817'."""
    letters = "".join(rng.choice("BCDFGHJKLMNPQRSTVWXZ") for _ in range(4))
    return f"{letters}-{rng.randrange(1000, 10000)}"


def build_haystack(n_chars: int, depth: float, identifier: str, seed: int) -> str:
    """Filler of about `n_chars` characters with the needle sentence at `depth` percent (a sentence
    boundary, so the needle is not cut)."""
    sentences: list[str] = []
    size = 0
    for s in filler_sentences(max(8, n_chars // 30 + 8), seed):
        if size >= n_chars:
            break
        sentences.append(s)
        size += len(s) + 1
    needle = f"The secret code is {identifier}."
    at = round(len(sentences) * depth / 100)
    sentences.insert(at, needle)
    return " ".join(sentences)


@dataclass
class NeedleCell:
    length: int  # target context tokens
    depth: float
    identifier: str
    prompt_tokens: int | None = None
    found: bool | None = None  # None: not run (skipped or failed)
    ttft_s: float | None = None
    answer: str = ""
    error: str | None = None


def _chat_body(ep: Endpoint, haystack: str, max_tokens: int) -> dict:
    return {"model": ep.model, "messages": [{"role": "user", "content": f"{haystack}\n\n{QUESTION}"}],
            "max_tokens": max_tokens, "temperature": 0.0, "stream": True, "stream_options": {"include_usage": True}}


async def calibrate(client: httpx.AsyncClient, ep: Endpoint, seed: int) -> tuple[float, int]:
    """Characters per token of the filler and the fixed overhead (chat template + question) in tokens,
    from the server's own usage on two small requests, so lengths are right for any tokenizer."""
    counts = []
    for chars in (400, 1600):
        body = _chat_body(ep, build_haystack(chars, 50, "ABCD-1234", seed), 1)
        res = await stream_request(client, ep.api + "/chat/completions", body)
        if res.prompt_tokens is None:
            raise BenchError("the server reports no usage.prompt_tokens with stream_options.include_usage; "
                             "needle lengths cannot be calibrated")
        counts.append((len(build_haystack(chars, 50, "ABCD-1234", seed)), res.prompt_tokens))
    (c1, t1), (c2, t2) = counts
    per_token = (c2 - c1) / max(t2 - t1, 1)
    overhead = max(0, round(t1 - c1 / per_token))
    return per_token, overhead


async def run_needle(ep: Endpoint, lengths: list[int], depths: list[float], *, seed: int = 0, max_tokens: int = 32,
                     progress: bool | None = None, cells: list[NeedleCell] | None = None) -> list[NeedleCell]:
    """Every (length, depth) cell in turn. Cells go into `cells` as they run, so a caller interrupted
    by Ctrl-C keeps the finished ones."""
    from tqdm import tqdm

    rng = random.Random(seed)
    cells = [] if cells is None else cells
    async with ep.async_client(1) as client:
        per_token, overhead = await calibrate(client, ep, seed)
        log.info("filler: %.2f chars/token, overhead %d tokens", per_token, overhead)
        disable = None if progress is None else not progress
        with tqdm(total=len(lengths) * len(depths), unit="cell", desc="bench needle", disable=disable,
                  leave=False) as bar:
            for length in lengths:
                for depth in depths:
                    cell = NeedleCell(length=length, depth=depth, identifier=make_identifier(rng))
                    cells.append(cell)
                    bar.update(1)
                    if ep.max_model_len and length + max_tokens > ep.max_model_len:
                        cell.error = f"skipped: {length} + {max_tokens} tokens exceed the server's max_model_len {ep.max_model_len}"
                        continue
                    chars = int(max(length - overhead, 16) * per_token)
                    # a filler of its own per cell: with a shared one, the prefix cache would serve every
                    # cell after the first up to its needle, and TTFT would measure the cache, not the prefill
                    filler_seed = seed * 1_000_003 + length * 1009 + round(depth * 10) + 1
                    body = _chat_body(ep, build_haystack(chars, depth, cell.identifier, filler_seed), max_tokens)
                    start = time.perf_counter()
                    try:
                        res = await stream_request(client, ep.api + "/chat/completions", body)
                    except (BenchError, httpx.HTTPError) as exc:
                        cell.error = str(exc) or exc.__class__.__name__
                        continue
                    cell.prompt_tokens = res.prompt_tokens
                    cell.ttft_s = res.chunk_times[0] - start if res.chunk_times else None
                    cell.answer = res.text.strip()
                    cell.found = _normalise(cell.identifier) in _normalise(cell.answer)
    return cells


def _normalise(text: str) -> str:
    return "".join(ch for ch in text.upper() if ch.isalnum())


def format_needle(cells: list[NeedleCell], lengths: list[int], depths: list[float]) -> str:
    by = {(c.length, c.depth): c for c in cells}
    head = f"{'length':>8} {'tokens':>7} " + " ".join(f"{f'd={d:g}%':>8}" for d in depths) + f" {'TTFT ms':>9}"
    lines = [head]
    for length in lengths:
        row = [by[(length, d)] for d in depths if (length, d) in by]
        if not row:
            continue
        marks = ["found" if c.found else ("MISSED" if c.found is False else ("skip" if c.error and c.error.startswith("skipped") else "error"))
                 for c in row]
        toks = [c.prompt_tokens for c in row if c.prompt_tokens]
        ttfts = [c.ttft_s for c in row if c.ttft_s is not None]
        lines.append(f"{length:>8} {(statistics.median(toks) if toks else '-'):>7} "
                     + " ".join(f"{m:>8}" for m in marks)
                     + f" {(f'{statistics.median(ttfts) * 1000:.0f}' if ttfts else '-'):>9}")
    found = sum(1 for c in cells if c.found)
    ran = sum(1 for c in cells if c.found is not None)
    lines.append(f"found {found} of {ran} cells run ({len(cells) - ran} skipped or failed)")
    for c in cells:
        if c.error and not c.error.startswith("skipped"):
            lines.append(f"  {c.length} @ {c.depth:g}%: {c.error}")
    return "\n".join(lines)


def cells_to_dict(cells: list[NeedleCell]) -> list[dict]:
    return [asdict(c) for c in cells]

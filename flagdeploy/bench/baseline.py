"""Accuracy baselines: "is it still right?" after a quantisation, a driver or an engine upgrade.

`save` runs a fixed prompt set greedily with top logprobs and keeps every token and logprob; `compare`
runs the same prompts now and reports, per prompt, the first token where the outputs part, the share
of positions that agree, and how far the logprobs of the agreeing tokens moved. Greedy decoding of the
same weights on the same engine is deterministic, so any divergence means something changed; the
logprob drift says how much even when the tokens still agree.

`ppl` computes perplexity of a text file from the prompt logprobs of /v1/completions (`echo` +
`logprobs`), the quantity quantisation papers report.
"""

from __future__ import annotations

import json
import logging
import math
import re
import statistics
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import httpx

from flagdeploy.bench.client import BenchError, Endpoint
from flagdeploy.bench.report import write_json

log = logging.getLogger(__name__)

# Short, varied, with one clearly right continuation each: facts, arithmetic, code, translation, lists.
PROMPTS = (
    "What is the capital of France?",
    "What is 17 plus 25?",
    "Write a Python function that returns the square of a number.",
    "Translate 'good morning' into Spanish.",
    "List the first five prime numbers.",
    "Who wrote the play Romeo and Juliet?",
    "Explain in one sentence why the sky is blue.",
    "Name three primary colors.",
    "What is the boiling point of water in degrees Celsius at sea level?",
    "Complete the sentence: The quick brown fox",
    "Give a synonym for the word 'happy'.",
    "How many days are there in a leap year?",
)
FORMAT = 1
_NAME = re.compile(r"^[A-Za-z0-9._-]+$")


@dataclass
class Answer:
    prompt: str
    text: str
    tokens: list[str]
    logprobs: list[float]
    top_logprobs: list[dict[str, float]]
    finish_reason: str | None = None


@dataclass
class Baseline:
    name: str
    model: str
    base_url: str
    temperature: float
    seed: int
    max_tokens: int
    top_logprobs: int
    created: float
    answers: list[Answer] = field(default_factory=list)
    format: int = FORMAT

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict) -> Baseline:
        if d.get("format") != FORMAT:
            raise BenchError(f"baseline {d.get('name')!r} has format {d.get('format')!r}; this flagdeploy reads {FORMAT}")
        answers = [Answer(**a) for a in d.pop("answers")]
        return cls(**d, answers=answers)


def baseline_path(directory: str | Path, name: str) -> Path:
    if not _NAME.match(name):
        raise BenchError(f"baseline name {name!r} may use only letters, digits, '.', '_' and '-'")
    return Path(directory) / f"{name}.json"


def _chat_answer(c: httpx.Client, ep: Endpoint, prompt: str, *, temperature: float, seed: int, max_tokens: int,
                 top_logprobs: int) -> Answer:
    body = {"model": ep.model, "messages": [{"role": "user", "content": prompt}], "max_tokens": max_tokens,
            "temperature": temperature, "seed": seed, "logprobs": True, "top_logprobs": top_logprobs}
    r = c.post(f"{ep.api}/chat/completions", json=body)
    if r.status_code != 200:
        raise BenchError(f"{ep.api}/chat/completions answered HTTP {r.status_code} for {prompt!r}: {r.text[:300]}")
    choice = r.json()["choices"][0]
    content = (choice.get("logprobs") or {}).get("content")
    if content is None:
        raise BenchError(f"{ep.base_url} returned no logprobs for chat completions; a baseline needs "
                         f"`logprobs`/`top_logprobs` support (vLLM: --max-logprobs >= {top_logprobs}).")
    return Answer(prompt=prompt, text=choice["message"].get("content") or "",
                  tokens=[t["token"] for t in content], logprobs=[float(t["logprob"]) for t in content],
                  top_logprobs=[{x["token"]: float(x["logprob"]) for x in t.get("top_logprobs") or []} for t in content],
                  finish_reason=choice.get("finish_reason"))


def run_prompts(ep: Endpoint, base: Baseline, *, limit: int | None = None, progress: bool | None = None) -> Baseline:
    """Run the fixed prompt set one at a time (batching can change the numerics of a step) with the
    settings of `base`. Answers go into `base` as they come, so a caller interrupted by Ctrl-C keeps them."""
    from tqdm import tqdm

    prompts = PROMPTS[:limit] if limit else PROMPTS
    disable = None if progress is None else not progress
    with ep.client() as c:
        for p in tqdm(prompts[len(base.answers):], unit="prompt", desc=f"eval {base.name}", disable=disable,
                      leave=False):
            base.answers.append(_chat_answer(c, ep, p, temperature=base.temperature, seed=base.seed,
                                             max_tokens=base.max_tokens, top_logprobs=base.top_logprobs))
    return base


def new_baseline(ep: Endpoint, name: str, *, temperature: float, seed: int, max_tokens: int,
                 top_logprobs: int) -> Baseline:
    return Baseline(name=name, model=ep.model, base_url=ep.base_url, temperature=temperature, seed=seed,
                    max_tokens=max_tokens, top_logprobs=top_logprobs, created=time.time())


def save_baseline(base: Baseline, directory: str | Path) -> Path:
    return write_json(baseline_path(directory, base.name), base.to_dict())


def load_baseline(directory: str | Path, name: str) -> Baseline:
    path = baseline_path(directory, name)
    try:
        return Baseline.from_dict(json.loads(path.read_text()))
    except FileNotFoundError:
        have = sorted(p.stem for p in Path(directory).glob("*.json")) if Path(directory).is_dir() else []
        raise BenchError(f"no baseline {name!r} in {directory} (have: {', '.join(have) or 'none'}); "
                         f"save one with `flagdeploy eval baseline save {name}`") from None
    except (ValueError, TypeError, KeyError) as exc:
        raise BenchError(f"{path} is not a baseline file: {exc}") from None


@dataclass
class PromptComparison:
    prompt: str
    first_divergence: int | None  # token index where the outputs part; None: identical
    agreement: float  # equal tokens at equal positions / the longer output
    drift_mean: float | None  # mean |logprob difference| over the tokens before the divergence
    drift_max: float | None
    baseline_token: str | None = None  # the two tokens at the divergence
    current_token: str | None = None
    baseline_text: str = ""
    current_text: str = ""


def compare_answers(a: Answer, b: Answer) -> PromptComparison:
    n = max(len(a.tokens), len(b.tokens))
    same = sum(1 for x, y in zip(a.tokens, b.tokens) if x == y)
    first = next((i for i, (x, y) in enumerate(zip(a.tokens, b.tokens)) if x != y), None)
    if first is None and len(a.tokens) != len(b.tokens):
        first = min(len(a.tokens), len(b.tokens))
    upto = len(a.tokens) if first is None else first
    drift = [abs(x - y) for x, y in zip(a.logprobs[:upto], b.logprobs[:upto])]
    return PromptComparison(
        prompt=a.prompt, first_divergence=first, agreement=same / n if n else 1.0,
        drift_mean=statistics.fmean(drift) if drift else None, drift_max=max(drift) if drift else None,
        baseline_token=a.tokens[first] if first is not None and first < len(a.tokens) else None,
        current_token=b.tokens[first] if first is not None and first < len(b.tokens) else None,
        baseline_text=a.text, current_text=b.text)


@dataclass
class Comparison:
    baseline: str
    prompts: list[PromptComparison]

    @property
    def full_agreement(self) -> bool:
        return all(p.first_divergence is None for p in self.prompts)

    @property
    def agreement(self) -> float:
        return statistics.fmean(p.agreement for p in self.prompts) if self.prompts else 1.0

    def to_dict(self) -> dict:
        return {"baseline": self.baseline, "full_agreement": self.full_agreement, "agreement": self.agreement,
                "prompts": [asdict(p) for p in self.prompts]}


def compare(base: Baseline, current: Baseline) -> Comparison:
    """Prompt by prompt; `current` may have fewer answers (an interrupted or --limit run)."""
    theirs = [a.prompt for a in base.answers[:len(current.answers)]]
    if theirs != [a.prompt for a in current.answers]:
        raise BenchError("the two runs used different prompt sets; re-save the baseline with this flagdeploy")
    return Comparison(base.name, [compare_answers(a, b) for a, b in zip(base.answers, current.answers)])


def format_comparison(cmp: Comparison) -> str:
    lines = [f"{'#':>3} {'first diverging token':>22} {'agreement':>9} {'drift mean':>10} {'drift max':>9}  prompt"]
    for i, p in enumerate(cmp.prompts):
        div = "-" if p.first_divergence is None else f"{p.first_divergence} {p.baseline_token!r}->{p.current_token!r}"
        dm = "-" if p.drift_mean is None else f"{p.drift_mean:.4f}"
        dx = "-" if p.drift_max is None else f"{p.drift_max:.4f}"
        lines.append(f"{i:>3} {div[:22]:>22} {p.agreement:>9.1%} {dm:>10} {dx:>9}  {p.prompt[:40]}")
    diverged = sum(1 for p in cmp.prompts if p.first_divergence is not None)
    if cmp.full_agreement:
        lines.append(f"full agreement with baseline {cmp.baseline!r}: every token of {len(cmp.prompts)} prompts matches")
    else:
        lines.append(f"DIVERGED from baseline {cmp.baseline!r}: {diverged} of {len(cmp.prompts)} prompts differ; "
                     f"token agreement {cmp.agreement:.1%}")
    return "\n".join(lines)


# ---- perplexity ---------------------------------------------------------------------------------


def split_text(text: str, chunk_chars: int) -> list[str]:
    """Chunks of at most about `chunk_chars` characters, cut at whitespace."""
    words = text.split()
    chunks, cur, size = [], [], 0
    for w in words:
        if cur and size + len(w) + 1 > chunk_chars:
            chunks.append(" ".join(cur))
            cur, size = [], 0
        cur.append(w)
        size += len(w) + 1
    if cur:
        chunks.append(" ".join(cur))
    return chunks


@dataclass
class Perplexity:
    tokens: int
    nll: float  # summed negative log-likelihood (nats)
    chunks: int

    @property
    def ppl(self) -> float:
        return math.exp(self.nll / self.tokens) if self.tokens else float("nan")


def prompt_logprobs(c: httpx.Client, ep: Endpoint, text: str) -> list[float]:
    """The logprob of each prompt token given the ones before it (the first token has none)."""
    body = {"model": ep.model, "prompt": text, "max_tokens": 1, "echo": True, "logprobs": 1, "temperature": 0.0}
    r = c.post(f"{ep.api}/completions", json=body)
    if r.status_code != 200:
        raise BenchError(f"{ep.api}/completions answered HTTP {r.status_code}: {r.text[:300]}")
    data = r.json()
    lp = (data["choices"][0].get("logprobs") or {}).get("token_logprobs")
    n = (data.get("usage") or {}).get("prompt_tokens")
    if lp is None or n is None:
        raise BenchError(f"{ep.base_url} returned no prompt logprobs (`echo` + `logprobs` on /v1/completions); "
                         f"perplexity needs them")
    return [x for x in lp[:n] if x is not None]


def perplexity(ep: Endpoint, text: str, *, chunk_chars: int = 2000, progress: bool | None = None,
               into: Perplexity | None = None) -> Perplexity:
    """Each chunk is scored on its own (its first token has no context, so it is not counted). Sums go
    into `into` as chunks finish, so an interrupted run still has a perplexity of what it scored."""
    from tqdm import tqdm

    chunks = split_text(text, chunk_chars)
    if not chunks:
        raise BenchError("the file has no text to score")
    total = into if into is not None else Perplexity(tokens=0, nll=0.0, chunks=0)
    disable = None if progress is None else not progress
    with ep.client() as c:
        for chunk in tqdm(chunks, unit="chunk", desc="eval ppl", disable=disable, leave=False):
            lps = prompt_logprobs(c, ep, chunk)
            total.tokens += len(lps)
            total.nll -= sum(lps)
            total.chunks += 1
    return total

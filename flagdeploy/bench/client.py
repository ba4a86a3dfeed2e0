"""The endpoint under test: URL handling, the checks run before any load, and the SSE stream reader.

Every command checks the endpoint first (reachable, serves the model, streams) so that a typo in the
URL or the model name is one clear message, not a table of 100% errors after minutes of "load".
"""

from __future__ import annotations

import json
import logging
import time
from dataclasses import dataclass, field

import httpx

from flagdeploy.errors import FlagdeployError

log = logging.getLogger(__name__)


class BenchError(FlagdeployError):
    """The endpoint or the input cannot be benchmarked; the message says why and what to do."""


@dataclass
class Endpoint:
    """An OpenAI-compatible server. `base_url` may be given with or without the `/v1` suffix."""

    base_url: str
    model: str
    api_key: str | None = None
    timeout: float = 600.0
    max_model_len: int | None = None  # from /v1/models where the server says (ours, vLLM, SGLang)
    served_ids: list[str] = field(default_factory=list)

    def __post_init__(self) -> None:
        url = self.base_url.strip().rstrip("/")
        if not url.startswith(("http://", "https://")):
            raise BenchError(f"--base-url {self.base_url!r} is not an http(s) URL; write e.g. http://127.0.0.1:8000")
        self.base_url = url.removesuffix("/v1")

    @property
    def api(self) -> str:
        return f"{self.base_url}/v1"

    @property
    def headers(self) -> dict[str, str]:
        return {"Authorization": f"Bearer {self.api_key}"} if self.api_key else {}

    def client(self) -> httpx.Client:
        return httpx.Client(headers=self.headers, timeout=self.timeout)

    def async_client(self, connections: int) -> httpx.AsyncClient:
        limits = httpx.Limits(max_connections=connections + 4, max_keepalive_connections=connections + 4)
        return httpx.AsyncClient(headers=self.headers, timeout=self.timeout, limits=limits)

    @property
    def root(self) -> str:
        """The server root (`base_url` without `/v1`), where /metrics, /health and /ready live."""
        return self.base_url

    def metrics_text(self, timeout: float = 30) -> str | None:
        """The Prometheus text of `GET {root}/metrics`, or None when there is none (no such route, an
        error status, an unreachable server): every /metrics reader here treats that as "not exposed"."""
        url = f"{self.root}/metrics"
        try:
            r = httpx.get(url, headers=self.headers, timeout=min(self.timeout, timeout))
        except httpx.HTTPError as exc:
            log.warning("cannot read %s: %s: %s", url, exc.__class__.__name__, exc)
            return None
        if r.status_code != 200:
            log.info("%s answered HTTP %d: no server metrics", url, r.status_code)
            return None
        return r.text

    # ---- checks before load ---------------------------------------------------------------------

    def check_model(self) -> None:
        """Reachable, authorised, and lists the model (case-insensitive, as our server matches). Sets
        `model` to the server's spelling and `max_model_len` where /v1/models reports it."""
        url = f"{self.api}/models"
        try:
            r = httpx.get(url, headers=self.headers, timeout=min(self.timeout, 30))
        except httpx.HTTPError as exc:
            raise BenchError(f"cannot reach {url}: {exc.__class__.__name__}: {exc or 'no answer'}. Check the URL "
                             f"(--base-url; --a / --b for `bench ab`) and that the server is running.") from None
        if r.status_code in (401, 403):
            raise BenchError(f"{url} refused the API key (HTTP {r.status_code}); pass --api-key or set "
                             f"FLAGDEPLOY_API_KEY.")
        if r.status_code != 200:
            raise BenchError(f"{url} answered HTTP {r.status_code}, not a model list: {r.text[:200]!r}. Is "
                             f"--base-url an OpenAI-compatible server?")
        try:
            data = r.json()["data"]
        except (ValueError, KeyError, TypeError):
            raise BenchError(f"{url} did not answer an OpenAI model list: {r.text[:200]!r}") from None
        self.served_ids = [str(m.get("id")) for m in data if isinstance(m, dict)]
        for m in data:
            if str(m.get("id", "")).lower() == self.model.lower():
                self.model = m["id"]
                mml = m.get("max_model_len") or m.get("context_length")
                self.max_model_len = int(mml) if isinstance(mml, int) else None
                return
        raise BenchError(f"the server at {self.base_url} does not serve model {self.model!r}; it lists: "
                         f"{', '.join(self.served_ids) or 'nothing'}. Pass one of those to --model.")

    def check_streaming(self, path: str = "/completions", body: dict | None = None) -> None:
        """One tiny request with `stream: true`; the answer must be server-sent events. A server that
        answers plain JSON would make every TTFT equal the end-to-end time, a silently wrong benchmark."""
        body = {"model": self.model, "prompt": "Hello", "max_tokens": 2, "stream": True} if body is None else body
        url = f"{self.api}{path}"
        try:
            with self.client() as c, c.stream("POST", url, json=body) as r:
                if r.status_code != 200:
                    r.read()
                    raise BenchError(f"the streaming check to {url} failed with HTTP {r.status_code}: "
                                     f"{_error_text(r)}")
                ctype = r.headers.get("content-type", "")
                if "text/event-stream" not in ctype:
                    got = ctype or "no content type"
                    raise BenchError(f"{url} does not stream: asked for `stream: true`, it answered {got} instead "
                                     f"of text/event-stream. TTFT and inter-token latency cannot be measured on it.")
                for line in r.iter_lines():
                    if line.startswith("data:"):
                        return
                raise BenchError(f"{url} answered text/event-stream without any `data:` event.")
        except httpx.HTTPError as exc:
            raise BenchError(f"the streaming check to {url} failed: {exc.__class__.__name__}: {exc}") from None


def _error_text(r: httpx.Response) -> str:
    try:
        err = r.json().get("error")
        if isinstance(err, dict):
            return str(err.get("message"))
        return str(err or r.json())
    except ValueError:
        return r.text[:300]


@dataclass
class StreamResult:
    """One streamed answer: arrival time of each chunk that carried output, the text, usage."""

    chunk_times: list[float] = field(default_factory=list)
    text: str = ""
    prompt_tokens: int | None = None
    completion_tokens: int | None = None
    cached_tokens: int | None = None  # usage.prompt_tokens_details.cached_tokens, where the server reports it
    finish_reason: str | None = None
    # first chunk with output *or* a finish reason: when the first token was produced even if it was EOS
    first_token_time: float | None = None


def _chunk_text(choice: dict) -> str:
    if "text" in choice:
        return choice.get("text") or ""
    delta = choice.get("delta") or {}
    return (delta.get("content") or "") + (delta.get("reasoning_content") or delta.get("reasoning") or "")


async def stream_request(client: httpx.AsyncClient, url: str, body: dict) -> StreamResult:
    """POST `body` with streaming and read the SSE answer. Raises BenchError for an HTTP error or an
    error event, so the caller records it as a failed request with its reason."""
    out = StreamResult()
    async with client.stream("POST", url, json=body) as r:
        if r.status_code != 200:
            await r.aread()
            raise BenchError(f"HTTP {r.status_code}: {_error_text(r)}")
        async for line in r.aiter_lines():
            if not line.startswith("data:"):
                continue
            data = line[5:].strip()
            if data == "[DONE]":
                break
            now = time.perf_counter()
            try:
                chunk = json.loads(data)
            except ValueError:
                raise BenchError(f"a stream event is not JSON: {data[:200]!r}") from None
            if chunk.get("error"):
                raise BenchError(f"error event: {chunk['error']}")
            usage = chunk.get("usage")
            if usage:
                out.prompt_tokens = usage.get("prompt_tokens")
                out.completion_tokens = usage.get("completion_tokens")
                out.cached_tokens = (usage.get("prompt_tokens_details") or {}).get("cached_tokens")
            for choice in chunk.get("choices") or []:
                text = _chunk_text(choice)
                if text:
                    out.text += text
                    if not out.chunk_times or out.chunk_times[-1] != now:
                        out.chunk_times.append(now)
                out.finish_reason = choice.get("finish_reason") or out.finish_reason
                if out.first_token_time is None and (text or out.finish_reason):
                    out.first_token_time = now
    return out

"""Forward one OpenAI request to a replica of an upstream model, and its answer back, normalised.

What a client can rely on, whichever engine answers:
- never a hang: connecting has `connect_timeout`, waiting for the answer (or for the next chunk of a
  stream) has `read_timeout`; a replica that cannot be reached is reported to its supervisor and the
  next ready replica is tried; when none is left the answer is 503 with Retry-After, at once.
- streams pass through chunk by chunk (no buffering), rewritten by `normalize.StreamNormalizer`.
- a client that disconnects (mid-stream, or while waiting for a non-streamed answer) closes the
  upstream request at once, so the engine aborts the generation instead of finishing it for nobody.
- a dialect that shows the prompt's tokens before the engine answers (Anthropic's message_start)
  has them counted first, on the replica that then serves the request (gateway/tokens.py).
- a prefill-decode pair (a pool with prefill instances, serve.yaml's `prefill_upstreams`) answers in two
  steps, as vllm-router --vllm-pd-disaggregation does for vLLM's NixlConnector: the chat/completions
  request (after a dialect's translation) first goes to a prefill instance with max_tokens 1, no stream and
  `kv_transfer_params: {do_remote_decode: true, ...}`; the kv_transfer_params of its answer are added,
  unchanged, to the client's request, which then goes to a decode replica as any request does (balancer,
  retries, stream, disconnect). A prefill instance that cannot be reached is reported and another is
  tried; none left: 503 naming them. An answer without kv_transfer_params: decode computes the prompt.
"""

from __future__ import annotations

import asyncio
import json
import logging
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, AsyncIterator, Callable

import httpx
from starlette.types import Receive, Send

from flagdeploy.server.disconnect import ClientDisconnected, until_disconnect
from flagdeploy.server.errors import APIError

from .balancer import affinity_key
from .normalize import (
    StreamNormalizer,
    normalize_response,
    prepare_request,
    says_which_stop,
    upstream_body,
    upstream_error,
    upstream_unavailable,
)
from .send import send_json
from .translate import PASSTHROUGH, Dialect

if TYPE_CHECKING:
    from .app import ModelPool

log = logging.getLogger(__name__)

PD_PATHS = ("/v1/chat/completions", "/v1/completions")  # the routes a prefill-decode pair runs in two steps
# What vllm-router sends a prefill instance (vLLM's NixlConnector protocol; engine/kv_transfer.py).
REMOTE_DECODE = {"do_remote_decode": True, "do_remote_prefill": False, "remote_engine_id": None,
                 "remote_block_ids": None, "remote_host": None, "remote_port": None}
SSE_HEADERS = [(b"content-type", b"text/event-stream; charset=utf-8"), (b"cache-control", b"no-cache"),
               (b"x-accel-buffering", b"no")]


@dataclass
class Timeouts:
    connect: float = 5.0
    read: float = 600.0

    def httpx(self) -> httpx.Timeout:
        return httpx.Timeout(connect=self.connect, read=self.read, write=self.read, pool=self.connect)


class Proxy:
    """Holds the one HTTP client (and its connection pool) every upstream request goes through."""

    def __init__(self, timeouts: Timeouts | None = None):
        self.timeouts = timeouts or Timeouts()
        self.client = httpx.AsyncClient(timeout=self.timeouts.httpx(),
                                        limits=httpx.Limits(max_connections=None, max_keepalive_connections=64))

    async def aclose(self) -> None:
        await self.client.aclose()

    async def handle(self, pool: "ModelPool", path: str, body: dict[str, Any], receive: Receive, send: Send,
                     dialect: Dialect = PASSTHROUGH) -> None:
        """Answer the request (already authenticated, body parsed and, for another protocol, turned
        into a chat request by `dialect`) from one of `pool`'s replicas."""
        model = pool.name
        path = dialect.upstream_path or path
        send_error = dialect.send_error
        key = affinity_key(body)
        if pool.prefill and path in PD_PATHS:
            try:
                params = await until_disconnect(receive, self._prefill(pool, path, body, key))
            except ClientDisconnected:
                log.info("%s: client disconnected during the prefill step", model)
                return
            except APIError as exc:
                await send_error(send, exc)
                return
            body = {k: v for k, v in body.items() if k != "kv_transfer_params"}  # the pair's, never the client's
            if params is not None:
                body["kv_transfer_params"] = params
        tried: set[str] = set()
        while True:
            picked = pool.pick(key, exclude=tried)
            if picked is None:
                error = pool.unavailable() if not tried else upstream_unavailable(model, "no replica could be reached")
                await send_error(send, error)
                return
            replica, upstream = picked
            up_body, wants_usage = prepare_request(body, upstream.model_id)
            headers = {"Authorization": f"Bearer {upstream.api_key}"} if upstream.api_key else {}
            pool.balancer.acquire(replica)
            released = False

            def release() -> None:
                """Once the engine is done with the request, before the client has the last byte: the
                client's next request must see this replica idle again."""
                nonlocal released
                if not released:
                    released = True
                    pool.balancer.release(replica)

            try:
                if dialect.wants_prompt_count:  # before the request: llama-cpp-python serves one at a time
                    counting = self._prompt_tokens(pool, upstream, up_body, dialect.request)
                    dialect.input_tokens = await until_disconnect(receive, counting)
                request = self.client.build_request("POST", f"{upstream.url}{path}", json=up_body, headers=headers)
                try:
                    response = await until_disconnect(receive, self.client.send(request, stream=True))
                except (httpx.ConnectError, httpx.ConnectTimeout) as exc:
                    log.warning("%s: cannot reach %s (%s); trying another replica", model, upstream.url, exc)
                    upstream.report_failure(f"connection failed: {exc}")
                    tried.add(upstream.url)
                    continue
                except httpx.TimeoutException:
                    await send_error(send, upstream_unavailable(
                        model, f"no answer within the read timeout of {self.timeouts.read:.0f} s"))
                    return
                except httpx.HTTPError as exc:
                    upstream.report_failure(str(exc))
                    await send_error(send, upstream_unavailable(model, f"{type(exc).__name__}: {exc}"))
                    return
                if dialect.clamps_max_tokens and response.status_code == 400 and "max_tokens" in body:
                    raw = await until_disconnect(receive, response.aread())
                    await _close(response)
                    error = upstream_error(400, upstream_body(raw), response.headers)
                    if error.code != "context_length_exceeded":
                        await send_error(send, error)
                        return
                    # the client's max_tokens cannot fit after the prompt (Claude Code asks every model for
                    # 32,000): asked again without it, the engine generates what fits, as the builtin route does
                    body = {k: v for k, v in body.items() if k != "max_tokens"}
                    continue
                try:
                    await self._answer(response, model, path, bool(body.get("stream")), wants_usage, upstream,
                                       receive, send, release, dialect)
                finally:
                    await _close(response)
                return
            except ClientDisconnected:
                log.info("%s: client disconnected; upstream request to %s closed", model, upstream.url)
                return
            finally:
                release()

    async def _prefill(self, pool: "ModelPool", path: str, body: dict[str, Any], key: str | None) -> Any:
        """The first step of a prefill-decode pair: `body` (the upstream request) computed on a prefill
        instance, which keeps the prompt's cache for the decode instance. Returns the kv_transfer_params
        of its answer (None: it returned none; decode then computes the prompt), or raises the APIError
        for the client."""
        model = pool.name
        tried: dict[str, str] = {}
        while True:
            picked = pool.pick_prefill(key, exclude=set(tried))
            if picked is None:
                if not tried:
                    raise pool.unavailable_prefill()
                why = "; ".join(f"{url}: {reason}" for url, reason in tried.items())
                raise upstream_unavailable(model, f"no prefill instance could be reached ({why})")
            replica, upstream = picked
            up_body, _ = prepare_request(body, upstream.model_id)
            up_body |= {"stream": False, "max_tokens": 1, "min_tokens": 1, "kv_transfer_params": dict(REMOTE_DECODE)}
            up_body.pop("stream_options", None)
            if "max_completion_tokens" in up_body:  # it wins over max_tokens
                up_body["max_completion_tokens"] = 1
            headers = {"Authorization": f"Bearer {upstream.api_key}"} if upstream.api_key else {}
            pool.prefill_balancer.acquire(replica)
            try:
                response = await self.client.post(f"{upstream.url}{path}", json=up_body, headers=headers)
            except (httpx.ConnectError, httpx.ConnectTimeout) as exc:
                log.warning("%s: cannot reach prefill instance %s (%s); trying another", model, upstream.url, exc)
                upstream.report_failure(f"connection failed: {exc}")
                tried[upstream.url] = f"connection failed: {exc}"
                continue
            except httpx.TimeoutException:
                raise upstream_unavailable(model, f"the prefill instance {upstream.url} did not answer within the "
                                                  f"read timeout of {self.timeouts.read:.0f} s") from None
            except httpx.HTTPError as exc:
                upstream.report_failure(str(exc))
                raise upstream_unavailable(model, f"prefill instance {upstream.url}: {type(exc).__name__}: {exc}") \
                    from None
            finally:
                pool.prefill_balancer.release(replica)
            answer = upstream_body(response.content)
            if response.status_code >= 400:
                if response.status_code >= 500:
                    log.warning("%s: prefill instance %s answered %d: %s", model, upstream.url,
                                response.status_code, response.content[:300])
                raise upstream_error(response.status_code, answer, response.headers)
            params = answer.get("kv_transfer_params") if isinstance(answer, dict) else None
            if params is None:
                log.info("%s: prefill instance %s returned no kv_transfer_params; decode computes the prompt",
                         model, upstream.url)
            return params

    async def _prompt_tokens(self, pool: "ModelPool", upstream: Any, body: dict[str, Any],
                             request: dict[str, Any] | None) -> int | None:
        """The prompt's tokens for a dialect to show before the engine answers (`request`: the
        client's own body). A failed count costs only that number (logged), never the request."""
        try:
            return await pool.count_tokens(self.client, upstream, body, request)
        except APIError as exc:
            log.warning("%s: prompt tokens not counted on %s: %s", pool.name, upstream.url, exc.message)
            return None

    async def _answer(self, response: httpx.Response, model: str, path: str, stream: bool, wants_usage: bool,
                      upstream: Any, receive: Receive, send: Send, release: Callable[[], None],
                      dialect: Dialect) -> None:
        send_error = dialect.send_error
        if response.status_code >= 400:
            raw = await until_disconnect(receive, response.aread())
            release()
            error = upstream_error(response.status_code, upstream_body(raw), response.headers)
            if response.status_code >= 500:
                log.warning("%s: %s answered %d: %s", model, upstream.url, response.status_code, raw[:300])
            await send_error(send, error)
            return
        is_sse = response.headers.get("content-type", "").startswith("text/event-stream")
        if not stream or not is_sse:
            try:
                raw = await until_disconnect(receive, response.aread())
            except httpx.TimeoutException:
                await send_error(send, upstream_unavailable(model, "the answer did not come within the read timeout"))
                return
            except httpx.HTTPError as exc:
                upstream.report_failure(str(exc))
                await send_error(send, upstream_unavailable(model, f"the engine broke off its answer ({exc})"))
                return
            release()
            body = upstream_body(raw)
            if not isinstance(body, dict):
                await send_error(send, upstream_unavailable(model, "the engine answered something that is not JSON"))
                return
            choices = [c for c in body.get("choices") or [] if isinstance(c, dict)]
            upstream.says_which_stop |= any(says_which_stop(c) for c in choices)
            await send_json(send, 200, dialect.answer(normalize_response(body, model)))
            return
        kind = "chat" if path.endswith("/chat/completions") else "text"
        normalizer = StreamNormalizer(model, wants_usage, kind)
        events = _events(response, normalizer, model, upstream, release)
        try:
            if dialect.client_stream is False:  # the dialect streams upstream for an answer of its own
                try:
                    answer = await until_disconnect(receive, dialect.collected(events))
                except APIError as exc:
                    await send_error(send, exc)
                    return
                await send_json(send, 200, answer)
            else:
                await stream_to_client(dialect.frames(events), receive, send)
        finally:
            upstream.says_which_stop |= normalizer.says_which_stop


async def _events(response: httpx.Response, normalizer: StreamNormalizer, model: str, upstream: Any,
                  release: Callable[[], None]) -> AsyncIterator[str]:
    """The normalised SSE payloads (JSON text, `[DONE]`), chunk by chunk as the upstream sends them."""
    data: list[str] = []
    try:
        async for line in response.aiter_lines():
            if line.startswith("data:"):
                data.append(line[5:].removeprefix(" "))
                continue
            if line.strip() or not data:  # comments (`: ping`), event:/id: lines, stray blank lines
                continue
            events = normalizer.event("\n".join(data))
            data = []
            if normalizer.done:
                release()
            for out in events:
                yield out
            if normalizer.done:
                return
        if data:  # the last event had no blank line after it
            for out in normalizer.event("\n".join(data)):
                yield out
        release()
        for out in normalizer.end():
            yield out
    except httpx.TimeoutException:
        yield _error_event(f"The engine serving `{model}` sent nothing for the read timeout; the answer is cut short.")
        yield "[DONE]"  # an OpenAI stream ends so, error or not (the builtin routes' streams too)
    except httpx.HTTPError as exc:
        upstream.report_failure(str(exc))
        yield _error_event(f"The engine serving `{model}` broke off the stream ({type(exc).__name__}). "
                           "Retry the request.")
        yield "[DONE]"


def _error_event(message: str) -> str:
    body = {"error": {"message": message, "type": "service_unavailable_error", "param": None,
                      "code": "upstream_error"}}
    return json.dumps(body, separators=(",", ":"))


async def stream_to_client(events: AsyncIterator[bytes], receive: Receive, send: Send) -> None:
    """Send `events` as a 200 SSE response, stopping the moment the client disconnects (not at the
    next chunk: during a long prefill there is none)."""
    await send({"type": "http.response.start", "status": 200, "headers": SSE_HEADERS})

    async def pump() -> None:
        async for chunk in events:
            await send({"type": "http.response.body", "body": chunk, "more_body": True})
        await send({"type": "http.response.body", "body": b"", "more_body": False})

    try:
        await until_disconnect(receive, pump())
    except OSError:  # the connection broke while sending
        raise ClientDisconnected() from None
    finally:
        aclose = getattr(events, "aclose", None)
        if aclose is not None:
            await asyncio.shield(aclose())


async def _close(response: httpx.Response) -> None:
    try:
        await asyncio.shield(response.aclose())
    except Exception:  # noqa: BLE001 - closing a broken connection may fail; it is closed either way
        pass

"""The OpenAI and Anthropic error envelopes, and the handlers that put every failure into one of them.

Clients key their behaviour on the status: the SDKs retry 408/409/429/5xx (twice by default),
LangChain turns a 400 with `context_length_exceeded` into a context-overflow signal, and Dify shows
the raw body. So client mistakes are always 4xx (never FastAPI's 422) and the body is always
`{"error": {"message", "type", "param", "code"}}`.
"""

from __future__ import annotations

import logging
from typing import Any, Iterable

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.requests import ClientDisconnect
from starlette.responses import Response
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from flagdeploy.errors import PromptTooLongError

from .protocol import request_field_names

log = logging.getLogger(__name__)

BAD_JSON_MESSAGE = (
    "We could not parse the JSON body of your request. (HINT: This likely means you aren't using your "
    "HTTP library correctly. The API expects a JSON payload, but what was sent was not valid JSON.)"
)
SERVER_ERROR_MESSAGE = "The server had an error while processing your request."

_FIELDS = request_field_names()


class APIError(Exception):
    """An error with everything its HTTP answer needs; raised anywhere, rendered by one handler."""

    def __init__(self, status: int, message: str, type: str = "invalid_request_error", param: str | None = None,
                 code: str | None = None, headers: dict[str, str] | None = None):
        super().__init__(message)
        self.status = status
        self.message = message
        self.type = type
        self.param = param
        self.code = code
        self.headers = headers

    def body(self) -> dict[str, Any]:
        return error_body(self.message, self.type, self.param, self.code)

    def response(self) -> JSONResponse:
        return JSONResponse(self.body(), status_code=self.status, headers=self.headers)


def error_body(message: str, type: str, param: str | None = None, code: str | None = None) -> dict[str, Any]:
    return {"error": {"message": message, "type": type, "param": param, "code": code}}


# Anthropic's error type for each status (its documented table). Our 503 "still loading" (with
# Retry-After) is transient like Anthropic's 529, so it is "overloaded"; a 503 without Retry-After
# (the model failed to load) is an api_error.
_ANTHROPIC_TYPES = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
                    404: "not_found_error", 405: "invalid_request_error", 408: "timeout_error",
                    413: "request_too_large", 415: "invalid_request_error", 429: "rate_limit_error",
                    503: "overloaded_error", 529: "overloaded_error"}

ANTHROPIC_PATHS = "/v1/messages"  # the routes whose clients (Claude Code, the anthropic SDK) read Anthropic's shape


def anthropic_response(exc: APIError) -> JSONResponse:
    """An APIError (raised by the shared code in OpenAI terms) in Anthropic's shape."""
    kind = _ANTHROPIC_TYPES.get(exc.status, "api_error" if exc.status >= 500 else "invalid_request_error")
    if exc.status == 503 and not exc.headers:
        kind = "api_error"
    return JSONResponse({"type": "error", "error": {"type": kind, "message": exc.message}},
                        status_code=exc.status, headers=exc.headers)


# ---- the errors the routes raise -----------------------------------------------------------------


def bad_json() -> APIError:
    return APIError(400, BAD_JSON_MESSAGE)


def model_not_found(name: str) -> APIError:
    return APIError(404, f"The model `{name}` does not exist or you do not have access to it.",
                    param="model", code="model_not_found")


def invalid_api_key(given: str | None) -> APIError:
    if not given:
        message = ("You didn't provide an API key. Send it as `Authorization: Bearer <key>` "
                   "(or `x-api-key: <key>`); the server was started with --api-key.")
    else:
        message = f"Incorrect API key provided: {_mask(given)}."
    return APIError(401, message, code="invalid_api_key")


def model_loading() -> APIError:
    return APIError(503, "The model is still loading; retry in a few seconds.", type="service_unavailable_error",
                    code="model_loading", headers={"Retry-After": "5"})


def model_load_failed(reason: str) -> APIError:
    # No Retry-After: retrying cannot help until an operator fixes the model and restarts.
    return APIError(503, f"The model failed to load, so this server cannot answer: {reason}",
                    type="service_unavailable_error", code="model_load_failed")


def overloaded(max_waiting: int, status: int = 429) -> APIError:
    """Too many requests already wait for the engine. 429 with OpenAI's rate-limit body (type
    `requests`, code `rate_limit_exceeded`, as real OpenAI answers); the Anthropic routes send 529,
    which they render as `overloaded_error`. Both SDKs retry after Retry-After."""
    return APIError(status, f"The server is busy: more than {max_waiting} requests are already waiting. "
                            "Retry after a short while.", type="requests", code="rate_limit_exceeded",
                    headers={"Retry-After": "1"})


def max_tokens_too_large(max_model_len: int, prompt_tokens: int, requested: int, param: str) -> APIError:
    """`max_tokens` cannot fit after the prompt (with --max-tokens-policy error, the default): the
    numbers, in the words OpenAI and vLLM use, so that a client can size its next request."""
    return APIError(400, f"This model's maximum context length is {max_model_len} tokens. However, you requested "
                         f"{prompt_tokens + requested} tokens ({prompt_tokens} in the prompt, {requested} in the "
                         f"completion: `{param}`). Please reduce the length of the prompt or `{param}` (at most "
                         f"{max_model_len - prompt_tokens} here).", param=param, code="context_length_exceeded")


def request_timeout(seconds: float) -> APIError:
    """The request ran past --request-timeout; its engine requests are aborted."""
    return APIError(408, f"The request took longer than the server's limit of {seconds:g} s (--request-timeout) and "
                         "was stopped. Ask for fewer tokens, or retry when the server is less busy.",
                    type="timeout_error", code="request_timeout")


def server_error(detail: str | None = None) -> APIError:
    message = SERVER_ERROR_MESSAGE if not detail else f"{SERVER_ERROR_MESSAGE} ({detail})"
    return APIError(500, message, type="server_error")


def from_generation(exc: BaseException, prompt_param: str) -> APIError:
    """Map what `engine.generate` raised to an answer: the client's fault (400) or ours (500)."""
    if isinstance(exc, APIError):
        return exc
    if isinstance(exc, PromptTooLongError):
        # openai>=3 puts only `message` (not `code`) in the exception text, and LangChain spots a
        # context overflow by text: the message opens with "The prompt is too long", one of its markers.
        return APIError(400, str(exc), param=prompt_param, code="context_length_exceeded")
    if isinstance(exc, ValueError):  # sampling values are checked before; what remains is the prompt
        return APIError(400, str(exc), param=prompt_param)
    log.error("generation failed", exc_info=exc)
    return server_error(str(exc) or type(exc).__name__)


def from_validation(errors: Iterable[dict[str, Any]], fields: frozenset[str] = _FIELDS) -> APIError:
    """A 400 naming the first offending field, the way OpenAI reports a bad parameter. `fields`: the
    request models' field names (other location parts are union members' tags, left out)."""
    errors = list(errors)
    if not errors:
        return APIError(400, "The request body is invalid.")
    first = most_specific(errors)
    loc = [part for part in first.get("loc", ()) if part != "body"]
    if first.get("type") == "json_invalid":
        return bad_json()
    if not loc and first.get("type") == "model_type":
        return APIError(400, "The request body must be a JSON object.")
    param = _param(loc, fields)
    message = first.get("msg", "invalid value")
    if param:
        message = f"Invalid value for '{param}': {message}"
        if first.get("type") == "missing":
            message = f"Missing required parameter: '{param}'."
    more = len({_param([p for p in e.get("loc", ()) if p != "body"], fields) for e in errors}) - 1
    if more > 0:
        message += f" (and {more} more invalid field{'s' if more > 1 else ''})"
    return APIError(400, message, param=param)


def most_specific(errors: list[dict[str, Any]]) -> dict[str, Any]:
    """The pydantic error deepest in the body (the first of those): where a value matches no member of a
    union, each member fails, and the deepest names what is wrong (`content[0].text` is no string) where
    the first would name another member (`content` is no string)."""
    return max(errors, key=lambda e: len(e.get("loc", ())))


def _param(loc: list[Any], fields: frozenset[str]) -> str | None:
    """`messages[0].content` from a pydantic location; union-member tags (`str`, `list[str]`) dropped."""
    out = ""
    for part in loc:
        if isinstance(part, int):
            out += f"[{part}]"
        elif part in fields:
            out += f".{part}" if out else str(part)
    return out or None


def _mask(key: str) -> str:
    return key[:3] + "*" * 4 + key[-4:] if len(key) > 8 else "*" * len(key)


# ---- handlers ------------------------------------------------------------------------------------


def install_error_handlers(app: FastAPI) -> None:
    """Client errors through FastAPI's handlers; anything else through `UnexpectedErrors`, added last
    so that it wraps the app's other middleware (whose request counters then see the 500)."""
    app.add_exception_handler(APIError, _on_api_error)
    app.add_exception_handler(RequestValidationError, _on_validation_error)
    app.add_exception_handler(StarletteHTTPException, _on_http_error)
    app.add_exception_handler(ClientDisconnect, _on_disconnect)
    app.add_middleware(UnexpectedErrors)


async def _on_api_error(request: Request, exc: APIError) -> JSONResponse:
    return exc.response()


async def _on_validation_error(request: Request, exc: RequestValidationError) -> JSONResponse:
    return from_validation(exc.errors()).response()


async def _on_http_error(request: Request, exc: StarletteHTTPException) -> JSONResponse:
    """Routing errors (unknown URL, wrong method) in the envelope of the protocol the path belongs to,
    so SDKs show a readable message."""
    if exc.status_code == 404:
        message = f"Invalid URL ({request.method} {request.url.path})"
    elif exc.status_code == 405:
        message = f"Method {request.method} is not allowed for {request.url.path}"
    else:
        message = str(exc.detail)
    if request.url.path.startswith(ANTHROPIC_PATHS):
        return anthropic_response(APIError(exc.status_code, message, headers=exc.headers))
    type_ = "server_error" if exc.status_code >= 500 else "invalid_request_error"
    return JSONResponse(error_body(message, type_), status_code=exc.status_code, headers=exc.headers)


async def _on_disconnect(request: Request, exc: ClientDisconnect) -> Response:
    """The client hung up before its body arrived: nobody reads an answer, and it is no server error
    (a slowloris client used to leave a traceback and a counted 500 per connection)."""
    log.debug("client disconnected before sending its body: %s %s", request.method, request.url.path)
    return Response(status_code=499)


class UnexpectedErrors:
    """A bug becomes one 500 in the envelope and one log line. (A handler for `Exception` would answer
    too, but Starlette re-raises after it, and uvicorn logs the same traceback a second time.) Once a
    response has started nothing can be answered any more; the error is left to the server then."""

    def __init__(self, app: ASGIApp):
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        started = False

        async def send_wrapper(message: Message) -> None:
            nonlocal started
            if message["type"] == "http.response.start":
                started = True
            await send(message)

        try:
            await self.app(scope, receive, send_wrapper)
        except Exception as exc:
            if started:
                raise
            log.error("unhandled error on %s %s", scope.get("method"), scope.get("path"), exc_info=exc)
            await server_error().response()(scope, receive, send)

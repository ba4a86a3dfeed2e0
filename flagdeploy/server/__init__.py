"""The HTTP front: one FastAPI app speaking the OpenAI protocol in front of an engine."""

from __future__ import annotations

import uvicorn
from fastapi import FastAPI

from .app import create_app


def make_server(app: FastAPI, host: str = "127.0.0.1", port: int = 8000, log_level: str = "warning") -> uvicorn.Server:
    """A uvicorn server for `app`, not yet running (the CLI keeps it to stop it on a failed load).

    The access log is per request, so it is on only at debug level; streamed requests would
    otherwise drown the useful lines.
    """
    config = uvicorn.Config(app, host=host, port=port, log_level=log_level, access_log=log_level == "debug",
                            timeout_graceful_shutdown=5)
    return uvicorn.Server(config)


def run(app: FastAPI, host: str = "127.0.0.1", port: int = 8000, log_level: str = "warning") -> None:
    """Serve `app` until interrupted."""
    make_server(app, host, port, log_level).run()


__all__ = ["create_app", "make_server", "run"]

"""The engine a server answers with, loaded on a thread so that the server is up before the weights are."""

from __future__ import annotations

import logging
import threading
import time
from typing import TYPE_CHECKING, Callable

from flagdeploy.errors import FlagdeployError

from . import errors

if TYPE_CHECKING:
    from flagdeploy.engine import AsyncEngine

log = logging.getLogger(__name__)


class EngineSlot:
    """Holds the engine once `load_engine` returns; loading runs on a thread so the server can
    answer /health and /ready (and a clear 503) while weights are read."""

    def __init__(self, load_engine: Callable[[], "AsyncEngine"]):
        self._load_engine = load_engine
        self.engine: "AsyncEngine | None" = None
        self.error: str | None = None
        self._thread: threading.Thread | None = None

    def start(self) -> None:
        self._thread = threading.Thread(target=self._load, name="flagdeploy-load", daemon=True)
        self._thread.start()

    def _load(self) -> None:
        started = time.monotonic()
        try:
            engine = self._load_engine()
        except BaseException as exc:  # noqa: BLE001 - a failed load must leave the server answering
            self.error = str(exc) or type(exc).__name__
            # a refusal the user can act on is its one line (the message says what to do); anything else
            # is a bug, with its traceback
            log.error("loading the model failed: %s", self.error,
                      exc_info=None if isinstance(exc, FlagdeployError) else exc)
            return
        self.engine = engine
        log.info("model loaded in %.1f s", time.monotonic() - started)

    def fail(self, message: str) -> None:
        """The engine can no longer answer (a machine of its replica is gone): /ready and the inference
        routes answer 503 with `message` from now on."""
        self.error = message
        self.engine = None

    def get(self) -> "AsyncEngine":
        if self.engine is not None:
            return self.engine
        if self.error is not None:
            raise errors.model_load_failed(self.error)
        raise errors.model_loading()

    def shutdown(self) -> None:
        stop = getattr(self.engine, "shutdown", None)
        if stop is not None:
            try:
                stop()
            except Exception:  # noqa: BLE001 - shutting down anyway
                log.exception("engine shutdown failed")

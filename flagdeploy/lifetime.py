"""Processes that end with the process that started them.

A parent killed outright (SIGKILL, the OOM killer) cannot stop its children: a `--dp` replica in its own
process group, a parallel rank blocked in a collective. Without a watch they would hold their devices
and ports until someone finds them. Linux reparents an orphan, so the child notices by its parent pid.
"""

from __future__ import annotations

import os
import threading
import time
from typing import Callable


def on_parent_exit(parent: int, action: Callable[[], None], interval: float = 1.0) -> None:
    """Run `action` on a daemon thread once this process's parent is no longer `parent`."""

    def watch() -> None:
        while os.getppid() == parent:
            time.sleep(interval)
        action()

    threading.Thread(target=watch, name="flagdeploy-parent-watch", daemon=True).start()

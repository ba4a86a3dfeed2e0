"""The names one served model answers to: aliases, case, and clients' context suffixes."""

from __future__ import annotations

import re

from . import errors

_CONTEXT_SUFFIX = re.compile(r"(\s*\[1m\])+\s*$", re.IGNORECASE)


def strip_context_suffix(name: str) -> str:
    """The bare name: Claude Code's `[1m]` (1M-context) marker is client-side decoration."""
    return _CONTEXT_SUFFIX.sub("", name.strip()).strip()


def normalize_model_name(name: str) -> str:
    """The lookup key: the bare name, case-insensitive."""
    return strip_context_suffix(name).lower()


class ModelNames:
    """The names one model answers to; the first is the id every response shows."""

    def __init__(self, names: list[str]):
        if not names:
            raise ValueError("create_app needs at least one served model name")
        self.names = list(names)
        self.canonical = names[0]
        self._keys = {normalize_model_name(n) for n in names}

    def resolve(self, name: str | None) -> str:
        """The canonical id for `name`; a missing or empty name means the one model served."""
        if name is None or not name.strip() or normalize_model_name(name) in self._keys:
            return self.canonical
        raise errors.model_not_found(name)

"""Edge: ONNX Runtime as the engine for small boxes and edge NPUs (docs/edge.md).

export.py  `flagdeploy export onnx`: llama-family model → ONNX decoder (onnxruntime-genai's model builder)
engine.py  the ONNX engine behind the builtin scheduler and server (`serve --engine onnxruntime`)
cli.py     the click commands

Why not a backend plugin (backends/, docs/backends/writing-a-backend.md): a backend overrides torch ops one
at a time under the torch model; ONNX Runtime runs a whole exported graph with its own kernels and cache,
so it replaces the model runner, not ops. It lives here and reuses the engine's scheduler instead.

Importing this package imports neither onnxruntime nor torch.
"""

from __future__ import annotations

from typing import Any


def edge_info(chip: str | None) -> dict[str, Any]:
    """The `edge:` entry of a chip in profiles/chips.yaml ({} when it has none or the id is unknown)."""
    if not chip:
        return {}
    import yaml

    from flagdeploy.chips import CATALOG

    entry = (yaml.safe_load(CATALOG.read_text()) or {}).get(chip.strip().lower())
    return dict(entry.get("edge") or {}) if isinstance(entry, dict) else {}


def edge_chips() -> dict[str, dict[str, Any]]:
    """Every chip of the catalog with an `edge:` entry."""
    import yaml

    from flagdeploy.chips import CATALOG

    data = yaml.safe_load(CATALOG.read_text()) or {}
    return {cid: dict(e["edge"]) for cid, e in data.items() if isinstance(e, dict) and e.get("edge")}


def implied_engine(chip: str | None, engine: str) -> str:
    """`serve --chip cpu-edge` means `--engine onnxruntime`: an explicit --engine other than builtin wins."""
    if engine != "builtin":
        return engine
    return edge_info(chip).get("engine", engine)

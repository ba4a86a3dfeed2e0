"""What a loaded model really holds for its weights, by format, measured from its tensors.

The planner's ledger (ledger.py) counts a checkpoint as stored; the builtin engine does not always hold
that: a GGUF's 4-bit linears stay packed Q4 blocks, the backend may keep a dense copy of them for steps of
many rows (prompts), the LM head may be re-stored as int8, FP8 may stay FP8 or be dequantised. Which of
these happen depends on the backend and the machine (native kernels built or not), so `flagdeploy serve`
reports the bytes after loading, from the tensors themselves, rather than predicting them.

Counted: every parameter, every linear's dense weight and bias, and every quantized weight bundle
(flagdeploy.ops.weights) with what the backend prepared for it, each storage once (a tied LM head shares
the embedding's). Not counted: tables a model derives at start-up (RoPE cos/sin) and the caches, which the
KV line reports.
"""

from __future__ import annotations

import dataclasses
from collections import Counter
from collections.abc import Iterator

import torch

from flagdeploy.ops.weights import Fp8BlockWeight, Int4Weight, Int8Weight

__all__ = ["held_weights", "held_line"]

# A bundle's own tensors (canonical or laid out by the backend) are its format. Its `dense` entry is a
# dequantised copy: kept beside the packed form (the cpu backend, for steps of many rows) it is reported
# as a copy, because it is the surprise; as the only form (the cuda backend) as what it was made from.
_BUNDLE_FORMAT = {Int4Weight: "q4 blocks", Int8Weight: "int8", Fp8BlockWeight: "fp8 blocks"}
_DTYPE_NAME = {torch.float32: "fp32", torch.bfloat16: "bf16", torch.float16: "fp16", torch.int8: "int8", torch.uint8: "uint8",
               **{getattr(torch, n): "fp8" for n in ("float8_e4m3fn", "float8_e5m2") if hasattr(torch, n)}}


def _format_of(bundle) -> str:
    return next((f for t, f in _BUNDLE_FORMAT.items() if isinstance(bundle, t)), type(bundle).__name__)


def _bundle_tensors(bundle) -> Iterator[tuple[str, torch.Tensor]]:
    fmt = _format_of(bundle)
    prepared = bundle.prepared if isinstance(bundle.prepared, dict) else {}
    own = [getattr(bundle, f.name) for f in dataclasses.fields(bundle)]
    own += [value for key, value in prepared.items() if key != "dense"]
    own = [t for t in own if isinstance(t, torch.Tensor)]
    yield from ((fmt, t) for t in own)
    dense = prepared.get("dense")
    if isinstance(dense, torch.Tensor):
        name = _DTYPE_NAME.get(dense.dtype, str(dense.dtype))
        yield (f"{name} copy" if own else f"{name} from {fmt}"), dense


def _is_bundle(x) -> bool:
    return dataclasses.is_dataclass(x) and not isinstance(x, type) and hasattr(x, "prepared")


def _weights(model: torch.nn.Module) -> Iterator[tuple[str, torch.Tensor]]:
    from flagdeploy.models.linear import Linear

    for module in model.modules():
        for p in module._parameters.values():
            if p is not None:
                yield _DTYPE_NAME.get(p.dtype, str(p.dtype)), p
        for name, value in vars(module).items():
            for x in value if isinstance(value, (tuple, list)) else (value,):
                if _is_bundle(x):
                    yield from _bundle_tensors(x)
                elif isinstance(x, torch.Tensor) and isinstance(module, Linear) and name in ("weight", "bias"):
                    yield _DTYPE_NAME.get(x.dtype, str(x.dtype)), x


def _storage(t: torch.Tensor) -> tuple[object, int]:
    """(identity of the memory, its bytes): a view counts its whole buffer once; an opaque tensor (oneDNN's
    laid-out weights) has no storage to ask, so its elements are counted."""
    try:
        s = t.untyped_storage()
        return (t.device, s.data_ptr()), s.nbytes()
    except (RuntimeError, NotImplementedError):
        return id(t), t.numel() * t.element_size()


def held_weights(model: torch.nn.Module) -> dict[str, int]:
    """Bytes of weights this process holds for `model`, by format ('q4 blocks', 'int8', 'fp8 blocks', 'bf16 copy',
    'fp32', ...), largest first. Under tensor/expert parallelism that is this rank's share."""
    seen: set[object] = set()
    out: Counter[str] = Counter()
    for fmt, t in _weights(model):
        if t.device.type == "meta":
            continue
        key, nbytes = _storage(t)
        if key not in seen:
            seen.add(key)
            out[fmt] += nbytes
    return dict(out.most_common())


def held_line(held: dict[str, int], device: str) -> str:
    """`weights held on cpu: 0.44 GiB = bf16 copy (many-row steps) 0.25 + fp32 0.11 + q4 blocks 0.06 + int8 0.03`."""
    gib = 1 << 30
    parts = " + ".join(f"{fmt}{' (many-row steps)' if fmt.endswith(' copy') else ''} {n / gib:.2f}"
                       for fmt, n in held.items())
    return f"weights held on {device}: {sum(held.values()) / gib:.2f} GiB = {parts or 'nothing'}"

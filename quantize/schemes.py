"""What each quantization scheme does to one checkpoint tensor, and which chips can run it.

A scheme turns a source tensor (as stored: BF16, float32, or FP8 with its block inverse scales) into
the tensors of the output checkpoint. The arithmetic is chip-neutral; the output formats only rename
(see `formats`). Int8 schemes apply to weight matrices (2-D `*.weight`); a vector or table that a
policy's int8 rule happens to match is stored as `bf16` would store it (plans say so in a note).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from flagdeploy.ops.weights import FP8_DTYPES


@dataclass(frozen=True)
class Scheme:
    name: str
    requires: str | None  # the matmul dtype the chip must have (chip catalog `matmul_dtypes`), if any
    int8: bool  # stores int8 weights with float32 scales
    doc: str


SCHEMES = {s.name: s for s in (
    Scheme("keep", None, False, "as stored (FP8 weights stay FP8 with their scales: only on FP8 chips)"),
    Scheme("bf16", "bf16", False, "16-bit: FP8 weights dequantised to BF16, BF16 kept, float32 kept"),
    Scheme("w8a8_dynamic", "int8", True,
           "int8 weights, symmetric per output channel; activations quantised to int8 per token at run time"),
    Scheme("w8a16", "bf16", True, "int8 weights per output channel (or per group of input channels); BF16 activations"),
    Scheme("fp8", "fp8", False, "FP8 e4m3 with 128x128 block inverse scales (kept, or quantised from BF16)"),
)}

FP8_BLOCK = (128, 128)  # the published GLM / DeepSeek block


def is_matrix_weight(name: str, shape: tuple[int, ...]) -> bool:
    return name.endswith(".weight") and len(shape) == 2


def is_fp8(dtype: torch.dtype) -> bool:
    return dtype in FP8_DTYPES


def relative_error(approx: torch.Tensor, exact: torch.Tensor) -> float:
    """||approx - exact||_F / ||exact||_F in float64 accumulation (0 for an all-zero tensor)."""
    norm = torch.linalg.vector_norm(exact, dtype=torch.float64)
    if norm == 0:
        return 0.0
    return float(torch.linalg.vector_norm(approx.float() - exact, dtype=torch.float64) / norm)

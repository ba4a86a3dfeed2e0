"""The two output layouts: flagdeploy's own, and the msModelSlim layout vLLM-Ascend loads.

Both keep the source's tensor names and `[out, in]` orientation; they differ in the companions of an
int8 weight, in where the per-tensor schemes are recorded, and in which schemes they can carry.

flagdeploy: `X.weight` int8 + `X.weight_scale` float32 [out, 1] (per channel) or [out, in / G] (per
group); FP8 weights keep `X.weight_scale_inv`; config.json's `quantization_config` has quant_method
"flagdeploy" and names every weight matrix's scheme under `modules`.

vllm-ascend (`--quantization ascend`): W8A8_DYNAMIC weights get `X.weight` int8, `X.weight_scale` and
`X.weight_offset` (zeros: symmetric) float32 [out, 1]; everything else is a 16-bit or float32 "FLOAT"
tensor; `quant_model_description.json` lists every tensor with its type, and config.json has no
`quantization_config` (the FP8 one is gone with the FP8 weights; vLLM-Ascend is told by the flag).
"""

from __future__ import annotations

import torch

FORMATS = ("flagdeploy", "vllm-ascend")
# Which schemes each format can carry (the others need a runtime that format's loader does not have).
CARRIES = {"flagdeploy": ("keep", "bf16", "w8a8_dynamic", "w8a16", "fp8"), "vllm-ascend": ("keep", "bf16", "w8a8_dynamic")}
KEEPS_FP8 = {"flagdeploy": True, "vllm-ascend": False}  # whether `keep` may carry an FP8 tensor and its block scales
DESCRIPTION_FILE = "quant_model_description.json"
_ASCEND_TYPE = {"w8a8_dynamic": "W8A8_DYNAMIC"}


def base_name(weight_name: str) -> str:
    return weight_name[: -len(".weight")] if weight_name.endswith(".weight") else weight_name


def int8_companions(fmt: str, weight_name: str, rows: int, scale_cols: int) -> list[tuple[str, torch.dtype, tuple]]:
    base = base_name(weight_name)
    out = [(f"{base}.weight_scale", torch.float32, (rows, scale_cols))]
    if fmt == "vllm-ascend":
        out.append((f"{base}.weight_offset", torch.float32, (rows, 1)))
    return out


def quantization_config(fmt: str, *, chip: str, policy: str, source: dict | None, modules: dict[str, str],
                        fp8_block: list[int] | None) -> dict | None:
    if fmt == "vllm-ascend":
        return None
    qc = {"quant_method": "flagdeploy", "version": 1, "chip": chip, "policy": policy,
          "source_quantization_config": source, "modules": modules}
    if fp8_block:
        qc["weight_block_size"] = fp8_block
    return qc


def description(outputs: list[tuple[str, str]]) -> dict:
    """msModelSlim's quant_model_description.json from (output tensor name, scheme) pairs."""
    desc = {name: _ASCEND_TYPE.get(scheme, "FLOAT") for name, scheme in outputs}
    kinds = {v for v in desc.values() if v != "FLOAT"}
    return {"model_quant_type": kinds.pop() if len(kinds) == 1 else "FLOAT", "version": "1.0.0", **desc}

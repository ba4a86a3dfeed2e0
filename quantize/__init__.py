"""`flagdeploy quantize`: FP8 (or BF16) checkpoints to the BF16 / INT8 mix a chip can run.

Chips without FP8 matmuls (Ascend 910B/910C, many edge NPUs) cannot run GLM-5.3-Flash's FP8 weights.
This package converts a checkpoint directory for one chip: a policy (YAML rules, `policies/`) picks a
scheme per tensor, the chip catalog says which schemes the chip can run, and the conversion streams
shard by shard into flagdeploy's own layout (which `flagdeploy serve` runs) or the one vLLM-Ascend
loads. Layout: `policy` (rules), `schemes` (what a scheme does to a tensor), `shards` (safetensors
streamed with bounded memory), `formats` (output layouts), `convert` (plan, then convert resumably),
`report` (sizes, errors, perplexity / KL).
"""

from __future__ import annotations

import json
from pathlib import Path

from flagdeploy.chips import get_chip

from .convert import QuantizeError, convert, plan
from .policy import PolicyError, default_policy_name, load_policy
from .report import evaluate, format_table

__all__ = ["PolicyError", "QuantizeError", "format_table", "quantize"]


def quantize(src: str | Path, dst: str | Path, *, chip: str, policy: str | Path | None = None,
             fmt: str = "flagdeploy", eval_text: str | Path | None = None, overwrite: bool = False,
             progress: bool = True) -> dict:
    """Convert checkpoint directory `src` into `dst` for `chip`; returns the report (also in
    dst/quantize_report.json). Every check runs before anything is written."""
    src, dst = Path(src), Path(dst)
    if not src.is_dir():
        raise QuantizeError(f"{src} is not a directory; pass a local HF checkpoint directory (config.json and "
                            f"safetensors shards). Fetch hub models with `flagdeploy pull` first.")
    the_chip = get_chip(chip)
    pol = load_policy(policy or default_policy_name(the_chip))
    text = Path(eval_text).read_text() if eval_text else None
    the_plan = plan(src, pol, the_chip, fmt)
    report = convert(the_plan, dst, chip=the_chip, policy=pol, fmt=fmt, overwrite=overwrite, progress=progress)
    if text is not None:
        report["eval"] = evaluate(src, dst, text)
        (dst / "quantize_report.json").write_text(json.dumps(report, indent=2) + "\n")
    return report

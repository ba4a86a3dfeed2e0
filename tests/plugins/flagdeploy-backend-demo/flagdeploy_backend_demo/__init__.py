"""A third-party backend in one file: a descriptor and one override, found through the entry point."""

import torch

from flagdeploy.ops.registry import Backend

CALLS = {"rms_norm": 0}


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    CALLS["rms_norm"] += 1
    xf = x.float()
    return (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype) * weight


backend = Backend(
    name="demo",
    vendor="acme",
    device_type="cpu",  # a real plugin names its torch device type ("mlu", "xpu", ...)
    dtypes=("float32", "bfloat16"),
    collective="gloo",
    detect=lambda: False,  # never auto-selected: only by name (--chip demo)
    overrides={"rms_norm": rms_norm},
    description="demo plugin for the tests",
)

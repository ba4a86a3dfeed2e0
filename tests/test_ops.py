"""Every op's reference against float64, and every installed backend's overrides against the reference."""

from __future__ import annotations

import pytest
import torch

from flagdeploy import ops
from flagdeploy.ops.reference import a16_dtype
from flagdeploy.ops.registry import OPS
from flagdeploy.ops.weights import Int4Weight, Int8Weight

DTYPES = [torch.float32, torch.bfloat16]


def _run(fn, args, kwargs):
    args = [a.clone() if isinstance(a, torch.Tensor) else a for a in args]
    out = fn(*args, **kwargs)
    if out is None:  # in-place op (write_kv_cache): its outputs are the caches it wrote
        out = (args[2], args[3])
    return out if isinstance(out, tuple) else (out,)


def _to64(x):
    return x.double() if isinstance(x, torch.Tensor) and x.is_floating_point() else x


def _inputs(spec, dtype, seed=0):
    args, kwargs = spec.make_inputs(dtype, "cpu", torch.Generator().manual_seed(seed))
    return args, kwargs


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("name", sorted(OPS))
def test_reference_matches_float64(name, dtype):
    spec = OPS[name]
    args, kwargs = _inputs(spec, dtype)
    got = _run(spec.reference, args, kwargs)
    want = _run(spec.reference, [_to64(a) for a in args], kwargs)
    tol = spec.tolerance[dtype]
    out_dtype = a16_dtype(dtype) if name.startswith("linear_w") else dtype  # A16 linears answer in 16 bits
    for g, w in zip(got, want):
        assert g.dtype == out_dtype
        torch.testing.assert_close(g.double(), w, atol=tol.atol, rtol=tol.rtol)


def _override_cases():
    for be in ops.backends().values():
        for name in sorted(be.overrides):
            yield pytest.param(be.name, name, id=f"{be.name}-{name}")


@pytest.mark.parametrize("rows", [1, 9], ids=lambda m: f"m{m}")
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("backend,name", list(_override_cases()))
def test_backend_override_matches_reference(backend, name, dtype, rows):
    """`rows` matters for ops whose backend routes shape buckets differently (few rows vs many)."""
    be = ops.get_backend(backend)
    if be.device_type != "cpu":
        pytest.skip(f"{backend} needs its device")
    spec = OPS[name]
    args, kwargs = _inputs(spec, dtype, seed=1)
    if name.startswith("linear_w"):
        args = (args[0][:1].expand(rows, -1).contiguous() + 0.01 * torch.arange(rows, dtype=dtype)[:, None], *args[1:])
    prepare = be.prepare.get(name)  # weight bundles go through the backend's own layout first
    native = [prepare(a) if prepare and isinstance(a, (Int4Weight, Int8Weight)) else a for a in args]
    got = _run(be.overrides[name], native, kwargs)
    want = _run(spec.reference, [_to64(a) for a in args], kwargs)
    tol = spec.tolerance[dtype]
    for g, w in zip(got, want):
        torch.testing.assert_close(g.double(), w, atol=tol.atol, rtol=tol.rtol)


def test_cpu_backend_is_registered_through_the_entry_point():
    from importlib.metadata import entry_points

    names = {ep.name for ep in entry_points(group="flagdeploy.backends")}
    assert "cpu" in names
    assert ops.get_backend("cpu").overrides, "the cpu backend should override at least one op"


def test_unknown_backend_error_names_the_installed_ones():
    with pytest.raises(KeyError, match="cpu"):
        ops.get_backend("no-such-chip")


def test_dispatch_routes_to_the_active_backend():
    be = ops.use_backend("cpu")
    calls = []
    orig = be.overrides["rms_norm"]
    try:
        be.overrides["rms_norm"] = lambda *a, **k: calls.append(1) or orig(*a, **k)
        ops.use_backend(be)
        ops.rms_norm(torch.ones(2, 4), torch.ones(4), 1e-6)
        assert calls == [1]
    finally:
        be.overrides["rms_norm"] = orig
        ops.use_backend("cpu")

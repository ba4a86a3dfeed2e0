"""The Ascend backend against the op references, through the CPU stand-in for torch_npu.

The stand-in (tests/standins/torch_npu) implements the documented semantics of exactly the torch_npu
functions the backend calls, traps included; it is put on sys.path only for this module (the `npu`
fixture) and removed afterwards, so no other test sees a fake NPU.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch

from flagdeploy import ops
from flagdeploy.backends.ascend import backend
from flagdeploy.backends.ascend import ops as aops
from flagdeploy.backends.ascend.detect import chip_id, detect_info, parse_npu_smi, soc_family
from flagdeploy.ops.registry import OPS
from flagdeploy.ops.weights import Int4Weight, Int8Weight, W8A8Weight

STANDINS = str(Path(__file__).parent / "standins")
DTYPES = [torch.float32, torch.bfloat16]


def test_import_without_torch_npu_and_detect_is_false():
    """In a clean interpreter: the package imports, torch_npu stays unimported, detect() says no."""
    code = ("import sys; import flagdeploy.backends.ascend as a; "
            "assert 'torch_npu' not in sys.modules, 'imported torch_npu at import time'; "
            "assert a.backend.detect() is False; print('ok')")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0 and "ok" in out.stdout, out.stderr
    assert backend.name == "ascend" and backend.collective == "hccl" and backend.device_type == "npu"
    assert "ascend" in ops.backends()


@pytest.fixture(scope="module")
def npu():
    """The stand-in torch_npu (simulating an A3 die), removed with its torch.npu shim afterwards."""
    sys.path.insert(0, STANDINS)
    try:
        import torch_npu

        torch_npu.set_soc("Ascend910_9391")
        yield torch_npu
    finally:
        sys.path.remove(STANDINS)
        for name in [m for m in sys.modules if m == "torch_npu" or m.startswith("torch_npu.")]:
            del sys.modules[name]
        if hasattr(torch, "npu"):
            del torch.npu


@pytest.fixture
def soc(npu):
    """Switch the simulated SoC inside one test; back to A3 afterwards."""
    yield npu.set_soc
    npu.set_soc("Ascend910_9391")


def test_detect_is_true_with_torch_npu(npu):
    assert backend.detect() is True
    assert ops.detect_backend().name == "ascend"  # priority 10 beats cpu


# ---- every override against its reference ---------------------------------------------------------------

# The torch_npu function each override must reach (per dtype); float32 attention / KV writes are not in
# FIA's / scatter_pa_kv_cache's documented dtypes, so those stay on the reference.
NATIVE = {
    "rms_norm": "npu_rms_norm", "add_rms_norm": "npu_add_rms_norm", "gated_rms_norm": "npu_rms_norm",
    "rope": "npu_rotary_mul", "swiglu": "npu_swiglu",
    "attention_prefill": "npu_fused_infer_attention_score",
    "paged_attention_decode": "npu_fused_infer_attention_score",
    "write_kv_cache": "npu_scatter_pa_kv_cache", "linear_w8a8_dynamic": "npu_quant_matmul",
    "linear_w8a16": "npu_weight_quant_batchmatmul", "moe_router": "npu_moe_gating_top_k",
    "moe_experts": "npu_grouped_matmul",
}
HALF_ONLY = {"attention_prefill", "paged_attention_decode", "write_kv_cache"}


from test_ops import _run, _to64  # noqa: E402  (the generic op tests' own helpers)


def _check(name, got, args, kwargs, dtype):
    want = _run(OPS[name], OPS[name].reference, [_to64(a) for a in args], kwargs)
    tol = OPS[name].tolerance[dtype]
    for g, w in zip(got, want):
        torch.testing.assert_close(g.double(), w, atol=tol.atol, rtol=tol.rtol)


def test_every_override_is_listed():
    assert set(backend.overrides) == set(NATIVE)


def _cases():
    for name in sorted(NATIVE):
        for rows in ([1, 9] if name.startswith("linear_w") else [1]):  # rows only matter for the linears
            yield pytest.param(name, rows, id=f"{name}-m{rows}")


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("name,rows", list(_cases()))
def test_override_matches_reference(npu, name, dtype, rows):
    """Mirrors tests/test_ops.py::test_backend_override_matches_reference, on the stand-in."""
    spec = OPS[name]
    args, kwargs = spec.make_inputs(dtype, "cpu", torch.Generator().manual_seed(1))
    if name.startswith("linear_w"):
        args = (args[0][:1].expand(rows, -1).contiguous() + 0.01 * torch.arange(rows, dtype=dtype)[:, None], *args[1:])
    prepare = backend.prepare.get(name)
    native = [prepare(a) if prepare and isinstance(a, (Int4Weight, Int8Weight)) else a for a in args]
    npu.CALLS.clear()
    got = _run(spec, backend.overrides[name], native, kwargs)
    _check(name, got, args, kwargs, dtype)
    ran_native = npu.CALLS[NATIVE[name]] > 0
    assert ran_native == (dtype == torch.bfloat16 or name not in HALF_ONLY), dict(npu.CALLS)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_swiglu_without_limit(npu, dtype):
    x = torch.randn(5, 64, generator=torch.Generator().manual_seed(0)).to(dtype)
    _check("swiglu", (aops.swiglu(x),), (x,), {}, dtype)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_w8a8_expert_bank_through_gmm(npu, dtype):
    """A W8A8 bank: init_routing quant_mode=1 + int8 GMM + dynamic quant, against the reference."""
    spec = OPS["moe_experts"]
    (x, routing, _, _, limit), _ = spec.make_inputs(dtype, "cpu", torch.Generator().manual_seed(0))
    g = torch.Generator().manual_seed(1)
    gate_up = W8A8Weight.quantize(torch.randn(5, 24, 16, generator=g) * 0.5)
    down = W8A8Weight.quantize(torch.randn(5, 16, 12, generator=g) * 0.3)
    npu.CALLS.clear()
    got = aops.moe_experts(x, routing, *aops.prepare_moe_banks((gate_up, down)), limit)
    assert npu.CALLS["npu_grouped_matmul"] == 2 and npu.CALLS["npu_dynamic_quant"] == 1
    want = spec.reference(x.double(), routing.double(), gate_up, down, limit)
    tol = spec.tolerance[torch.bfloat16]
    torch.testing.assert_close(got.double(), want, atol=tol.atol, rtol=tol.rtol)


@pytest.mark.parametrize("rows", [1, 9], ids=lambda m: f"m{m}")
def test_groupwise_w8a16(npu, rows):
    g = torch.Generator().manual_seed(2)
    w = Int8Weight.quantize(torch.randn(48, 64, generator=g) * 0.1, group_size=16)
    x = torch.randn(rows, 64, generator=g).to(torch.bfloat16)
    npu.CALLS.clear()
    got = aops.linear_w8a16(x, aops.prepare_w8a16(w))
    assert npu.CALLS["npu_weight_quant_batchmatmul"] == 1
    _check("linear_w8a16", (got,), (x, w), {}, torch.bfloat16)


def test_router_without_renormalisation_stays_on_reference(npu):
    args, _ = OPS["moe_router"].make_inputs(torch.float32, "cpu", torch.Generator().manual_seed(0))
    args = (*args[:6], False, args[7])
    npu.CALLS.clear()
    got = aops.moe_router(*args)
    assert npu.CALLS["npu_moe_gating_top_k"] == 0
    _check("moe_router", (got,), args, {}, torch.float32)


# ---- the documented traps, as the stand-in enforces them -----------------------------------------------


def _prefill_bf16():
    args, _ = OPS["attention_prefill"].make_inputs(torch.bfloat16, "cpu", torch.Generator().manual_seed(1))
    return args


def test_fia_default_scale_gives_a_wrong_answer(npu):
    q, k, v, cu_q, cu_k, scale = _prefill_bf16()
    want = OPS["attention_prefill"].reference(q.double(), k.double(), v.double(), cu_q, cu_k, scale)
    out, _ = npu.npu_fused_infer_attention_score(
        q, k, v, atten_mask=aops._causal_mask("cpu"), actual_seq_lengths=cu_q[1:].tolist(),
        actual_seq_lengths_kv=cu_k[1:].tolist(), num_heads=q.shape[1], num_key_value_heads=k.shape[1],
        input_layout="TND", sparse_mode=3)  # no scale: the default 1.0 applies
    assert (out.double() - want).abs().max() > 0.1


def test_fia_missing_num_heads_or_lengths_or_mask_is_rejected(npu):
    q, k, v, cu_q, cu_k, scale = _prefill_bf16()
    base = dict(atten_mask=aops._causal_mask("cpu"), actual_seq_lengths=cu_q[1:].tolist(),
                actual_seq_lengths_kv=cu_k[1:].tolist(), num_heads=q.shape[1], num_key_value_heads=k.shape[1],
                scale=scale, input_layout="TND", sparse_mode=3)
    for drop, match in (("num_heads", "num_heads|N_q"), ("actual_seq_lengths", "mandatory"), ("atten_mask", "2048"),
                        ("input_layout", "does not fit")):
        kw = {k_: v_ for k_, v_ in base.items() if k_ != drop}
        with pytest.raises(RuntimeError, match=match):
            npu.npu_fused_infer_attention_score(q, k, v, **kw)
    per_request = {**base, "actual_seq_lengths": torch.diff(cu_q).tolist()}  # not cumulative: rejected
    with pytest.raises(RuntimeError, match="CUMULATIVE"):
        npu.npu_fused_infer_attention_score(q, k, v, **per_request)
    with pytest.raises(TypeError):  # everything after key/value is keyword-only
        npu.npu_fused_infer_attention_score(q, k, v, None, aops._causal_mask("cpu"))
    with pytest.raises(RuntimeError, match="dtype"):  # FIA queries are fp16/bf16 only
        npu.npu_fused_infer_attention_score(q.float(), k.float(), v.float(), **base)


def test_fia_paged_cache_must_be_viewed_three_d(npu):
    (q, kc, vc, tables, lens, scale), _ = OPS["paged_attention_decode"].make_inputs(
        torch.bfloat16, "cpu", torch.Generator().manual_seed(0))
    with pytest.raises(RuntimeError, match="paged KV cache"):  # [nb, bs, N, D] is not a BSND paged shape
        npu.npu_fused_infer_attention_score(
            q.unsqueeze(1), kc, vc, block_table=tables, block_size=kc.shape[1], actual_seq_lengths_kv=lens.tolist(),
            num_heads=q.shape[1], num_key_value_heads=kc.shape[2], scale=scale, input_layout="BSND")


def test_scatter_kv_cache_default_mode_expects_nz(npu):
    (k, v, kc, vc, slots), _ = OPS["write_kv_cache"].make_inputs(torch.bfloat16, "cpu", torch.Generator().manual_seed(0))
    with pytest.raises(RuntimeError, match="PA_NZ"):
        npu.npu_scatter_pa_kv_cache(k, v, kc, vc, slots)
    with pytest.raises(RuntimeError, match="unique"):
        npu.npu_scatter_pa_kv_cache(k, v, kc, vc, torch.tensor([1, 1, 2, 3, 4]), cache_mode="Norm")


def test_w8a8_prepare_is_kn_nz_and_quant_matmul_checks_its_arguments(npu):
    w = W8A8Weight.quantize(torch.randn(48, 64, generator=torch.Generator().manual_seed(0)))
    p = aops.prepare_w8a8(w).prepared
    assert p["q_kn"].shape == (64, 48) and npu.get_npu_format(p["q_kn"]) == 29
    assert npu.get_npu_format(p["q_kn"].t()) == 2  # a view of an NZ tensor is not NZ
    qx, sx = npu.npu_dynamic_quant(torch.randn(3, 64).to(torch.bfloat16))
    with pytest.raises(RuntimeError, match=r"\(K, N\)"):  # the HF [N, K] orientation
        npu.npu_quant_matmul(qx, w.q, p["scale"], pertoken_scale=sx, output_dtype=torch.bfloat16)
    with pytest.raises(RuntimeError, match="int64 scale"):  # default output is int8
        npu.npu_quant_matmul(qx, p["q_kn"], p["scale"], pertoken_scale=sx)
    with pytest.raises(RuntimeError, match="fp32 scale"):  # fp16 output needs a fp32 scale
        npu.npu_quant_matmul(qx, p["q_kn"], p["scale"].bfloat16(), pertoken_scale=sx, output_dtype=torch.float16)


def test_nz_is_required_where_documented(npu):
    """ADOC documents NZ as REQUIRED only for ops this backend does not call (grouped_matmul_swiglu_quant
    A8W8, mla_prolog weights, int8 kv_rmsnorm_rope_cache) and as the default cache_mode of
    npu_scatter_pa_kv_cache; npu_quant_matmul takes ND or NZ. So: ND works for quant_matmul, and
    scatter_pa_kv_cache's default mode refuses ND caches (above)."""
    w = W8A8Weight.quantize(torch.randn(8, 32, generator=torch.Generator().manual_seed(0)))
    qx, sx = npu.npu_dynamic_quant(torch.randn(2, 32).to(torch.bfloat16))
    nd = npu.npu_quant_matmul(qx, w.q.t().contiguous(), w.scales, pertoken_scale=sx, output_dtype=torch.bfloat16)
    nz = npu.npu_quant_matmul(qx, npu.npu_format_cast(w.q.t(), 29), w.scales, pertoken_scale=sx,
                              output_dtype=torch.bfloat16)
    assert torch.equal(nd, nz)


@pytest.mark.skipif(not hasattr(torch, "float8_e4m3fn"), reason="torch without FP8 dtypes")
@pytest.mark.parametrize("soc_name,ok", [("Ascend910B3", False), ("Ascend910_9391", False), ("Ascend950DT_9582", True)])
def test_fp8_only_on_950(npu, soc, soc_name, ok):
    soc(soc_name)
    x = torch.randn(4, 32).to(torch.bfloat16)
    if not ok:
        with pytest.raises(RuntimeError, match="950"):
            npu.npu_dynamic_quant(x, dst_type=torch.float8_e4m3fn)
        with pytest.raises(RuntimeError, match="950"):
            npu.npu_quant_matmul(x.to(torch.float8_e4m3fn), torch.randn(32, 8).to(torch.float8_e4m3fn),
                                 torch.ones(8), output_dtype=torch.bfloat16)
        return
    qx, sx = npu.npu_dynamic_quant(x, dst_type=torch.float8_e4m3fn)
    w = torch.randn(32, 8).to(torch.float8_e4m3fn)
    y = npu.npu_quant_matmul(qx, w, torch.ones(8), pertoken_scale=sx, output_dtype=torch.bfloat16)
    want = x.float() @ w.float()
    assert ((y.float() - want).norm() / want.norm()) < 0.1


def test_310p_has_no_bf16(npu, soc):
    soc("Ascend310P3")
    x = torch.randn(4, 16).to(torch.bfloat16)
    with pytest.raises(RuntimeError, match="310P"):
        npu.npu_rms_norm(x, torch.ones(16, dtype=torch.bfloat16), epsilon=1e-5)
    y, _ = npu.npu_rms_norm(x.half(), torch.ones(16, dtype=torch.float16), epsilon=1e-5)
    assert y.dtype == torch.float16


def test_rms_norm_default_epsilon_differs(npu):
    """The op's epsilon default is 1e-6; the override passes the model's eps."""
    x = torch.full((1, 8), 1e-3)
    w = torch.ones(8)
    default, _ = npu.npu_rms_norm(x, w)
    assert not torch.allclose(default, OPS["rms_norm"].reference(x, w, 1e-5))
    assert torch.allclose(aops.rms_norm(x, w, 1e-5), OPS["rms_norm"].reference(x, w, 1e-5))


def test_rotary_mul_rejects_half_width_tables(npu):
    x = torch.randn(3, 1, 2, 16)
    c = torch.randn(3, 1, 1, 8)
    with pytest.raises(RuntimeError, match="shaped like x"):
        npu.npu_rotary_mul(x, c, c)


def test_init_routing_rejects_int64_ids_and_static_quant_default(npu):
    x = torch.randn(4, 8)
    ids = torch.tensor([[0, 1], [1, 2], [0, 2], [2, 1]])
    with pytest.raises(RuntimeError, match="int32"):
        npu.npu_moe_init_routing_v2(x, ids, expert_num=3)
    with pytest.raises(RuntimeError, match="STATIC"):
        npu.npu_moe_init_routing_v2(x, ids.int(), expert_num=3, quant_mode=0)


# ---- detection ------------------------------------------------------------------------------------------

A2_SMI = """\
+------------------------------------------------------------------------------------------------+
| npu-smi 24.1.rc1                 Version: 24.1.rc1                                             |
+---------------------------+---------------+----------------------------------------------------+
| NPU   Name                | Health        | Power(W)    Temp(C)           Hugepages-Usage(page)|
| Chip                      | Bus-Id        | AICore(%)   Memory-Usage(MB)  HBM-Usage(MB)        |
+===========================+===============+====================================================+
| 0     910B3               | OK            | 101.8       43                0    / 0             |
| 0                         | 0000:C1:00.0  | 0           0    / 0          3318 / 65536         |
+===========================+===============+====================================================+
| 1     910B3               | OK            | 94.5        42                0    / 0             |
| 0                         | 0000:01:00.0  | 0           0    / 0          3319 / 65536         |
+===========================+===============+====================================================+
+---------------------------+---------------+----------------------------------------------------+
| NPU     Chip              | Process id    | Process name             | Process memory(MB)      |
+===========================+===============+====================================================+
| 0       0                 | 2532931       | python3.10               | 2998                    |
+===========================+===============+====================================================+
"""

A3_SMI = """\
| npu-smi 25.0.rc1.1               Version: 25.0.rc1.1                                           |
| NPU     Name              | Health        | Power(W)    Temp(C)           Hugepages-Usage(page)|
| Chip    Phy-ID            | Bus-Id        | AICore(%)   Memory-Usage(MB)  HBM-Usage(MB)        |
| 0       Ascend910         | OK            | 180.2       38                0    / 0             |
| 0       0                 | 0000:9D:00.0  | 0           0    / 0          3400 / 65536         |
| 1       1                 | 0000:9F:00.0  | 0           0    / 0          3100 / 65536         |
| 1       Ascend910         | OK            | 175.0       37                0    / 0             |
| 0       2                 | 0000:99:00.0  | 0           0    / 0          3400 / 65536         |
| 1       3                 | 0000:9B:00.0  | 0           0    / 0          3100 / 65536         |
"""


def test_detect_info_parses_a2_npu_smi(tmp_path):
    for i in range(2):
        (tmp_path / f"davinci{i}").touch()
    (tmp_path / "davinci_manager").touch()
    info = detect_info(npu_smi_output=A2_SMI, dev_dir=str(tmp_path), probe=False)
    assert info.npu_smi.driver_version == "24.1.rc1"
    assert [d.name for d in info.npu_smi.devices] == ["910B3", "910B3"]  # the process table is not a device
    assert info.family == "A2" and info.chip == "ascend910b"
    assert info.device_count == 2 and info.memory_mib == [65536, 65536]
    assert len(info.device_nodes) == 2 and "fp8" not in info.matmul_dtypes


def test_detect_info_parses_a3_with_two_dies_per_npu():
    info = detect_info(npu_smi_output=A3_SMI, dev_dir="/nonexistent", probe=False)
    assert info.npu_smi.chips_per_npu == 2
    assert info.family == "A3" and info.chip == "ascend910c" and info.device_count == 4
    assert info.memory_mib == [65536] * 4


@pytest.mark.parametrize("soc_name,family,chip", [
    ("Ascend910B3", "A2", "ascend910b"), ("Ascend910B4", "A2", "ascend910b4"), ("ascend910b2c", "A2", "ascend910b"),
    ("Ascend910_9391", "A3", "ascend910c"), ("ascend910_9362", "A3", "ascend910c"),
    ("Ascend950DT_9582", "950", "ascend950"), ("Ascend310P3", "310P", "ascend310p"), (223, "A2", "ascend910b"),
    (252, "A3", "ascend910c"), (260, "950", "ascend950"), ("Ascend910", None, None),
])
def test_soc_family_and_chip(soc_name, family, chip):
    assert soc_family(soc_name) == family
    assert chip_id(soc_name) == chip
    if chip:
        from flagdeploy.chips import get_chip

        assert get_chip(chip).backend == "ascend"


def test_detect_info_with_soc_name_and_fp8_on_950():
    info = detect_info(soc_name="Ascend950DT_9582", dev_dir="/nonexistent", probe=False)
    assert info.family == "950" and info.chip == "ascend950" and "fp8" in info.matmul_dtypes
    assert info.device_count == 0 and not info.present
    assert parse_npu_smi("").devices == []


"""Every op's reference against float64, and every installed backend's overrides against the reference."""

from __future__ import annotations

import concurrent.futures
import os
from pathlib import Path

import pytest
import torch

from flagdeploy import ops
from flagdeploy.ops.reference import a16_dtype
from flagdeploy.ops.registry import OPS, implementation
from flagdeploy.ops.weights import Fp8BlockWeight, Int4Weight, Int8Weight

DTYPES = [torch.float32, torch.bfloat16]


def _run(spec, fn, args, kwargs):
    """The call's outputs: what it returned, then the arguments it writes in place (caches)."""
    args = [a.clone() if isinstance(a, torch.Tensor) else a for a in args]
    return spec.outputs(fn(*args, **kwargs), args)


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
    got = _run(spec, spec.reference, args, kwargs)
    want = _run(spec, spec.reference, [_to64(a) for a in args], kwargs)
    tol = spec.tolerance[dtype]
    out_dtype = a16_dtype(dtype) if name.startswith(("linear_w", "linear_fp8")) else dtype  # quantized linears answer in 16 bits
    if name == "sample_probs":
        out_dtype = torch.float32  # probabilities: never fewer bits than float32
    for g, w in zip(got, want):
        assert g.dtype == (out_dtype if w.is_floating_point() else w.dtype)  # indices (argmax) stay int64
        torch.testing.assert_close(g.double(), w.double(), atol=tol.atol, rtol=tol.rtol)


def _override_cases():
    """Every backend's own kernels and the ops it builds from them (composites)."""
    for be in ops.backends().values():
        for name in sorted(OPS):
            if implementation(be, name)[0] != "reference":
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
    got = _run(spec, implementation(be, name)[1], native, kwargs)
    want = _run(spec, spec.reference, [_to64(a) for a in args], kwargs)
    tol = spec.tolerance[dtype]
    for g, w in zip(got, want):
        torch.testing.assert_close(g.double(), w.double(), atol=tol.atol, rtol=tol.rtol)


def test_cpu_backend_is_registered_through_the_entry_point():
    from importlib.metadata import entry_points

    names = {ep.name for ep in entry_points(group="flagdeploy.backends")}
    assert "cpu" in names
    assert ops.get_backend("cpu").overrides, "the cpu backend should override at least one op"


def test_a_second_copy_of_the_cpu_ops_is_refused(monkeypatch):
    """Imported again through the repository's backends/ (a second module), the cpu ops would register
    prepared_linear against an empty weight table; the import is refused with the name to use instead."""
    import importlib
    import sys
    from pathlib import Path

    import flagdeploy.backends.cpu.ops  # noqa: F401  (the installed copy, registered first)

    monkeypatch.syspath_prepend(str(Path(__file__).resolve().parents[1]))
    before = set(sys.modules)
    try:
        with pytest.raises(ImportError, match="flagdeploy.backends.cpu.ops"):
            importlib.import_module("backends.cpu.ops")
    finally:  # what the refused import left (the repository's `backends` package) goes with the test
        for name in set(sys.modules) - before:
            del sys.modules[name]


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


def test_trace_constant_marks_what_dynamo_reads():
    """`registry.trace_constant` stands in for `torch._dynamo.assume_constant_result` without importing dynamo
    at start-up: it must mark a function exactly as dynamo's own decorator does (a torch that changes the
    marker would leave the flags traced as ContextVar reads, which dynamo refuses)."""
    import torch._dynamo

    from flagdeploy.ops.registry import in_prefill_step, in_verify_step, trace_constant

    def mine() -> bool: ...
    def dynamos() -> bool: ...

    trace_constant(mine)
    torch._dynamo.assume_constant_result(dynamos)
    marks = {k: v for k, v in vars(dynamos).items()}
    assert marks and {k: v for k, v in vars(mine).items()} == marks
    for fn in (ops.tracing, in_prefill_step, in_verify_step):
        assert all(getattr(fn, k, None) == v for k, v in marks.items())


def test_server_imports_leave_torch_compiler_alone():
    """Importing the server and engine does not import dynamo/inductor (seconds before a server is ready);
    the compile, in serve's background thread, imports it."""
    import subprocess
    import sys

    code = ("import sys, flagdeploy.server, flagdeploy.engine, flagdeploy.cli; flagdeploy.ops.active_backend(); "
            "print(sorted(m for m in ('torch._dynamo', 'torch._inductor') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300, check=True)
    assert out.stdout.strip() == "[]", out.stdout + out.stderr


# ---- quantized weights the generic cases do not reach: group-wise W8A16 and quantized expert banks --


def test_w8a8_reference_accumulates_integers_exactly():
    """The reference's float64 accumulation is the chip's int32 accumulator, value for value."""
    from flagdeploy.ops.reference import dynamic_quant

    g = torch.Generator().manual_seed(3)
    x = torch.randn(7, 256, generator=g, dtype=torch.float64).to(torch.bfloat16)
    w = ops.W8A8Weight.quantize(torch.randn(40, 256, generator=g))
    qx, sx = dynamic_quant(x)
    exact = torch._int_mm(qx, w.q.t())  # int32 on the CPU
    want = (exact.float() * sx[:, None] * w.scales).to(torch.bfloat16)
    assert torch.equal(OPS["linear_w8a8_dynamic"].reference(x, w), want)
    # and it is a good approximation of the unquantized product (8 bits each side: ~1% of the row scale)
    dense = x.double() @ w.dequantize(torch.float64).t()
    assert ((want.double() - dense).norm() / dense.norm()) < 0.02


@pytest.mark.parametrize("group_size", [0, 16])
def test_int8_quantize_round_trip(group_size):
    w = torch.randn(24, 64, generator=torch.Generator().manual_seed(0))
    q = Int8Weight.quantize(w, group_size)
    assert q.q.dtype == torch.int8 and q.q.abs().max() == 127
    assert q.scales.shape == ((24, 4) if group_size else (24,))
    err = (q.dequantize() - w).abs().max() / w.abs().max()
    assert 0 < err <= 0.5 / 127 + 1e-6  # half a quantisation step of the largest scale at most


def _banks(kind, g):
    e, h, i = 5, 16, 12
    gate_up = torch.randn(e, 2 * i, h, generator=g, dtype=torch.float64) * 0.5
    down = torch.randn(e, h, i, generator=g, dtype=torch.float64) * 0.3
    if kind == "dense":
        return gate_up, down
    if kind == "fp8":
        return Fp8BlockWeight.quantize(gate_up, (4, 8)), Fp8BlockWeight.quantize(down, (4, 4))
    cls, gs = (ops.W8A8Weight, 0) if kind == "w8a8" else (Int8Weight, 4)
    return cls.quantize(gate_up, gs), cls.quantize(down, gs)


@pytest.mark.parametrize("kind", ["w8a16", "w8a8", "fp8"])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_quantized_expert_banks(kind, dtype):
    """Reference vs float64, the cpu override vs the reference, and both vs the dequantized dense bank."""
    spec = OPS["moe_experts"]
    (x, routing, _, _, limit), _ = spec.make_inputs(dtype, "cpu", torch.Generator().manual_seed(0))
    gate_up, down = _banks(kind, torch.Generator().manual_seed(1))
    got = spec.reference(x, routing, gate_up, down, limit)
    want = spec.reference(x.double(), routing.double(), gate_up, down, limit)
    tol = spec.tolerance[torch.bfloat16]
    torch.testing.assert_close(got.double(), want, atol=tol.atol, rtol=tol.rtol)
    cpu = ops.get_backend("cpu").overrides["moe_experts"](x, routing, gate_up, down, limit)
    torch.testing.assert_close(cpu.double(), want, atol=tol.atol, rtol=tol.rtol)
    dense = spec.reference(x.double(), routing.double(), gate_up.dequantize(torch.float64),
                           down.dequantize(torch.float64), limit)
    assert (want - dense).norm() / dense.norm() < (1e-12 if kind == "w8a16" else 0.03 if kind == "w8a8" else 0.08)


@pytest.mark.parametrize("looped", [False, True], ids=["all-expert", "per-expert"])
def test_bf16_expert_banks_under_float32_activations(looped, monkeypatch):
    """A BF16 checkpoint's experts kept bfloat16 in a float32 run (weight_format auto): the reference and
    the cpu override (its all-expert matmuls, on banks as given and as prepared, or its per-expert loop)
    agree with float64 arithmetic on the same weights within bfloat16's tolerance, and answer in float32."""
    from flagdeploy.backends.cpu import ops as cpu_ops  # the installed module the backend runs (not a second copy)

    if looped:
        monkeypatch.setitem(cpu_ops.TUNE["moe_experts"], "dense_max_token_experts", 0)
    spec, be = OPS["moe_experts"], ops.get_backend("cpu")
    (x, routing, gate_up, down, limit), _ = spec.make_inputs(torch.float32, "cpu", torch.Generator().manual_seed(4))
    gate_up, down = gate_up.bfloat16(), down.bfloat16()
    want = spec.reference(x.double(), routing.double(), gate_up.double(), down.double(), limit)
    tol = spec.tolerance[torch.bfloat16]
    prepared = be.prepare["moe_experts"]((gate_up, down))
    e, i2, h = gate_up.shape  # the all-expert weights are views of the prepared banks, not per-call copies
    assert prepared[0].reshape(e * i2, h).data_ptr() == prepared[0].data_ptr()
    for fn, banks in ((spec.reference, (gate_up, down)), (be.overrides["moe_experts"], (gate_up, down)),
                      (be.overrides["moe_experts"], prepared)):
        got = fn(x, routing, *banks, limit)
        assert got.dtype == torch.float32
        torch.testing.assert_close(got.double(), want, atol=tol.atol, rtol=tol.rtol)


@pytest.mark.parametrize("form", ["native", "sdpa", "matmuls", "compiled"])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_cpu_decode_attention_forms_match_reference(dtype, form, monkeypatch):
    """The cpu backend's decode attention has four forms (its own kernel, fused SDPA for few keys, batched
    matmuls for more, plain reductions inside a compiled step): each agrees with float64 on GQA heads,
    padded block tables and a one-key sequence, and the compiled one, called again at other lengths, masks
    by the lengths it is given, not by those it was traced with."""
    from flagdeploy.backends.cpu import ops as cpu_ops  # the installed module the backend runs

    if form == "native" and (dtype == torch.float16 or not cpu_ops.native.available()):
        pytest.skip("the backend's own attention kernel takes float32 and bf16 caches, where it is built")
    tune = cpu_ops.TUNE["paged_attention_decode"]
    monkeypatch.setitem(tune, "native_max_keys", 10**9 if form == "native" else 0)
    monkeypatch.setitem(tune, "sdpa_max_keys", 10**9 if form == "sdpa" else 0)
    monkeypatch.setitem(tune, "matmul_dtypes", [str(dtype).removeprefix("torch.")])
    spec = OPS["paged_attention_decode"]
    fn = cpu_ops.paged_attention_decode
    if form == "compiled":
        fn = torch.compile(fn, fullgraph=True, dynamic=False)
    args, _ = _inputs(spec, dtype, seed=3)
    tol = spec.tolerance[dtype]
    for lens in (args[4], torch.tensor([16, 2, 9], dtype=torch.int32)):
        case = (*args[:4], lens, args[5])
        got = fn(*case)
        assert got.dtype == dtype
        torch.testing.assert_close(got.double(), spec.reference(*[_to64(a) for a in case]), atol=tol.atol, rtol=tol.rtol)


@pytest.mark.parametrize("heads,kv_heads,d", [(8, 1, 64), (4, 2, 64), (8, 2, 64), (14, 2, 128), (12, 4, 128)],
                         ids=lambda h: str(h))
@pytest.mark.parametrize("build", ["native", "avx2"])
def test_cpu_native_decode_attention_matches_reference_for_any_head_group(heads, kv_heads, d, build, kernel_builds):
    """The kernel's grouped path (rows that read the same keys, all query heads of a key head at once) sums a
    head's values a few column vectors at a time, as many as the group's accumulators leave registers for:
    for every group size (1 to 8 query heads a key head, several verify rows) and head width, each head's
    output is its own (a pass that ran past a 64-wide head's columns wrote into the next head's), against
    float64. Four sequences and a sequence's three verify rows, so that the grouped path serves them. Each ISA's
    build: its column passes differ (8 lanes on AVX2, 16 on AVX-512)."""
    kernels = _build(kernel_builds, build)
    g = torch.Generator().manual_seed(heads * d + kv_heads)
    k, v = (torch.randn(40, 16, kv_heads, d, generator=g) for _ in range(2))
    rows = 7
    q = torch.randn(rows, heads, d, generator=g)
    tables = torch.randperm(40, generator=g)[:rows * 5].view(rows, 5)
    tables[5:] = tables[4]  # rows 4..6: one sequence's verify rows
    lens = torch.tensor([70, 3, 33, 80, 50, 51, 52])
    got = kernels.paged_decode_attention(q, k, v, tables, lens, d ** -0.5)
    want = OPS["paged_attention_decode"].reference(q.double(), k.double(), v.double(), tables, lens, d ** -0.5)
    torch.testing.assert_close(got.double(), want, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("heads,kv_heads", [(9, 3), (8, 2), (16, 4), (6, 6)], ids=lambda h: str(h))
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("build", ["native", "avx2"])
def test_cpu_native_decode_attention_rows_do_not_depend_on_their_neighbours(dtype, heads, kv_heads, build,
                                                                            kernel_builds):
    """What makes speculative verify rows exact on the CPU: each row of the backend's own attention kernel
    is bitwise the same computed alone (its own table), in a batch of other sequences (a wider, padded
    table) and as one of a verify step's rows (the same sequence at consecutive lengths), on several
    threads or one. Rows read the same keys together where their tables agree over the blocks they read
    (row 6's table differs past them); row 1 shares its first block with row 0 but not the next two (a
    shared prefix): another sequence. Each ISA's build."""
    kernels = _build(kernel_builds, build)
    g = torch.Generator().manual_seed(4)
    k, v = (torch.randn(64, 16, kv_heads, 64, generator=g).to(dtype) for _ in range(2))
    q = torch.randn(7, heads, 64, generator=g).to(dtype)
    tables = torch.randperm(64, generator=g)[:42].view(7, 6)
    tables[4:] = tables[3]  # rows 3..6: one sequence's verify rows
    tables[6, 5] = tables[0, 1]  # past the 4 blocks row 6 reads
    tables[1, 0] = tables[0, 0]
    lens = torch.tensor([1, 40, 96, 60, 61, 62, 63])
    batched = kernels.paged_decode_attention(q, k, v, tables, lens, 0.125)
    threads = torch.get_num_threads()
    try:
        # 1 and 2 threads: a lone row's key heads as units; 16: its query heads one by one (kAlone)
        for n_threads in (1, 2, 16):
            torch.set_num_threads(n_threads)
            assert torch.equal(kernels.paged_decode_attention(q, k, v, tables, lens, 0.125), batched), n_threads
            for r, n in enumerate(lens.tolist()):
                w = -(-n // 16)
                alone = kernels.paged_decode_attention(q[r:r + 1], k, v, tables[r:r + 1, :w], lens[r:r + 1], 0.125)
                assert torch.equal(alone, batched[r:r + 1]), (n_threads, r)
    finally:
        torch.set_num_threads(threads)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("build", ["native", "avx2"])
def test_cpu_native_decode_attention_prompt_rows_are_each_as_alone(dtype, build, kernel_builds):
    """A prompt's rows as decode rows (backends/cpu/llama_step.py `takes_prompt`): one sequence at lengths 1 to 70,
    read together, each key scored only for the rows that read it and each row's values summed over its own keys:
    every row bitwise what it computes alone, and the reference's values."""
    kernels = _build(kernel_builds, build)
    g = torch.Generator().manual_seed(5)
    k, v = (torch.randn(8, 16, 3, 64, generator=g).to(dtype) for _ in range(2))
    q = torch.randn(70, 9, 64, generator=g).to(dtype)
    tables = torch.tensor([[3, 1, 6, 2, 7]]).expand(70, -1).contiguous()
    lens = torch.arange(1, 71)
    batched = kernels.paged_decode_attention(q, k, v, tables, lens, 0.125)
    want = OPS["paged_attention_decode"].reference(q.double(), k.double(), v.double(), tables, lens, 0.125)
    torch.testing.assert_close(batched.double(), want, atol=1e-2 if dtype == torch.bfloat16 else 1e-5, rtol=1e-2)
    for r in range(70):
        w = -(-(r + 1) // 16)
        alone = kernels.paged_decode_attention(q[r:r + 1], k, v, tables[r:r + 1, :w], lens[r:r + 1], 0.125)
        assert torch.equal(alone, batched[r:r + 1]), r


@pytest.mark.parametrize("group", [8, 16, 32])
@pytest.mark.parametrize("rows", [1, 9], ids=lambda m: f"m{m}")
def test_cpu_groupwise_w8a16_matches_reference(rows, group):
    """Groups of 16 or 32 (a GGUF's Q6_K, Q8_0 / Q5_0 linears) on the int8 kernel where it builds, others on the
    dense copy."""
    g = torch.Generator().manual_seed(2)
    w = Int8Weight.quantize(torch.randn(48, 64, generator=g) * 0.1, group_size=group)
    x = torch.randn(rows, 64, generator=g).to(torch.bfloat16)
    be = ops.get_backend("cpu")
    got = be.overrides["linear_w8a16"](x, be.prepare["linear_w8a16"](w))
    want = OPS["linear_w8a16"].reference(x.double(), w)
    tol = OPS["linear_w8a16"].tolerance[torch.bfloat16]
    torch.testing.assert_close(got.double(), want, atol=tol.atol, rtol=tol.rtol)


def _random_int4(n: int, k: int, g: torch.Generator) -> Int4Weight:
    """A random [n, k] 4-bit weight in groups of 32 (positive scales, offsets about 0), drawn from `g`."""
    return Int4Weight(torch.randint(0, 16, (n, k), generator=g, dtype=torch.uint8),
                      torch.rand(n, k // 32, generator=g) * 0.02 + 1e-3, torch.randn(n, k // 32, generator=g) * 0.02,
                      32, n, k)


def _assert_rounds_as_its_bf16_output(got: torch.Tensor, x: torch.Tensor, w, want: torch.Tensor | None = None) -> None:
    """A bf16 [rows, N] kernel output of x @ w.T (or of `want`, float64, where the kernel computes something else
    on purpose) whose error against float64 is the bf16 rounding's alone."""
    want = x.double() @ w.dequantize(torch.float64).t() if want is None else want
    assert got.dtype == torch.bfloat16 and got.shape == want.shape
    err = (got.double() - want).norm() / want.norm()
    rounding = (want.bfloat16().double() - want).norm() / want.norm()
    assert err < 1.2 * rounding + 1e-4, f"{len(x)} rows: error {err:.2e} against the bf16 output's {rounding:.2e}"


def _cpu_kernels_or_skip():
    from flagdeploy.backends.cpu import native

    if native.unsupported():
        pytest.skip(f"no int4 x int8 kernel here: {native.unsupported()}")
    assert native.available(), "this CPU and compiler can build the cpu backend's kernels, so it must have"
    return native


@pytest.fixture(scope="module")
def kernel_builds(tmp_path_factory):
    """The cpu backend's kernels by ISA: the CPU's own build, and beside any other (AVX-512, AVX-VNNI) the AVX2
    one (FLAGDEPLOY_CPU_ISA=avx2's, built once here under another op namespace), so that the AVX2 kernels' own
    paths (their pass sizes, shuffles, 8-lane folds) are checked on a CI machine with AVX-512 too."""
    native = _cpu_kernels_or_skip()
    builds = {"native": torch.ops.flagdeploy_cpu}
    if native.isa() == "avx512":  # q4_linear's AMX path over the tile instructions' stand-in, and the real ones
        builds["amx stand-in"] = _amx_standin(native, tmp_path_factory.mktemp("amx_standin"))
        if set(native.ISAS["amx"].cpu_flags) <= native._proc_flags():
            builds["amx"] = native.build_beside("amx", tmp_path_factory.mktemp("amx"))
    if native.isa() != "avx2":
        builds["avx2"] = native.build_beside("avx2", tmp_path_factory.mktemp("avx2"))
    if native.isa() not in ("avxvnni", "avx2") and set(native.ISAS["avxvnni"].cpu_flags) <= native._proc_flags():
        builds["avxvnni"] = _avxvnni_int8(native, tmp_path_factory.mktemp("avxvnni"))
    return builds


def _avxvnni_int8(native, directory):
    """The int8 kernel alone as FLAGDEPLOY_CPU_ISA=avxvnni builds it (its own vpdpbusd paths), on an AVX-512 CPU
    that also has AVX-VNNI."""
    ns = "flagdeploy_cpu_avxvnni_int8"
    _, flags = native._build("avxvnni")
    so = directory / f"{ns}.so"
    native._compile(so, (*flags, f"-DFLAGDEPLOY_OPS_NS={ns}"), (native.CSRC / "q8_linear.cpp", native.CSRC / "thread_pool.cpp"))
    torch.ops.load_library(str(so))
    return getattr(torch.ops, ns)


def _amx_standin(native, directory):
    """q4_linear built as FLAGDEPLOY_CPU_ISA=amx builds it, but over csrc/amx_standin.h's tile instructions (plain
    C++ after Intel's documented semantics), so that its AMX path runs on any AVX-512 CPU."""
    ns = "flagdeploy_cpu_amx_standin"
    _, flags = native._build("avx512")
    so = directory / f"{ns}.so"
    native._compile(so, (*flags, "-DFLAGDEPLOY_AMX_STANDIN", f"-DFLAGDEPLOY_OPS_NS={ns}"),
                    (native.CSRC / "q4_linear.cpp", native.CSRC / "thread_pool.cpp"))
    torch.ops.load_library(str(so))
    return getattr(torch.ops, ns)


def _build(kernel_builds, name):
    if name not in kernel_builds:
        pytest.skip(f"this CPU's own build leaves no {name} one to compare")
    return kernel_builds[name]


@pytest.mark.parametrize("n,k", [(48, 64), (16, 32), (64, 96), (960, 576), (576, 1536)])
def test_cpu_int4_kernel_rounds_no_worse_than_its_bf16_output(n, k):
    """The cpu backend's int4 kernel carries the activations as two int8 parts (~15 bits), so its only
    visible rounding is the bf16 output's: against float64 its error is that rounding's, where one int8
    part would add ~4x bf16's noise (and torch's own kernel, bf16 throughout, adds ~1.4x). Every row count the
    kernel passes over a tile differently (AVX-512: one pass of up to 8 rows, equal passes beyond, tiles in pairs
    from 12; AVX2: passes of 2 over the tile, from 8 rows the passes within each block, 17 as 9 + 8), K with an
    odd number of 32-blocks; and a row's result is bitwise the same alone."""
    native = _cpu_kernels_or_skip()
    g = torch.Generator().manual_seed(n + k)
    w = _random_int4(n, k, g)
    prepared = ops.get_backend("cpu").prepare["linear_w4a16"](w)
    assert "nib" in prepared.prepared
    for rows in (1, 2, 3, 5, 7, 9, 13, 17):
        x = torch.randn(rows, k, generator=g).to(torch.bfloat16)
        got = native.q4_linear(x, prepared.prepared["nib"], prepared.prepared["dm"])
        _assert_rounds_as_its_bf16_output(got, x, w)
        alone = torch.cat([native.q4_linear(r, prepared.prepared["nib"], prepared.prepared["dm"]) for r in x.split(1)])
        assert torch.equal(alone, got), f"{rows} rows: a row's result depends on the rows beside it"


def _one_part(x: torch.Tensor) -> torch.Tensor:
    """x in float64 as the kernels' parts=1 takes it: each row's blocks of 32 rounded to one int8 part (llama.cpp's Q8:
    a block's absmax / 127 a step, round half to even)."""
    blocks = x.float().view(x.shape[0], -1, 32)
    amax = blocks.abs().amax(-1, keepdim=True)
    inv = torch.where(amax > 0, torch.full_like(amax, 127.0) / amax, 0.0)  # IEEE's division (torch's scalar / tensor is
    # not: a reciprocal a ulp off, which moved a tie at 63.5)
    return (torch.round(blocks * inv).double() * (amax.double() / 127)).view(x.shape)


def _one_part_product(x: torch.Tensor, w: Int4Weight) -> torch.Tensor:
    """x @ w.T in float64 as q4_linear's parts=1 takes it: x rounded to one part against the weight's scaled values
    d * q, and the blocks' exact sums against its offsets m (w = d * q + m: the kernel takes m * sum(x) from the float
    activations); d and m in float16, as the packed weight holds them."""
    d = w.scales.double()
    d, m = (v.half().double().repeat_interleave(32, dim=1) for v in (d, w.zeros.double() - 8 * d))
    return _one_part(x) @ (w.q.double() * d).t() + x.double() @ m.t()


def test_cpu_int4_kernel_one_activation_part_on_every_build(kernel_builds):
    """`serve --q8-activations`: q4_linear with parts=1 takes the activations as one int8 part per block of 32. Its
    result is x rounded so, times the weight, up to the bf16 output's rounding; every build gives it bit for bit (the
    AVX2 one in passes of four rows, the AVX-512 one without the lo part's products, the AMX tiles over a lo part of
    zeros), each row as alone, at every row count around those passes; and it is not the two-part result."""
    native = _cpu_kernels_or_skip()
    builds = {name: b for name, b in kernel_builds.items() if name in ("native", "avx2", "amx stand-in", "amx")}
    for b in builds.values():
        if b.q4_amx_min_rows(0):
            b.q4_amx_min_rows(1)
    try:
        g = torch.Generator().manual_seed(21)
        for n, k in [(48, 96), (960, 576), (64, 1536)]:
            w = _random_int4(n, k, g)
            nib, dm = native.pack_q4(w)
            for rows in (1, 2, 3, 4, 5, 7, 8, 9, 13, 17):
                x = (torch.randn(rows, k, generator=g) * torch.rand(rows, 1, generator=g) * 4).to(torch.bfloat16)
                got = native.q4_linear(x, nib, dm, 1)
                _assert_rounds_as_its_bf16_output(got, x, w, want=_one_part_product(x, w))
                for name, b in builds.items():
                    assert torch.equal(b.q4_linear(x, nib, dm, 1), got), (name, n, k, rows)
                alone = torch.cat([native.q4_linear(r, nib, dm, 1) for r in x.split(1)])
                assert torch.equal(alone, got), f"{rows} rows: a row's result depends on the rows beside it"
                assert not torch.equal(got, native.q4_linear(x, nib, dm)), "parts=1 computed the two-part result"
        with pytest.raises(RuntimeError, match="parts is 1 or 2"):
            native.q4_linear(x, nib, dm, 3)
    finally:
        for b in builds.values():
            b.q4_amx_min_rows(native.AMX_NEVER)


def test_cpu_kernels_thread_pool_gives_one_answer_to_concurrent_callers_thread_counts_and_a_forked_child():
    """The kernels' loops run on their own worker threads (csrc/thread_pool.h), one loop at a time: a second
    Python thread calling meanwhile computes on its own thread, torch.set_num_threads changes how many share a
    loop, and a forked child (no threads survive fork) starts a pool of its own. Every way, the same bits."""
    native = _cpu_kernels_or_skip()
    g = torch.Generator().manual_seed(3)
    w = Int4Weight(torch.randint(0, 16, (960, 576), generator=g, dtype=torch.uint8),
                   torch.rand(960, 18, generator=g) * 0.02 + 1e-3, torch.randn(960, 18, generator=g) * 0.02, 32, 960, 576)
    prepared = ops.get_backend("cpu").prepare["linear_w4a16"](w).prepared
    x = torch.randn(5, 576, generator=g).to(torch.bfloat16)
    want = native.q4_linear(x, prepared["nib"], prepared["dm"])

    def calls(n=200):
        return all(torch.equal(native.q4_linear(x, prepared["nib"], prepared["dm"]), want) for _ in range(n))

    with concurrent.futures.ThreadPoolExecutor(3) as pool:
        assert all(f.result() for f in [pool.submit(calls) for _ in range(3)])
    threads = torch.get_num_threads()
    try:
        for n in (1, 3, 16, 2):  # 16: more workers than cores, late to loops that others closed (thread_pool.cpp)
            torch.set_num_threads(n)
            assert calls(100 if n == 16 else 20), f"{n} threads"
    finally:
        torch.set_num_threads(threads)
    pid = os.fork()
    if pid == 0:  # the child: exit status 0 only if its kernels answer the same; never back into pytest
        ok = False
        try:
            ok = calls(20)
        finally:
            os._exit(0 if ok else 1)
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0, "the forked child's kernels failed or answered differently"


def test_cpu_int4_kernel_cut_for_many_threads_gives_the_same_bits(kernel_builds):
    """A small linear cut over many threads (36 tiles of a 576-wide output over 16: a chunk or two a thread, stolen
    where a thread is late): every row count, on every build, the bits of one thread."""
    native = _cpu_kernels_or_skip()
    builds = {name: b for name, b in kernel_builds.items() if name in ("native", "avx2")}
    g = torch.Generator().manual_seed(36)
    w = _random_int4(576, 1536, g)
    nib, dm = native.pack_q4(w)
    threads = torch.get_num_threads()
    try:
        for rows in (1, 2, 5, 9, 12, 16, 17):
            x = torch.randn(rows, 1536, generator=g).to(torch.bfloat16)
            for parts in (1, 2):
                torch.set_num_threads(1)
                want = native.q4_linear(x, nib, dm, parts)
                torch.set_num_threads(16)
                for name, b in builds.items():
                    assert torch.equal(b.q4_linear(x, nib, dm, parts), want), (name, rows, parts)
    finally:
        torch.set_num_threads(threads)


@pytest.mark.parametrize("group", [0, 16, 32], ids=["per-channel", "group16", "group32"])
@pytest.mark.parametrize("n,k", [(8, 32), (48, 64), (960, 576), (49152, 576)])
def test_cpu_int8_kernel_rounds_no_worse_than_its_bf16_output_and_rows_are_independent(n, k, group):
    """The cpu backend's int8 kernel (a quantized model's LM head; with a scale per group of 16 or 32, a GGUF's
    Q6_K, Q8_0 and Q5_0 linears) carries the activations as ~15-bit integers and sums exactly in int32 per block, so against
    float64 its error is its bf16 output's rounding (torch's int8 GEMV, bf16 throughout, adds ~1.5x). A row's
    result is bitwise the same alone or beside others, whichever group of rows the kernel tiles it in: a
    speculative verify row equals a plain one."""
    native = _cpu_kernels_or_skip()
    g = torch.Generator().manual_seed(n + k)
    w = Int8Weight.quantize(torch.randn(n, k, generator=g) * 0.02, group)
    prepared = ops.get_backend("cpu").prepare["linear_w8a16"](w)
    assert "w8" in prepared.prepared
    for rows in (1, 3, 6):
        x = torch.randn(rows, k, generator=g).to(torch.bfloat16)
        got = native.q8_linear(x, prepared.prepared["w8"], prepared.prepared["d"])
        _assert_rounds_as_its_bf16_output(got, x, w)
        alone = torch.cat([native.q8_linear(r, prepared.prepared["w8"], prepared.prepared["d"]) for r in x.split(1)])
        assert torch.equal(alone, got)


def test_cpu_int8_kernel_one_activation_part_on_every_build(kernel_builds):
    """`serve --q8-activations` on the int8 kernel (the LM head; a Q4_K_M file's Q6_K and Q5_0 linears, held in 8, 6
    or 5 bits): with parts=1 its result is x rounded to one int8 part per block, times the weight, up to the bf16
    output's rounding. Every build gives it bit for bit (vpdpbusd on the weights' bytes plus 128 where the CPU has
    VNNI: AVX-512's tile pairs and single tiles, AVX-VNNI's; the int16 form of a lo part of zeros on AVX2), each row
    as alone, at every row count around the passes; and it is not the two-part result."""
    native = _cpu_kernels_or_skip()
    builds = {name: b for name, b in kernel_builds.items() if name in ("native", "avx2", "avxvnni")}
    g = torch.Generator().manual_seed(54)
    weights = [Int8Weight.quantize(torch.randn(n, k, generator=g) * 0.02, group)
               for n, k, group in ((48, 96, 0), (40, 256, 16), (40, 256, 32), (64, 576, 0))]
    weights[0].q[3, 5], weights[0].q[7, 9] = 127, -127  # both ends of the kernels' range
    low = [Int8Weight(torch.randint(lo, hi, (40, 256), generator=g, dtype=torch.int8),
                      torch.rand(40, 256 // group, generator=g) * 0.01 + 1e-4, 40, 256, group_size=group)
           for lo, hi, group in ((-16, 16, 32), (-32, 32, 16))] + [_q6_k_like(40, 256, g)]
    for w, bits in [*((w, 8) for w in weights), *((w, native.q8_bits(w)) for w in low)]:
        w8, d = native.pack_q8(w, bits)
        for rows in (1, 2, 3, 4, 5, 8, 9, 16, 17):
            x = (torch.randn(rows, w.in_features, generator=g) * torch.rand(rows, 1, generator=g) * 4).to(torch.bfloat16)
            got = native.q8_linear(x, w8, d, 1)
            _assert_rounds_as_its_bf16_output(got, x, w, want=_one_part(x) @ w.dequantize(torch.float64).t())
            for name, b in builds.items():
                assert torch.equal(b.q8_linear(x, w8, d, 1), got), (name, bits, w.group_size, rows)
            alone = torch.cat([native.q8_linear(r, w8, d, 1) for r in x.split(1)])
            assert torch.equal(alone, got), f"{rows} rows: a row's result depends on the rows beside it"
            assert not torch.equal(got, native.q8_linear(x, w8, d)), "parts=1 computed the two-part result"
    with pytest.raises(RuntimeError, match="parts is 1 or 2"):
        native.q8_linear(x, w8, d, 3)


@pytest.mark.parametrize("group", [16, 32])
def test_cpu_int8_kernel_holds_5_and_6_bit_values_in_as_many_bits_with_the_same_results(group):
    """Per-group weights whose values fit 5 bits (a GGUF's Q5_0) or 6 (Q6_K) can be held in 5 or 6 bits a value
    (what a decode step reads of them; by default where the build has vpdpbusd), and the kernel answers bit for bit
    as from their 8-bit packing: any row count (AVX-512's tile pairs from 3 rows in passes of 16, single tiles in
    passes of 8, AVX2's of 4), an odd count of tiles; values one past the range take the next form."""
    native = _cpu_kernels_or_skip()
    g = torch.Generator().manual_seed(group)
    for lo, hi, bits, block_bytes in ((-16, 15, 5, 160), (-32, 31, 6, 192), (-17, 15, 6, 192), (-32, 32, 8, None)):
        n, k = 40, 256
        q = torch.randint(lo, hi + 1, (n, k), generator=g, dtype=torch.int8)
        q[3, 7], q[5, 200] = lo, hi  # both ends of the range present
        w = Int8Weight(q, torch.rand(n, k // group, generator=g) * 0.01 + 1e-4, n, k, group_size=group)
        assert native.q8_bits(w) == bits
        packed, eight = native.pack_q8(w, bits), native.pack_q8(w, 8)
        if block_bytes:
            assert packed[0].shape == (n // 8, k // 32, block_bytes)
        for rows in (1, 2, 3, 5, 8, 9, 16, 17):
            x = torch.randn(rows, k, generator=g).to(torch.bfloat16)
            assert torch.equal(native.q8_linear(x, *packed), native.q8_linear(x, *eight)), (bits, rows)
    per_channel = Int8Weight(torch.randint(-8, 8, (16, 64), generator=g, dtype=torch.int8), torch.rand(16), 16, 64)
    assert native.q8_bits(per_channel) == 8  # the form is per group only


def _q6_k_like(n: int, k: int, g: torch.Generator) -> Int8Weight:
    """Q6_K's values and scales: d (an fp16) x an int8 per 16 inputs, the largest of a row's 256 at 127 or -128."""
    d = ((torch.rand(n, k // 256, 1, generator=g) * 2e-3 - 1e-3).half().float())  # either sign, as llama.cpp writes it
    sc = torch.randint(-128, 128, (n, k // 256, 16), generator=g)
    sc[..., 5] = torch.where(torch.rand(n, k // 256, generator=g) > 0.5, -128, 127)
    return Int8Weight(torch.randint(-32, 32, (n, k), generator=g, dtype=torch.int8), (d * sc).view(n, -1), n, k,
                      group_size=16)


def test_cpu_int8_kernel_holds_q6_k_scales_as_q6_k_does():
    """Q6_K's scales per 16 are an int8 times an fp16 per 256 inputs: held so (0.6 bits a weight, not 2: 208 bytes a
    tile's block, a float32 per 256) wherever every product gives a scale back exactly, with the 8-bit form's
    results bit for bit; one scale off that grid keeps the float32 per group."""
    native = _cpu_kernels_or_skip()
    g = torch.Generator().manual_seed(6)
    for n, k in ((40, 256), (48, 768)):
        w = _q6_k_like(n, k, g)
        w8, d = native.pack_q8(w, 6)
        assert w8.shape == (n // 8, k // 32, 208) and d.shape == (n // 8, k // 256, 8)
        for rows in (1, 2, 3, 5, 9, 16, 17):
            x = torch.randn(rows, k, generator=g).to(torch.bfloat16)
            assert torch.equal(native.q8_linear(x, w8, d), native.q8_linear(x, *native.pack_q8(w, 8))), rows
    w.scales[3, 7] *= 1 + 2 ** -20
    assert native.pack_q8(w, 6)[0].shape[-1] == 192


def test_cpu_int8_weights_the_kernel_cannot_take_keep_torchs():
    """Widths off the 8-row tile, or a -128 (the kernel's int16 products assume -127..127) leave torch's int8
    GEMV (per-group scales other than 16 or 32: the dense copy), with the reference's results."""
    _cpu_kernels_or_skip()
    be = ops.get_backend("cpu")
    g = torch.Generator().manual_seed(5)
    odd = Int8Weight.quantize(torch.randn(12, 64, generator=g))
    low = Int8Weight.quantize(torch.randn(16, 64, generator=g))
    low.q[0, 0] = -128
    for w in (odd, low):
        prepared = be.prepare["linear_w8a16"](w)
        assert "w8" not in prepared.prepared and "q" in prepared.prepared
        x = torch.randn(2, 64, generator=g).to(torch.bfloat16)
        tol = OPS["linear_w8a16"].tolerance[torch.bfloat16]
        torch.testing.assert_close(be.overrides["linear_w8a16"](x, prepared).double(),
                                   OPS["linear_w8a16"].reference(x.double(), w), atol=tol.atol, rtol=tol.rtol)


def test_cpu_mixed_residual_add_norm_is_torchs_add_then_the_norm_bit_for_bit():
    """A weight-only quantized model's bf16 sublayer output into its float32 residual stream: the one-pass
    kernel adds as torch's type-promoting add does (the same bits as the two ops it replaces, so greedy text
    does not move), for one row and for many."""
    native = _cpu_kernels_or_skip()
    g = torch.Generator().manual_seed(9)
    for rows in (1, 16):
        x = torch.randn(rows, 576, generator=g).bfloat16()
        r, w = torch.randn(rows, 576, generator=g) * 10, torch.rand(576, generator=g) + 0.5
        out, h = ops.get_backend("cpu").overrides["add_rms_norm"](x, r, w, 1e-5)
        assert h.dtype == out.dtype == torch.float32
        assert torch.equal(h, x + r) and torch.equal(out, native.rms_norm(x + r, w, 1e-5))


def test_cpu_argmax_and_swiglu_kernels_answer_as_torch():
    """Greedy decoding's argmax is torch's max(-1).indices exactly (equal maxima: the first; NaN: the first);
    the SwiGLU kernel's own exp rounds to the same bf16 values as torch's silu * up on a decode step's rows
    here (and float32 within a few ulps)."""
    native = _cpu_kernels_or_skip()
    be = ops.get_backend("cpu")
    g = torch.Generator().manual_seed(4)
    for dtype in (torch.float32, torch.bfloat16):
        logits = torch.randn(16, 49152, generator=g).to(dtype)
        logits[1, 10] = logits[1, 40000] = 100.0
        logits[2, 7] = logits[2, 9] = float("nan")
        logits[3] = float("-inf")
        logits[4, 3], logits[4, 5] = -0.0, 0.0
        logits[4, :3] = logits[4, 6:] = -1.0
        tail = logits[:5, :1001].clone()  # a width the vector passes do not divide: the last values in the scalar loop
        tail[0, 1000] = tail[3, 999] = 200.0
        for rows in (logits, logits[:1], logits[1:2], tail):
            assert torch.equal(be.overrides["argmax"](rows), rows.max(-1).indices)
        gate_up = torch.randn(16, 3072, generator=g).to(dtype) * 3
        gate, up = gate_up.chunk(2, -1)
        got, want = be.overrides["swiglu"](gate_up), torch.nn.functional.silu(gate) * up
        if dtype is torch.bfloat16:
            assert torch.equal(got, want)
        else:
            torch.testing.assert_close(got, want, rtol=4e-7, atol=1e-6)
    assert native.gates(gate_up) and native.argmaxes(logits)


def _weight_only_pair(seed: int, rows: int) -> tuple[Int4Weight, Int8Weight, torch.Tensor]:
    """A small int4 weight (groups of 32) and an int8 one, both 48 x 64, and `rows` bf16 activations."""
    g = torch.Generator().manual_seed(seed)
    w4 = Int4Weight(torch.randint(0, 16, (48, 64), generator=g, dtype=torch.uint8),
                    torch.rand(48, 2, generator=g) * 0.02 + 1e-3, torch.randn(48, 2, generator=g) * 0.02, 32, 48, 64)
    w8 = Int8Weight.quantize(torch.randn(48, 64, generator=g) * 0.02)
    return w4, w8, torch.randn(rows, 64, generator=g).to(torch.bfloat16)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_cpu_dense_copy_in_either_dtype_computes_the_reference(dtype, monkeypatch):
    """Past `packed_max_m` rows and for prompt rows a weight-only linear multiplies its dense copy, in the
    dtype tune.yaml gives this kind of CPU (float32 where bf16 is emulated); either way bf16 out, within
    the op's tolerance."""
    from flagdeploy.backends.cpu import ops as cpu_ops

    monkeypatch.setitem(cpu_ops.TUNE["weight_only_dense"], "dtype", dtype)
    for op in ("linear_w4a16", "linear_w8a16"):
        monkeypatch.setitem(cpu_ops.TUNE[op], "packed_max_m", 0)
        monkeypatch.setitem(cpu_ops.TUNE[op], "dense_copy", True)
    be = ops.get_backend("cpu")
    w4, w8, x = _weight_only_pair(3, 5)
    for op, w in (("linear_w4a16", w4), ("linear_w8a16", w8)):
        prepared = be.prepare[op](w)
        got = be.overrides[op](x, prepared)
        assert got.dtype == torch.bfloat16
        tol = OPS[op].tolerance[torch.bfloat16]
        torch.testing.assert_close(got.double(), OPS[op].reference(x.double(), w), atol=tol.atol, rtol=tol.rtol)


def test_cpu_without_a_dense_copy_every_row_takes_the_packed_kernel(monkeypatch):
    """Where the tune table keeps no dense copy beside the backend's own kernels (`dense_copy: false`, a CPU without
    bf16 matmuls), none is made, and a prompt's many rows take the packed kernel: each row as it computes alone, bit
    for bit, so a prompt computes the same however much of it a prefix-cache hit skipped. `ops tune`'s measurement
    makes copies meanwhile and puts the table back."""
    from flagdeploy.backends.cpu import native, tune
    from flagdeploy.backends.cpu import ops as cpu_ops

    if not native.available():
        pytest.skip("the cpu backend's own kernels are not built here")
    for op in ("linear_w4a16", "linear_w8a16"):
        monkeypatch.setitem(cpu_ops.TUNE[op], "dense_copy", False)
        monkeypatch.setitem(cpu_ops.TUNE[op], "packed_max_m", 4)
    be = ops.get_backend("cpu")
    w4, w8, x = _weight_only_pair(5, 70)
    for op, w in (("linear_w4a16", w4), ("linear_w8a16", w8)):
        prepared = be.prepare[op](w)
        assert "dense" not in prepared.prepared
        with ops.prefill_step():
            got = be.overrides[op](x, prepared)
        alone = torch.cat([be.overrides[op](row[None], prepared) for row in x])
        assert torch.equal(got, alone), op
        with tune._dense_copies("float32"):
            assert "dense" in be.prepare[op](w).prepared
        assert (cpu_ops.TUNE[op]["packed_max_m"], cpu_ops.TUNE[op]["dense_copy"]) == (4, False)


def test_cpu_tune_table_is_chosen_by_the_cpus_flags(tmp_path):
    """tune.yaml holds one table per kind of CPU; the first whose flags this CPU has applies, the shipped
    file ends with one for any CPU, and every table has the same keys (the backend reads them all)."""
    import yaml

    from flagdeploy.backends.cpu import ops as cpu_ops

    shipped = yaml.safe_load(Path(cpu_ops.__file__).with_name("tune.yaml").read_text())["machines"]
    assert shipped[-1]["cpu_flags"] == []
    keys = {m["name"]: set(m) - {"name", "cpu_flags"} for m in shipped}
    assert len(set(map(frozenset, keys.values()))) == 1, keys
    by_name = {m["name"]: m for m in shipped}
    assert cpu_ops.tune_table(frozenset({"avx2", "avx512f", "avx512_bf16"}))["weight_only_dense"]["dtype"] == "bfloat16"
    assert cpu_ops.tune_table(frozenset({"avx2", "fma"}))["weight_only_dense"]["dtype"] == "float32"
    assert cpu_ops.tune_table(frozenset())["linear_w4a16"] == by_name[shipped[-1]["name"]]["linear_w4a16"]
    bad = tmp_path / "tune.yaml"
    bad.write_text(yaml.safe_dump({"machines": [{"name": "x", "cpu_flags": ["avx512f"], "linear": {}}]}))
    with pytest.raises(RuntimeError, match="no entry for a CPU with flags avx2"):
        cpu_ops.tune_table(frozenset({"avx2"}), bad)


def test_cpu_kernels_isa_is_the_cpus_best_unless_forced(monkeypatch):
    """The kernels are built for the best instruction set the CPU has (AVX-512, AVX-VNNI, AVX2);
    FLAGDEPLOY_CPU_ISA=avx2 builds the AVX2 ones on an AVX-512 CPU (their own cache file) and tunes that machine
    as an AVX2 one; asking for what the CPU lacks, or for a name that is none, leaves torch's kernels with a
    reason that says what to set (the portable kernels are then built alone: see test_rejection_sampling.py)."""
    from flagdeploy.backends.cpu import native
    from flagdeploy.backends.cpu import ops as cpu_ops

    avx512 = frozenset({"avx2", "fma", "f16c", "avx512f", "avx512bw", "avx512vl", "avx512_vnni", "avx512_bf16"})
    monkeypatch.setattr(native, "_proc_flags", lambda: avx512)
    monkeypatch.setattr(native.platform, "machine", lambda: "x86_64")
    monkeypatch.delenv("FLAGDEPLOY_CPU_ISA", raising=False)
    monkeypatch.delenv("FLAGDEPLOY_NATIVE_KERNELS", raising=False)
    assert native.isa() == "avx512" and native.cpu_flags() == avx512 and native.unsupported() is None
    assert native.isa_class() == "AVX-512"
    monkeypatch.setenv("FLAGDEPLOY_CPU_ISA", "AVX2")
    assert native.isa() == "avx2" and native.unsupported() is None
    assert native.cpu_flags() == {"avx2", "fma", "f16c"}
    assert native.isa_class() == "AVX2 (FLAGDEPLOY_CPU_ISA=avx2 on an AVX-512 CPU)"
    assert cpu_ops.tune_table(native.cpu_flags())["weight_only_dense"]["dtype"] == "float32"  # tuned as AVX2
    monkeypatch.setenv("FLAGDEPLOY_CPU_ISA", "avx3")
    assert "FLAGDEPLOY_CPU_ISA=avx3 is not one of avx512, avxvnni, avx2, amx, portable" in native.unsupported()
    monkeypatch.setenv("FLAGDEPLOY_CPU_ISA", "portable")  # the plain C++ kernels alone, as another CPU builds them
    assert "portable kernels alone" in native.unsupported() and native.cpu_flags() == avx512
    monkeypatch.setattr(native, "_proc_flags", lambda: frozenset({"avx2", "fma", "f16c"}))
    monkeypatch.setenv("FLAGDEPLOY_CPU_ISA", "avx512")
    assert "lacks avx512f, avx512bw, avx512vl, avx512_vnni" in native.unsupported()
    monkeypatch.delenv("FLAGDEPLOY_CPU_ISA")
    assert native.isa() == "avx2" and native.isa_class() == "AVX2" and native.unsupported() is None
    assert "-mno-avxvnni" not in native.ISAS["avx2"].compiler_flags()  # (a compiler may not know the flag)
    # AVX-VNNI without AVX-512 (Intel since Alder Lake): its own build; an AVX2 one there turns it off
    vnni = frozenset({"avx2", "fma", "f16c", "avx_vnni"})
    monkeypatch.setattr(native, "_proc_flags", lambda: vnni)
    assert native.isa() == "avxvnni" and native.isa_class() == "AVX2+VNNI" and native.unsupported() is None
    assert "-mavxvnni" in native.ISAS["avxvnni"].compiler_flags()
    monkeypatch.setenv("FLAGDEPLOY_CPU_ISA", "avx2")
    assert "-mno-avxvnni" in native.ISAS["avx2"].compiler_flags() and native.cpu_flags() == {"avx2", "fma", "f16c"}
    assert native.isa_class() == "AVX2 (FLAGDEPLOY_CPU_ISA=avx2 on an AVX2+VNNI CPU)"
    # AMX (Intel since Sapphire Rapids): the AVX-512 build by default, with the tile instructions turned off; the
    # build with the tile multiplies only when asked for by name
    amx = avx512 | {"amx_tile", "amx_int8", "amx_bf16"}
    monkeypatch.setattr(native, "_proc_flags", lambda: amx)
    monkeypatch.delenv("FLAGDEPLOY_CPU_ISA")
    assert native.isa() == "avx512" and native.isa_class() == "AMX" and native.cpu_flags() == amx
    assert "-mno-amx-tile" in native.ISAS["avx512"].compiler_flags()
    monkeypatch.setenv("FLAGDEPLOY_CPU_ISA", "amx")
    assert native.isa() == "amx" and native.unsupported() is None and "-mamx-int8" in native.ISAS["amx"].compiler_flags()
    monkeypatch.setattr(native, "_proc_flags", lambda: avx512)
    assert "lacks amx_tile, amx_int8" in native.unsupported()


@pytest.mark.parametrize("build", ["amx stand-in", "amx"])
def test_cpu_kernels_amx_path_computes_what_the_avx512_one_does(kernel_builds, build):
    """The AMX build's int4 kernel takes a block's dot products of many rows in tile multiplies, then the VNNI
    path's own float steps: bit for bit the AVX-512 build's outputs, at every row count around the tiles' 16 rows
    and its passes, K with an odd count of blocks, several tiles. Over the tile instructions' stand-in on any
    AVX-512 CPU; over the real ones where the CPU has AMX."""
    native = _cpu_kernels_or_skip()
    amx, avx512 = _build(kernel_builds, build), kernel_builds["native"]
    g = torch.Generator().manual_seed(12)
    for n, k in [(48, 96), (960, 576), (64, 1536)]:
        w = _random_int4(n, k, g)
        nib, dm = native.pack_q4(w)
        for rows in (1, 3, 4, 5, 8, 9, 15, 16, 17, 33):
            x = (torch.randn(rows, k, generator=g) * torch.rand(rows, 1, generator=g) * 4).to(torch.bfloat16)
            for least in (9, 1):  # the path from two halves of rows on, then at every row count
                assert amx.q4_amx_min_rows(least) == least
                assert torch.equal(amx.q4_linear(x, nib, dm), avx512.q4_linear(x, nib, dm)), (n, k, rows, least)
    amx.q4_amx_min_rows(native.AMX_NEVER)


def test_cpu_tune_measures_where_the_amx_path_starts(kernel_builds):
    """`ops tune` on the amx build measures from how many rows its tile path beats the VNNI one (tune.yaml's
    `amx_min_rows`), and leaves the kernels' setting as it was."""
    from flagdeploy.backends.cpu import tune

    native = _cpu_kernels_or_skip()
    standin = _build(kernel_builds, "amx stand-in")
    standin.q4_amx_min_rows(6)
    least = tune._amx_min_rows(standin)
    assert least is None or least in tune.ROWS
    assert standin.q4_amx_min_rows(0) == 6
    standin.q4_amx_min_rows(native.AMX_NEVER)
    if native.isa() != "amx":  # a build without the path reports 0 and takes no setting
        assert torch.ops.flagdeploy_cpu.q4_amx_min_rows(5) == 0


def test_cpu_kernels_keep_their_prefetches(kernel_builds):
    """The weight kernels ask for their weight 8 KiB ahead of the loads (a lone stream 151 -> 194 tok/s when that came,
    csrc/q4_linear.cpp), and decode attention for a key head's blocks two ahead (16 streams' attention 1.75-1.9x,
    csrc/decode_attention.cpp), and a compiler may drop every prefetch of a loop without a word: GCC 12 did, for a
    scale form tried in issue 54's fourteenth pass whose prefetch address had `b % 8` in it (2-5 rows 30-50% slower,
    the same results), and for the attention's two prefetch sites folded into one helper (twenty-ninth pass: 16
    streams 1.9x slower). So in each library built here (the CPU's own build and the AVX2 one beside it), every
    function with a weight loop (8 or more int8 dot instructions: vpdpbusd, vpmaddubsw) and every loop of the
    attention over keys (attend_rows, attend's per-head loop: those with fused multiply-adds) still has its
    prefetches."""
    import re
    import shutil
    import subprocess

    _cpu_kernels_or_skip()
    if shutil.which("objdump") is None:
        pytest.skip("no objdump to read the built library with")
    libraries = {line.split()[-1] for line in Path("/proc/self/maps").read_text().splitlines()
                 if re.search(r"flagdeploy_cpu[-_][^/]*\.so$", line)}
    assert libraries, "the kernels' libraries are loaded, so /proc/self/maps names them"
    loops = 0  # a library without such loops (another test's portable build) has none to check
    for lib in libraries:
        listing = subprocess.run(["objdump", "-d", "--no-show-raw-insn", "-C", lib], capture_output=True, text=True,
                                 check=True).stdout
        for function in re.split(r"\n(?=[0-9a-f]+ <)", listing):
            attention = re.search(r"<(void \(anonymous namespace\)::attend_rows<|dynamic_for<\(anonymous namespace\)::attend<)",
                                  function.split("\n", 1)[0]) and re.search(r"\bvfmadd", function)
            if attention or len(re.findall(r"\b(vpdpbusd|vpmaddubsw)\b", function)) >= 8:
                loops += 1
                assert "prefetch" in function, f"{Path(lib).name}: no prefetch left in {function.splitlines()[0][:160]}"
    assert loops, f"no weight or attention loop found to check in {sorted(libraries)}"


def test_cpu_kernels_avx2_build_computes_what_the_avx512_one_does(kernel_builds):
    """CPUs without AVX-512 get the same kernels built for AVX2 (two 8-row halves per tile, vpmaddubsw for
    vpdpbusd; portable C++ for the FP8 conversions, norms, rope and attention): built here as FLAGDEPLOY_CPU_ISA=avx2
    builds them, under another op namespace, they give the default build's outputs bit for bit."""
    from flagdeploy.ops.weights import fp8_block_quantize

    native = _cpu_kernels_or_skip()
    avx2, default = _build(kernel_builds, "avx2"), kernel_builds["native"]
    g = torch.Generator().manual_seed(11)
    for n, k, rows in [(48, 64, 5), (64, 96, 4), (960, 576, 3), (80, 64, 13), (48, 64, 17), (48, 64, 8)]:  # 13, 17: tiles in pairs
        w = _random_int4(n, k, g)
        nib, dm = native.pack_q4(w)
        x = torch.randn(rows, k, generator=g).to(torch.bfloat16)
        assert torch.equal(avx2.q4_linear(x, nib, dm), default.q4_linear(x, nib, dm))
        for group in (0, 16, 32):  # an odd count of 8-row tiles
            w8, d = native.pack_q8(Int8Weight.quantize(torch.randn(n + 8, k, generator=g), group))
            assert torch.equal(avx2.q8_linear(x, w8, d), default.q8_linear(x, w8, d))
        for group, top in ((32, 16), (16, 32)):  # values held in 5 and 6 bits
            q = torch.randint(-top, top, (n + 8, k), generator=g, dtype=torch.int8)
            w = Int8Weight(q, torch.rand(n + 8, k // group, generator=g) * 0.01, n + 8, k, group_size=group)
            w8, d = native.pack_q8(w, native.q8_bits(w))
            assert w8.dim() == 3 and torch.equal(avx2.q8_linear(x, w8, d), default.q8_linear(x, w8, d))
    for rows in (2, 5, 17):  # Q6_K's own scales
        w8, d = native.pack_q8(_q6_k_like(40, 512, g), 6)
        x = torch.randn(rows, 512, generator=g).to(torch.bfloat16)
        assert w8.shape[-1] == 208 and torch.equal(avx2.q8_linear(x, w8, d), default.q8_linear(x, w8, d))
    w8, s = fp8_block_quantize(torch.randn(200, 160, generator=g) * 0.05, (128, 128))
    u8 = w8.view(torch.uint8)
    for group in (0, 32):
        a, b = avx2.fp8_to_int8(u8, s, 128, 128, group), default.fp8_to_int8(u8, s, 128, 128, group)
        assert torch.equal(a[0], b[0]) and torch.equal(a[1], b[1])
        torch.testing.assert_close(a[2], b[2], rtol=1e-5, atol=0)
    assert torch.equal(avx2.fp8_to_bf16(u8, s, 128, 128)[0], default.fp8_to_bf16(u8, s, 128, 128)[0])
    for dtype in (torch.float32, torch.bfloat16):  # the portable norm and rope loops
        x, r, w = (torch.randn(*shape, generator=g).to(dtype) for shape in ((3, 576), (3, 576), (576,)))
        assert torch.equal(avx2.rms_norm(x, w, 1e-5), default.rms_norm(x, w, 1e-5))
        assert all(torch.equal(a, b) for a, b in zip(avx2.add_rms_norm(x, r, w, 1e-5), default.add_rms_norm(x, r, w, 1e-5)))
        gate_up = torch.randn(5, 2 * 200, generator=g).to(dtype) * 4  # SwiGLU: 200 wide, not a multiple of 16
        assert torch.equal(avx2.swiglu(gate_up), default.swiglu(gate_up))
        logits = torch.randn(4, 1000 + 7, generator=g).to(dtype)
        logits[1, 3] = logits[1, 900] = 50.0
        logits[2, 501] = float("nan")
        assert torch.equal(avx2.argmax_rows(logits), default.argmax_rows(logits))
        x16 = x.bfloat16()  # a bf16 sublayer output into a float32 residual stream
        if dtype is torch.float32:
            assert all(torch.equal(a, b) for a, b in zip(avx2.add_rms_norm(x16, r, w, 1e-5),
                                                         default.add_rms_norm(x16, r, w, 1e-5)))
        q, k, v = (torch.randn(3, h, 64, generator=g).to(dtype) for h in (9, 3, 3))
        cos, sin = torch.rand(3, 32, generator=g), torch.rand(3, 32, generator=g)
        caches = [[torch.zeros(2, 4, 3, 64, dtype=dtype) for _ in range(2)] for _ in range(2)]
        slots = torch.tensor([5, 0, 2])
        got = [ns.rope_write_kv(q, k, v, cos, sin, *c, slots) for ns, c in ((avx2, caches[0]), (default, caches[1]))]
        assert all(torch.equal(a, b) for a, b in zip(got[0], got[1])) and torch.equal(caches[0][0], caches[1][0])
        # decode attention: AVX-512 folds 16 keys' dot products at once, the portable loop one key at a time;
        # head widths with that path (64, 128) and without (48), partial blocks and block sizes not of 16
        for d, block_size in ((64, 16), (128, 20), (48, 16)):
            kc, vc = (torch.randn(12, block_size, 3, d, generator=g).to(dtype) for _ in range(2))
            q = torch.randn(4, 9, d, generator=g).to(dtype)
            tables = torch.stack([torch.randperm(12, generator=g)[:6] for _ in range(4)])
            lens = torch.tensor([1, 17, 5 * block_size + 3, 40])
            assert torch.equal(avx2.paged_decode_attention(q, kc, vc, tables, lens, 0.125),
                               default.paged_decode_attention(q, kc, vc, tables, lens, 0.125)), (d, dtype)
            verify = tables[2].expand(4, -1).contiguous()  # one sequence's verify rows: its keys read once for all
            lens = torch.arange(5 * block_size, 5 * block_size + 4)
            assert torch.equal(avx2.paged_decode_attention(q, kc, vc, verify, lens, 0.125),
                               default.paged_decode_attention(q, kc, vc, verify, lens, 0.125)), (d, dtype)


def test_cpu_int4_weights_no_packed_kernel_can_tile_run_the_reference():
    """Output widths not a multiple of 16 rows (both packed kernels' tile) stay canonical: the reference."""
    g = torch.Generator().manual_seed(5)
    n, k = 40, 64
    w = Int4Weight(torch.randint(0, 16, (n, k), generator=g, dtype=torch.uint8),
                   torch.rand(n, k // 32, generator=g) * 0.02, torch.randn(n, k // 32, generator=g) * 0.02, 32, n, k)
    be = ops.get_backend("cpu")
    prepared = be.prepare["linear_w4a16"](w)
    assert prepared.prepared is None
    x = torch.randn(3, k, generator=g)
    torch.testing.assert_close(be.overrides["linear_w4a16"](x, prepared), OPS["linear_w4a16"].reference(x, w))


def test_cpu_prepared_dense_layouts_change_strides_not_results(monkeypatch):
    """The cpu backend stores wide dense weights column-major (where its tune table says so: here the AVX-512
    table's rule) and expert banks so that its two all-expert matmuls read them as views: every reader still
    sees the same [N, K] / [E, 2I, H] / [E, H, I] values."""
    from flagdeploy.backends.cpu import ops as cpu_ops

    monkeypatch.setitem(cpu_ops.TUNE, "linear", {"column_major_min_out": 256, "column_major_max_in": 512})
    g = torch.Generator().manual_seed(3)
    be = ops.get_backend("cpu")
    wide, narrow = torch.randn(512, 64, generator=g), torch.randn(8, 64, generator=g)
    x = torch.randn(5, 64, generator=g)
    for w in (wide, narrow):
        p = be.prepare["linear"](w)
        assert torch.equal(p, w) and p.is_contiguous() == (w.shape[0] < 256)
        torch.testing.assert_close(ops.linear(x, p), ops.linear(x, w))
    e, i, h = 6, 16, 32
    gate_up, down = torch.randn(e, 2 * i, h, generator=g), torch.randn(e, h, i, generator=g)
    pg, pd = be.prepare["moe_experts"]((gate_up, down))
    assert torch.equal(pg, gate_up) and torch.equal(pd, down)
    # the all-expert weights are views of the prepared banks, not per-call copies
    assert pg.permute(2, 0, 1).reshape(h, e * 2 * i).data_ptr() == pg.data_ptr()
    assert pd.permute(1, 0, 2).reshape(h, e * i).data_ptr() == pd.data_ptr()
    xs = torch.randn(3, h, generator=g)
    routing = torch.zeros(3, e).scatter_(1, torch.tensor([[0, 2], [1, 5], [2, 3]]), torch.rand(3, 2, generator=g))
    want = OPS["moe_experts"].reference(xs.double(), routing.double(), gate_up.double(), down.double(), 7.0)
    for banks in ((pg, pd), (gate_up, down)):
        got = be.overrides["moe_experts"](xs, routing, *banks, 7.0)
        torch.testing.assert_close(got.double(), want, atol=1e-5, rtol=1e-5)


# ---- per-op evidence: ops check and selftest --------------------------------------------------------------


def test_ops_check_and_selftest_on_the_cpu(tmp_path):
    import json

    from click.testing import CliRunner

    from flagdeploy.cli import main

    r = CliRunner().invoke(main, ["ops", "check", "--chip", "cpu", "--json"])
    assert r.exit_code == 0, r.output
    report = json.loads(r.output)
    assert report["passed"] == report["total"] == 2 * len(OPS)
    impl = {(x["op"], x["dtype"]): x["impl"] for x in report["results"]}
    assert impl[("rms_norm", "float32")] == "native" and impl[("moe_router", "bfloat16")] == "reference"
    assert all(x["time_us"] > 0 and x["max_abs_err"] is not None for x in report["results"])
    config = tmp_path / "config.json"
    config.write_text(json.dumps({"model_type": "llama", "hidden_size": 64, "num_attention_heads": 4,
                                  "num_key_value_heads": 2, "intermediate_size": 96}))
    r = CliRunner().invoke(main, ["ops", "check", "--chip", "cpu", "--model", str(config), "--dtype", "bfloat16"])
    assert r.exit_code == 0, r.output
    assert "m256 hidden=64" in r.output and "paged_attention_decode" in r.output
    out = tmp_path / "report.json"
    r = CliRunner().invoke(main, ["selftest", "--chip", "cpu", "-o", str(out)])
    assert r.exit_code == 0, r.output
    assert json.loads(out.read_text())["chip"] == "cpu"
    r = CliRunner().invoke(main, ["selftest", "--chip", "ascend910c"])
    assert r.exit_code == 1 and "ascend910c" in r.output


def test_ops_tune_writes_the_backends_table(tmp_path):
    import yaml
    from click.testing import CliRunner

    from flagdeploy.cli import main
    from flagdeploy.profiles import PROFILES_DIR

    out = tmp_path / "tune.yaml"
    r = CliRunner().invoke(main, ["ops", "tune", "--chip", "cpu", "-o", str(out)])
    assert r.exit_code == 0, r.output
    measured = yaml.safe_load(out.read_text())
    amx_min_rows = measured["linear_w4a16"].pop("amx_min_rows", None)  # only from the amx build (FLAGDEPLOY_CPU_ISA)
    assert amx_min_rows is None or amx_min_rows >= 1
    shipped = yaml.safe_load((PROFILES_DIR.parent / "backends" / "cpu" / "tune.yaml").read_text())["machines"][-1]
    del shipped["name"], shipped["cpu_flags"]
    assert {k: set(v) for k, v in measured.items()} == {k: set(v) for k, v in shipped.items()}
    assert measured.pop("weight_only_dense")["dtype"] in ("float32", "bfloat16")
    layouts = measured["moe_experts"].pop("column_major_gate_up")  # dtypes, a switch, the rest sizes
    assert set(layouts) <= {"float32", "bfloat16"}
    assert set(measured["paged_attention_decode"].pop("matmul_dtypes")) <= {"float32", "bfloat16", "float16"}
    compile_settings = measured.pop("compile")
    assert isinstance(compile_settings["freezing"], bool)
    # inductor's GEMM templates need frozen weights
    assert compile_settings["weight_only_one_row"].get("max_autotune", False) == compile_settings["freezing"]
    assert all(isinstance(x, int) and x >= 0 for v in measured.values() for x in v.values())
    r = CliRunner().invoke(main, ["ops", "tune", "--chip", "cuda"])
    assert r.exit_code == 1 and "nothing to tune" in r.output


# ---- the DSA indexer at exact ties -----------------------------------------------------------------------


def _kept_pools(mask: torch.Tensor, n_pools: int, p: int) -> list[int]:
    return [i for i in range(n_pools) if mask[i * p] != 0]


@pytest.mark.parametrize("dtype", [*DTYPES, torch.float64], ids=str)
def test_dsa_indexer_keeps_the_lower_pool_of_equal_scores_whatever_the_padding(dtype):
    """The op check's inputs put exact ties (scores of 0.0) at the top-k cut (flagdeploy/ops/glm.py
    `_tied_pools`). Of equal scores the lower pool index is kept, by the per-sequence op and by the decode
    op, whatever the width the decode rows are padded to and whatever other sequences share the call
    (torch.topk's own choice among ties changes with the row's width)."""
    import flagdeploy.ops.glm  # noqa: F401  (declares the ops)

    ref = OPS["dsa_indexer_topk_decode"].reference
    (q, w, keys, gate, ape, lengths, topk, tail), _ = _inputs(OPS["dsa_indexer_topk_decode"], dtype)
    p = ape.shape[0]
    want = {0: [0, 3], 1: [0, 2], 2: [0]}  # (see `_indexer_decode_inputs`)
    base = ref(q, w, keys, gate, ape, lengths, topk, tail)
    for b, pools in want.items():
        assert _kept_pools(base[b], int(lengths[b]) // p, p) == pools
    g = torch.Generator().manual_seed(5)
    for extra in (1, 4, 13, 40, 123):  # padded to wider block tables: random rows past every sequence's length
        pad = lambda x: torch.cat([x, torch.randn(x.shape[0], extra, x.shape[2], generator=g).to(x.dtype)], 1)  # noqa: E731
        wide = ref(q, w, pad(keys), pad(gate), ape, lengths, topk, tail)
        assert torch.equal(wide[:, : keys.shape[1]], base) and not wide[:, keys.shape[1] :].any()
    for b in want:  # alone, cut to its own length, and through the per-sequence op
        n = int(lengths[b])
        alone = ref(q[b : b + 1], w[b : b + 1], keys[b : b + 1, :n], gate[b : b + 1, :n], ape, lengths[b : b + 1],
                    topk, tail)
        assert torch.equal(alone[0], base[b, :n])
        one = OPS["dsa_indexer_topk"].reference(q[b : b + 1], w[b : b + 1], keys[b, :n], gate[b, :n], ape, n - 1,
                                                topk, tail)
        assert torch.equal(one[0], base[b, :n])
    (q, w, keys, gate, ape, start, topk, tail), _ = _inputs(OPS["dsa_indexer_topk"], dtype)
    mask = OPS["dsa_indexer_topk"].reference(q, w, keys, gate, ape, start, topk, tail)
    assert [_kept_pools(row, keys.shape[0] // p, p) for row in mask] == [[0, 2], [0, 1], [0, 2], [0, 2]]

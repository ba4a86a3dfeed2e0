"""The op registry: each hot op declared once (signature, reference, tolerance); backends override.

A model calls `flagdeploy.ops.<name>(...)`; the call goes to the active backend's override if it has
one, else to the plain-torch reference. Backends are plugins found through the entry-point group
`flagdeploy.backends` (the in-tree cpu backend registers itself the same way a third party would).
"""

from __future__ import annotations

import contextvars
import logging
from contextlib import contextmanager
from dataclasses import dataclass, field
from importlib.metadata import entry_points
from typing import Any, Callable

import torch

from flagdeploy.errors import UnknownChipError

log = logging.getLogger(__name__)

ENTRY_POINT_GROUP = "flagdeploy.backends"


@dataclass(frozen=True)
class Tolerance:
    atol: float
    rtol: float


@dataclass(frozen=True)
class OpSpec:
    """One hot op. `reference` is the specification: plain torch, any device, what tests compare against.

    `make_inputs(dtype, device, gen)` builds representative random arguments so that every backend can
    be checked against the reference (and the reference against float64) without per-op test code.
    `writes`: positions of the arguments the op writes in place (a cache), checked as outputs too.
    `composite(impl)`: for a backend with no kernel of its own for this op, the op built from that
    backend's implementations of other ops (`impl(name)`), so a fused op never falls back below what
    the backend already runs natively.
    """

    name: str
    reference: Callable
    tolerance: dict[torch.dtype, Tolerance]
    make_inputs: Callable[[torch.dtype, str, torch.Generator], tuple[tuple, dict]]
    doc: str = ""
    writes: tuple[int, ...] = ()
    composite: Callable[[Callable[[str], Callable]], Callable] | None = None

    def outputs(self, out, args) -> tuple:
        """What a call produced, as the checks compare it: its return value(s), then what it wrote."""
        out = () if out is None else out if isinstance(out, tuple) else (out,)
        return out + tuple(args[i] for i in self.writes)


@dataclass
class Backend:
    """What a chip plugin declares: identity, how to find the chip, what its matrix unit takes, its ops.

    `detect` returns True when the chip is present on this host; it must be cheap and never raise.
    """

    name: str
    vendor: str
    device_type: str
    dtypes: tuple[str, ...]
    collective: str
    detect: Callable[[], bool]
    overrides: dict[str, Callable] = field(default_factory=dict)
    # op name → lays a weight (a dense tensor or a canonical bundle of flagdeploy.ops.weights) out for
    # this backend's kernels, once at load time. What it returns must still be read correctly by the op's
    # override where the backend has one, else by the reference (e.g. a dense tensor with other strides).
    prepare: dict[str, Callable] = field(default_factory=dict)
    # 16-bit dtypes whose matmuls run at full speed while the rest of a float32 step stays float32: there,
    # `weight_format=auto` keeps weights stored in one of them as stored (the CPU's AMX: bf16). A GPU runs
    # 16-bit end to end when speed matters, and a float32 run on it is asked for exactness: none.
    narrow_weight_dtypes: tuple[str, ...] = ()
    # Weight-only linear ops whose kernels read the quantized bytes at every step (not a dense copy made at load):
    # where `linear_w8a16` is one, `weight_format=auto` keeps a GGUF's wider quantized linears (Q5_*, Q6_K, Q8_0)
    # and a fused linear of mixed quantized layouts as int8 groups, which only pays where int8 is what is read.
    packed_weights: tuple[str, ...] = ()
    # whether `linear_w8a16`'s kernels hold per-group values of at most 6 bits in 6 (asked at load time: the answer may
    # need the kernels built). Where they do, a GGUF's Q6_K LM head loads as the file holds it (6.6 bits a weight,
    # exact) rather than as per-channel int8 (8 bits, rounded once more).
    int8_low_bits: Callable[[], bool] = lambda: False
    # Where the backend's packed kernels quantise a linear's activations finer than llama.cpp does (its Q8: one int8 a
    # value, a scale per 32): (model) -> how many of the loaded model's linears now take that precision instead
    # (`serve --q8-activations`; faster few-row steps where the kernels' products are the bound). None: the
    # backend's kernels have no finer form to give up.
    q8_activations: Callable[[Any], int] | None = None
    # inductor settings for the compiled decode step (`serve --compile`, engine/compiled_step.py) that are
    # this backend's to choose, e.g. {"freezing": True}: the weights become constants that inductor lays
    # out once for its own GEMM calls (the cpu backend's tune table says where that is faster). Entries
    # under "weight_only_one_row" apply only to the one-row graph of a model whose linears are all
    # weight-only quantized (e.g. autotuning: a few GEMV shapes there, every dense shape elsewhere)
    compile_config: dict = field(default_factory=dict)
    # A whole decode step in the backend's own code, for the models it knows: (model, kv caches, block size)
    # -> an object with `serves(rows, width)` and `run(ids, positions, slots, tables, ctx)` -> logits, or None
    # where it cannot compute what the eager step computes. The runner prefers it to the eager step, and a
    # model it serves is not compiled by default (cpu: backends/cpu/llama_step.py).
    decode_step: Callable | None = None
    # Threads its kernels get in a server process, from the cores the process may use, where OMP_NUM_THREADS does
    # not say (flagdeploy/cpu_threads.py): a pool that spins on every core stalls whenever the server's own
    # threads take one of them. None: torch's default (a device's kernels do not run on the host's cores).
    server_threads: Callable[[int], int] | None = None
    priority: int = 0  # higher wins when several backends detect their chip
    description: str = ""
    # The environment variable that restricts which devices a process sees (CUDA_VISIBLE_DEVICES, ...):
    # how data-parallel replicas (flagdeploy/gateway/replicas.py) each get their own devices. None:
    # the backend has no such variable (the CPU), and every process sees the whole machine.
    visible_devices_env: str | None = None
    # Catalog backends (chip families: metax, cambricon, ...) this backend runs when no plugin of that name is
    # installed; `specialize(chip)` gives the backend for one chip of them, or for a family named alone
    # (backends/generic: the family's device type and collective come from its families.yaml).
    families: tuple[str, ...] = ()
    specialize: Callable[[str], "Backend"] | None = None
    # op name -> one line on how this backend runs it beyond native/composite/reference (`ops list`)
    explain: Callable[[str], str] | None = None


OPS: dict[str, OpSpec] = {}


def register_op(spec: OpSpec) -> OpSpec:
    if spec.name in OPS:
        raise ValueError(f"op {spec.name!r} is declared twice")
    OPS[spec.name] = spec
    return spec


_backends: dict[str, Backend] | None = None


def backends() -> dict[str, Backend]:
    """All installed backends, loaded once from the entry-point group. A broken plugin is skipped, logged."""
    global _backends
    if _backends is None:
        found: dict[str, Backend] = {}
        for ep in entry_points(group=ENTRY_POINT_GROUP):
            try:
                be = ep.load()
            except Exception as exc:  # a broken third-party plugin must not take the rest down
                log.warning("backend plugin %s could not be loaded: %s", ep.name, exc)
                continue
            unknown = set(be.overrides) - set(OPS)
            if unknown:
                log.warning("backend %s overrides undeclared ops %s; ignored", be.name, sorted(unknown))
                be.overrides = {k: v for k, v in be.overrides.items() if k in OPS}
            found[be.name] = be
        _backends = found
    return _backends


def get_backend(name: str) -> Backend:
    """The installed backend `name`, or the backend a chip of the catalog runs on (ascend910c -> ascend):
    a user names the chip they own, the op layer needs its backend (flagdeploy.chips.resolve_chip)."""
    bes = backends()
    if name in bes:
        return bes[name]
    from flagdeploy.chips import resolve_chip

    choice = resolve_chip(name, plugin_backends=bes)  # an unknown value raises the one --chip error
    if choice.backend not in bes:
        runs_family = [be for be in bes.values() if choice.backend in be.families and be.specialize]
        if runs_family:
            return runs_family[0].specialize(choice.value)
        raise UnknownChipError(
            f"--chip {choice.value} runs on the {choice.backend!r} backend, which is not installed here (installed: "
            f"{', '.join(sorted(bes)) or 'none'}). Install its stack (`flagdeploy install --chip {choice.value}`) or "
            f"the plugin that provides {choice.backend!r}, or pick an installed backend with --chip."
        )
    return bes[choice.backend]


def require_device(be: Backend, chip: str | None = None) -> Backend:
    """`be`, once its chip is seen on this host: without it, loading fails deep in torch ("Expected one of
    cpu, cuda, ... device string: npu", "Torch not compiled with CUDA enabled")."""
    if not _safe_detect(be):
        name = chip or be.name
        raise UnknownChipError(f"no {name} device is visible to the {be.name} backend on this host. Check the driver "
                               f"and runtime install (`flagdeploy install --chip {name}`), the device nodes and the "
                               f"visibility variables (`flagdeploy doctor --chip {name}` names the usual traps), or "
                               f"leave --chip out to use what this host has.")
    return be


def detect_backend() -> Backend:
    """The best backend whose chip is present; the cpu backend always is."""
    present = [be for be in backends().values() if _safe_detect(be)]
    if not present:
        return get_backend("cpu")
    return max(present, key=lambda be: be.priority)


def _safe_detect(be: Backend) -> bool:
    try:
        return bool(be.detect())
    except Exception as exc:
        log.debug("detect() of backend %s failed: %s", be.name, exc)
        return False


# ---- dispatch -------------------------------------------------------------------------------------

_active: dict[str, Callable] = {}
_active_backend: Backend | None = None


def implementation(be: Backend, name: str) -> tuple[str, Callable]:
    """How `be` runs op `name`: ("native", its override), ("composite", the op built from its other
    ops' implementations) or ("reference", the specification)."""
    spec = OPS[name]
    if name in be.overrides:
        return "native", be.overrides[name]
    if spec.composite is not None:
        return "composite", spec.composite(lambda other: implementation(be, other)[1])
    return "reference", spec.reference


def use_backend(backend: Backend | str | None) -> Backend:
    """Route every op to `backend`'s implementation: its override, a composite of its others, the reference."""
    global _active_backend
    be = get_backend(backend) if isinstance(backend, str) else (backend or detect_backend())
    _active.clear()
    for name in OPS:
        _active[name] = implementation(be, name)[1]
    _active_backend = be
    log.info("op backend: %s (%d native ops)", be.name, len(be.overrides))
    return be


def active_backend() -> Backend:
    if _active_backend is None:
        use_backend(None)
    return _active_backend  # type: ignore[return-value]


def prepare_weight(op: str, weight):
    """Hand a weight to the active backend for its own layout (see `Backend.prepare`)."""
    fn = active_backend().prepare.get(op)
    return fn(weight) if fn else weight


def dispatch(name: str) -> Callable:
    """Build the module-level function for op `name`: one dict lookup per call."""

    def call(*args, **kwargs):
        try:
            fn = _active[name]
        except KeyError:  # no backend chosen yet, or ops declared after it was: (re)build the table
            use_backend(_active_backend)
            fn = _active[name]
        return fn(*args, **kwargs)

    call.__name__ = name
    call.__doc__ = OPS[name].doc
    return call


# ---- what kind of step the ops run in -------------------------------------------------------------------


def trace_constant(fn):
    """`torch._dynamo.assume_constant_result` without importing dynamo (~3 s of a server's start before it
    is ready, where only the compile needs it): the decorator only marks the function with this attribute,
    which dynamo reads when it traces a call (tests/test_ops.py checks the two still agree)."""
    fn._dynamo_marked_constant = True
    return fn


@trace_constant
def tracing() -> bool:
    """Whether this call is being traced by torch.compile in this thread. Not `torch.compiler.is_compiling()`:
    that is one process-wide flag, held for a whole compile session, so while the decode step compiles in a
    background thread (`serve`'s default on the CPU) the serving thread's eager ops would take the traced
    forms. Dynamo runs this at trace time and bakes the answer in; run eagerly it asks the thread's own
    tracing context."""
    return torch._guards.TracingContext.try_get() is not None


_PREFILL = contextvars.ContextVar("flagdeploy_prefill_step", default=None)  # {rows: prompt rows among them} or None


@contextmanager
def prefill_step(leading: dict[int, int] | None = None):
    """Marks a forward that computes prompt tokens (alone or beside decodes). A backend whose kernels
    differ by row count (the cpu backend's packed int4 kernel for few rows, a bf16 GEMM for more) runs
    every prompt token through one of them, so that a prompt computes the same values whatever part of
    it a prefix-cache hit skipped. `leading` {n: k}: an activation of n rows holds a prompt's rows in its first
    k (the paged runner puts a step's prompt chunks first: its token rows, and its logits rows); the decode rows
    after them are computed as a step of decodes alone computes them, so that a sequence's tokens do not depend
    on whether a prompt arrived beside it. Other activations count as a prompt's rows throughout."""
    token = _PREFILL.set(leading or {})
    try:
        yield
    finally:
        _PREFILL.reset(token)


# Dynamo cannot trace a ContextVar read: a compiled step reads the flag once, at trace time (its graphs are
# decode steps, traced outside any prefill or verify step), and keeps the answer.
@trace_constant
def in_prefill_step() -> bool:
    return _PREFILL.get() is not None


def prompt_rows(n: int) -> int:
    """How many of the first rows of an activation of `n` rows are prompt tokens (`prefill_step`): 0 outside a
    prefill step."""
    leading = _PREFILL.get()
    return 0 if leading is None else leading.get(n, n)


_VERIFY = contextvars.ContextVar("flagdeploy_verify_step", default=False)


@contextmanager
def verify_step():
    """Marks a decode forward in which one sequence has several rows: the positions of a speculative
    verify (its last token and its drafts, each a decode row over the same block table with its own
    context length). A backend whose decode attention changes form or rounding with the batch (the cpu
    backend: one sequence unmasked, several masked, matmuls past a number of keys) computes each row here
    as a lone decode row of that sequence would be, so that verified tokens equal unspeculated ones."""
    token = _VERIFY.set(True)
    try:
        yield
    finally:
        _VERIFY.reset(token)


@trace_constant
def in_verify_step() -> bool:
    return _VERIFY.get()

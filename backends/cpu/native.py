"""The cpu backend's own C++ kernels (csrc/), built on first use with the machine's C++ compiler.

- `q4_linear`: torch has no x86 kernel that multiplies int4 weights by int8 activations (its int4 GEMV
  converts each nibble to bf16), and that kernel is what a 4-bit GGUF's decode step is made of. This
  one runs AVX-512 VNNI dot products over 16 output rows at a time, or on AVX2 the same arithmetic in
  two halves (csrc/q4_linear.cpp), each weight chunk unpacked once for up to 8 (AVX2: 4) activation rows.
- `q8_linear`: the same for int8 weights with per-channel scales (a quantized model's LM head), where torch's
  int8 GEMV converts each weight to float: int16 dot products of 8 output rows at a time (csrc/q8_linear.cpp).
- `paged_decode_attention`: decode attention over paged caches, each (row, query head) by the same
  arithmetic whatever else is in the call (a row's result is bitwise the same alone, batched or as a
  speculative verify row), in one call where torch's SDPA costs ~200 us per call and a verify step needed
  one per row; a verify step's rows read their sequence's keys and values once (csrc/decode_attention.cpp).
- `rms_norm` / `add_rms_norm`: RMS norm (after the residual add) in one pass per row, where torch's
  composite norm is several kernels and allocations: 7 us a decode row against 40-70 us (csrc/rms_norm.cpp).
- `rope_write_kv`: rotary embedding of q and k and the k/v cache write in one pass, where torch's form is
  a dozen small kernels (csrc/rope_write_kv.cpp).
- `swiglu`: silu(gate) * up in one pass, where torch's form is two single-threaded kernels and an
  intermediate at a decode step's sizes (csrc/swiglu.cpp).
- `argmax_rows`: greedy decoding's argmax, rows in parallel, where torch's max-with-indices takes ~2 ns a
  value on one thread (0.4-0.7 ms a 16-row step over a 49k vocabulary) (csrc/argmax.cpp).
- `sample_probs` / `draw`: sampled decoding's distributions (temperature, min_p, top_k, top_p) and draws, rows in
  parallel, selecting top_k and top_p among the few entries above a bound instead of sorting the vocabulary:
  numpy or torch on the engine's thread took 0.16-0.29 ms a row, ~4 ms of a 16-row step (csrc/sample.cpp).
- `fp8_to_int8` / `fp8_to_bf16`: `flagdeploy quantize`'s per-tensor arithmetic in one pass over an FP8
  weight's rows, where torch's elementwise ops make several over float32 temporaries (csrc/fp8_convert.cpp).

They are compiled once per source, torch version and CPU into the user's cache directory (~40 s on two
cores, a compiler per source at once, like inductor's own kernels under `serve --compile`) and loaded as a
torch library, so that compiled graphs call them without Python. They are built for the best instruction set
the CPU has (ISAS), or the one FLAGDEPLOY_CPU_ISA names (amx, avx512, avxvnni, avx2): all compute the same bits. Where they
cannot be used (another CPU, no compiler, FLAGDEPLOY_NATIVE_KERNELS=0) the callers keep torch's kernels:
`available()` says which, and the log says why. The kernels in plain C++ (PORTABLE: the argmax and sampling
kernels) are built on their own on any other CPU with a compiler (an ARM server, x86 without AVX2; on x86
FLAGDEPLOY_CPU_ISA=portable builds only them): `portable()` says whether those are loaded.
Per-group int8 weights of 5 or 6 bits (a GGUF's Q5_0, Q6_K) are held in as many where the build has vpdpbusd
(`holds_low_bits`); FLAGDEPLOY_INT8_LOW_BITS=0 holds them in 8 (the same outputs, more bytes: for an A/B).
"""

from __future__ import annotations

import functools
import hashlib
import logging
import os
import platform
import shutil
import subprocess
import tempfile
from dataclasses import dataclass
from pathlib import Path

import torch

from flagdeploy.ops.weights import Int4Weight, Int8Weight

log = logging.getLogger(__name__)

CSRC = Path(__file__).with_name("csrc")
SOURCES = tuple(sorted(CSRC.glob("*.cpp")))  # compiled into one library
# The kernels written in plain C++ (no intrinsics: auto-vectorised for the CPU at hand), which also make a library
# of their own on CPUs the others cannot run on: without them a sampled row goes through the torch reference,
# whose top_p sorts the vocabulary (~4.6 ms a row of 49k, against ~0.1 ms here).
PORTABLE = tuple(CSRC / name for name in ("argmax.cpp", "sample.cpp", "thread_pool.cpp"))
TILE = 16  # output rows per vpdpbusd: the kernel's N must be a multiple
GROUP = 32  # the activations' and the weights' block along K


@dataclass(frozen=True)
class Isa:
    """An instruction set the kernels are built for: what the CPU must have (as /proc/cpuinfo names it), the
    compiler flags beside -march=native, and the flags of larger sets that a build for this one leaves unused
    (hidden from the tune table too, so that a forced build is measured and tuned as that class of CPU)."""

    cpu_flags: tuple[str, ...]
    cxx_flags: tuple[str, ...] = ()
    hides: tuple[str, ...] = ()
    # what turns off, under -march=native, a feature of the CPU this build must not use (the flag only where the
    # CPU has the feature: an older compiler may not know it)
    turns_off: tuple[tuple[str, str], ...] = ()
    # whether per-group int8 weights whose values fit 5 or 6 bits are held in as many (pack_q8): where vpdpbusd takes
    # their bytes. Measured (benchmarks/cpu_low_bits.py, a 16-core Xeon): AVX-512 and AVX-VNNI builds alike, 1-2 rows
    # 0.60-0.88x the 8-bit form's time, 5-16 rows 0.94-1.28x (a lone stream's bytes against a few rows' unpacking, as
    # on the AVX-512 EPYC's model steps); AVX2, whose vpmaddubsw + vpmaddwd take two instructions a product, 1.36-1.80x
    # from 5 rows (a default-model step of 5 or 16 rows 1.27x on the EPYC): it keeps 8 bits
    low_bit_weights: bool = False

    def compiler_flags(self) -> tuple[str, ...]:
        return (*self.cxx_flags, *(flag for feature, flag in self.turns_off if feature in _proc_flags()))


# Best first: by default the kernels are built for the first of these the CPU has; FLAGDEPLOY_CPU_ISA names one
# (so that an AVX-512 machine builds, tests and measures the AVX2 kernels too).
# AVX-VNNI (vpdpbusd on ymm: Intel since Alder Lake and Sapphire Rapids, AMD since Zen 5) is a class of its own
# below AVX-512: an AVX2 build that takes the dot products of int8 in one instruction instead of two.
# AMX (Intel since Sapphire Rapids): the AVX-512 build plus tile multiplies in q4_linear's many-row path. Last, so
# asked for by name only (FLAGDEPLOY_CPU_ISA=amx): on a 16-core Xeon its tiles won from 8 rows on one thread and at
# no row count on all 16 (tune.yaml's amx_min_rows); the AVX-512 build turns them off on such a CPU.
_AVX512 = ("avx512f", "avx512bw", "avx512vl", "avx512_vnni", "fma", "f16c")
ISAS = {"avx512": Isa(_AVX512, turns_off=(("amx_tile", "-mno-amx-tile"),), low_bit_weights=True),
        "avxvnni": Isa(("avx2", "fma", "f16c", "avx_vnni"), ("-mno-avx512f", "-mavxvnni"), hides=("avx512", "amx"),
                       low_bit_weights=True),
        "avx2": Isa(("avx2", "fma", "f16c"), ("-mno-avx512f",), hides=("avx512", "amx", "avx_vnni"),
                    turns_off=(("avx_vnni", "-mno-avxvnni"),)),
        "amx": Isa(("amx_tile", "amx_int8", *_AVX512), ("-mamx-tile", "-mamx-int8"), low_bit_weights=True)}
# The class of CPU a figure was measured on, for benchmarks' headers: the first whose flag the CPU has
ISA_CLASSES = (("amx_tile", "AMX"), ("avx512f", "AVX-512"), ("avx_vnni", "AVX2+VNNI"), ("avx2", "AVX2"))


# -fno-trapping-math lets GCC if-convert the clamp of exp_nonpositive.h for AVX2 (AVX-512 masks it anyway), so
# that softmax's and SwiGLU's exp run 8 values at a time there, not one: it changes no value, only what may
# raise floating-point exception flags, which nothing here reads
CXX_FLAGS = ("-O3", "-march=native", "-fno-trapping-math", "-fPIC", "-std=c++20", "-w")
# The kernels use OpenMP's simd loops only (their threads are thread_pool.h's): the portable build asks for just
# those, so it links no OpenMP runtime
OPENMP, OPENMP_SIMD = ("-fopenmp",), ("-fopenmp-simd",)


def _cxx() -> str:
    return os.environ.get("CXX", "c++")


@functools.cache
def _proc_flags() -> frozenset[str]:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("flags"):
                return frozenset(line.split(":", 1)[1].split())
    except OSError:
        pass
    return frozenset()


def isa() -> str:
    """The instruction set the kernels are built for: FLAGDEPLOY_CPU_ISA's, else the best this CPU has
    (ISAS' first key where it has none: unsupported() says why)."""
    forced = os.environ.get("FLAGDEPLOY_CPU_ISA", "").strip().lower()
    if forced:
        return forced
    return next((name for name, want in ISAS.items() if set(want.cpu_flags) <= _proc_flags()), next(iter(ISAS)))


def cpu_flags() -> frozenset[str]:
    """The CPU's flags as the kernels and the tune table see them: without those the kernels' ISA leaves
    unused (a forced AVX2 build on an AVX-512 CPU is tuned as an AVX2 machine)."""
    name = isa()
    hides = ISAS[name].hides if name in ISAS else ()
    return frozenset(f for f in _proc_flags() if not f.startswith(hides))


def isa_class() -> str:
    """How benchmarks name the CPU they ran on: its class (AMX, AVX-512, AVX2), and the kernels' ISA where
    FLAGDEPLOY_CPU_ISA forces one below it."""
    real = next((name for flag, name in ISA_CLASSES if flag in _proc_flags()), platform.machine())
    seen = next((name for flag, name in ISA_CLASSES if flag in cpu_flags()), platform.machine())
    return real if seen == real else f"{seen} (FLAGDEPLOY_CPU_ISA={isa()} on an {real} CPU)"


def _compile(out: Path, extra_flags: tuple[str, ...] = (), sources: tuple[Path, ...] = SOURCES) -> None:
    """g++ on `sources` (of csrc/) against this torch, into `out` by way of a temporary file: one compiler a source,
    as many at once as there are cores (one g++ over all of them took ~85 s on two cores), then one link."""
    from concurrent.futures import ThreadPoolExecutor

    from torch.utils.cpp_extension import include_paths

    lib = Path(torch.__file__).parent / "lib"
    cxx = _cxx()
    flags = [*CXX_FLAGS, *extra_flags,
             f"-D_GLIBCXX_USE_CXX11_ABI={int(torch._C._GLIBCXX_USE_CXX11_ABI)}", *(f"-I{p}" for p in include_paths())]
    out.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=out.parent) as tmp:
        def run(cmd: list[str]) -> None:
            done = subprocess.run(cmd, capture_output=True, text=True)
            if done.returncode:
                raise RuntimeError(f"{cxx} exited with {done.returncode}: {done.stderr.strip()[-2000:]}")

        objects = [Path(tmp) / f"{src.stem}.o" for src in sources]
        with ThreadPoolExecutor(os.cpu_count() or 1) as pool:
            list(pool.map(run, ([cxx, *flags, "-c", str(src), "-o", str(o)] for src, o in zip(sources, objects))))
        so = Path(tmp) / out.name
        run([cxx, "-shared", *(f for f in extra_flags if f in OPENMP), *map(str, objects), "-o", str(so), f"-L{lib}",
             "-ltorch", "-ltorch_cpu", "-lc10", f"-Wl,-rpath,{lib}"])
        so.replace(out)


def unsupported() -> str | None:
    """Why this machine cannot run the kernels (None: it can, given a compiler to build them): x86 with
    the flags of the ISA they are built for (isa())."""
    if os.environ.get("FLAGDEPLOY_NATIVE_KERNELS", "1") == "0":
        return "switched off by FLAGDEPLOY_NATIVE_KERNELS=0"
    if isa() == "portable":
        return "FLAGDEPLOY_CPU_ISA=portable asks for the portable kernels alone"
    if isa() not in ISAS:
        return (f"FLAGDEPLOY_CPU_ISA={isa()} is not one of {', '.join(ISAS)}, portable: set one of those, or unset it "
                "for this CPU's best")
    missing = [f for f in ISAS[isa()].cpu_flags if f not in _proc_flags()]
    if platform.machine() not in ("x86_64", "AMD64") or missing:
        forced = " (FLAGDEPLOY_CPU_ISA)" if os.environ.get("FLAGDEPLOY_CPU_ISA") else ""
        return f"this CPU lacks {', '.join(missing) or 'x86'}{forced}"
    return None


def _build(name: str) -> tuple[tuple[Path, ...], tuple[str, ...]]:
    """(sources, compiler flags) of the library built for `name`: an ISA of ISAS, or "portable"."""
    return (PORTABLE, OPENMP_SIMD) if name == "portable" else (SOURCES, (*OPENMP, *ISAS[name].compiler_flags()))


def build_beside(name: str, directory: Path, csrc: Path | None = None, namespace: str | None = None):
    """The kernels built for ISA `name` (or the portable ones alone, "portable") under their own op namespace
    (`torch.ops.flagdeploy_cpu_<name>`, or `namespace`) and loaded beside this process's: how a test or benchmark
    on a larger CPU runs a smaller class's kernels (avx2 on an AVX-512 CPU) in the same process, or another
    version's (`csrc`: that version's csrc/ folder, e.g. a git ref's) beside this one's. Built into `directory`,
    not the cache."""
    ns = namespace or f"flagdeploy_cpu_{name}"
    so = directory / f"{ns}.so"
    sources, flags = _build(name)
    if csrc is not None:  # that version's own files (it may have more or fewer than this one)
        sources = tuple(csrc / p.name for p in sources) if name == "portable" else tuple(sorted(csrc.glob("*.cpp")))
    _compile(so, (*flags, f"-DFLAGDEPLOY_OPS_NS={ns}"), sources)
    torch.ops.load_library(str(so))
    return getattr(torch.ops, ns)


def _load(name: str) -> bool:
    """Load the library built for `name` (see _build) from the cache, building it first where it is not there."""
    from flagdeploy.checkpoints.source import cache_dir

    sources, flags = _build(name)
    code = b"".join(p.read_bytes() for p in sorted({*sources, *CSRC.glob("*.h")}))  # the sources and the headers
    key = hashlib.sha256(code + torch.__version__.encode() + platform.machine().encode() + name.encode()
                         + " ".join(sorted(cpu_flags())).encode() + " ".join((*CXX_FLAGS, *flags)).encode())
    so = cache_dir() / "kernels" / f"flagdeploy_cpu-{name}-{key.hexdigest()[:16]}.so"
    if not so.exists():
        log.warning("cpu backend: building its C++ kernels for %s (once per machine, ~%d s on two cores) into %s",
                    name, 10 if name == "portable" else 40, so)
        try:
            _compile(so, flags, sources)
        except (OSError, RuntimeError) as e:
            log.warning("cpu backend: building csrc/ failed, keeping torch's kernels: %s", e)
            return False
    torch.ops.load_library(str(so))
    return True


@functools.cache
def _compiler() -> bool:
    """Whether the C++ compiler is there (a warning once where it is not)."""
    if shutil.which(_cxx()) is None:
        log.warning("cpu backend: no C++ compiler (%s) to build its kernels, so 4-bit models decode ~1.7x slower "
                    "on torch's int4 kernel (and quantize converts slower). Install g++ (or set CXX) to get them.",
                    _cxx())
        return False
    return True


AMX_NEVER = 1 << 62  # q4_amx_min_rows's row count for "never" (also the kernels' own default)
_amx_min_rows = 0  # what use_amx_from asked of the AMX path (0: the kernels' own default), kept for their load


def use_amx_from(rows: int | None) -> None:
    """q4_linear's AMX path (the amx build) from `rows` activation rows on, None for never: tune.yaml's
    `amx_min_rows`, which `ops tune` measures. Either path gives the same bits: this moves only the speed.
    Applied when the kernels load (at once where they are loaded); nothing in a build without the path."""
    global _amx_min_rows
    _amx_min_rows = AMX_NEVER if rows is None else rows
    if available.cache_info().currsize and available():
        torch.ops.flagdeploy_cpu.q4_amx_min_rows(_amx_min_rows)


@functools.cache
def available() -> bool:
    """Whether the kernels are loaded, building them first if this machine has not yet."""
    reason = unsupported()
    if reason:  # a warning where FLAGDEPLOY_CPU_ISA asked for what cannot be had
        forced = os.environ.get("FLAGDEPLOY_CPU_ISA") and isa() != "portable"
        log.log(logging.WARNING if forced else logging.INFO,
                "cpu backend: torch's kernels only, not its own (csrc/): %s", reason)
        return False
    if not _compiler() or not _load(isa()):
        return False
    torch.library.register_fake("flagdeploy_cpu::q4_linear")(_q4_linear_fake)
    torch.library.register_fake("flagdeploy_cpu::q8_linear")(_q8_linear_fake)
    torch.library.register_fake("flagdeploy_cpu::paged_decode_attention")(lambda q, *_: torch.empty_like(q))
    torch.library.register_fake("flagdeploy_cpu::swiglu")(lambda x: x.new_empty(x.shape[0], x.shape[1] // 2))
    torch.ops.flagdeploy_cpu.q4_amx_min_rows(_amx_min_rows)
    return True


@functools.cache
def portable() -> bool:
    """Whether the portable kernels (PORTABLE: argmax and sampling) are loaded: in the whole library where that
    builds, else on their own, wherever a compiler is (another CPU than x86 with AVX2)."""
    if available():
        return True
    if os.environ.get("FLAGDEPLOY_NATIVE_KERNELS", "1") == "0" or not _compiler():
        return False
    # their exp (exp_nonpositive.h) is a chain of fused multiply-adds: without the instruction each is a libm
    # call, and a temperature-only row took 0.7 ms where torch's reference takes 0.2 (x86-64-v2 build)
    if platform.machine().lower() not in ("aarch64", "arm64") and "fma" not in _proc_flags():
        log.info("cpu backend: torch's kernels only: this CPU has no fused multiply-add for the portable ones")
        return False
    log.info("cpu backend: its portable kernels (argmax, sampling) alone")
    return _load("portable")


def _q4_linear_fake(x, nib, dm, parts=2):
    return x.new_empty(x.shape[0], nib.shape[0] * TILE, dtype=torch.bfloat16)


def _q8_linear_fake(x, w8, d):
    return x.new_empty(x.shape[0], w8.shape[0] * TILE8, dtype=torch.bfloat16)


def fits(w: Int4Weight) -> bool:
    return w.group_size == GROUP and w.out_features % TILE == 0 and w.in_features % GROUP == 0


def pack_q4(w: Int4Weight) -> tuple[torch.Tensor, torch.Tensor]:
    """(nib, dm) in the kernel's layout (csrc/q4_linear.cpp) from the canonical bundle: tiles of 16 rows,
    and per tile and block of 32, the 16 rows' nibbles interleaved by 4 (one int32 lane per row), then
    their scales and offsets. The canonical w = (q - 8) * s + z is stored as d * q + m (d = s, m = z - 8 s)
    in float16, which holds a GGUF's own fp16 d and m exactly."""
    t, g = w.out_features // TILE, w.in_features // GROUP
    q = w.q.to(torch.uint8).view(t, TILE, g, 4, 2, 4).permute(0, 2, 3, 4, 1, 5)  # tile, block, chunk, nibble, row, 4
    nib = (q[:, :, :, 0] | (q[:, :, :, 1] << 4)).contiguous()
    d = w.scales.float()
    m = w.zeros.float() - 8 * d
    dm = torch.stack([v.view(t, TILE, g).transpose(1, 2) for v in (d, m)], 2).to(torch.float16).contiguous()
    return nib, dm


def q4_linear(x: torch.Tensor, nib: torch.Tensor, dm: torch.Tensor, parts: int = 2) -> torch.Tensor:
    """x [M, K] (float32 or bf16) times the packed weight: [M, N] bf16. `parts`: the activations' int8 parts per
    value (2: ~15 bits, the default; 1: llama.cpp's Q8 precision, `serve --q8-activations`)."""
    return torch.ops.flagdeploy_cpu.q4_linear(x, nib, dm, parts)


TILE8 = 8  # output rows per tile of the int8 kernel


def fits_q8(w: Int8Weight) -> bool:
    """Int8 in -127..127 (the kernel's int16 products need no -128), per channel or per group of 16 or 32 inputs,
    widths it tiles."""
    return (w.group_size in (0, 16, GROUP) and w.q.dim() == 2 and w.out_features % TILE8 == 0
            and w.in_features % GROUP == 0 and int(w.q.min()) >= -127)


def q8_bits(w: Int8Weight) -> int:
    """The fewest bits the kernel can hold `w`'s values in: 5 (-16..15, a GGUF's Q5_0) or 6 (-32..31, Q6_K) where
    its scales are per group, else 8."""
    if w.group_size:
        low, high = int(w.q.min()), int(w.q.max())
        for bits in (5, 6):
            if -(1 << (bits - 1)) <= low and high < 1 << (bits - 1):
                return bits
    return 8


def holds_low_bits() -> bool:
    """Whether pack_q8 holds per-group values of 5 or 6 bits in as many by default: this build's Isa.low_bit_weights,
    unless FLAGDEPLOY_INT8_LOW_BITS=0."""
    return ISAS.get(isa(), Isa(())).low_bit_weights and os.environ.get("FLAGDEPLOY_INT8_LOW_BITS", "1") != "0"


def pack_q8(w: Int8Weight, bits: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """(w8, d) in the kernel's layout (csrc/q8_linear.cpp): tiles of 8 rows, and per tile and block of 32, the
    rows' values two columns at a time (one int32 lane per row), or in `bits` 5 or 6 (default: q8_bits where this
    build's Isa holds low-bit weights, else 8) the 8 rows' values four columns at a time; the scales as float32,
    per channel [N], or per group of G inputs as [N/8, K/G, 8] (per tile and group, its rows' scales)."""
    if bits is None:
        bits = q8_bits(w) if holds_low_bits() else 8
    t, g = w.out_features // TILE8, w.in_features // GROUP
    if bits < 8:  # per tile and block, 8 chunks of the 8 rows' 4 inputs, then packed
        w8 = _pack_low_bits(w.q.to(torch.int8).view(t, TILE8, g, 8, 4).permute(0, 2, 3, 1, 4).reshape(t, g, 8, 32), bits)
        factors = _q6k_scales(w) if bits == 6 else None
        if factors is not None:  # each block's 16 int8 scales after its values; d per 256 inputs
            sub, per_256 = factors
            sub = sub.view(t, TILE8, g, 2).permute(0, 2, 3, 1).reshape(t, g, 2 * TILE8)
            return torch.cat([w8, sub], dim=2).contiguous(), per_256.view(t, TILE8, -1).transpose(1, 2).contiguous()
    else:
        w8 = w.q.to(torch.int8).view(t, TILE8, g, GROUP // 2, 2).permute(0, 2, 3, 1, 4).contiguous()
    if w.group_size:
        return w8, w.scales.float().view(t, TILE8, -1).transpose(1, 2).contiguous()
    return w8, w.scales.float().reshape(-1).contiguous()


def _q6k_scales(w: Int8Weight) -> tuple[torch.Tensor, torch.Tensor] | None:
    """Scales per group of 16 as Q6_K holds them, int8 [N, K/16] times float32 [N, K/256] (0.6 bits a weight, not
    2), where every product is the scale exactly; else None. A GGUF's Q6_K is d * sc with d an fp16 and the
    largest |sc| of its 256 inputs 127 or 128 (llama.cpp's quantiser: -128 for the largest, d of either sign), so d
    is that largest scale / +-128 or +-127."""
    if w.group_size != 16 or w.in_features % 256:
        return None
    s = w.scales.float().view(w.out_features, -1, 16)
    largest = s.abs().amax(dim=-1, keepdim=True)
    sub, per_256 = torch.zeros_like(s, dtype=torch.int8), torch.zeros_like(largest)
    done = torch.zeros_like(largest, dtype=torch.bool)
    for top in (128.0, -128.0, 127.0, -127.0):
        d = largest / top
        sc = torch.round(s / torch.where(d == 0, torch.ones_like(d), d))
        ok = ((sc >= -128) & (sc <= 127) & (sc * d == s)).all(dim=-1, keepdim=True) & ~done
        sub = torch.where(ok, sc.clamp(-128, 127).to(torch.int8), sub)
        per_256, done = torch.where(ok, d, per_256), done | ok
    return (sub.view(w.out_features, -1), per_256.view(w.out_features, -1)) if bool(done.all()) else None


def _pack_low_bits(chunks: torch.Tensor, bits: int) -> torch.Tensor:
    """A block's 8 chunks of 32 values as 4 x 32 bytes of low nibbles (chunks 2v and 2v + 1 in byte i of the
    v-th) and `bits` - 4 x 32 bytes of the high bits (the e-th holds chunk (8 / E) e + j's at bit E j)."""
    u = (chunks.to(torch.int16) + (1 << (bits - 1))).to(torch.uint8)  # 0 .. 2^bits - 1
    nib = (u[:, :, 0::2] & 0x0F) | ((u[:, :, 1::2] & 0x0F) << 4)
    extra = bits - 4
    high = (u >> 4).unflatten(2, (extra, 8 // extra))  # [t, g, E, 8 / E, 32]
    high = sum(high[:, :, :, j] << (extra * j) for j in range(8 // extra))
    return torch.cat([nib.flatten(2), high.to(torch.uint8).flatten(2)], dim=2).view(torch.int8).contiguous()


def q8_linear(x: torch.Tensor, w8: torch.Tensor, d: torch.Tensor, parts: int = 2) -> torch.Tensor:
    """x [M, K] (float32 or bf16) times the packed int8 (or 5- or 6-bit) weight: [M, N] bf16. `parts` as q4_linear's."""
    return torch.ops.flagdeploy_cpu.q8_linear(x, w8, d, parts)


def paged_decode_attention(q, k_cache, v_cache, block_tables, context_lens, scale: float) -> torch.Tensor:
    """q [R, H, D] over each row's keys in the paged caches [blocks, block_size, KH, D]: [R, H, D]."""
    return torch.ops.flagdeploy_cpu.paged_decode_attention(q, k_cache, v_cache, block_tables, context_lens, scale)


def attends(k_cache: torch.Tensor) -> bool:
    """Whether `paged_decode_attention` takes caches like this one (float32 or bf16, contiguous)."""
    return k_cache.dtype in (torch.float32, torch.bfloat16) and k_cache.is_contiguous() and available()


def normalizes(x: torch.Tensor, weight: torch.Tensor) -> bool:
    """Whether `rms_norm` takes these: float32 or bf16 rows on the CPU with a weight of their dtype."""
    return x.dtype in (torch.float32, torch.bfloat16) and weight.dtype == x.dtype and x.device.type == "cpu" and \
        available()


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    return torch.ops.flagdeploy_cpu.rms_norm(x, weight, eps)


def add_rms_norm(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float):
    """(the norm of x + residual, x + residual)."""
    return torch.ops.flagdeploy_cpu.add_rms_norm(x, residual, weight, eps)


def rotates(q, k, v, k_cache, v_cache) -> bool:
    """Whether `rope_write_kv` takes these: q, k, v and contiguous caches of one dtype, float32 or bf16."""
    dt = q.dtype
    return dt in (torch.float32, torch.bfloat16) and all(t.dtype == dt for t in (k, v, k_cache, v_cache)) and \
        k_cache.is_contiguous() and v_cache.is_contiguous() and q.device.type == "cpu" and available()


def rope_write_kv(q, k, v, cos, sin, k_cache, v_cache, slot_mapping):
    """(rotated q, rotated k); the rotated k and v written to their slots of the caches."""
    return torch.ops.flagdeploy_cpu.rope_write_kv(q, k, v, cos, sin, k_cache, v_cache, slot_mapping)


def gates(gate_up: torch.Tensor) -> bool:
    """Whether `swiglu` takes this: [R, 2I] float32 or bf16 rows on the CPU."""
    return gate_up.dim() == 2 and gate_up.dtype in (torch.float32, torch.bfloat16) and gate_up.device.type == "cpu" \
        and available()


def swiglu(gate_up: torch.Tensor) -> torch.Tensor:
    """silu(gate) * up of gate_up = [gate | up]: [R, I] in its dtype."""
    return torch.ops.flagdeploy_cpu.swiglu(gate_up)


def argmaxes(logits: torch.Tensor) -> bool:
    """Whether `argmax_rows` takes these: [R, V] float32 or bf16 logits on the CPU."""
    return logits.dim() == 2 and logits.dtype in (torch.float32, torch.bfloat16) and logits.device.type == "cpu" and \
        portable()


def argmax_rows(logits: torch.Tensor) -> torch.Tensor:
    """[R] int64: each row's first index of its largest value (the first NaN where it has one)."""
    return torch.ops.flagdeploy_cpu.argmax_rows(logits)


def samples(x: torch.Tensor) -> bool:
    """Whether `sample_probs` and `draw` take these rows: [R, V] float32 or bf16 on the CPU."""
    return argmaxes(x)


def sample_probs(logits, temperature, top_k, top_p, min_p) -> torch.Tensor:
    """[R, V] float32: each row's distribution under its settings (see flagdeploy.ops.reference.sample_probs)."""
    return torch.ops.flagdeploy_cpu.sample_probs(logits, temperature.float().contiguous(), top_k.long().contiguous(),
                                                 top_p.float().contiguous(), min_p.float().contiguous())


def draw(probs: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """[R] int64: each row's token at its uniform u (-1: nothing to draw from)."""
    return torch.ops.flagdeploy_cpu.draw(probs.float(), u.double().contiguous())


def fp8_to_int8(w: torch.Tensor, scale_inv: torch.Tensor, block: tuple[int, int], group: int):
    """(q int8, scales float32 [R, C / group or 1], sum of squares of the dequantised weight, of the error)."""
    q, scales, sums = torch.ops.flagdeploy_cpu.fp8_to_int8(w.view(torch.uint8), scale_inv.float().contiguous(),
                                                          block[0], block[1], group)
    return q, scales, float(sums[0]), float(sums[1])


def fp8_to_bf16(w: torch.Tensor, scale_inv: torch.Tensor, block: tuple[int, int]):
    """(bf16 weight, sum of squares of the dequantised weight, of the rounding error)."""
    out, sums = torch.ops.flagdeploy_cpu.fp8_to_bf16(w.view(torch.uint8), scale_inv.float().contiguous(), *block)
    return out, float(sums[0]), float(sums[1])


def converts_fp8(w: torch.Tensor, block: tuple[int, int], group: int = 0) -> bool:
    """Whether the one-pass FP8 kernels take this weight (e4m3, widths in multiples of 16)."""
    return (w.dtype == getattr(torch, "float8_e4m3fn", None) and w.dim() == 2 and w.is_contiguous()
            and w.shape[1] % 16 == 0 and block[1] % 16 == 0 and (group or 16) % 16 == 0 and available())

"""`flagdeploy serve` against llama.cpp's `llama-server` on the CPU, same GGUF, same run (issue 33).

    python benchmarks/cpu_vs_llama_server.py [--rounds 3] [--max-tokens 128] [--concurrency 16] [--quick]
        [--llama-server PATH] [--model SRC] [--quantize TYPE] [--build-only] [--isa avx2|avxvnni|avx512]
        [--temperature T [--top-p P] [--top-k K]]

What a CPU user would otherwise run is llama.cpp's server, so that is the baseline. The script:

1. finds or builds `llama-server`: from the llama-cpp-python source distribution (its version pins the
   vendored llama.cpp under vendor/llama.cpp; the installed version, else LLAMA_CPP_PYTHON), configured as
   a user would build it for this machine (GGML_NATIVE, Release) and cached under
   `<flagdeploy cache>/llama-server/bin/`, keyed by that version and a hash of the CPU's flags, so only the
   first run on a machine pays the build (minutes). `--llama-server PATH` uses a binary you have.
2. serves the embedded default GGUF (SmolLM2-135M-Instruct Q4_1, found as `flagdeploy serve` finds it), or
   --model's, requantized first to --quantize's type (Q4_K_M: what most users download) by llama.cpp's own
   `llama-quantize` (built and cached as llama-server is), with both servers, started one after the other and
   then both up, but never both busy (they would share the cores): their rounds alternate, in the order
   A B B A A ..., so that a host whose speed drifts over the minutes of a run (this VM's does, by up to ~30%)
   favours neither:
   `llama-server -m GGUF -t THREADS -np CONCURRENCY -c CONCURRENCY*CTX_PER_SLOT` and `flagdeploy serve` with
   its default flags (only --port; --model only when --model is given here). The per-slot context defaults
   to flagdeploy serve's default --max-model-len, 4096, so both hold the same context per sequence.
3. measures, over HTTP (streamed chat completions, greedy unless --temperature (with --top-p, --top-k) has
   both servers sample, `max_tokens` forced with `ignore_eos`, which both servers take; the completion tokens
   are counted from the streamed usage, and every request is checked to have produced exactly max_tokens):
   - ready s: process start -> readiness endpoint answers 200 (llama-server /health, flagdeploy /ready);
   - first req tok/s: one request sent at once after ready (where flagdeploy's default serve compiles its
     decode step in the background, for models its C++ step does not serve, this is what a client gets
     meanwhile);
   - settled s: process start -> flagdeploy's `decode_step_compiling` gauge reads 0 (the compiled step in,
     or given up); the throughput columns are measured after it;
   - 1-stream tok/s: output tokens / wall time of one request (prefill included), median of --rounds
     sequential requests after one warm-up request;
   - N-concurrent tok/s: output tokens of N requests sent at once / wall time until the last one ends,
     median of --rounds rounds after one warm-up round.
   The maths is flagdeploy.bench's (loadgen.run_round, stats.median_of_rounds), as `flagdeploy bench serve`.
4. sets beside flagdeploy's HTTP rates what its engine itself did, to show what is lost between the engine
   and the client (issue 33):
   - engine tok/s: the same rounds' generation tokens / seconds inside engine steps, from the server's
     /metrics (`generation_tokens_total`, `engine_step_seconds_total`), median of the rounds;
   - in-process tok/s: the same engine configuration (serve's defaults, with the decode step the server
     settles to: the C++ step for the default model, no compile), the same chat prompts and token counts,
     driven by `LLMEngine.generate` in this process with no server at all (the servers are stopped by then;
     not interleaved), median of --rounds after a warm-up.
   HTTP / in-process is the share of the engine's own speed a client receives.

Prints one row per server and the ratios flagdeploy / llama-server: above 1 is flagdeploy faster for the
tok/s columns, and slower for ready s. "spread" is max/min throughput over the rounds used: far above 1 the
host was not quiet and the figures need more rounds. Finally it says whether the two servers' greedy answers
(EOS honoured, same prompts) agree; informational only, different kernels may round differently.
`--quick` is a smoke test (32 tokens, 1 round), not a measurement.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import hashlib
import json
import os
import platform
import re
import shutil
import signal
import statistics
import subprocess
import sys
import tarfile
import tempfile
import time
from collections import deque
from dataclasses import dataclass
from importlib import metadata
from pathlib import Path
from typing import Self

import httpx

from flagdeploy.cpu_threads import cores, sleep_idle_openmp, threads_for_server, user_environ

sleep_idle_openmp()  # before torch loads, as serve does: the in-process rows run the server's engine settings
from cpu_serving import PROMPTS  # the in-process benchmark's prompts (this script runs from benchmarks/)

from flagdeploy.backends.cpu.native import isa_class
from flagdeploy.bench.client import Endpoint, StreamResult, stream_request
from flagdeploy.bench.loadgen import LoadConfig, Prompt, ServeResults, run_round
from flagdeploy.checkpoints.source import cache_dir, resolve
from flagdeploy.net import free_port

LLAMA_CPP_PYTHON = "0.3.36"  # used when llama-cpp-python is not installed (the `gateway` extra)
CMAKE_FLAGS = ["-DLLAMA_BUILD_SERVER=ON", "-DGGML_NATIVE=ON", "-DLLAMA_CURL=OFF", "-DCMAKE_BUILD_TYPE=Release",
               "-DBUILD_SHARED_LIBS=OFF"]  # static: the cached binary must not need the build tree's .so files
# --isa avx2: both servers as on a CPU without AVX-512 (an AVX2 Zen 2/3, most desktops): llama.cpp built for AVX2
# alone, and flagdeploy's kernels built so with torch's own (ATen, oneDNN, MKL) capped there too; --isa avxvnni: as on
# an AVX2 CPU with AVX-VNNI (Intel desktops and laptops since Alder Lake, AMD since Zen 5: vpdpbusd on 256 bits);
# --isa avx512: as on an AVX-512 CPU without AMX
_X86 = ["-DGGML_NATIVE=OFF", "-DGGML_AVX=ON", "-DGGML_AVX2=ON", "-DGGML_FMA=ON", "-DGGML_F16C=ON", "-DGGML_BMI2=ON"]
ISA_CMAKE_FLAGS = {"avx2": [*_X86, "-DGGML_AVX512=OFF"],
                   "avxvnni": [*_X86, "-DGGML_AVX_VNNI=ON", "-DGGML_AVX512=OFF"],
                   # AVX-512 without AMX: llama.cpp 0.3.36's AMX path (GGML_NATIVE on an AMX CPU) crashed on a 2-core
                   # Xeon VM (SIGSEGV in ggml_backend_amx_mul_mat at its first decode; issue 54's twenty-fourth pass)
                   "avx512": [*_X86, "-DGGML_AVX512=ON", "-DGGML_AVX512_VBMI=ON", "-DGGML_AVX512_VNNI=ON",
                              "-DGGML_AVX512_BF16=ON", "-DGGML_AMX_TILE=OFF", "-DGGML_AMX_INT8=OFF", "-DGGML_AMX_BF16=OFF"]}
ISA_ENV = {"avx2": {"FLAGDEPLOY_CPU_ISA": "avx2", "ATEN_CPU_CAPABILITY": "avx2", "ONEDNN_MAX_CPU_ISA": "AVX2",
                    "MKL_ENABLE_INSTRUCTIONS": "AVX2"},
           "avxvnni": {"FLAGDEPLOY_CPU_ISA": "avxvnni", "ATEN_CPU_CAPABILITY": "avx2", "ONEDNN_MAX_CPU_ISA": "AVX2_VNNI",
                       "MKL_ENABLE_INSTRUCTIONS": "AVX2"},
           "avx512": {"FLAGDEPLOY_CPU_ISA": "avx512", "ATEN_CPU_CAPABILITY": "avx512",
                      "ONEDNN_MAX_CPU_ISA": "AVX512_CORE_BF16"}}
READY_TIMEOUT = 1800.0  # seconds; flagdeploy's own --startup-timeout default
COMPARE_PROMPTS = 4  # greedy answers compared between the servers (EOS honoured)


def log(msg: str) -> None:
    print(f"[cpu_vs_llama_server] {msg}", file=sys.stderr, flush=True)


def kill_group(proc: subprocess.Popen, grace: float = 30.0) -> None:
    """SIGTERM the process group started with the process, SIGKILL what is left after `grace` seconds."""
    if proc.poll() is None:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(grace)
        except subprocess.TimeoutExpired:
            pass
    with contextlib.suppress(ProcessLookupError):  # children of a leader that already exited, too
        os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()


# ------------------------------------------------------------------------------------ building llama-server


def cpu_key() -> str:
    """A short hash of what a GGML_NATIVE build depends on: the architecture and the CPU's feature flags."""
    flags = ""
    with contextlib.suppress(OSError):
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith(("flags", "Features")):  # x86 / arm
                flags = " ".join(sorted(line.split(":", 1)[1].split()))
                break
    return hashlib.sha256(f"{platform.machine()}|{flags or platform.processor()}".encode()).hexdigest()[:12]


def cpu_name() -> str:
    with contextlib.suppress(OSError):
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    return platform.processor() or platform.machine()


def llama_server_version(binary: Path) -> str:
    """`llama-server --version`'s first line (the commit it names is the source tree's, where it had one)."""
    try:
        r = subprocess.run([str(binary), "--version"], check=False, capture_output=True, text=True, timeout=60)
    except (OSError, subprocess.TimeoutExpired) as exc:
        return f"unknown ({exc})"
    lines = [ln for ln in (r.stdout + r.stderr).splitlines() if ln.startswith("version")]
    return lines[0] if lines else "unknown"


def llama_cpp_python_version() -> str:
    try:
        return metadata.version("llama_cpp_python")
    except metadata.PackageNotFoundError:
        return LLAMA_CPP_PYTHON


def run_logged(cmd: list[str], logfile: Path, cwd: Path, env: dict[str, str] | None = None,
               progress: re.Pattern | None = None) -> None:
    """Run `cmd` in its own process group, its output appended to `logfile`; lines matching `progress`
    go to stderr too. On failure the log's tail is shown; on Ctrl-C the whole group is killed."""
    log("$ " + " ".join(cmd))
    tail: deque[str] = deque(maxlen=40)
    with logfile.open("a") as out:
        proc = subprocess.Popen(cmd, cwd=cwd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                                errors="replace", start_new_session=True)
        try:
            for line in proc.stdout:
                out.write(line)
                tail.append(line)
                if progress and progress.search(line):
                    log(line.rstrip()[:160])
            proc.wait()
        finally:
            kill_group(proc, grace=5)
    if proc.returncode:
        sys.stderr.writelines(tail)
        raise SystemExit(f"{cmd[0]} failed (exit {proc.returncode}); full log: {logfile}")


def build_llama_server(version: str, jobs: int, isa: str | None = None, tool: str = "llama-server") -> Path:
    """The cached llama-server (or another llama.cpp tool: `llama-quantize`) for this llama-cpp-python version and
    this CPU (or ISA), built first if absent."""
    root = cache_dir() / "llama-server"
    cmake_flags = [f for f in CMAKE_FLAGS if not (isa and f.startswith("-DGGML_NATIVE"))] + ISA_CMAKE_FLAGS.get(isa, [])
    key = f"{cpu_key()}-{isa}" if isa else cpu_key()
    binary = root / "bin" / f"{tool}-{version}-{key}"
    if binary.is_file() and os.access(binary, os.X_OK):
        log(f"using cached {binary}")
        return binary
    for needed in ("cmake", "c++"):
        if shutil.which(needed) is None:
            raise SystemExit(f"building {tool} needs `{needed}` on PATH (or pass --llama-server PATH)")
    sdist_dir = root / "sdist"
    sdist_dir.mkdir(parents=True, exist_ok=True)
    sdist = sdist_dir / f"llama_cpp_python-{version}.tar.gz"
    binary.parent.mkdir(parents=True, exist_ok=True)
    logfile = root / f"build-{tool}-{version}-{key}.log"
    logfile.write_text("")
    t0 = time.perf_counter()
    if not sdist.is_file():
        log(f"downloading the llama-cpp-python {version} source distribution into {sdist_dir}")
        run_logged([sys.executable, "-m", "pip", "download", "--no-deps", "--no-binary", ":all:",
                    f"llama-cpp-python=={version}", "-d", str(sdist_dir)], logfile, cwd=sdist_dir)
        if not sdist.is_file():
            raise SystemExit(f"pip download did not leave {sdist}; see {logfile}")
    work = Path(tempfile.mkdtemp(prefix=f".build-{version}-", dir=root))
    try:
        log(f"unpacking {sdist.name} into {work}")
        with tarfile.open(sdist) as tar:
            tar.extractall(work, filter="data")
        src = work / f"llama_cpp_python-{version}" / "vendor" / "llama.cpp"
        if not (src / "CMakeLists.txt").is_file():
            raise SystemExit(f"{sdist} has no vendor/llama.cpp/CMakeLists.txt")
        # build-info asks git for a commit: stop it at the unpacked tree (the sdist ships llama-cpp-python's own
        # .git, so the commit llama-server reports is that repository's, not llama.cpp's)
        env = {**os.environ, "GIT_CEILING_DIRECTORIES": str(work)}
        log(f"configuring llama.cpp {llama_cpp_version(src)} (log: {logfile})")
        run_logged(["cmake", "-B", "build", *cmake_flags], logfile, cwd=src, env=env)
        log(f"building {tool} with {jobs} jobs; this takes minutes, once per machine")
        run_logged(["cmake", "--build", "build", "--target", tool, "-j", str(jobs)], logfile, cwd=src,
                   env=env, progress=re.compile(r"^\[\s*\d+%\] (Built target|Linking)"))
        built = src / "build" / "bin" / tool
        tmp = binary.with_name(f".{binary.name}.{os.getpid()}.tmp")
        shutil.copy2(built, tmp)
        os.chmod(tmp, 0o755)
        seconds = time.perf_counter() - t0
        meta = {"llama_cpp_python": version, "llama_cpp": llama_cpp_version(src), "cpu_key": cpu_key(),
                "cmake_flags": cmake_flags, "jobs": jobs, "build_seconds": round(seconds, 1), "built_at": time.time()}
        binary.with_name(binary.name + ".json").write_text(json.dumps(meta, indent=1) + "\n")
        os.replace(tmp, binary)  # last: a binary at the final path is always complete
    finally:
        shutil.rmtree(work, ignore_errors=True)
    log(f"built {binary} in {seconds:.0f} s")
    return binary


def requantized(src: Path, kind: str, args: argparse.Namespace) -> Path:
    """`src` requantized to `kind` (Q4_K_M, Q5_0, ...) by llama.cpp's own llama-quantize, cached beside the built
    llama-server: the file a user who downloads that type has (from the bundled Q4_1 it is a requantization, so
    its answers are worse than a conversion from the original weights would give; both servers read the same
    file)."""
    st = src.stat()
    tag = hashlib.sha256(f"{src.resolve()}|{st.st_size}|{st.st_mtime_ns}".encode()).hexdigest()[:8]
    out = cache_dir() / "llama-server" / "models" / f"{src.stem}-{tag}-{kind}.gguf"
    if out.is_file():
        return out
    beside = args.llama_server.expanduser().resolve().parent / "llama-quantize" if args.llama_server else None
    tool = beside if beside and beside.is_file() else build_llama_server(
        args.llama_cpp_python or llama_cpp_python_version(), args.threads, args.isa, "llama-quantize")
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_name(f".{out.name}.{os.getpid()}.tmp")
    try:
        run_logged([str(tool), "--allow-requantize", str(src), str(tmp), kind, str(args.threads)],
                   out.with_suffix(".log"), cwd=out.parent)
        os.replace(tmp, out)  # last: a file at the final path is always complete
    finally:
        tmp.unlink(missing_ok=True)
    return out


def llama_cpp_version(src: Path) -> str:
    text = (src / "CMakeLists.txt").read_text()
    parts = [re.search(rf"set\(LLAMA_VERSION_{p} (\d+)\)", text) for p in ("MAJOR", "MINOR", "PATCH")]
    return ".".join(m.group(1) for m in parts) if all(parts) else "unknown"


# ------------------------------------------------------------------------------------------------ servers


@dataclass
class Server:
    """A server process in its own process group; `start()` returns the seconds until it was ready."""

    name: str
    argv: list[str]
    ready_path: str
    port: int
    logdir: Path
    proc: subprocess.Popen | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def logfile(self) -> Path:
        return self.logdir / f"{self.name}.log"

    def start(self) -> float:
        log(f"starting {self.name}: {' '.join(self.argv)}")
        out = self.logfile.open("w")
        t0 = time.perf_counter()
        self.proc = subprocess.Popen(self.argv, stdout=out, stderr=subprocess.STDOUT, start_new_session=True,
                                     env={**user_environ(), "PYTHONUNBUFFERED": "1"})
        out.close()
        with httpx.Client(timeout=2) as c:
            while time.perf_counter() - t0 < READY_TIMEOUT:
                if self.proc.poll() is not None:
                    self.fail(f"exited with {self.proc.returncode} while starting")
                with contextlib.suppress(httpx.TransportError):
                    if c.get(self.url + self.ready_path).status_code == 200:
                        ready = time.perf_counter() - t0
                        log(f"{self.name} ready in {ready:.1f} s")
                        return ready
                time.sleep(0.05)
        self.fail(f"was not ready after {READY_TIMEOUT:.0f} s")

    def fail(self, why: str) -> None:
        tail = self.logfile.read_text(errors="replace")[-3000:]
        raise SystemExit(f"{self.name} {why}; the end of its log:\n{tail}")

    def stop(self) -> None:
        if self.proc is not None:
            kill_group(self.proc)
            log(f"{self.name} stopped")
            self.proc = None

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()


def endpoint(server: Server) -> Endpoint:
    """The served model id as the server spells it (llama-server names it after the file)."""
    r = httpx.get(server.url + "/v1/models", timeout=30)
    r.raise_for_status()
    return Endpoint(server.url, model=r.json()["data"][0]["id"], timeout=1800)


# ---------------------------------------------------------------------------------------------- measuring


def prompts(n: int, max_tokens: int, offset: int = 0, sampling: dict | None = None) -> list[Prompt]:
    return [Prompt(messages=[{"role": "user", "content": PROMPTS[(offset + i) % len(PROMPTS)]}], max_tokens=max_tokens,
                   sampling=sampling) for i in range(n)]


def sampling(args: argparse.Namespace) -> dict | None:
    """The request fields of --temperature/--top-p/--top-k (both servers take them); None: greedy."""
    if not args.temperature:
        return None
    fields = {"temperature": args.temperature, "top_p": args.top_p, "top_k": args.top_k}
    return {k: v for k, v in fields.items() if v is not None}


def engine_counters(ep: Endpoint) -> tuple[float, float] | None:
    """(generation tokens, seconds inside engine steps) from flagdeploy's /metrics; None for a server
    without them (llama-server)."""
    text = httpx.get(ep.base_url + "/metrics", timeout=30).text
    found = [re.search(rf"^flagdeploy:{name}_total (\S+)$", text, re.M)
             for name in ("generation_tokens", "engine_step_seconds")]
    return None if None in found else (float(found[0].group(1)), float(found[1].group(1)))


async def measure(eps: dict[str, Endpoint], args: argparse.Namespace) -> dict[str, dict]:
    """Single-stream and concurrent throughput of every server (flagdeploy.bench's rounds: round 0 is the
    warm-up), the servers' rounds interleaved (ABBA: a host that speeds up or slows down over the minutes
    of a run favours neither), the engine's own rate over the same rounds where a server reports it, and
    the greedy answers with EOS honoured for the text comparison."""
    out: dict[str, dict] = {name: {} for name in eps}
    for key, concurrency, n in (("single", 1, 1), ("concurrent", args.concurrency, args.concurrency)):
        cfg = LoadConfig(concurrencies=[concurrency], rounds=args.rounds + 1, ignore_eos=True)
        results = {name: ServeResults() for name in eps}
        engine_rates: dict[str, list[float]] = {name: [] for name in eps}
        for rnd in range(args.rounds + 1):
            # a new prompt each single-stream round, so no round is served from a prefix cache of the last
            batch = prompts(n, args.max_tokens, offset=rnd if key == "single" else 0, sampling=sampling(args))
            for name in (list(eps) if rnd % 2 == 0 else list(reversed(eps))):
                ep = eps[name]
                before = engine_counters(ep)
                stats = await run_round(ep, batch, concurrency, rnd, cfg, results[name])
                after = engine_counters(ep)
                engine = ""
                if before is not None and after is not None and after[1] > before[1]:
                    rate = (after[0] - before[0]) / (after[1] - before[1])
                    engine = f" (engine {rate:.1f} tok/s)"
                    if rnd:
                        engine_rates[name].append(rate)
                log(f"  {name} {key} round {rnd}{' (warm-up)' if rnd == 0 else ''}: {stats.output_tokens} tokens "
                    f"in {stats.duration_s:.2f} s = {stats.output_throughput:.1f} tok/s{engine}, {stats.errors} errors")
        for name in eps:
            summary = results[name].summaries([concurrency])[0]
            records = results[name].records
            errors = [r.error for r in records if r.error]
            counts = sorted({r.output_tokens for r in records if r.ok})
            unreported = sum(not r.usage_reported for r in records if r.ok)
            rates = engine_rates[name]
            out[name][key] = {"tok_s": summary["output_throughput"], "spread": summary["throughput_spread"],
                              "engine_tok_s": statistics.median(rates) if rates else None,
                              "errors": errors, "token_counts": counts, "no_usage": unreported,
                              "forced": not errors and counts == [args.max_tokens] and not unreported}
    for name, ep in eps.items():
        async with ep.async_client(1) as client:
            texts: list[StreamResult] = []
            for p in prompts(COMPARE_PROMPTS, args.max_tokens):
                path, body = p.request(ep.model, ignore_eos=False)
                texts.append(await stream_request(client, ep.api + path, body))
        out[name]["texts"] = [t.text for t in texts]
    return out


def llama_server_argv(binary: Path, gguf: Path, port: int, args: argparse.Namespace) -> list[str]:
    return [str(binary), "-m", str(gguf), "-t", str(args.threads), "-np", str(args.concurrency),
            "-c", str(args.concurrency * args.ctx_per_slot), "--host", "127.0.0.1", "--port", str(port)]


def flagdeploy_argv(port: int, args: argparse.Namespace) -> list[str]:
    model = ["--model", args.model] if args.model else []  # else its default: the same bundled GGUF
    # --chip cpu: on a host with a GPU, serve's default backend is the GPU's, which is not what this compares
    return [sys.executable, "-m", "flagdeploy", "serve", "--port", str(port), "--chip", "cpu", *model, *args.serve_arg]


def check_on_cpu(server: Server) -> None:
    """Stop where serve holds its weights anywhere but on the CPU (a --serve-arg naming another --chip): a server
    on a GPU host's accelerator once passed for its CPU here (docs/performance.md, issue 54's sixteenth pass)."""
    held = re.search(r"weights held on (\w+)", server.logfile.read_text(errors="replace"))
    if held is None or held.group(1) != "cpu":
        server.fail(f"holds its weights on {held.group(1) if held else 'an unknown device'}, not the CPU")


async def first_request(ep: Endpoint, args: argparse.Namespace) -> float:
    """Output tokens/s of one request sent as soon as the server is ready (flagdeploy: while its decode
    step may still be compiling in the background)."""
    cfg = LoadConfig(concurrencies=[1], rounds=1, ignore_eos=True)
    stats = await run_round(ep, prompts(1, args.max_tokens, offset=7), 1, 0, cfg, ServeResults())
    return stats.output_throughput


def compiled_after(server: Server, t0: float) -> float | None:
    """Seconds from the server's start until its decode step stopped compiling in the background (the
    `flagdeploy:decode_step_compiling` gauge is 0); None where the server has no such gauge."""
    with httpx.Client(timeout=10) as c:
        while time.perf_counter() - t0 < READY_TIMEOUT:
            text = c.get(server.url + "/metrics").text
            m = re.search(r"^flagdeploy:decode_step_compiling (\S+)$", text, re.M)
            if m is None:
                return None
            if float(m.group(1)) == 0:
                return time.perf_counter() - t0
            time.sleep(1)
    server.fail(f"was still compiling after {READY_TIMEOUT:.0f} s")


def bring_up(server: Server, args: argparse.Namespace) -> tuple[Endpoint, dict]:
    """Start `server` (any other one started before idles meanwhile: both hold a model, neither computes)
    and take its start-up figures: ready s, first request tok/s, settled s."""
    t0 = time.perf_counter()
    ready = server.start()
    ep = endpoint(server)
    first = asyncio.run(first_request(ep, args))
    settled = compiled_after(server, t0)
    if settled is not None:
        log(f"{server.name}: first request {first:.1f} tok/s; decode step compiled {settled:.0f} s after start")
    log(f"{server.name} serves {ep.model!r}")
    return ep, {"ready": ready, "first": first, "settled": settled}


def in_process(args: argparse.Namespace) -> dict[str, float]:
    """flagdeploy's engine with no server: serve's engine defaults (its --max-model-len, --max-num-seqs,
    --compile etc. are EngineConfig's, so the decode step is the one the server settles to), the same chat
    prompts and forced token counts as the HTTP rounds; median tok/s of --rounds after a warm-up."""
    from flagdeploy.engine import EngineConfig, SamplingParams
    from flagdeploy.engine.replica import build_llm_engine

    src = resolve(args.model)
    threads = threads_for_server("cpu")
    log(f"in-process: building the engine with serve's defaults ({threads or 'OMP_NUM_THREADS'} kernel threads)")
    engine = build_llm_engine(src.path, src.format, EngineConfig(), chip="cpu", progress=False)
    if engine.runner.compiling is not None:  # a model the C++ step does not serve compiles in the background
        engine.runner.compiling.join()
    tok = engine.tokenizer
    params = SamplingParams(max_tokens=args.max_tokens, ignore_eos=True, seed=0,
                            **(sampling(args) or {"temperature": 0}))

    def ids(p: Prompt) -> list[int]:
        return tok.encode(tok.apply_chat_template(p.messages))

    out = {}
    for key, n in (("single", 1), ("concurrent", args.concurrency)):
        rates = []
        for rnd in range(args.rounds + 1):
            batch = [ids(p) for p in prompts(n, args.max_tokens, offset=rnd if key == "single" else 0)]
            t = time.perf_counter()
            made = engine.generate(batch, params)
            rate = sum(map(len, made)) / (time.perf_counter() - t)
            log(f"  in-process {key} round {rnd}{' (warm-up)' if rnd == 0 else ''}: {rate:.1f} tok/s")
            if rnd:
                rates.append(rate)
        out[key] = statistics.median(rates)
    engine.close()
    return out


# ------------------------------------------------------------------------------------------------ report


def report(rows: dict[str, dict], args: argparse.Namespace) -> None:
    conc = f"{args.concurrency}-concurrent tok/s"
    print(f"requests: {args.max_tokens} tokens each, sampled with {sampling(args)}" if sampling(args) else
          f"requests: {args.max_tokens} tokens each, greedy")
    print(f"{'':28} {'ready s':>9} {'first req tok/s':>16} {'settled s':>10} {'1-stream tok/s':>15} {conc:>22} "
          f"{'spread 1 / N':>13}")
    for name, r in rows.items():
        spread = "/".join(f"{r[k]['spread']:.2f}" if r[k]["spread"] else "-" for k in ("single", "concurrent"))
        settled = f"{r['settled']:.0f}" if r["settled"] is not None else "-"
        print(f"{name:28} {r['ready']:9.2f} {r['first']:16.1f} {settled:>10} {r['single']['tok_s']:15.1f} "
              f"{r['concurrent']['tok_s']:22.1f} {spread:>13}")
    if len(rows) == 2:
        fd, ls = rows["flagdeploy serve"], rows["llama-server"]
        print(f"{'flagdeploy / llama-server':28} {fd['ready'] / ls['ready']:8.2f}x {fd['first'] / ls['first']:15.2f}x "
              f"{'':>10} {fd['single']['tok_s'] / ls['single']['tok_s']:14.2f}x "
              f"{fd['concurrent']['tok_s'] / ls['concurrent']['tok_s']:21.2f}x")
        print("(ratios: above 1 flagdeploy is faster in the tok/s columns, slower to get ready)")
    fd = rows.get("flagdeploy serve")
    if fd is not None:
        inproc = fd.get("in_process")
        print(f"\nflagdeploy's engine against what its HTTP clients received, tok/s:\n"
              f"{'':28} {'1-stream':>10} {conc:>22}")
        lines = [("HTTP (above)", fd["single"]["tok_s"], fd["concurrent"]["tok_s"]),
                 ("engine steps, same rounds", fd["single"]["engine_tok_s"], fd["concurrent"]["engine_tok_s"])]
        if inproc is not None:
            lines.append(("in-process, no server", inproc["single"], inproc["concurrent"]))
        for name, one, many in lines:
            print(f"{name:28} {one or float('nan'):10.1f} {many or float('nan'):22.1f}")
        if inproc is not None:
            print(f"{'HTTP / in-process':28} {fd['single']['tok_s'] / inproc['single']:9.2f}x "
                  f"{fd['concurrent']['tok_s'] / inproc['concurrent']:21.2f}x")
    for name, r in rows.items():
        for key in ("single", "concurrent"):
            m = r[key]
            if not m["forced"]:
                print(f"WARNING {name} {key}: not every request produced exactly {args.max_tokens} tokens (ignore_eos "
                      f"not honoured?): token counts {m['token_counts']}, {len(m['errors'])} errors "
                      f"{m['errors'][:2]}, {m['no_usage']} without usage")
    if len(rows) == 2:
        a, b = rows["flagdeploy serve"]["texts"], rows["llama-server"]["texts"]
        same = sum(x.strip() == y.strip() for x, y in zip(a, b, strict=True))
        print(f"greedy answers (EOS honoured, max {args.max_tokens} tokens), flagdeploy vs llama-server: {same}/{len(a)} "
              f"identical (informational: different kernels may round differently)")
        for i, (x, y) in enumerate(zip(a, b, strict=True)):
            if x.strip() != y.strip():
                common = len(os.path.commonprefix([x, y]))
                print(f"  prompt {PROMPTS[i]!r}: first difference at character {common}\n"
                      f"    flagdeploy:   {x[:200]!r}\n    llama-server: {y[:200]!r}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rounds", type=int, default=None, help="measured rounds after the warm-up (default 3; quick 1)")
    ap.add_argument("--max-tokens", type=int, default=None, help="output tokens per request (default 128; quick 32)")
    ap.add_argument("--concurrency", type=int, default=16, help="requests at once, and llama-server's -np (default 16)")
    ap.add_argument("--quick", action="store_true", help="a smoke test: 32 tokens, 1 round; not a measurement")
    ap.add_argument("--llama-server", type=Path, default=None, help="use this llama-server binary instead of building")
    ap.add_argument("--llama-cpp-python", default=None, metavar="VERSION",
                    help=f"source distribution to build from (default: the installed one, else {LLAMA_CPP_PYTHON})")
    ap.add_argument("--build-only", action="store_true", help="find or build llama-server, print its path, exit")
    ap.add_argument("--model", default=None, help="model source (default: the embedded SmolLM2-135M-Instruct GGUF)")
    ap.add_argument("--quantize", default=None, metavar="TYPE",
                    help="serve the model requantized to TYPE (Q4_K_M, Q5_0, Q8_0, ...) by llama.cpp's llama-quantize "
                         "(built beside llama-server, or found beside --llama-server); the file is cached")
    ap.add_argument("--threads", type=int, default=cores(), help="llama-server -t and the build's -j (default: the "
                                                                 "CPUs this process may use)")
    ap.add_argument("--ctx-per-slot", type=int, default=4096,
                    help="llama-server context per parallel slot (default 4096, flagdeploy serve's --max-model-len)")
    ap.add_argument("--isa", choices=sorted(ISA_ENV), default=None,
                    help="measure both servers as on a CPU of this class: llama.cpp built for it, flagdeploy with "
                         "FLAGDEPLOY_CPU_ISA and torch capped there (default: each at its best for this CPU)")
    ap.add_argument("--temperature", type=float, default=0.0,
                    help="sample every request at this temperature (default 0: greedy, the texts comparable)")
    ap.add_argument("--top-p", type=float, default=None, help="with --temperature: nucleus sampling (vLLM's flag)")
    ap.add_argument("--top-k", type=int, default=None, help="with --temperature: top-k sampling (vLLM's flag)")
    ap.add_argument("--serve-arg", action="append", default=[],
                    help="extra flag for flagdeploy serve, repeatable, as --serve-arg=--compile (default none: its default flags)")
    args = ap.parse_args()
    if args.isa and any(os.environ.get(k) != v for k, v in ISA_ENV[args.isa].items()):
        # torch reads its caps when it starts: this process (the in-process rows) and the server it starts both
        # run under them, so start again with them set
        os.execve(sys.executable, [sys.executable, *sys.argv], {**user_environ(), **ISA_ENV[args.isa]})
    args.rounds = args.rounds if args.rounds is not None else (1 if args.quick else 3)
    args.max_tokens = args.max_tokens if args.max_tokens is not None else (32 if args.quick else 128)
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # unwinds the with-blocks: servers are stopped

    if args.llama_server is not None:
        binary = args.llama_server.expanduser().resolve()
        if not (binary.is_file() and os.access(binary, os.X_OK)):
            raise SystemExit(f"--llama-server {args.llama_server} is not an executable file")
    else:
        binary = build_llama_server(args.llama_cpp_python or llama_cpp_python_version(), args.threads, args.isa)
    if args.build_only:
        print(binary)
        return

    src = resolve(args.model)
    if src.format != "gguf":
        raise SystemExit(f"{src.path} is not a GGUF file; llama-server needs one")
    if args.quantize:
        args.model = str(requantized(src.path, args.quantize, args))
        src = resolve(args.model)
    print(f"model {src.name} ({src.path})\nllama-server {binary} ({llama_server_version(binary)})\n"
          f"{args.max_tokens} tokens per request, {args.rounds} round(s) after a warm-up, {args.concurrency} concurrent, "
          f"llama-server -t {args.threads}; {cpu_name()}, ISA class {isa_class()}, {cores()} CPUs"
          f"{'; QUICK smoke run, not a measurement' if args.quick else ''}")
    rows: dict[str, dict] = {}
    eps: dict[str, Endpoint] = {}
    with tempfile.TemporaryDirectory(prefix="cpu_vs_llama_server-") as logdir, contextlib.ExitStack() as up:
        port = free_port()
        llama = up.enter_context(Server("llama-server", llama_server_argv(binary, src.path, port, args), "/health",
                                        port, Path(logdir)))
        eps[llama.name], rows[llama.name] = bring_up(llama, args)
        port = free_port()
        ours = up.enter_context(Server("flagdeploy serve", flagdeploy_argv(port, args), "/ready", port, Path(logdir)))
        eps[ours.name], rows[ours.name] = bring_up(ours, args)
        check_on_cpu(ours)
        log("measuring, the two servers' rounds interleaved")
        for name, measured in asyncio.run(measure(eps, args)).items():
            rows[name].update(measured)
    if not args.serve_arg:  # the same engine with no server, where the server ran its defaults
        rows["flagdeploy serve"]["in_process"] = in_process(args)
    report(rows, args)


if __name__ == "__main__":
    try:
        main()
    except KeyboardInterrupt:  # the with-blocks have stopped the servers by now
        log("interrupted")
        sys.exit(130)

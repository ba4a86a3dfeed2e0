"""The cpu backend's kernels of this checkout against a git ref's, in one process, on the same weights and inputs:
the default model's C++ decode step, shaped as a speculative verify step of one sequence (as cpu_few_rows.py shapes
it) and as a decode step of as many streams of ~250 keys as rows (each through its own blocks), its 120 4-bit linears
alone, its int8 LM head, and the attention of both shapes x 30 (a cache pair a layer), rounds alternating between the
two builds.

    python benchmarks/cpu_kernels_ab.py [--ref HEAD] [--rows 1 5 16] [--rounds 30] [--threads N] [--model M]
        [--q8-activations]

Why: on a small shared VM a figure drifts 10-20% from hour to hour and from one process to the next, so a kernel
change worth a few percent cannot be seen by running a benchmark before and after it. Here both builds run in the
same process, in the same minutes, their calls interleaved (the order flipping every round), and the figure is
the median ratio. The ref's backends/cpu/csrc is built for this CPU's ISA (FLAGDEPLOY_CPU_ISA's where set) under
its own op namespace beside the working tree's kernels. Outputs are compared first: a change meant to keep the
bits says so (or not) before its speed is shown.

Measured against itself (a working tree with no change), 20 rounds on the 2-core AVX-512 EPYC, two runs: the step
and the linears 0.994-1.028x, attention 0.992-1.054x and once 1.160x (16 rows): read a few percent as noise,
attention's more, and run twice. On a 16-core Xeon at 16 threads the same self-A/B read the step 0.90-1.06x and the
head 0.72-0.92x (two builds' thread pools in one process on many cores): there compare builds in separate processes.
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import tempfile
import time
from pathlib import Path

import torch
from cpu_few_rows import default_model, packed_linears, verify_step, written  # this script runs from benchmarks/
from cpu_vs_llama_server import cpu_name

from flagdeploy.backends.cpu import llama_step, native

REPO = Path(__file__).resolve().parents[1]
CSRC = "backends/cpu/csrc"


def build_ref(ref: str, tmp: Path):
    """`ref`'s kernels, built for this CPU's ISA and loaded as torch.ops / torch.classes.flagdeploy_cpu_ref."""
    archive = subprocess.run(["git", "-C", str(REPO), "archive", ref, CSRC], capture_output=True, check=False)
    if archive.returncode:
        raise SystemExit(f"git archive {ref} {CSRC} failed: {archive.stderr.decode().strip()} "
                         "(this benchmark needs a git checkout and a ref that has the cpu backend's sources)")
    subprocess.run(["tar", "-x", "-C", str(tmp)], input=archive.stdout, check=True)
    return native.build_beside(native.isa(), tmp / "build", csrc=tmp / CSRC, namespace="flagdeploy_cpu_ref")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--ref", default="HEAD", help="the git ref whose kernels are the baseline")
    ap.add_argument("--rows", type=int, nargs="+", default=[1, 5, 16])
    ap.add_argument("--rounds", type=int, default=30)
    ap.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's)")
    ap.add_argument("--model", default=None, help="model source (default: the embedded SmolLM2-135M-Instruct GGUF)")
    ap.add_argument("--q8-activations", action="store_true",
                    help="the model as serve --q8-activations loads it (a ref whose int8 kernel has no one-part form "
                         "takes two parts there: its head's and step's bits then differ)")
    args = ap.parse_args()
    runner, model = default_model(args.threads, args.model, args.q8_activations)
    if runner.native is None:
        raise SystemExit("no C++ decode step here (see the engine's log): nothing to compare")
    with tempfile.TemporaryDirectory() as tmp:
        ops = {"ref": build_ref(args.ref, Path(tmp)), "new": torch.ops.flagdeploy_cpu}
    if native.isa() == "amx":  # the same AMX threshold for both (the tune table's, set on the working tree's)
        ops["ref"].q4_amx_min_rows(ops["new"].q4_amx_min_rows(0))
    layer, cfg = model.layers[0], model.cfg
    tensors = llama_step._tensors(model, runner.kv_caches)
    dims = llama_step.dims(model)  # the pieces' format: refs from e01ad61 on

    def step(ns: str):
        try:
            return getattr(torch.classes, ns).LlamaStep(tensors, dims, cfg.rms_norm_eps, layer.scale)
        except RuntimeError:  # a ref before the activation parts joined the sizes (--q8-activations): two parts
            assert dims[4] == 2, "a ref without one activation part cannot run this model's setting"
            return getattr(torch.classes, ns).LlamaStep(tensors, dims[:4] + dims[5:], cfg.rms_norm_eps, layer.scale)

    steps = {k: step(ns) for k, ns in (("ref", "flagdeploy_cpu_ref"), ("new", "flagdeploy_cpu"))}
    packed = packed_linears(model)
    head = model.lm_head.qweight.prepared  # the int8 head: w8, d
    g = torch.Generator().manual_seed(0)
    # a cache pair a layer, as a step reads them (30 layers' do not stay in L2 from one call to the next)
    caches = [tuple(torch.randn(400, 16, layer.kv_heads, cfg.head_dim, generator=g).bfloat16() for _ in range(2))
              for _ in model.layers]
    blocks = torch.randperm(400, generator=g)
    table = blocks[:17]
    inputs, read = {}, set()  # read: the model's cache blocks the steps read
    bs = runner.block_size
    cache_blocks = (torch.randperm(runner.kv_caches[0][0].shape[0] - 1, generator=g) + 1).tolist()  # 0 pads tables
    for r in args.rows:
        st = verify_step(r, 256, bs, cfg.vocab_size)
        # a decode step of r streams: sequence i at 256 - i keys, through its own blocks
        lens = [256 - i for i in range(r)]
        own = [cache_blocks[i * 17:(i + 1) * 17] for i in range(r)]
        read.update(st.tables[0], *own)
        slots = [t[(n - 1) // bs] * bs + (n - 1) % bs for t, n in zip(own, lens)]
        ids = torch.randint(0, cfg.vocab_size, (r,), generator=g).tolist()
        streams_step = llama_step.step_inputs(ids, [n - 1 for n in lens], slots, own, lens)
        inputs[r] = {
            "step": llama_step.step_inputs(st.ids, st.positions, st.slots, st.tables, st.ctx_lens),
            "streams' step": streams_step,
            "x": {p["nib"].shape[1] * 32: torch.randn(r, p["nib"].shape[1] * 32, generator=g).bfloat16() for p in packed},
            "h": torch.randn(r, cfg.hidden_size, generator=g).bfloat16(),
            "q": torch.randn(r, layer.heads, cfg.head_dim, generator=g).bfloat16(),
            "attn": (table.expand(r, -1).contiguous(), torch.arange(257 - r, 257)),
            # r sequences of 241-256 keys, each through its own blocks: a decode step of r streams
            "streams": (blocks[:17 * r].view(r, 17), 256 - torch.arange(r)),
        }
    written(runner, sorted(read))
    every_row = torch.empty(0, dtype=torch.int64)  # the rows whose logits step returns: all (from 8a74ff4 on)
    calls = {}
    for k, step in steps.items():  # a ref before 8a74ff4: step(rows, tables, head)
        try:
            step.step(*inputs[args.rows[0]]["step"], True, every_row)
            calls[k] = lambda st, step=step: step.step(*st, True, every_row)
        except RuntimeError:
            calls[k] = lambda st, step=step: step.step(*st, True)

    def head_call(k: str, x: torch.Tensor) -> torch.Tensor:
        try:
            return ops[k].q8_linear(x, head["w8"], head["d"], head.get("parts", 2))
        except RuntimeError:  # a ref before q8_linear's parts (two parts)
            return ops[k].q8_linear(x, head["w8"], head["d"])

    kinds = {
        "step": lambda k, r: calls[k](inputs[r]["step"]),
        "streams' step": lambda k, r: calls[k](inputs[r]["streams' step"]),
        "120 4-bit linears": lambda k, r: [ops[k].q4_linear(inputs[r]["x"][p["nib"].shape[1] * 32], p["nib"], p["dm"],
                                                            p.get("parts", 2)) for p in packed],
        "LM head": lambda k, r: head_call(k, inputs[r]["h"]),
        "attention x 30": lambda k, r: [ops[k].paged_decode_attention(inputs[r]["q"], kc, vc, *inputs[r]["attn"], 0.125)
                                        for kc, vc in caches],
        "streams' attention": lambda k, r: [ops[k].paged_decode_attention(inputs[r]["q"], kc, vc, *inputs[r]["streams"],
                                                                          0.125) for kc, vc in caches],
    }
    same = {}
    for name, fn in kinds.items():
        for r in args.rows:
            a, b = fn("ref", r), fn("new", r)
            a, b = (torch.cat([t.flatten() for t in x]) if isinstance(x, list) else x for x in (a, b))
            same[(name, r)] = torch.equal(a, b)
    times = {(k, name, r): [] for k in ops for name in kinds for r in args.rows}
    for i in range(args.rounds):
        for name, fn in kinds.items():
            for r in args.rows:
                for k in ("ref", "new") if i % 2 else ("new", "ref"):
                    t = time.perf_counter()
                    fn(k, r)
                    times[(k, name, r)].append((time.perf_counter() - t) * 1e3)
    print(f"CPU: {cpu_name()}, ISA class {native.isa_class()}, {torch.get_num_threads()} thread(s), torch "
          f"{torch.__version__}; {args.ref}'s kernels (ref) against the working tree's (new), median of {args.rounds} "
          "rounds, ms")
    print(f"{'':>18} {'rows':>5} {'ref':>9} {'new':>9} {'new/ref':>8}  bitwise equal")
    for name in kinds:
        for r in args.rows:
            ref, new = (statistics.median(times[(k, name, r)]) for k in ("ref", "new"))
            print(f"{name:>18} {r:5d} {ref:9.3f} {new:9.3f} {new / ref:7.3f}x  {'yes' if same[(name, r)] else 'NO'}")


if __name__ == "__main__":
    main()

"""`flagdeploy quantize` throughput against plain file reads, and its peak memory against the largest tensor.

    python benchmarks/quantize_speed.py [--size-gb 1.5] [--workdir /tmp/flagdeploy-quantize-bench]
                                        [--policy no-fp8] [--format flagdeploy] [--keep]

Builds once (cached under --workdir) a synthetic FP8 checkpoint in GLM-5.3-Flash's published shapes
(hidden 4096, MLA q_lora 1536 / kv_lora 512 / 64 heads x 256, a dense SwiGLU layer of intermediate
12288, MoE layers with routed and shared experts of intermediate 2048, embeddings and lm_head of a
reduced vocabulary): FP8 e4m3 weights with float32 128x128 block `weight_scale_inv`, BF16 and float32
tensors where the model keeps them, in ~500 MB shards with an index and a config.json. Then, with the
shards in the page cache (one warm-up pass), it times reading every shard with plain reads into a 64 MB
buffer (the baseline), and converts the checkpoint for --chip in a fresh subprocess, whose own peak RSS
(ru_maxrss from wait4) is the conversion's alone. Prints MB/s of source bytes for both and the ratio
(target: conversion >= 0.5x read), and the peak RSS against 3x the largest source tensor + 500 MB
(target: ratio <= 1); an idle subprocess that only imports flagdeploy.quantize and torch gives the
interpreter's own share. A copy of the shards (read, write, fsync) shows what the disk alone allows:
the output has to be written, so on a machine whose disk writes slower than memory reads, that and
not the read is the ceiling. MB = 10^6 bytes throughout.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

MB = 1_000_000
# GLM-5.3-Flash (shared/docs/glm-5.3-flash.md)
HIDDEN, MOE_INTER, DENSE_INTER, VOCAB = 4096, 2048, 12288, 154880
Q_LORA, KV_LORA, HEADS, NOPE_DIM, V_DIM, ROUTED = 1536, 512, 64, 256, 256, 288
BLOCK = 128
ITEMSIZE = {"fp8": 1, "bf16": 2, "f32": 4}
CONFIG = {"model_type": "glm5_next", "quantization_config": {"quant_method": "fp8", "weight_block_size": [BLOCK, BLOCK],
                                                             "fmt": "e4m3"}}


# ---- the synthetic checkpoint (runs in its own subprocess: --build-only) ------------------------------------


def _nbytes(kind: str, shape: tuple[int, ...]) -> int:
    n = ITEMSIZE[kind] * math.prod(shape)
    if kind == "fp8":  # plus the float32 inverse block scales
        n += 4 * -(-shape[0] // BLOCK) * -(-shape[1] // BLOCK)
    return n


def _attention(p: str) -> list:
    a = p + "self_attn."
    return [(p + "input_layernorm.weight", "norm", (HIDDEN,)), (p + "post_attention_layernorm.weight", "norm", (HIDDEN,)),
            (a + "q_a_proj.weight", "fp8", (Q_LORA, HIDDEN)), (a + "q_a_layernorm.weight", "norm", (Q_LORA,)),
            (a + "q_b_proj.weight", "fp8", (HEADS * NOPE_DIM, Q_LORA)),
            (a + "kv_a_proj_with_mqa.weight", "fp8", (KV_LORA, HIDDEN)), (a + "kv_a_layernorm.weight", "norm", (KV_LORA,)),
            (a + "kv_b_proj.weight", "bf16", (HEADS * (NOPE_DIM + V_DIM), KV_LORA)),
            (a + "o_proj.weight", "fp8", (HIDDEN, HEADS * V_DIM))]


def _swiglu(p: str, inter: int) -> list:
    return [(p + "gate_proj.weight", "fp8", (inter, HIDDEN)), (p + "up_proj.weight", "fp8", (inter, HIDDEN)),
            (p + "down_proj.weight", "fp8", (HIDDEN, inter))]


def tensor_specs(size_bytes: int, vocab: int, experts: int) -> list[tuple[str, str, tuple]]:
    """(name, kind, shape) in file order: embeddings, one dense layer, then MoE layers (attention, router,
    shared expert, `experts` routed experts) until the size is reached, then the final norm and lm_head.
    kind: fp8 (with a scale_inv), bf16, norm (bf16 ones), f32."""
    m = "model.language_model."
    tail = [(m + "norm.weight", "norm", (HIDDEN,)), ("lm_head.weight", "bf16", (vocab, HIDDEN))]
    specs = [(m + "embed_tokens.weight", "bf16", (vocab, HIDDEN))]
    total = lambda xs: sum(_nbytes("bf16" if k == "norm" else k, s) for _, k, s in xs)  # noqa: E731
    budget = size_bytes - total(tail)
    groups = [_swiglu(m + "layers.0.mlp.", DENSE_INTER), _attention(m + "layers.0.")]
    for i in range(3, 3 + 64):  # the first 3 layers are dense; we take one of them, then MoE layers
        p = f"{m}layers.{i}."
        groups.append(_attention(p) + [(p + "mlp.gate.weight", "bf16", (ROUTED, HIDDEN)),
                                       (p + "mlp.gate.e_score_correction_bias", "f32", (ROUTED,))])
        groups.append(_swiglu(p + "mlp.shared_experts.", MOE_INTER))
        groups += [_swiglu(f"{p}mlp.experts.{e}.", MOE_INTER) for e in range(experts)]
    for g in groups:
        if total(specs) >= budget:
            break
        specs += g
    return specs + tail


def build(dst: Path, size_bytes: int, vocab: int, experts: int, shard_bytes: int) -> None:
    import torch
    from safetensors.torch import save_file

    from flagdeploy.ops.weights import fp8_block_quantize

    specs = tensor_specs(size_bytes, vocab, experts)
    shards, cur, acc = [], [], 0
    for spec in specs:
        cur.append(spec)
        acc += _nbytes("bf16" if spec[1] == "norm" else spec[1], spec[2])
        if acc >= shard_bytes:
            shards.append(cur)
            cur, acc = [], 0
    if cur:
        shards.append(cur)
    tmp_dir = dst.with_name(f".{dst.name}.tmp-{os.getpid()}")
    shutil.rmtree(tmp_dir, ignore_errors=True)
    tmp_dir.mkdir(parents=True)
    g = torch.Generator().manual_seed(0)
    weight_map, total = {}, 0
    for i, shard in enumerate(shards, 1):
        fname = f"model-{i:05d}-of-{len(shards):05d}.safetensors"
        tensors = {}
        for name, kind, shape in shard:  # generated one tensor at a time; a shard is held until written
            if kind == "norm":
                tensors[name] = torch.ones(shape, dtype=torch.bfloat16)
            elif kind == "f32":
                tensors[name] = torch.randn(shape, generator=g) * 0.01
            elif kind == "bf16":
                tensors[name] = (torch.randn(shape, generator=g) * 0.02).bfloat16()
            else:
                q, s = fp8_block_quantize(torch.randn(shape, generator=g) * 0.02, (BLOCK, BLOCK))
                tensors[name], tensors[name + "_scale_inv"] = q.contiguous(), s.contiguous()
        for name, t in tensors.items():
            weight_map[name] = fname
            total += t.numel() * t.element_size()
        save_file(tensors, str(tmp_dir / (fname + ".tmp")), metadata={"format": "pt"})
        os.replace(tmp_dir / (fname + ".tmp"), tmp_dir / fname)
        del tensors
    (tmp_dir / "model.safetensors.index.json").write_text(
        json.dumps({"metadata": {"total_size": total}, "weight_map": weight_map}, indent=2) + "\n")
    (tmp_dir / "config.json").write_text(json.dumps(CONFIG, indent=2) + "\n")
    os.rename(tmp_dir, dst)


# ---- measurements (the parent stays free of torch so its memory does not leak into the children's) ------------


def read_pass(files: list[Path], buf: bytearray) -> int:
    n, view = 0, memoryview(buf)
    for f in files:
        with open(f, "rb", buffering=0) as fh:
            while k := fh.readinto(view):
                n += k
    return n


def copy_pass(files: list[Path], buf: bytearray, out: Path) -> None:
    """Read every shard and write it out again with an fsync: the I/O any converter has to do at least."""
    view = memoryview(buf)
    for f in files:
        with open(f, "rb", buffering=0) as fh, open(out, "wb") as fo:
            while k := fh.readinto(view):
                fo.write(view[:k])
            fo.flush()
            os.fsync(fo.fileno())
        out.unlink()


def run_child(code: str, *args: str) -> tuple[dict, float, int]:
    """Run `python -c code args... result.json` and wait4 it: (its JSON result, wall s, its peak RSS in bytes)."""
    with tempfile.NamedTemporaryFile(suffix=".json", delete=False) as f:
        out = f.name
    try:
        t = time.perf_counter()
        proc = subprocess.Popen([sys.executable, "-c", code, *args, out])
        _, status, usage = os.wait4(proc.pid, 0)
        wall = time.perf_counter() - t
        proc.returncode = os.waitstatus_to_exitcode(status)
        if proc.returncode:
            raise SystemExit(f"child failed with exit code {proc.returncode}")
        return json.loads(Path(out).read_text()), wall, usage.ru_maxrss * 1024  # KiB on Linux
    finally:
        os.unlink(out)


IDLE = """
import json, sys, time
t = time.perf_counter()
import torch, flagdeploy.quantize
json.dump({"import_s": time.perf_counter() - t}, open(sys.argv[-1], "w"))
"""

CONVERT = """
import json, sys, time
t = time.perf_counter()
import torch
from flagdeploy.quantize import quantize
src, dst, chip, policy, fmt, out = sys.argv[1:]
t1 = time.perf_counter()
report = quantize(src, dst, chip=chip, policy=policy, fmt=fmt, progress=False)
json.dump({"import_s": t1 - t, "convert_s": time.perf_counter() - t1}, open(out, "w"))
"""


def dir_bytes(d: Path) -> int:
    return sum(f.stat().st_size for f in d.iterdir() if f.is_file())


def largest_tensor(files: list[Path]) -> tuple[str, int]:
    import struct

    best = ("", 0)
    for f in files:
        with open(f, "rb") as fh:
            header = json.loads(fh.read(struct.unpack("<Q", fh.read(8))[0]))
        for name, info in header.items():
            if name != "__metadata__":
                a, b = info["data_offsets"]
                best = max(best, (name, b - a), key=lambda x: x[1])
    return best


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--size-gb", type=float, default=1.5, help="source checkpoint size (10^9 bytes, approximate)")
    ap.add_argument("--workdir", default="/tmp/flagdeploy-quantize-bench", help="cache of checkpoints, and the output")
    ap.add_argument("--policy", default="no-fp8")
    ap.add_argument("--format", default="flagdeploy")
    ap.add_argument("--chip", default="ascend910c")
    ap.add_argument("--vocab", type=int, default=0,
                    help=f"embedding / lm_head rows (default: each about 1/8 of --size-gb, at most {VOCAB})")
    ap.add_argument("--experts", type=int, default=16, help=f"routed experts per MoE layer (of {ROUTED})")
    ap.add_argument("--shard-mb", type=int, default=500)
    ap.add_argument("--keep", action="store_true", help="keep the converted checkpoint")
    ap.add_argument("--build-only", metavar="DIR", help="(internal) build the checkpoint into DIR and exit")
    args = ap.parse_args()
    size = int(args.size_gb * 1e9)
    vocab = args.vocab or max(BLOCK, min(VOCAB, size // 8 // (2 * HIDDEN) // BLOCK * BLOCK))
    if args.build_only:
        build(Path(args.build_only), size, vocab, args.experts, args.shard_mb * MB)
        return

    work = Path(args.workdir)
    work.mkdir(parents=True, exist_ok=True)
    src = work / f"glm53flash-fp8-{args.size_gb:g}gb-v{vocab}-e{args.experts}-s{args.shard_mb}"
    if not src.is_dir():
        print(f"building {src} ...", flush=True)
        t = time.perf_counter()
        subprocess.run([sys.executable, __file__, "--build-only", str(src), "--size-gb", str(args.size_gb),
                        "--vocab", str(vocab), "--experts", str(args.experts), "--shard-mb", str(args.shard_mb)],
                       check=True)
        print(f"built in {time.perf_counter() - t:.1f} s", flush=True)
    files = sorted(src.glob("*.safetensors"))
    src_bytes = sum(f.stat().st_size for f in files)
    big_name, big = largest_tensor(files)

    buf = bytearray(64 * 1024 * 1024)
    read_pass(files, buf)  # warm-up: both measurements below see the shards in the page cache
    times = []
    for _ in range(3):
        t = time.perf_counter()
        assert read_pass(files, buf) == src_bytes
        times.append(time.perf_counter() - t)
    read_s = sorted(times)[1]  # median of 3
    t = time.perf_counter()
    copy_pass(files, buf, work / f"copy-{os.getpid()}.tmp")
    copy_s = time.perf_counter() - t
    del buf

    idle, _, idle_rss = run_child(IDLE)
    dst = work / f"out-{os.getpid()}"
    try:
        conv, conv_wall, conv_rss = run_child(CONVERT, str(src), str(dst), args.chip, args.policy, args.format)
        dst_bytes = dir_bytes(dst)
    finally:
        if not args.keep:
            shutil.rmtree(dst, ignore_errors=True)
            shutil.rmtree(dst.parent / f".{dst.name}.partial", ignore_errors=True)
    conv_s = conv["convert_s"]

    read_mbs, conv_mbs = src_bytes / MB / read_s, src_bytes / MB / conv_s
    speed = conv_mbs / read_mbs
    budget = 3 * big + 500 * MB
    mem = conv_rss / budget
    print(f"source    {src}: {src_bytes / MB:.0f} MB in {len(files)} shards; largest tensor {big_name} "
          f"{big / MB:.1f} MB")
    print(f"output    {args.chip} / {args.policy} / {args.format}: {dst_bytes / MB:.0f} MB"
          + (f" in {dst}" if args.keep else " (deleted)"))
    print(f"{'':28} {'seconds':>9} {'MB/s':>9} {'x read':>8}")
    print(f"{'read (page cache, 64 MB buf)':28} {read_s:9.2f} {read_mbs:9.1f} {1.0:8.2f}")
    print(f"{'copy (read + write + fsync)':28} {copy_s:9.2f} {src_bytes / MB / copy_s:9.1f} {read_s / copy_s:8.2f}")
    print(f"{'convert':28} {conv_s:9.2f} {conv_mbs:9.1f} {speed:8.2f}   "
          f"(+{conv['import_s']:.1f} s imports; child wall {conv_wall:.1f} s; x{copy_s / conv_s:.2f} of copy)")
    print(f"{'':28} {'peak RSS MB':>11} {'3x largest + 500 MB':>20} {'ratio':>6}")
    print(f"{'idle (import torch+quantize)':28} {idle_rss / MB:11.0f}")
    print(f"{'convert':28} {conv_rss / MB:11.0f} {budget / MB:20.0f} {mem:6.2f}   "
          f"(above idle: {(conv_rss - idle_rss) / MB:.0f} MB = {(conv_rss - idle_rss) / big:.2f}x largest)")
    print(f"targets: speed x{speed:.2f} of read (>=0.5) {'PASS' if speed >= 0.5 else 'FAIL'}, "
          f"memory x{mem:.2f} of 3x largest + 500 MB (<=1) {'PASS' if mem <= 1 else 'FAIL'}")


if __name__ == "__main__":
    main()

"""`flagdeploy quantize`: stream a safetensors checkpoint into a per-tensor scheme mix for one chip.

Two passes. The plan reads only the shards' headers: every tensor gets its scheme from the policy, its
FP8 scale partner and its output tensors, and every problem (a corrupt shard, a missing scale, a scheme
the chip or the output format cannot carry) is raised before a byte is written. The conversion then
goes shard by shard, tensor by tensor, into `.<DST>.partial` next to DST: each output shard is written
under a temporary name and renamed, and a state file records the finished shards, so a re-run with
the same inputs resumes where the last one stopped (different inputs: it starts over). DST appears,
complete, only through the final rename.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import shutil
from dataclasses import dataclass, field
from pathlib import Path

import torch
from tqdm import tqdm

from flagdeploy.backends.cpu import native
from flagdeploy.chips import Chip
from flagdeploy.errors import FlagdeployError
from flagdeploy.ops.weights import Int8Weight, fp8_block_dequantize, fp8_block_quantize

from . import formats
from .policy import Policy
from .schemes import FP8_BLOCK, SCHEMES, is_fp8, is_matrix_weight, relative_error
from .shards import ShardWriter, TensorEntry, read_header, read_tensor

log = logging.getLogger(__name__)
STATE_FILE = ".quantize-state.json"
REPORT_FILE = "quantize_report.json"


class QuantizeError(FlagdeployError, ValueError):
    """The source, policy, chip and format do not make a conversion; nothing was written."""


@dataclass
class TensorPlan:
    name: str
    entry: TensorEntry
    scale: tuple[Path, TensorEntry] | None  # an FP8 weight's inverse block scales, wherever they are stored
    scheme: str  # what is done (the rule's scheme, or what it means for a tensor that is not a matrix)
    group_size: int
    rule: str
    outputs: list[tuple[str, torch.dtype, tuple]]
    block: tuple[int, int]  # FP8 block (rows, cols) of the source's scales and of any FP8 output
    note: str = ""

    @property
    def bytes_before(self) -> int:
        return self.entry.nbytes + (self.scale[1].nbytes if self.scale else 0)


@dataclass
class ShardPlan:
    source: Path
    output: str
    tensors: list[TensorPlan] = field(default_factory=list)


@dataclass
class Plan:
    src: Path
    config: dict
    shards: list[ShardPlan]
    notes: list[str]
    fingerprint: str

    @property
    def tensors(self) -> list[TensorPlan]:
        return [t for s in self.shards for t in s.tensors]


# ---- plan ------------------------------------------------------------------------------------------------


def _source_shards(src: Path) -> list[Path]:
    index = src / "model.safetensors.index.json"
    if index.exists():
        try:
            names = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        except (json.JSONDecodeError, KeyError) as exc:
            raise QuantizeError(f"{index} is not a valid safetensors index ({exc}); download it again.") from exc
        files = [src / n for n in names]
    else:
        files = sorted(src.glob("*.safetensors"))
    missing = [f.name for f in files if not f.is_file()]
    if missing or not files:
        raise QuantizeError(f"{src} is missing weight files ({', '.join(missing) or 'no *.safetensors at all'}); "
                            f"the source must be a complete HF checkpoint directory.")
    return files


def _plan_tensor(name: str, entry: TensorEntry, scale, policy: Policy, chip: Chip, fmt: str,
                 block: tuple[int, int]) -> TensorPlan:
    rule = policy.rule_for(name)
    scheme, group, note = rule.scheme, rule.group_size, ""
    fp8, matrix = is_fp8(entry.dtype), is_matrix_weight(name, entry.shape)
    if SCHEMES[scheme].int8 and not matrix:
        scheme, note = "bf16", f"not a weight matrix: {rule.scheme} does not apply, stored as bf16"
    elif scheme == "fp8" and not (matrix and entry.dtype.is_floating_point):
        scheme, note = "keep", "not a weight matrix: fp8 does not apply, kept as stored"
    if scheme == "keep" and fp8 and not chip.supports("fp8"):
        raise QuantizeError(f"policy {policy.name!r} keeps the FP8 tensor {name} (rule {rule.match!r}), but {chip.id} has "
                            f"no FP8 matmuls. Use a policy that converts FP8 weights (bf16 or an int8 scheme).")
    if scheme == "w8a16" and group and entry.shape[1] % group:
        raise QuantizeError(f"{name} has {entry.shape[1]} input channels, not a multiple of the w8a16 group size "
                            f"{group} (rule {rule.match!r}); pick a group size that divides it, or 0 for per channel.")
    if scheme == "keep" and fp8 and not formats.KEEPS_FP8[fmt]:
        raise QuantizeError(f"the {fmt} format has no way to describe FP8 weights with block scales, but policy "
                            f"{policy.name!r} keeps the FP8 tensor {name} (rule {rule.match!r}). Use a policy that "
                            f"converts FP8 weights (bf16 or w8a8_dynamic), or --format flagdeploy.")
    if scheme not in formats.CARRIES[fmt]:
        raise QuantizeError(f"the {fmt} format cannot carry scheme {scheme!r} ({name}, rule {rule.match!r}); it carries "
                            f"{', '.join(formats.CARRIES[fmt])}. Use --format flagdeploy or change the policy.")
    if scale is not None and tuple(scale[1].shape) != (-(-entry.shape[0] // block[0]), -(-entry.shape[1] // block[1])):
        raise QuantizeError(f"{name}_scale_inv has shape {scale[1].shape}, which does not cover {name} {entry.shape} in "
                            f"{block} blocks (weight_block_size in config.json); the checkpoint is inconsistent.")
    rows = entry.shape[0] if entry.shape else 0
    if scheme == "keep" or (scheme == "fp8" and fp8):
        outs = [(name, entry.dtype, entry.shape)] + ([(name + "_scale_inv", scale[1].dtype, scale[1].shape)] if scale else [])
    elif scheme == "bf16":
        keep_dtype = entry.dtype in (torch.float32, torch.bfloat16) or not entry.dtype.is_floating_point
        outs = [(name, entry.dtype if keep_dtype and not fp8 else torch.bfloat16, entry.shape)]
    elif scheme == "fp8":
        blocks = (-(-entry.shape[0] // block[0]), -(-entry.shape[1] // block[1]))
        outs = [(name, torch.float8_e4m3fn, entry.shape), (name + "_scale_inv", torch.float32, blocks)]
    else:  # int8
        cols = entry.shape[1] // group if group else 1
        outs = [(name, torch.int8, entry.shape), *formats.int8_companions(fmt, name, rows, cols)]
    return TensorPlan(name, entry, scale, scheme, group, rule.match, outs, block, note)


def plan(src: Path, policy: Policy, chip: Chip, fmt: str) -> Plan:
    """Everything the conversion will do, from the headers alone; raises on any problem."""
    if fmt not in formats.FORMATS:
        raise QuantizeError(f"unknown output format {fmt!r}; choose one of {', '.join(formats.FORMATS)}.")
    policy.check_chip(chip)
    try:
        config = json.loads((src / "config.json").read_text())
    except (OSError, json.JSONDecodeError) as exc:
        raise QuantizeError(f"{src / 'config.json'} could not be read ({exc}); the source must be an HF checkpoint "
                            f"directory with its config.json.") from exc
    source_qc = config.get("quantization_config") or (config.get("text_config") or {}).get("quantization_config") or {}
    block = tuple(source_qc.get("weight_block_size") or FP8_BLOCK)
    files = _source_shards(src)
    headers = {f: read_header(f) for f in files}
    where = {e.name: (f, e) for f, entries in headers.items() for e in entries}
    scales = {n[: -len("_scale_inv")]: v for n, v in where.items() if n.endswith(".weight_scale_inv")}
    orphans = [n + "_scale_inv" for n in scales if n not in where or not is_fp8(where[n][1].dtype)]
    if orphans:
        raise QuantizeError(f"{len(orphans)} weight_scale_inv tensors have no FP8 weight beside them, e.g. {orphans[:3]}; "
                            f"the checkpoint is inconsistent. Download it again.")
    unscaled = [n for n, (_, e) in where.items() if is_fp8(e.dtype) and n not in scales]
    if unscaled:
        raise QuantizeError(f"{len(unscaled)} FP8 tensors have no weight_scale_inv, e.g. {sorted(unscaled)[:3]}; without "
                            f"its scales an FP8 weight cannot be dequantised. Download the complete checkpoint.")
    notes = []
    if not any(is_fp8(e.dtype) for _, e in where.values()):
        notes.append("the source has no FP8 tensors (it is already 16-bit): converted what the policy says")
    n = len(files)
    shards = []
    for i, f in enumerate(files, 1):
        sp = ShardPlan(f, f"model-{i:05d}-of-{n:05d}.safetensors")
        for e in headers[f]:
            if not e.name.endswith(".weight_scale_inv"):
                sp.tensors.append(_plan_tensor(e.name, e, scales.get(e.name), policy, chip, fmt, block))
        shards.append(sp)
    if fmt == "vllm-ascend":
        _check_fused_siblings(shards)
    ident = {"files": [(f.name, f.stat().st_size, f.stat().st_mtime_ns) for f in files], "policy": repr(policy),
             "chip": chip.id, "format": fmt}
    fingerprint = hashlib.sha256(json.dumps(ident, sort_keys=True).encode()).hexdigest()
    return Plan(src, config, shards, notes, fingerprint)


def _check_fused_siblings(shards: list[ShardPlan]) -> None:
    """vLLM fuses gate/up (and q/k/v) into one layer and requires the pieces to share one scheme."""
    schemes = {t.name: t.scheme for s in shards for t in s.tensors}
    for name, scheme in schemes.items():
        for a, b in ((".gate_proj.", ".up_proj."), (".q_proj.", ".k_proj."), (".q_proj.", ".v_proj.")):
            if a in name and schemes.get(name.replace(a, b), scheme) != scheme:
                raise QuantizeError(f"{name} ({scheme}) and {name.replace(a, b)} ({schemes[name.replace(a, b)]}) are fused "
                                    f"into one layer by vLLM-Ascend and must share a scheme; adjust the policy's rules.")


# ---- convert ---------------------------------------------------------------------------------------------


def _convert_tensor(tp: TensorPlan, w: torch.Tensor, scale_inv: torch.Tensor | None) -> tuple[list[torch.Tensor], float]:
    """The output tensors (in `tp.outputs` order) and the relative error against the source's values."""
    out_dtype = tp.outputs[0][1]
    if tp.scheme == "keep" or (tp.scheme == "fp8" and scale_inv is not None) or (tp.scheme == "bf16" and out_dtype == w.dtype):
        return [w] + ([scale_inv] if scale_inv is not None and tp.scheme != "bf16" else []), 0.0
    if tp.scheme == "fp8":  # BF16 -> FP8: rare (FP8 chips keep FP8 checkpoints), done whole
        exact = w.float()
        q, s = fp8_block_quantize(exact, tp.block)
        return [q, s], relative_error(fp8_block_dequantize(q, s, tp.block), exact)
    if w.dim() != 2:  # bf16 of a vector or a table: small, done whole
        out = w.to(out_dtype)
        return [out], relative_error(out, w.float())
    return _convert_rows(tp, w, scale_inv)


# Rows per step: a chunk's float32 temporaries (~2 MB) stay in cache, and peak memory stays a few times
# the largest tensor's stored size however many passes a scheme makes.
_CHUNK_ELEMENTS = 1 << 19


def _convert_rows(tp: TensorPlan, w: torch.Tensor, scale_inv: torch.Tensor | None) -> tuple[list[torch.Tensor], float]:
    int8 = SCHEMES[tp.scheme].int8
    if scale_inv is not None and native.converts_fp8(w, tp.block, tp.group_size if int8 else 0):
        return _convert_fp8_native(tp, w, scale_inv, int8)
    rows, cols = w.shape
    unit = tp.block[0] if scale_inv is not None else 1  # chunks start on a scale block's first row
    step = max(1, _CHUNK_ELEMENTS // max(cols, 1) // unit) * unit
    if int8:
        q = torch.empty(rows, cols, dtype=torch.int8)
        scales = torch.empty(rows, cols // tp.group_size if tp.group_size else 1, dtype=torch.float32)
    else:
        out = torch.empty(rows, cols, dtype=tp.outputs[0][1])
    norm2 = err2 = 0.0
    for r0 in range(0, rows, step):
        r1 = min(rows, r0 + step)
        if scale_inv is None:
            f = w[r0:r1].float()
        else:
            f = fp8_block_dequantize(w[r0:r1], scale_inv[r0 // unit: -(-r1 // unit)], tp.block)
        norm2 += float(torch.linalg.vector_norm(f)) ** 2
        if int8:
            b = Int8Weight.quantize(f, tp.group_size)
            q[r0:r1], scales[r0:r1] = b.q, b.scales.reshape(r1 - r0, -1)
            approx = b.dequantize()
        else:
            out[r0:r1] = f
            approx = out[r0:r1].float()
        err2 += float(torch.linalg.vector_norm(approx.sub_(f))) ** 2
    err = (err2 / norm2) ** 0.5 if norm2 else 0.0
    if not int8:
        return [out], err
    return _int8_outputs(tp, q, scales), err


def _int8_outputs(tp: TensorPlan, q: torch.Tensor, scales: torch.Tensor) -> list[torch.Tensor]:
    """An int8 weight's tensors in `tp.outputs` order: q, scales, and zero offsets where the format has them."""
    return [q, scales] + ([torch.zeros_like(scales)] if len(tp.outputs) == 3 else [])


def _convert_fp8_native(tp: TensorPlan, w: torch.Tensor, scale_inv: torch.Tensor, int8: bool):
    """The same arithmetic as `_convert_rows`, value for value, in one pass of the cpu backend's kernel
    (backends/cpu/csrc/fp8_convert.cpp) over the rows instead of several torch passes per chunk."""
    if int8:
        q, scales, norm2, err2 = native.fp8_to_int8(w, scale_inv, tp.block, tp.group_size)
        outs = _int8_outputs(tp, q, scales)
    else:
        out, norm2, err2 = native.fp8_to_bf16(w, scale_inv, tp.block)
        outs = [out]
    return outs, (err2 / norm2) ** 0.5 if norm2 else 0.0


def _convert_shard(sp: ShardPlan, partial: Path, bar: tqdm, handles: dict) -> list[dict]:
    rows = []
    tmp = partial / (sp.output + ".tmp")
    writer = ShardWriter(tmp, [o for t in sp.tensors for o in t.outputs])
    try:
        for tp in sp.tensors:
            w = read_tensor(_handle(handles, sp.source), tp.entry)
            s = read_tensor(_handle(handles, tp.scale[0]), tp.scale[1]) if tp.scale else None
            outs, err = _convert_tensor(tp, w, s)
            for (name, _, _), t in zip(tp.outputs, outs):
                writer.write(name, t)
            after = sum(t.numel() * t.element_size() for t in outs)
            rows.append({"name": tp.name, "scheme": tp.scheme, "rule": tp.rule, "dtype_before": str(tp.entry.dtype),
                         "bytes_before": tp.bytes_before, "bytes_after": after, "rel_error": err, "note": tp.note})
            bar.update(tp.bytes_before)
        writer.close()
    except BaseException:
        writer.abort()
        tmp.unlink(missing_ok=True)
        raise
    os.replace(tmp, partial / sp.output)
    return rows


def _handle(handles: dict, path: Path):
    if path not in handles:
        handles[path] = open(path, "rb")
    return handles[path]


def _write_json(path: Path, data) -> None:
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(data, indent=2) + "\n")
    os.replace(tmp, path)


def _load_state(partial: Path, fingerprint: str) -> dict:
    """Finished shards of an earlier run with the same inputs; anything else there is cleared."""
    if partial.exists():
        try:
            state = json.loads((partial / STATE_FILE).read_text())
            if state.get("fingerprint") == fingerprint:
                done = {k: v for k, v in state["done"].items() if (partial / k).is_file()}
                if done:
                    log.warning("resuming an interrupted conversion: %d shards already done", len(done))
                return {"fingerprint": fingerprint, "done": done}
        except (OSError, json.JSONDecodeError, KeyError):
            pass
        log.warning("%s holds an interrupted conversion of other inputs; starting over", partial)
        shutil.rmtree(partial)
    partial.mkdir(parents=True)
    state = {"fingerprint": fingerprint, "done": {}}
    _write_json(partial / STATE_FILE, state)
    return state


def convert(p: Plan, dst: Path, *, chip: Chip, policy: Policy, fmt: str, overwrite: bool = False,
            progress: bool = True) -> dict:
    """Run plan `p` into `dst`; returns the report (also written to dst/quantize_report.json)."""
    dst = Path(dst)
    if dst.exists() and not overwrite:
        raise QuantizeError(f"{dst} already exists; choose another output directory or pass --overwrite.")
    if dst.resolve() == p.src.resolve():
        raise QuantizeError("the output directory must differ from the source directory.")
    partial = dst.parent / f".{dst.name}.partial"
    dst.parent.mkdir(parents=True, exist_ok=True)
    state = _load_state(partial, p.fingerprint)
    todo = [s for s in p.shards if s.output not in state["done"]]
    handles: dict = {}
    with tqdm(total=sum(t.bytes_before for s in todo for t in s.tensors), unit="B", unit_scale=True,
              desc=f"quantize {p.src.name} -> {dst.name}", disable=not progress) as bar:
        try:
            for sp in todo:
                state["done"][sp.output] = _convert_shard(sp, partial, bar, handles)
                _write_json(partial / STATE_FILE, state)
                bar.set_postfix(tensors=sum(len(v) for v in state["done"].values()))
        finally:
            for f in handles.values():
                f.close()
    rows = [r for s in p.shards for r in state["done"][s.output]]
    _write_metadata(p, partial, rows, chip=chip, policy=policy, fmt=fmt)
    from .report import build_report

    report = build_report(rows, p.notes, chip=chip.id, policy=policy.name, fmt=fmt, src=str(p.src))
    _write_json(partial / REPORT_FILE, report)
    (partial / STATE_FILE).unlink()
    _swap_into_place(partial, dst)
    return report


def _write_metadata(p: Plan, root: Path, rows: list[dict], *, chip: Chip, policy: Policy, fmt: str) -> None:
    outputs = [(t.scheme, o) for t in p.tensors for o in t.outputs]  # o = (name, dtype, shape)
    weight_map = {name: s.output for s in p.shards for t in s.tensors for name, _, _ in t.outputs}
    total = sum(r["bytes_after"] for r in rows)
    _write_json(root / "model.safetensors.index.json", {"metadata": {"total_size": total}, "weight_map": weight_map})
    config = json.loads(json.dumps(p.config))
    source_qc = config.pop("quantization_config", None)
    if isinstance(config.get("text_config"), dict):
        source_qc = config["text_config"].pop("quantization_config", None) or source_qc
    fp8_out = any(is_fp8(dtype) for _, (_, dtype, _) in outputs)
    modules = {formats.base_name(t.name): t.scheme for t in p.tensors if is_matrix_weight(t.name, t.entry.shape)}
    block = list(p.tensors[0].block) if p.tensors else list(FP8_BLOCK)
    qc = formats.quantization_config(fmt, chip=chip.id, policy=policy.name, source=source_qc, modules=modules,
                                     fp8_block=block if fp8_out else None)
    if qc is not None:
        config["quantization_config"] = qc
    _write_json(root / "config.json", config)
    if fmt == "vllm-ascend":
        _write_json(root / formats.DESCRIPTION_FILE, formats.description([(o[0], scheme) for scheme, o in outputs]))
    skip = {"config.json", "model.safetensors.index.json", REPORT_FILE, formats.DESCRIPTION_FILE}
    for f in p.src.iterdir():  # tokenizer, chat template, generation config, ...
        if f.is_file() and f.suffix != ".safetensors" and f.name not in skip:
            shutil.copy2(f, root / f.name)


def _swap_into_place(partial: Path, dst: Path) -> None:
    old = dst.parent / f".{dst.name}.old"
    if dst.exists():
        shutil.rmtree(old, ignore_errors=True)
        os.rename(dst, old)
    os.rename(partial, dst)
    shutil.rmtree(old, ignore_errors=True)

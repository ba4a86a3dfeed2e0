"""`flagdeploy export onnx`: a llama-family model → an ONNX decoder with KV-cache inputs/outputs.

The graph is made by onnxruntime-genai's model builder (the tooling ORT ships for exactly this: fused
GroupQueryAttention, RotaryEmbedding and SkipSimplifiedLayerNormalization contrib ops, and weight-only
int4/int8 through ORT's own MatMulNBits kernels). The builder reads an HF safetensors directory, or a
float16/float32 GGUF only; a quantized GGUF (our default model is Q4_1) is dequantised first, through
the same reader the torch engine uses, into a temporary HF directory.

The output directory is written atomically (built beside it, then renamed into place) and carries
`flagdeploy-onnx.json`: opset, weights, EP hints, the source's sha256 and the graph's IO names.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path

log = logging.getLogger(__name__)

MANIFEST = "flagdeploy-onnx.json"
WEIGHTS = ("int4", "int8", "fp16", "fp32")
# Which ORT execution providers each weight format is meant for (hints, written into the manifest).
EP_HINTS = {
    "int4": ["CPUExecutionProvider", "CUDAExecutionProvider", "CANNExecutionProvider", "OpenVINOExecutionProvider"],
    "int8": ["CPUExecutionProvider", "CUDAExecutionProvider", "CANNExecutionProvider", "OpenVINOExecutionProvider"],
    "fp16": ["CUDAExecutionProvider", "CANNExecutionProvider", "DmlExecutionProvider"],
    "fp32": ["CPUExecutionProvider"],
}


class ExportError(RuntimeError):
    pass


def _need_builder():
    try:
        from onnxruntime_genai.models import builder  # noqa: F401
    except ImportError as exc:
        raise ExportError(
            "exporting to ONNX needs onnxruntime-genai (its model builder) and onnxruntime: "
            "pip install 'flagdeploy[edge]'"
        ) from exc
    return builder


def file_sha256(path: Path) -> str:
    """sha256 of a file, or of a directory's *.safetensors + config.json (sorted by name)."""
    h = hashlib.sha256()
    files = [path] if path.is_file() else sorted(
        p for p in path.iterdir() if p.suffix == ".safetensors" or p.name == "config.json")
    for f in files:
        with open(f, "rb") as fh:
            for chunk in iter(lambda: fh.read(1 << 20), b""):
                h.update(chunk)
    return h.hexdigest()


def gguf_to_hf_dir(path: Path, out: Path) -> None:
    """Dequantise a llama-family GGUF into an HF directory (config.json, model.safetensors, tokenizer)."""
    import torch
    from safetensors.torch import save_file

    from flagdeploy.checkpoints import gguf_reader
    from flagdeploy.tokenizer import Tokenizer

    reader = gguf_reader.open_gguf(path)
    cfg = gguf_reader.read_config(reader)
    tensors = {name: t.contiguous() for name, t in gguf_reader.iter_tensors(reader, cfg, torch.float32)}
    if cfg.tie_word_embeddings:
        tensors.pop("lm_head.weight", None)
    out.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})
    tok = Tokenizer.from_source(path, "gguf", extra_eos_ids=cfg.eos_token_ids)
    tok.hf.save_pretrained(str(out))
    eos = cfg.eos_token_ids[0] if len(cfg.eos_token_ids) == 1 else (cfg.eos_token_ids or None)
    hf_config = {
        "architectures": ["LlamaForCausalLM"], "model_type": "llama",
        "vocab_size": cfg.vocab_size, "hidden_size": cfg.hidden_size, "intermediate_size": cfg.intermediate_size,
        "num_hidden_layers": cfg.num_layers, "num_attention_heads": cfg.num_heads,
        "num_key_value_heads": cfg.num_kv_heads, "head_dim": cfg.head_dim, "rms_norm_eps": cfg.rms_norm_eps,
        "rope_theta": cfg.rope_theta, "max_position_embeddings": cfg.max_position_embeddings,
        "tie_word_embeddings": cfg.tie_word_embeddings, "attention_bias": cfg.attention_bias,
        "hidden_act": "silu", "bos_token_id": cfg.bos_token_id, "eos_token_id": eos,
        "pad_token_id": tok.hf.pad_token_id, "torch_dtype": "float32",
    }
    if cfg.source_model_type not in ("llama", "mistral"):
        raise ExportError(f"ONNX export handles the llama architecture; this GGUF is {cfg.source_model_type!r}")
    (out / "config.json").write_text(json.dumps(hf_config, indent=2))


def _run_builder(hf_dir: Path, out: Path, weights: str, ep: str, cache: Path, block_size: int,
                 extra: list[str] | None = None) -> None:
    """The builder's own command line, in a child process (it keeps module state, and it prints a lot)."""
    import subprocess

    _need_builder()
    argv = [sys.executable, "-m", "onnxruntime_genai.models.builder", "-i", str(hf_dir), "-o", str(out),
            "-p", weights, "-e", ep, "-c", str(cache)]
    if weights in ("int4", "int8"):
        # accuracy_level 4: int8 activations against the packed weights (ORT's fastest CPU MatMulNBits path)
        argv += ["--extra_options", f"block_size={block_size}", "accuracy_level=4", *(extra or [])]
    log.info("running %s", " ".join(argv))
    r = subprocess.run(argv, capture_output=True, text=True)
    if r.returncode != 0:
        raise ExportError(f"the onnxruntime-genai model builder failed (exit {r.returncode}):\n{r.stdout[-3000:]}"
                          f"{r.stderr[-3000:]}")


def export_onnx(source, out_dir: Path, weights: str = "int4", ep: str = "cpu", block_size: int = 32,
                overwrite: bool = False, int4_method: str = "auto") -> Path:
    """Export `source` (a ModelSource: .gguf file or HF dir) to `out_dir`; returns out_dir.

    int4_method: "gguf" carries a Q4_0/Q4_1 GGUF's own blocks into MatMulNBits (no second quantization,
    flagdeploy/edge/gguf_int4.py); "rtn" lets the model builder re-quantize (round-to-nearest, symmetric,
    `block_size`); "auto" is gguf where the source allows it, else rtn."""
    if weights not in WEIGHTS:
        raise ExportError(f"--weights must be one of {', '.join(WEIGHTS)}, not {weights!r}")
    if int4_method not in ("auto", "gguf", "rtn"):
        raise ExportError(f"int4_method must be auto, gguf or rtn, not {int4_method!r}")
    method = None
    if weights == "int4":
        from .gguf_int4 import has_q4_linears

        native = source.format == "gguf" and has_q4_linears(Path(source.path))
        if int4_method == "gguf" and not native:
            raise ExportError("--int4-from gguf needs a GGUF whose linears are Q4_0/Q4_1")
        method = "gguf" if native and int4_method != "rtn" else "rtn"
    out_dir = Path(out_dir)
    if out_dir.exists():
        if not overwrite:
            raise ExportError(f"{out_dir} exists; pass --overwrite to replace it")
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    src_path = Path(source.path)
    t0 = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix=".flagdeploy-onnx-", dir=out_dir.parent) as tmp:
        tmp = Path(tmp)
        if source.format == "gguf":
            hf_dir = tmp / "hf"
            gguf_to_hf_dir(src_path, hf_dir)
        else:
            hf_dir = src_path
        build = tmp / "out"
        gguf_stats = None
        if method == "gguf":  # the float graph, then the GGUF's blocks into MatMulNBits
            _run_builder(hf_dir, build, "fp32", ep, tmp / "cache", block_size)
            from .gguf_int4 import rewrite

            gguf_stats = rewrite(build, src_path)
            block_size = 32
        else:
            _run_builder(hf_dir, build, weights, ep, tmp / "cache", block_size)
        if not (build / "model.onnx").exists():
            raise ExportError(f"the model builder wrote no model.onnx into {build}")
        for f in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "config.json"):
            if (hf_dir / f).exists() and not (build / f).exists():
                shutil.copy(hf_dir / f, build / f)
        (build / "hf_config.json").write_text((hf_dir / "config.json").read_text())
        manifest = _manifest(build, source, src_path, weights, ep, block_size, time.perf_counter() - t0)
        if method == "gguf":
            manifest["quantization"] = {
                "method": "GGUF blocks carried into MatMulNBits (no re-quantization; Q4_1 offsets as two 4-bit "
                          "blocks against the input's block sums; gguf_int4.py)",
                "bits": 4, "block_size": 32, "source_types": gguf_stats["gguf_types"], "lm_head": "8-bit (GGUF Q8_0)"
                if gguf_stats["int8_gguf_head"] else "float", "accuracy_level": 4, "linears": gguf_stats}
        elif method == "rtn":
            manifest["quantization"]["method"] = "MatMulNBits RTN by the onnxruntime-genai model builder"
        tmp_manifest = build / (MANIFEST + ".tmp")
        tmp_manifest.write_text(json.dumps(manifest, indent=2))
        os.replace(tmp_manifest, build / MANIFEST)
        if out_dir.exists():
            old = out_dir.with_name(out_dir.name + f".old-{os.getpid()}")
            os.replace(out_dir, old)
            os.replace(build, out_dir)
            shutil.rmtree(old, ignore_errors=True)
        else:
            os.replace(build, out_dir)
    return out_dir


def _manifest(build: Path, source, src_path: Path, weights: str, ep: str, block_size: int, seconds: float) -> dict:
    import onnx
    import onnxruntime

    m = onnx.load(str(build / "model.onnx"), load_external_data=False)
    opsets = {op.domain or "ai.onnx": op.version for op in m.opset_import}
    ops = sorted({n.op_type for n in m.graph.node})
    try:
        import onnxruntime_genai

        genai_version = onnxruntime_genai.__version__
    except Exception:  # noqa: BLE001
        genai_version = "unknown"
    genai_cfg = json.loads((build / "genai_config.json").read_text()) if (build / "genai_config.json").exists() else {}
    return {
        "format": "flagdeploy-onnx/1",
        "model": source.name,
        "source": {"path": str(src_path), "format": source.format, "sha256": file_sha256(src_path)},
        "weights": weights,
        "quantization": ({"method": "MatMulNBits (weight-only, RTN)", "bits": 4 if weights == "int4" else 8,
                          "block_size": block_size, "symmetric": True, "accuracy_level": 4}
                         if weights in ("int4", "int8") else None),
        "opset": opsets,
        "ops": ops,
        "target_ep": ep,
        "ep_hints": EP_HINTS[weights],
        "inputs": [i.name for i in m.graph.input],
        "outputs": [o.name for o in m.graph.output],
        "context_length": genai_cfg.get("model", {}).get("context_length"),
        "exporter": {"tool": "onnxruntime-genai model builder", "onnxruntime_genai": genai_version,
                     "onnxruntime": onnxruntime.__version__, "onnx": onnx.__version__},
        "export_seconds": round(seconds, 1),
    }


def read_manifest(path: Path) -> dict:
    p = Path(path) / MANIFEST
    if not p.exists():
        raise ExportError(f"{path} is not a flagdeploy ONNX export (no {MANIFEST}); make one with "
                          f"`flagdeploy export onnx MODEL -o {path}`")
    return json.loads(p.read_text())


def cached_export(source, weights: str = "int4", ep: str = "cpu", int4_method: str = "auto") -> Path:
    """The export of `source` under the flagdeploy cache dir, made on first use (keyed by the source's hash,
    the weights and, for int4, how they were made)."""
    from flagdeploy.checkpoints.source import cache_dir

    digest = file_sha256(Path(source.path))[:16]
    kind = weights
    if weights == "int4":
        from .gguf_int4 import LAYOUT_VERSION, has_q4_linears

        native = source.format == "gguf" and has_q4_linears(Path(source.path))
        kind = f"int4-gguf{LAYOUT_VERSION}" if native and int4_method != "rtn" else "int4-rtn"
    out = cache_dir() / "onnx" / f"{source.name}-{digest}-{kind}-{ep}"
    if (out / MANIFEST).exists():
        return out
    return export_onnx(source, out, weights, ep, overwrite=out.exists(), int4_method=int4_method)

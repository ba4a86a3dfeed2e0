"""`flagdeploy export onnx` and the builtin-process ONNX path of `flagdeploy serve --engine onnxruntime`."""

from __future__ import annotations

import sys

import click

from flagdeploy.errors import FlagdeployError


def _fail(message: str) -> None:
    click.echo(f"error: {message}", err=True)
    sys.exit(1)


@click.group("export")
def export_group() -> None:
    """Export a model for another runtime."""


@export_group.command("onnx")
@click.argument("model", required=False)
@click.option("-o", "--output", required=True, type=click.Path(file_okay=False), help="Directory to write (atomically).")
@click.option("--weights", default="int4", show_default=True, type=click.Choice(["int4", "int8", "fp16", "fp32"]),
              help="int4/int8: weight-only MatMulNBits (ORT's own kernels); fp16/fp32: float weights.")
@click.option("--target", default="cpu", show_default=True, type=click.Choice(["cpu", "cuda"]),
              help="The execution provider the graph is laid out for (the model builder's -e).")
@click.option("--block-size", default=32, show_default=True, type=click.Choice(["16", "32", "64", "128"]),
              help="Quantization block size (int4/int8).")
@click.option("--int4-from", "int4_method", default="auto", show_default=True, type=click.Choice(["auto", "gguf", "rtn"]),
              help="int4: gguf carries a Q4_0/Q4_1 GGUF's own blocks into MatMulNBits (no second quantization); "
                   "rtn re-quantizes with the model builder; auto: gguf where the source allows it.")
@click.option("--overwrite", is_flag=True, help="Replace an existing output directory.")
def export_onnx_cmd(model, output, weights, target, block_size, int4_method, overwrite) -> None:
    """MODEL (default: the bundled SmolLM2-135M-Instruct) -> an ONNX decoder with KV-cache inputs/outputs
    and a flagdeploy-onnx.json manifest. Serve it with `flagdeploy serve --engine onnxruntime --model DIR`."""
    from pathlib import Path

    from flagdeploy.checkpoints.source import resolve

    from .export import ExportError, export_onnx

    try:
        src = resolve(model)
        click.echo(f"exporting {src.path} ({weights}, {target}) ...", err=True)
        out = export_onnx(src, Path(output), weights, target, int(block_size), overwrite, int4_method)
    except (FlagdeployError, ExportError, ValueError) as exc:
        _fail(str(exc))
    click.echo(f"wrote {out}")


def serve_onnx(options, *, host: str, port: int, log_level: str, weights: str = "int4") -> None:
    """`serve --engine onnxruntime`: the builtin server (flagdeploy/assemble.py) with the ONNX engine in this
    process; `options` the ServeOptions of the command line."""
    from pathlib import Path

    from flagdeploy.assemble import run_server
    from flagdeploy.engine import AsyncEngine, EngineConfig

    from .engine import EdgeError, build_onnx_engine, check_provider, provider_for_chip

    model, chip = options.model, options.chip
    try:
        check_provider(provider_for_chip(chip))  # a missing EP fails now, naming its package
    except (EdgeError, FlagdeployError) as exc:
        _fail(str(exc))
    config = EngineConfig(max_model_len=options.max_model_len, max_num_seqs=options.max_num_seqs,
                          kv_cache_memory=options.kv_cache_memory)
    if model and (Path(model) / "flagdeploy-onnx.json").exists():
        default_name = Path(model).name
    else:
        from flagdeploy.checkpoints.source import resolve

        try:
            default_name = resolve(model).name
        except FlagdeployError as exc:
            _fail(str(exc))
    names = list(options.served_names) or [default_name]

    def load() -> AsyncEngine:
        return AsyncEngine(build_onnx_engine(model, config, chip=chip, weights=weights))

    def ready(engine: AsyncEngine) -> str:
        return f"flagdeploy: serving {names[0]} (onnxruntime, {engine.engine.decoder.ep}) on http://{host}:{port}/v1 (ready)"

    run_server(options, load, names, host=host, port=port, log_level=log_level, ready=ready,
               loading=f"flagdeploy: loading {model or names[0]} with onnxruntime (exported on first use) ... "
                       f"(/ready answers 503 until done)")

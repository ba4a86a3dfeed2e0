"""`flagdeploy export onnx` (`flagdeploy serve --engine onnxruntime` serves the result: flagdeploy/serving.py)."""

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

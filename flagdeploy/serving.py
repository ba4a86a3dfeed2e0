"""What `flagdeploy serve` starts, once cli.py (the click surface) has parsed its flags into `ServeOptions`
and a `ServeSetup`; `serve` picks one of:

- the builtin engine in this process (assemble.py), or a headless node of a replica spread over machines;
- `--dp K`: K builtin replicas behind the gateway (`ServeOptions.replicas_entry`, gateway/replicas.py);
- the ONNX engine in this process (`--engine onnxruntime`, or an edge --chip that implies it; flagdeploy/edge);
- external engines behind the gateway (`--engine`, `--upstream`, `--config`; flagdeploy/gateway).

Everything that can refuse the command is checked here before anything listens or loads; a refusal is a
FlagdeployError or ValueError whose message names the flag to change (the CLI prints it as its error line).
"""

from __future__ import annotations

import dataclasses
import logging
import os
import socket
import sys
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from flagdeploy.assemble import ServeOptions, check_split, checked_source, engine_loader, run_server
from flagdeploy.errors import ConfigError, FlagdeployError

if TYPE_CHECKING:
    from flagdeploy.checkpoints.source import ModelSource
    from flagdeploy.engine.nodes import NodeGroup

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class ServeSetup:
    """What `flagdeploy serve` is told besides the builtin model's options: where to listen, which engine(s),
    a --profile or a serve.yaml, the machines one replica spans. `given`: the options named on the command
    line, by their parameter names (a profile or serve.yaml fills the others)."""

    host: str = "127.0.0.1"
    port: int = 8000
    log_level: str = "warning"
    engine: str = "builtin"
    upstreams: tuple[str, ...] = ()
    prefill_upstreams: tuple[str, ...] = ()
    config_file: str | None = None
    profile_file: str | None = None
    startup_timeout: float = 1800.0
    dp: int = 1
    nnodes: int = 1
    node_rank: int = 0
    master_addr: str = "127.0.0.1"
    master_port: int = 29500
    node_timeout: float = 300.0
    given: frozenset[str] = frozenset()


def serve(options: ServeOptions, setup: ServeSetup) -> None:
    """Check `options` and `setup` together, then serve them in this process until it stops."""
    from flagdeploy.edge import implied_engine
    from flagdeploy.gateway.replicas import exit_with_parent

    exit_with_parent()  # a replica launched by `--dp` ends with its gateway, however that ends
    if setup.prefill_upstreams and not setup.upstreams:
        raise ConfigError("--prefill-upstream names the prefill instances of a prefill-decode pair; give its decode "
                          "instances with --upstream (or write the pair in serve.yaml: prefill_upstreams beside "
                          "upstreams)")
    attached = bool(setup.upstreams or setup.config_file)
    builtin = setup.engine == "builtin" and not attached
    if options.speculative.enabled and not builtin:
        raise ConfigError("--speculative/--speculative-config apply to the builtin engine; for --engine/--upstream/"
                          "--config give the engine's own speculative flags there")
    if options.kv_transfer is not None and (not builtin or setup.dp > 1 or setup.nnodes > 1):
        raise ConfigError("--kv-transfer-config makes this builtin-engine instance a prefill or decode one: start one "
                          "`flagdeploy serve` per instance (no --dp, --nnodes, --engine, --upstream or --config), "
                          "and a router in front")
    if setup.profile_file and builtin:
        options, setup = _from_profile(options, setup)
    if builtin and options.chip and implied_engine(options.chip, setup.engine) == "builtin":
        from flagdeploy import ops  # a missing device: one line here, not a loader traceback

        ops.require_device(ops.get_backend(options.chip), options.chip)
    nodes = _nodes(options, setup, builtin)
    if setup.dp > 1:
        if not builtin:
            raise ConfigError("--dp runs replicas of the builtin engine; for --engine/--upstream/--config give the "
                              "replicas there instead (`replicas: N` in serve.yaml, or one --upstream per replica)")
        if options.tp * options.ep > 1:  # a split the model cannot take fails here, not in K restarting replicas
            check_split(checked_source(options.model, options.weights), options)
        _serve_gateway(options, setup, setup.engine, entry=options.replicas_entry(setup.dp))
        return
    engine = setup.engine if attached else implied_engine(options.chip, setup.engine)
    if engine == "onnxruntime" and not attached:
        _serve_onnx(options, setup)
    elif engine != "builtin" or attached:
        _serve_gateway(options, setup, engine)
    else:
        _serve_builtin(options, setup, nodes)


def _from_profile(options: ServeOptions, setup: ServeSetup) -> tuple[ServeOptions, ServeSetup]:
    """The profile's values for every option not given on the command line (and the plan's speculative
    decoding, unless --speculative or --speculative-config is given)."""
    from flagdeploy.chips import get_chip
    from flagdeploy.engine.speculative import SpeculativeConfig
    from flagdeploy.planner import Profile

    path = setup.profile_file
    prof = Profile.load(path)  # its errors name the file
    try:
        backend = get_chip(prof.chip).backend
    except (FlagdeployError, ValueError, TypeError) as exc:
        raise ConfigError(f"{path}: {exc}") from None
    if prof.engine not in (None, "builtin"):  # planned (by `plan --engine/--emit` or `deploy`) for another engine
        raise ConfigError(f"{path} was planned for {prof.engine}, whose layouts the builtin engine may not run: serve "
                          f"it with `flagdeploy serve --profile {path} --engine {prof.engine}` (flagdeploy launches "
                          f"{prof.engine} and serves it here), or plan again for the builtin engine (`flagdeploy plan "
                          "... --engine builtin`).")
    if prof.pp > 1:
        raise ConfigError(f"{path} splits the model over {prof.pp} pipeline stages (pp={prof.pp}); the builtin engine "
                          f"has none (it spreads --tp x --ep over nodes instead). Launch an external engine with "
                          f"`flagdeploy plan ... --emit vllm|sglang|...`.")
    if prof.nodes != setup.nnodes:
        raise ConfigError(f"{path} spans {prof.nodes} node(s): run `flagdeploy serve --profile {path} --nnodes "
                          f"{prof.nodes} --node-rank R --master-addr NODE0_ADDRESS` on each node (R = 0 on the node "
                          "that serves HTTP).")
    tp, ep, dp = prof.builtin_layout()
    planned = {"model": prof.model, "chip": backend, "max_model_len": prof.max_model_len,
               "max_num_seqs": prof.max_num_seqs, "max_num_batched_tokens": prof.max_num_batched_tokens,
               "block_size": prof.block_size, "tp": tp, "ep": ep,
               "served_names": (prof.served_model_name,) if prof.served_model_name else ()}
    picked = {name: value for name, value in planned.items() if name not in setup.given}
    if not options.speculative.enabled and not {"speculative", "speculative_config"} & setup.given:
        picked["speculative"] = SpeculativeConfig(method="mtp" if prof.mtp else "off",
                                                  num_speculative_tokens=prof.num_speculative_tokens)
    where = {name: value for name, value in (("port", prof.port), ("dp", dp)) if name not in setup.given}
    return dataclasses.replace(options, **picked), dataclasses.replace(setup, **where)


def _nodes(options: ServeOptions, setup: ServeSetup, builtin: bool) -> "NodeGroup | None":
    """The machines one builtin replica spans (--nnodes > 1), checked against its --tp x --ep; else None."""
    if setup.nnodes == 1:
        if setup.node_rank:
            raise ConfigError(f"--node-rank {setup.node_rank} needs --nnodes above it (the number of machines the "
                              "replica spans)")
        return None
    if not builtin or setup.dp > 1:
        raise ConfigError("--nnodes spreads one builtin-engine replica's --tp x --ep ranks over machines; it does not "
                          "combine with --dp, --engine, --upstream or --config (for external engines across nodes: "
                          "`flagdeploy plan --nodes N --emit ENGINE`)")
    from flagdeploy.engine.nodes import NodeGroup

    nodes = NodeGroup(setup.nnodes, setup.node_rank, setup.master_addr, setup.master_port, setup.node_timeout)
    nodes.check(options.tp * options.ep)
    return nodes


def _serve_builtin(options: ServeOptions, setup: ServeSetup, nodes: "NodeGroup | None") -> None:
    """The builtin engine in this process (assemble.py), or this node's ranks of it, headless, on node > 0."""
    from flagdeploy.server.app import check_parsers

    head = nodes is None or nodes.node_rank == 0
    if head:
        check_port(setup.host, setup.port)
    check_parsers(options.reasoning_parser, options.tool_call_parser, spell=lambda name: "--" + name.replace("_", "-"))
    src = checked_source(options.model, options.weights)  # a bad file fails here, before the server starts
    if head and not setup.profile_file:
        _say(plan_line(src, options))
    check_split(src, options)  # before the server starts, not in its loader
    config = options.engine_config()
    if not head:
        from flagdeploy.engine.lockstep import run_headless

        _say(f"flagdeploy: node {nodes.node_rank} of {nodes.nnodes}: joining {nodes.master_addr}:{nodes.master_port} ...")
        sys.exit(run_headless(src.path, src.format, config, options.chip, nodes))
    names = list(options.served_names) or [src.name]

    def ready(engine) -> str:
        _say(_held_line(engine.engine.model, config.device, options.tp * options.ep))
        return f"flagdeploy: serving {names[0]} on http://{setup.host}:{setup.port}/v1 (ready)"

    def on_node_failure(app) -> None:  # another node failed: not ready, with the reason, until node 0 exits
        from flagdeploy.engine.nodes import on_node_failure

        on_node_failure(app.state.engine_slot.fail)

    run_server(options, engine_loader(options, src, progress=True, nodes=nodes, config=config), names,
               host=setup.host, port=setup.port, log_level=setup.log_level,
               loading=f"flagdeploy: loading {src.path} ... (/ready answers 503 until done)", ready=ready,
               configure=on_node_failure if nodes is not None else None)


def _serve_onnx(options: ServeOptions, setup: ServeSetup) -> None:
    """The builtin server with the ONNX engine (flagdeploy/edge) in this process: --model a checkpoint
    (exported, int4, on first use) or a directory `flagdeploy export onnx` wrote."""
    from pathlib import Path

    from flagdeploy.edge.engine import build_onnx_engine, check_provider, provider_for_chip
    from flagdeploy.engine import AsyncEngine, EngineConfig

    check_port(setup.host, setup.port)
    check_provider(provider_for_chip(options.chip))  # a missing EP fails now, naming its package
    model = options.model
    exported = model is not None and (Path(model) / "flagdeploy-onnx.json").exists()
    names = list(options.served_names) or [Path(model).name if exported else checked_source(model).name]
    config = EngineConfig(max_model_len=options.max_model_len, max_num_seqs=options.max_num_seqs,
                          kv_cache_memory=options.kv_cache_memory)

    def load() -> AsyncEngine:
        return AsyncEngine(build_onnx_engine(model, config, chip=options.chip, weights="int4"))

    def ready(engine: AsyncEngine) -> str:
        return (f"flagdeploy: serving {names[0]} (onnxruntime, {engine.engine.decoder.ep}) on "
                f"http://{setup.host}:{setup.port}/v1 (ready)")

    run_server(options, load, names, host=setup.host, port=setup.port, log_level=setup.log_level, ready=ready,
               loading=f"flagdeploy: loading {model or names[0]} with onnxruntime (exported on first use) ... "
                       f"(/ready answers 503 until done)")


def _serve_gateway(options: ServeOptions, setup: ServeSetup, engine: str, entry: dict[str, Any] | None = None) -> None:
    """External engines (or --dp's builtin replicas) behind the gateway (flagdeploy/gateway): the models of
    --config's serve.yaml, or the one the options describe. `entry`: that model's serve.yaml entry, already
    built (--dp), used as given."""
    from flagdeploy.gateway import build_gateway, load_config, parse_config
    from flagdeploy.server import make_server

    host, port, given = setup.host, setup.port, setup.given
    top = {"api_key": options.api_key, "startup_timeout": setup.startup_timeout}
    if entry is not None:
        cfg = parse_config(top | {"models": [entry]}, "serve options")
    elif setup.config_file:
        if engine != "builtin" or setup.upstreams:
            raise ConfigError("--config describes every model; put the engine or upstreams in serve.yaml instead of "
                              "also passing --engine/--upstream")
        if options.media.profile_fields():
            raise ConfigError("--config describes every model; set limit_mm_per_prompt / allowed_media_domains on the "
                              "models of serve.yaml instead of passing --limit-mm-per-prompt / --allowed-media-domains")
        cfg = load_config(setup.config_file)
        host = host if "host" in given or not cfg.host else cfg.host
        port = port if "port" in given or not cfg.port else cfg.port
        updates: dict[str, Any] = {"api_key": options.api_key} if options.api_key is not None else {}
        if "startup_timeout" in given:
            updates["startup_timeout"] = setup.startup_timeout
        cfg = cfg.model_copy(update=updates)
    else:
        cfg = parse_config(top | {"models": [_model_entry(options, setup, engine)]}, "serve options")
    gateway = build_gateway(cfg)
    check_port(host, port)
    for pool in gateway.pools:
        _say(f"flagdeploy: {', '.join(pool.names) or '(names from the engine)'} -> {pool.engine} "
             f"{', '.join(u.url for u in pool.upstreams)}"
             + (f" (prefill: {', '.join(u.url for u in pool.prefill)})" if pool.prefill else ""))
    _say(f"flagdeploy: serving on http://{host}:{port}/v1 (/ready answers 503 until every engine is ready)")
    make_server(gateway, host, port, setup.log_level).run()


def _model_entry(options: ServeOptions, setup: ServeSetup, engine: str) -> dict[str, Any]:
    """The serve.yaml model entry of one attached (--upstream) or launched (--engine, with a --profile's
    fields) model; the command line wins over the profile."""
    if setup.upstreams and engine != "builtin":
        raise ConfigError(f"--upstream attaches engines that already run, --engine {engine} launches one; use one of "
                          f"them (or both kinds of model in a serve.yaml, --config)")
    model, given = options.model, setup.given
    entry: dict[str, Any] = {"names": list(options.served_names)}
    if setup.upstreams:
        entry |= {"engine": "upstream", "upstreams": list(setup.upstreams), "model": model}
        if setup.prefill_upstreams:
            entry["prefill_upstreams"] = list(setup.prefill_upstreams)
        if not options.served_names and model:
            entry["names"] = [model]  # and, where --model names local files, its template counts tokens
    else:
        entry |= {"engine": engine, "model": model, "chip": options.chip, "max_model_len": options.max_model_len}
        args: dict[str, Any] = {}
        if setup.profile_file:
            from flagdeploy.planner import Profile

            prof = dataclasses.asdict(Profile.load(setup.profile_file))
            entry["model"] = model or prof.pop("model")
            entry["chip"] = options.chip or prof.pop("chip")
            entry["max_model_len"] = options.max_model_len if "max_model_len" in given else prof["max_model_len"]
            if not options.served_names and prof.get("served_model_name"):
                entry["names"] = [prof["served_model_name"]]
            media_fields = {k: prof.pop(k) for k in ("limit_mm_per_prompt", "allowed_media_domains")}
            entry |= {k: v for k, v in media_fields.items() if v is not None}  # beside args, not in them
            args = {k: v for k, v in prof.items() if k not in ("model", "chip", "port")}
        if engine != "llama.cpp":  # profile fields; engines.yaml maps memory_utilization to each engine's flag
            args |= {name: getattr(options, name) for name in ("max_num_seqs", "max_num_batched_tokens",
                                                               "block_size", "memory_utilization") if name in given}
        entry["args"] = args
    return entry | options.media.profile_fields()  # the command line over a profile


def plan_line(src: "ModelSource", options: ServeOptions) -> str | None:
    """The planner's line for what is about to load: the replica's tp x ep devices of the chip (the one named
    by --chip, else the first catalog chip of the backend), in the planner's terms (the inverse of
    `Profile.builtin_layout`); None where there is no plan (it is advice: it never blocks serving). The
    weights are reported after loading (`_held_line`): what the backend holds depends on its kernels, not
    only on the checkpoint."""
    from flagdeploy import ops
    from flagdeploy.chips import all_chips, resolve_chip
    from flagdeploy.planner import PlanRequest, make_plan
    from flagdeploy.planner.cost import Layout
    from flagdeploy.planner.ledger import source_config
    from flagdeploy.planner.report import serve_line

    chip, tp, ep = options.chip, options.tp, options.ep
    try:
        choice = resolve_chip(chip) if chip else None
        backend = ops.get_backend(chip) if chip else ops.detect_backend()
        spec = choice.chip if choice and choice.chip else next(c for c in all_chips() if c.backend == backend.name)
        config = source_config(src)
        layout = Layout(tp=tp, dp=ep, ep=tp * ep if ep > 1 else 1)
        # a host CPU's memory is this machine's (the catalog's figure is nominal)
        host = round(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30, 1) if spec.backend == "cpu" else None
        plan = make_plan(PlanRequest(src.name, spec.id, tp * ep, max_model_len=options.max_model_len,
                                     concurrency=options.max_num_seqs, config=config, layout=layout,
                                     memory_utilization=options.memory_utilization, memory_gib=host))
        return f"flagdeploy: {serve_line(plan, options.kv_cache_memory)}"
    except (FlagdeployError, ValueError, KeyError, StopIteration, OSError) as exc:
        log.info("no plan for %s: %s", src.name, exc)
        return None


def _held_line(model, device: str, ranks: int) -> str | None:
    """The weights as loaded, by format (Q4 blocks, the backend's dense copy for many-row steps, an int8
    head, ...), measured from the model's tensors: the honest size of a quantized model."""
    from flagdeploy.planner.held import held_line, held_weights

    try:
        line = held_line(held_weights(model), device)
    except Exception as exc:  # noqa: BLE001 - a report: never take a loaded model down
        log.info("could not count the weights held: %r", exc)
        return None
    return f"flagdeploy: {line}" + (f", rank 0 of {ranks}" if ranks > 1 else "")


def check_port(host: str, port: int) -> None:
    """Refuse early if another process listens there. SO_REUSEADDR as uvicorn binds: the connections of a
    server that just died wait out TIME_WAIT (~60 s) on the port, and a plain bind took them for a listener
    (a --dp replica killed outright could then never be restarted)."""
    with socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind((host, port))
        except OSError as exc:
            raise FlagdeployError(f"cannot listen on {host}:{port} ({exc.strerror}). Another process (maybe another "
                                  f"`flagdeploy serve`) is using the port: stop it, or pass --port with a free port.") from None


def _say(line: str | None) -> None:
    if line:
        print(line, file=sys.stderr, flush=True)

"""The builtin server's one assembly (flagdeploy/assemble.py): ServeOptions in one vocabulary, whatever path
builds them (serve.yaml's builtin models with one replica or several; the CLI's flags are the same names)."""

from __future__ import annotations

import pytest

from flagdeploy.assemble import SERVE_FLAGS, ServeOptions
from flagdeploy.errors import ConfigError
from flagdeploy.gateway import parse_config
from flagdeploy.gateway.app import builtin_app
from flagdeploy.gateway.config import ConfigError as GatewayConfigError
from flagdeploy.gateway.launch import builtin_launch_plan

ARGS = {"max_model_len": 512, "kv_cache_memory": "64MiB", "max_num_seqs": 2, "tool_call_parser": "hermes",
        "reasoning_parser": "think", "request_timeout": 30, "max_tokens_policy": "clamp", "max_waiting": -1,
        "speculative_config": '{"method":"ngram","num_speculative_tokens":2}', "compile": False, "num_scheduler_steps": 8,
        "q8_activations": True}


def test_args_are_typed_once():
    options = ServeOptions.from_args(ARGS, model="m")
    assert options.kv_cache_memory == 64 << 20 and options.max_num_seqs == 2 and options.request_timeout == 30.0
    assert options.speculative.method == "ngram" and options.speculative.num_speculative_tokens == 2
    assert options.engine_config().num_scheduler_steps == 8 and ServeOptions().engine_config().num_scheduler_steps is None
    assert options.engine_config().q8_activations and not ServeOptions().engine_config().q8_activations
    assert options.engine_config().kv_cache_memory == 64 << 20 and options.engine_config().speculative.enabled
    assert ServeOptions.from_args({}).engine_config().max_model_len == ServeOptions().max_model_len


@pytest.mark.parametrize("args, match", [
    ({"cuda_graphs": False}, r"unknown args \['cuda_graphs'\]"),
    ({"reasoning_parser": "nope"}, "reasoning_parser"),
    ({"tool_call_parser": "nope"}, "tool_call_parser"),
    ({"tp": 0}, "tp: must be a whole number >= 1"),
    ({"compile": "yes"}, "compile: a switch"),
    ({"q8_activations": 1}, "q8_activations: a switch"),
    ({"kv_cache_memory": "lots"}, "kv_cache_memory"),
])
def test_bad_args_are_refused_naming_the_arg(args, match):
    with pytest.raises(ConfigError, match=match):
        ServeOptions.from_args(args)


def test_one_vocabulary_whatever_the_replicas(default_model):
    """The entry that K replicas take is taken in the gateway's process too, and the other way round."""
    one, two = parse_config({"models": [
        {"names": ["a"], "engine": "builtin", "model": str(default_model.path), "args": ARGS},
        {"names": ["b"], "engine": "builtin", "model": str(default_model.path), "replicas": 2, "args": ARGS},
    ]}).models
    assert builtin_app(one, None) is not None  # nothing loads until the app starts
    argv = builtin_launch_plan(two, 9100, 0).argv
    for name in ARGS:
        assert SERVE_FLAGS[name].replace("--", "--no-", 1) in argv if ARGS[name] is False else SERVE_FLAGS[name] in argv
    bad = parse_config({"models": [{"engine": "builtin", "model": str(default_model.path), "args": {"cuda_graphs": 1}}]})
    with pytest.raises(GatewayConfigError, match=r"unknown args \['cuda_graphs'\]"):
        builtin_app(bad.models[0], None)


def test_args_are_the_inverse_of_from_args():
    """`flagdeploy serve --dp K` writes its replicas' serve.yaml entry from ServeOptions (`args`); each
    replica reads the same options back, so a new option is added in one place."""
    kv = '{"kv_connector":"NixlConnector","kv_role":"kv_producer"}'
    for args in (ARGS, ARGS | {"kv_transfer_config": kv}, {}):
        options = ServeOptions.from_args(args, model="m")
        assert ServeOptions.from_args(options.args(), model="m") == options
    assert "request_timeout" not in ServeOptions().args() and "compile" not in ServeOptions().args()  # unset


def test_serve_flags_are_the_options_names(monkeypatch):
    """`flagdeploy serve`'s flags build the same ServeOptions (a new option reaches the engine from the CLI too)."""
    from click.testing import CliRunner

    from flagdeploy import serving
    from flagdeploy.cli import main

    seen = []
    monkeypatch.setattr(serving, "serve", lambda options, setup: seen.append(options))
    out = CliRunner().invoke(main, ["serve", "--q8-activations", "--num-scheduler-steps", "2"])
    assert out.exit_code == 0, out.output
    assert seen[0].engine_config().q8_activations and seen[0].num_scheduler_steps == 2
    assert not CliRunner().invoke(main, ["serve", "--no-q8-activations"]).exit_code and not seen[1].q8_activations

"""External engines behind our endpoint: launch and supervise them (vLLM, vLLM-Ascend, SGLang, MindIE,
llama.cpp) or attach running ones, balance replicas, proxy and normalise their OpenAI dialects, and
serve them beside the builtin model on one port. See docs/gateway.md."""

from __future__ import annotations

from .app import Gateway, ModelPool, build_gateway
from .config import ConfigError, ModelEntry, GatewayConfig, load_config, parse_config

__all__ = ["ConfigError", "Gateway", "ModelEntry", "ModelPool", "GatewayConfig", "build_gateway", "load_config",
           "parse_config"]

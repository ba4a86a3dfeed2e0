"""Client-side benchmarks and accuracy checks against any OpenAI-compatible endpoint (`flagdeploy bench`,
`flagdeploy eval`). Nothing here imports the engine: the same code measures our server, vLLM, SGLang,
vLLM-Ascend or MindIE, so the numbers are comparable across them.

Modules, one job each: `client` (endpoint checks, SSE parsing), `stats` (percentile / TTFT / TPOT / ITL
maths), `loadgen` (the asyncio load generator), `report` (table, CSV, JSON, plots), `prefix`
(prefix-cache evidence), `needle` (long-context retrieval), `baseline` (greedy baselines, perplexity).
"""

from flagdeploy.bench.client import BenchError, Endpoint

__all__ = ["BenchError", "Endpoint"]

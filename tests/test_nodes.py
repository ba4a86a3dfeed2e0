"""One replica across two "nodes" on loopback: node 0 in this process (rank 0 and its node's other
ranks), node 1 a separate headless process group, as `flagdeploy serve --nnodes 2 --node-rank 1` runs it,
all meeting through the store node 0 serves (gloo). The tokens equal one process's; a node that never
joins, or dies once serving, is named and node 0 stops instead of hanging."""

from __future__ import annotations

import multiprocessing as mp
import os
import signal
import subprocess
import sys
import time

import httpx
import pytest
from test_cli import _free_port, wait_ready
from test_tensor_parallel import PROMPTS
from test_tensor_parallel import _checkpoint as _llama_checkpoint

from flagdeploy import parallel
from flagdeploy.engine import EngineConfig, SamplingParams
from flagdeploy.engine.replica import build_llm_engine
from flagdeploy.engine.nodes import NodeGroup
from flagdeploy.errors import ModelLoadError
from flagdeploy.checkpoints.tiny_checkpoint import write_tiny_glm5_next


def _headless(path, config, nodes, codes) -> None:
    from flagdeploy.engine.lockstep import run_headless

    codes.put(run_headless(path, "safetensors", config, "cpu", nodes))


def _across_two_nodes(path, config: EngineConfig, prompts, params, timeout_s: float = 120.0):
    """Greedy tokens of `prompts` on a replica whose ranks are split over node 0 (here) and node 1 (a
    spawned headless node), and node 1's exit code once node 0 closes the engine."""
    nodes = NodeGroup(2, 0, "127.0.0.1", _free_port(), timeout_s)
    ctx = mp.get_context("spawn")
    codes = ctx.Queue()
    node1 = ctx.Process(target=_headless, args=(path, config, NodeGroup(2, 1, nodes.master_addr, nodes.master_port,
                                                                        timeout_s), codes))
    node1.start()
    try:
        engine = build_llm_engine(path, "safetensors", config, chip="cpu", progress=False, nodes=nodes)
        try:
            assert parallel.tp_size() * parallel.ep_size() == config.tp * config.ep
            assert len(engine.runner.workers.procs) == config.tp * config.ep // 2 - 1  # node 0's other ranks
            tokens = engine.generate(prompts, params)
        finally:
            engine.close()
        node1.join(timeout=60)
        return tokens, codes.get(timeout=5)
    finally:
        if node1.is_alive():
            node1.kill()


def test_llama_tensor_parallel_over_two_nodes_matches_one_process(tmp_path):
    """--tp 4 --nnodes 2: two ranks on each node, every TP collective crossing the node boundary."""
    _llama_checkpoint(tmp_path, 2, False)
    params = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)

    def config(tp: int) -> EngineConfig:
        return EngineConfig(max_model_len=128, max_num_seqs=4, max_num_batched_tokens=16, kv_cache_memory=4 << 20, tp=tp)

    want = build_llm_engine(tmp_path, "safetensors", config(1), chip="cpu", progress=False).generate(PROMPTS, params)
    got, code = _across_two_nodes(tmp_path, config(4), PROMPTS, params)
    assert got == want and code == 0


def test_glm5_next_tp_in_a_node_ep_across_nodes_matches_one_process(tmp_path):
    """--tp 2 --ep 2 --nnodes 2: each node holds one TP group (rank = ep_rank * tp + tp_rank), the routed
    experts split across the nodes (all-to-all over the boundary); chunked prefill across the KDA state."""
    path = write_tiny_glm5_next(tmp_path / "glm5")
    prompts = [[5, 9, 13, 22, 7, 31, 40, 3, 11, 17, 19, 23], [12, 14, 16]]
    params = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True)

    def config(tp: int, ep: int) -> EngineConfig:
        return EngineConfig(max_model_len=40, max_num_batched_tokens=5, block_size=4, kv_cache_memory=1 << 20, tp=tp,
                            ep=ep)

    want = build_llm_engine(path, "safetensors", config(1, 1), chip="cpu", progress=False).generate(prompts, params)
    got, code = _across_two_nodes(path, config(2, 2), prompts, params)
    assert got == want and code == 0


def test_a_node_that_never_joins_is_named_within_the_timeout(tmp_path):
    _llama_checkpoint(tmp_path, 2, False)
    nodes = NodeGroup(2, 0, "127.0.0.1", _free_port(), timeout_s=3)
    started = time.monotonic()
    with pytest.raises(ModelLoadError, match=r"node 1 \(ranks 2, 3\) did not join within 3 s"):
        build_llm_engine(tmp_path, "safetensors", EngineConfig(max_model_len=64, kv_cache_memory=1 << 20, tp=4),
                         chip="cpu", progress=False, nodes=nodes)
    assert time.monotonic() - started < 60
    assert parallel.tp_size() == 1


def test_layouts_that_do_not_spread_evenly_are_refused():
    with pytest.raises(ValueError, match="do not spread evenly over --nnodes 2"):
        NodeGroup(2, 0).check(3)
    with pytest.raises(ValueError, match="--node-rank 2 must be in 0..1"):
        NodeGroup(2, 2).check(4)


def _serve(*args: str) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "flagdeploy.cli", "serve", *args], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, start_new_session=True,
                            env={**os.environ, "PYTHONUNBUFFERED": "1"})


def test_serve_across_two_nodes_then_a_node_dies(tmp_path):
    """`flagdeploy serve --tp 2 --nnodes 2` on each "node" (one rank each): node 0 answers; node 1 is killed
    outright (SIGKILL to its whole process group); node 0 names it, /ready answers 503, and it exits
    within the --node-timeout instead of hanging."""
    _llama_checkpoint(tmp_path, 2, False)
    port, master = _free_port(), str(_free_port())
    common = ["--model", str(tmp_path), "--tp", "2", "--nnodes", "2", "--master-port", master, "--node-timeout", "20",
              "--max-model-len", "128", "--kv-cache-memory", "4MiB"]
    node0 = _serve(*common, "--node-rank", "0", "--port", str(port), "--served-model-name", "m")
    node1 = _serve(*common, "--node-rank", "1")
    try:
        url = wait_ready(node0, port)
        r = httpx.post(f"{url}/v1/completions", json={"model": "m", "prompt": "w5 w9", "max_tokens": 4,
                                                       "temperature": 0}, timeout=60)
        assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 4
        os.killpg(node1.pid, signal.SIGKILL)
        killed = time.monotonic()
        saw_503 = False
        while node0.poll() is None and time.monotonic() - killed < 60:
            try:
                ready = httpx.get(f"{url}/ready", timeout=2)
                saw_503 |= ready.status_code == 503 and "node 1" in ready.text
            except httpx.HTTPError:
                pass
            time.sleep(0.2)
        assert node0.poll() is not None, "node 0 kept running after node 1 died"
        assert time.monotonic() - killed < 20 + 15  # the timeout, the grace and the polling
        err = node0.stderr.read()
        assert "node 1 (rank 1)" in err and node0.returncode != 0
        assert saw_503
    finally:
        for proc in (node0, node1):
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(timeout=30)

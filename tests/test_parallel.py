"""The collectives on two CPU processes over gloo (the cpu backend's library): sums, gathers and
expert-style exchanges land where tensor and expert parallelism expect them; and the ascend backend's
library ("hccl") reached by name through the torch_npu stand-in."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch
import torch.multiprocessing as mp

from flagdeploy import ops, parallel

STANDINS = str(Path(__file__).parent / "standins")


def _worker(rank: int, init_method: str, results) -> None:
    ops.use_backend("cpu")
    assert parallel.init(rank, 2, init_method) == "gloo"
    x = torch.full((2, 3), float(rank + 1))
    results[f"reduce{rank}"] = parallel.all_reduce(x.clone()).tolist()
    results[f"gather{rank}"] = parallel.all_gather(torch.tensor([[rank, rank]]), dim=0).tolist()
    # rank r sends r+1 rows to rank 0 and 1 row to rank 1; each row says (sender, index)
    send = [rank + 1, 1]
    rows = torch.tensor([[rank, i] for i in range(sum(send))])
    recv = [[1, 2], [1, 1]][rank]  # what ranks 0 and 1 send to this rank
    results[f"a2a{rank}"] = parallel.all_to_all(rows, send, recv).tolist()
    torch.distributed.destroy_process_group()


def test_collectives_over_gloo(tmp_path):
    results = mp.Manager().dict()
    mp.spawn(_worker, args=(f"file://{tmp_path / 'rendezvous'}", results), nprocs=2, join=True)
    assert results["reduce0"] == results["reduce1"] == [[3.0] * 3] * 2
    assert results["gather0"] == results["gather1"] == [[0, 0], [1, 1]]
    assert results["a2a0"] == [[0, 0], [1, 0], [1, 1]]  # rank 0's first row, rank 1's first two
    assert results["a2a1"] == [[0, 1], [1, 2]]  # the row after them from each rank


def test_one_process_is_the_identity():
    x = torch.randn(3, 4)
    assert parallel.world_size() == 1
    assert parallel.all_reduce(x) is x and parallel.all_gather(x) is x and parallel.all_to_all(x, [3], [3]) is x


# ---- HCCL: tensor parallelism on the ascend backend, through the torch_npu stand-in -----------------------
# (here, not in test_ascend_backend.py: that module keeps the stand-in importable in this process, and
# transformers, finding a torch_npu, would then reach for NPU kernels the stand-in does not have)


def _hccl_rank(rank: int, init_method: str, path: str, ids: list[int], results) -> None:
    """One rank of a TP=2 llama on the ascend backend, through the stand-in, its collectives on "hccl"."""
    import torch.distributed as dist

    from flagdeploy.engine.replica import load_model
    from flagdeploy.tokenizer import Tokenizer

    # transformers looks for torch_npu's attention kernels once, when a tokenizer is first loaded: let it
    # find no torch_npu (the stand-in has no such kernels), then bring the stand-in in
    Tokenizer.from_source(Path(path), "safetensors")
    sys.path.insert(0, STANDINS)
    import torch_npu

    ops.use_backend("ascend")
    parallel.init_model_parallel(parallel.ParallelConfig(tp=2, ep=1), rank, init_method)
    results[f"library{rank}"] = dist.get_backend()
    model, _ = load_model(Path(path), "safetensors", torch.float32, "cpu", progress=False)
    model.prepare(64)  # the rope tables
    results[f"logits{rank}"] = model.score(torch.tensor(ids)).tolist()
    results[f"calls{rank}"] = dict(torch_npu.CALLS)
    parallel.shutdown()


def test_tensor_parallel_over_hccl_on_the_stand_in(tmp_path):
    """TP=2 on the ascend backend: the process group is created under the name torch_npu registers HCCL
    as ("hccl"; gloo behind it in the stand-in), each rank runs the Ascend overrides on its shard and the
    row-parallel sums and vocabulary gathers go through that group: both ranks' logits equal one process's
    on the cpu backend."""
    transformers = pytest.importorskip("transformers")
    from flagdeploy.engine.replica import load_model
    from flagdeploy.checkpoints.tiny_checkpoint import write_word_tokenizer

    cfg = transformers.LlamaConfig(vocab_size=211, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256)
    torch.manual_seed(0)
    transformers.AutoModelForCausalLM.from_config(cfg).save_pretrained(tmp_path / "m")
    write_word_tokenizer(tmp_path / "m", 211)
    ids = [5, 17, 42, 99, 3, 150, 7]
    results = mp.Manager().dict()
    mp.spawn(_hccl_rank, args=(f"file://{tmp_path / 'rendezvous'}", str(tmp_path / "m"), ids, results), nprocs=2,
             join=True)
    ops.use_backend("cpu")
    one, _ = load_model(tmp_path / "m", "safetensors", torch.float32, "cpu", progress=False)
    one.prepare(64)
    want = one.score(torch.tensor(ids))
    for rank in (0, 1):
        assert results[f"library{rank}"] == "hccl"
        calls = results[f"calls{rank}"]
        assert calls["ProcessGroupHCCL"] >= 1 and calls["npu_rms_norm"] > 0 and calls["npu_rotary_mul"] > 0, calls
        torch.testing.assert_close(torch.tensor(results[f"logits{rank}"]), want, atol=1e-4, rtol=1e-4)

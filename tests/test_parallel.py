"""The collectives on two CPU processes over gloo (the cpu backend's library): sums, gathers and
expert-style exchanges land where tensor and expert parallelism expect them."""

from __future__ import annotations

import torch
import torch.multiprocessing as mp

from flagdeploy import ops, parallel


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

"""The C++ decode step's packed weights in one mapping (backends/cpu/weight_arena.py): the same values, laid end
to end in the order the step reads them from a huge-page boundary, the originals released, and the step's
output unchanged."""

from __future__ import annotations

import weakref

import pytest
import torch
from conftest import make_engine

from flagdeploy.backends.cpu import llama_step, native, weight_arena
from flagdeploy.engine import SamplingParams


def test_move_lays_tensors_end_to_end_from_a_huge_page_boundary_and_releases_the_originals():
    g = torch.Generator().manual_seed(0)
    holders = [{"nib": torch.randint(0, 255, (3, 18, 4, 16, 4), dtype=torch.uint8, generator=g),
                "dm": torch.randn(3, 18, 2, 16, generator=g).half()},
               {"w8": torch.randint(-127, 127, (7, 5), dtype=torch.int8, generator=g),  # 35 bytes: padded to 64
                "d": torch.randn(56, generator=g)}]
    slots = [(h, k) for h in holders for k in h]
    before = [h[k].clone() for h, k in slots]
    gone = [weakref.ref(h[k]) for h, k in slots]
    weight_arena.move(slots)
    assert all(r() is None for r in gone), "an original is still held after its copy"
    ptrs = [h[k].data_ptr() for h, k in slots]
    assert ptrs[0] % weight_arena.HUGE_PAGE == 0
    for (h, k), want, ptr, nxt in zip(slots, before, ptrs, ptrs[1:] + [None]):
        got = h[k]
        assert got.dtype == want.dtype and got.shape == want.shape and got.is_contiguous() and torch.equal(got, want)
        assert ptr % 64 == 0 and got.untyped_storage().nbytes() == got.numel() * got.element_size()  # its own
        if nxt is not None:
            assert nxt == ptr + -(-got.numel() * got.element_size() // 64) * 64  # the next one right after it
    weight_arena.move([])  # nothing to move: nothing mapped
    empty = {"w": torch.empty(0, 576, dtype=torch.int8), "d": torch.ones(8)}
    weight_arena.move([(empty, "w"), (empty, "d")])  # an empty tensor stays as it is
    assert empty["w"].shape == (0, 576) and torch.equal(empty["d"], torch.ones(8))


@pytest.mark.skipif(not native.available(), reason="the cpu backend's kernels are not built here")
def test_the_default_models_step_reads_its_weights_in_order_from_one_arena_and_decodes_the_same(default_model,
                                                                                                monkeypatch):
    greedy = SamplingParams(max_tokens=16, temperature=0, ignore_eos=True)
    outputs = {}
    for arena in ("0", "1"):
        monkeypatch.setenv("FLAGDEPLOY_WEIGHT_ARENA", arena)
        engine = make_engine(default_model, "auto", compile=None, max_num_seqs=2, max_model_len=128)
        model = engine.runner.model
        assert engine.runner.native is not None
        lins = [m for layer in model.layers for m in llama_step._linears(layer)] + [model.lm_head]  # the step's order
        weights = [t for m in lins for k, t in m.qweight.prepared.items() if k in ("nib", "dm", "w8", "d")]
        ptrs = [t.data_ptr() for t in weights]
        in_order = all(b - a == -(-t.numel() * t.element_size() // 64) * 64 for a, b, t in zip(ptrs, ptrs[1:], weights))
        assert in_order == (arena == "1")
        prompts = [engine.tokenizer.encode(t) for t in ("The capital of France is", "def fib(n):")]
        outputs[arena] = engine.generate(prompts, greedy)
    assert outputs["1"] == outputs["0"]

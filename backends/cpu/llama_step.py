"""A llama-family model's whole decode step as one call into the cpu backend's C++ (csrc/llama_step.cpp).

The eager step of a small 4-bit model spends about a third of a lone stream's token in the interpreter
between its ~300 kernel calls, and the compiled step (`serve --compile`) takes a minute or two to build and
still pays dynamo's and its wrapper's per-call costs. The C++ step calls the same kernels in the same order
and dtypes, so its logits are the eager step's bit for bit, and it serves from the first request.

It is built only where the eager step would run exactly those kernels: one process (no tensor parallel),
every linear and the head laid out for the backend's int4 or int8 kernel, a 16-bit KV cache those kernels
feed, and float norms of the residual stream's dtype. A step is served by it when its rows are few enough for
the packed kernels (`packed_max_m`) and its block tables short enough for the native attention kernel
(`native_max_keys`), the eager step's own thresholds; other steps run eagerly. A prompt of up to `prompt_max_keys`
tokens (tune.yaml) is such a step too, its tokens decode rows (`takes_prompt`).
"""

from __future__ import annotations

import logging
import os
import sys

import torch

from flagdeploy import parallel

from . import native, weight_arena
from .ops import SERVE, TUNE

log = logging.getLogger(__name__)


class LlamaStep:
    def __init__(self, step, model, max_rows: int, head_rows: int, max_keys: int, block_size: int,
                 prompt_max_keys: int = 0, default_steps: int = 1):
        """max_rows / head_rows: the most rows the layers' / the head's packed kernels take; max_keys: the
        most cache slots a row's table may span for the native attention kernel; prompt_max_keys: see
        `takes_prompt`; default_steps: the engine's decode steps per call of `run_steps` where
        --num-scheduler-steps is not given (tune.yaml's `serve`)."""
        self._step, self.max_rows, self.max_keys, self.block_size = step, max_rows, max_keys, block_size
        self._head, self._head_rows, self._vocab = model.lm_head, head_rows, model.cfg.vocab_size
        self.prompt_max_keys, self.default_steps = prompt_max_keys, default_steps

    def serves(self, rows: int, width: int, verify: bool = False) -> bool:
        """Whether a decode step of `rows` rows (sequences, or a verify step's tokens) with block tables `width`
        wide runs here. A verify step's rows (drafts, a prompt's tokens) take the packed kernels at any count in the
        eager step too (backends/cpu/ops.py: the kernels are row-invariant), so `max_rows` does not bound them."""
        return (rows <= self.max_rows or verify) and width * self.block_size <= self.max_keys

    def takes_prompt(self, tokens: int) -> bool:
        """Whether the prompt tokens of a sequence of `tokens` tokens run as decode rows (each over its own keys
        in the cache, as a verify step's rows do) rather than as a prefill. As rows, a prompt computes the same
        whether it arrives whole, in chunks or after a prefix-cache hit, and a short prompt or a cached prompt's
        last few tokens run here instead of as an eager prefill of ~300 kernel calls from Python (a 134-token
        prompt of which 128 were cached: 30 ms to its first token, against 5 ms a decode row). Up to
        `prompt_max_keys` tokens (tune.yaml): past them the native kernel's rows, each over its own keys, cost more
        than torch's fused causal attention, and where linears keep a dense copy (bf16 for oneDNN / AMX) the copy's
        matmuls beat the packed kernels at a prompt's many rows."""
        return tokens <= self.prompt_max_keys

    def run(self, ids: list[int], positions: list[int], slots: list[int], tables: list[list[int]],
            ctx: list[int], verify: bool = False, logits_rows: list[int] | None = None) -> torch.Tensor:
        """Logits [len(logits_rows), vocab] (float32; None: every row) of n decoding rows, their new k/v written
        to the caches. A speculative verify step's rows (a sequence's last token and its drafts, each with its own
        context length) keep the head's packed kernel at any row count, as the eager step's verify mode does: the
        kernel is row-invariant, so each row's logits are a plain decode row's, bit for bit."""
        rows, padded = step_inputs(ids, positions, slots, tables, ctx)
        out = torch.tensor([] if logits_rows is None else logits_rows, dtype=torch.int64)
        if logits_rows == []:  # a prompt's chunk short of its end: its k/v only
            self._step.step(rows, padded, False, out)
            return torch.empty(0, self._vocab)
        if (len(ids) if logits_rows is None else len(logits_rows)) <= self._head_rows or verify:
            return self._step.step(rows, padded, True, out)
        # the head's dense copy, as the eager step calls it
        return self._head(self._step.step(rows, padded, False, out))[..., : self._vocab].float()

    def serves_steps(self, rows: int, width: int) -> bool:
        """Whether `run_steps` takes `rows` sequences with tables `width` wide: each of its steps is a decode step of
        at most that many rows, with every row's logits from the head's packed kernel, as `run` gives them."""
        return self.serves(rows, width) and rows <= self._head_rows

    def run_steps(self, ids: list[int], positions: list[int], ctx: list[int], counts: list[int],
                  slots: list[list[int]], tables: list[list[int]], settings: tuple[torch.Tensor, ...],
                  uniforms: list[list[float]]) -> list[list[int]]:
        """Each row's next `counts[i]` tokens, decoding from `ids[i]` at `positions[i]` (context length `ctx[i]`) into
        `slots[i]`: one C++ call for several steps (csrc/llama_step.cpp `steps`). `settings`: the rows' temperature,
        top_k, top_p and min_p (sampler.row_settings); `uniforms[i]`: a sampled row's uniform at each of its steps,
        none for a greedy row."""
        first = torch.tensor([ids, positions, ctx, counts], dtype=torch.int64)
        most = max(counts)
        u = torch.tensor([row + [0.0] * (most - len(row)) for row in uniforms], dtype=torch.float64).T.contiguous()
        sampled = torch.tensor([bool(row) for row in uniforms])
        tokens = self._step.steps(first, _padded(slots), _padded(tables), *settings, sampled, u)
        return [row[:c] for row, c in zip(tokens.tolist(), counts)]


def step_inputs(ids: list[int], positions: list[int], slots: list[int], tables: list[list[int]],
                ctx: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
    """What csrc/llama_step.cpp's `step` takes for these rows: ids, positions, slots and context lengths as the
    rows of one int64 tensor [4, n], and the block tables padded with block 0 to the widest [n, W]."""
    return torch.tensor([ids, positions, slots, ctx], dtype=torch.int64), _padded(tables)


def _padded(rows: list[list[int]]) -> torch.Tensor:
    """Lists of int64 (block tables, a row's slots) as one tensor, padded with 0 to the longest."""
    width = max(len(r) for r in rows)
    return torch.tensor([r + [0] * (width - len(r)) for r in rows], dtype=torch.int64)


def _pieces(lin) -> list[dict] | None:
    """The prepared bundles of a Linear the C++ step can run (one, or a PiecewiseWeight's pieces), else None."""
    prepared = [getattr(b, "prepared", None) for b in lin.bundles()]
    return prepared if prepared and all(p is not None and ("nib" in p or "w8" in p) for p in prepared) else None


def _packed_keys(p: dict) -> tuple[str, str]:
    """A prepared bundle's packed weight and scales: the int4 kernel's (nib, dm) or the int8 kernel's (w8, d)."""
    return ("nib", "dm") if "nib" in p else ("w8", "d")


def _linear(lin) -> list[torch.Tensor]:
    """What the C++ step takes of a Linear: each piece's packed weight and scales, then its bias (or an empty
    tensor)."""
    return [p[key] for p in _pieces(lin) for key in _packed_keys(p)] + [lin.bias if lin.bias is not None else torch.empty(0)]


def _linears(layer) -> tuple:
    """A layer's linears in the order csrc/llama_step.cpp takes them."""
    return layer.qkv_proj, layer.o_proj, layer.gate_up_proj, layer.down_proj


def _why_not(model, kv_caches) -> str | None:
    """Why the C++ step cannot reproduce this model's eager step (None: it can)."""
    from flagdeploy.models.llama import LlamaForCausalLM

    if type(model) is not LlamaForCausalLM:
        return f"{type(model).__name__} is not the llama family"
    if parallel.tp_size() > 1:
        return "tensor parallel"
    if not native.available():
        return "the backend's kernels are not built"
    dtype = model.embed_tokens.dtype
    norms = [model.norm] + [n for layer in model.layers for n in (layer.input_norm, layer.post_norm)]
    if dtype not in (torch.float32, torch.bfloat16) or any(n.dtype != dtype for n in norms):
        return "norms not in the residual stream's float dtype"
    if any(c.dtype != torch.bfloat16 or not c.is_contiguous() for kv in kv_caches for c in kv):
        return "the KV cache is not the packed kernels' bf16"
    if any(_pieces(m) is None for m in _all_linears(model)):
        return "a linear is not laid out for the backend's int4 / int8 kernels"
    return None


def _all_linears(model) -> list:
    """The head, then each layer's linears: the order of the C++ step's piece counts."""
    return [model.lm_head, *(m for layer in model.layers for m in _linears(layer))]


def _tensors(model, kv_caches) -> list[torch.Tensor]:
    """What csrc/llama_step.cpp's constructor takes: embedding, final norm, head, rope tables, then per layer its
    two norms, qkv / o / gate_up / down and its k and v caches (a linear: `_linear`)."""
    out = [model.embed_tokens.data, model.norm.data, *_linear(model.lm_head), model.rope_cos, model.rope_sin]
    for layer, (k, v) in zip(model.layers, kv_caches):
        out += [layer.input_norm.data, layer.post_norm.data]
        for m in _linears(layer):
            out += _linear(m)
        out += [k, v]
    return out


def dims(model) -> list[int]:
    """What csrc/llama_step.cpp's constructor takes beside the tensors: 4 sizes, the packed linears' activation parts
    (`ops.q8_activations`: one setting for the whole model), then each linear's piece count."""
    cfg, layer = model.cfg, model.layers[0]
    parts = {p.get("parts", 2) for m in _all_linears(model) for p in _pieces(m) if "nib" in p or "w8" in p} or {2}
    assert len(parts) == 1, "the packed linears disagree on their activation parts"
    return [layer.heads, layer.kv_heads, cfg.head_dim, cfg.vocab_size, *parts,
            *(len(_pieces(m)) for m in _all_linears(model))]


def build(model, kv_caches: list, block_size: int) -> LlamaStep | None:
    """The C++ decode step of `model` over its runner's caches, or None (logged) where it would not compute
    what the eager step computes."""
    reason = _why_not(model, kv_caches)
    if reason:
        log.info("no C++ decode step for this model (%s): the eager or compiled step serves", reason)
        return None
    if os.environ.get("FLAGDEPLOY_WEIGHT_ARENA", "1") != "0":
        _into_one_arena(model)
    cfg, layer = model.cfg, model.layers[0]
    max_rows = min(_packed_rows(m) for x in model.layers for m in _linears(x))
    step = torch.classes.flagdeploy_cpu.LlamaStep(_tensors(model, kv_caches), dims(model), cfg.rms_norm_eps, layer.scale)
    head_rows = _packed_rows(model.lm_head)
    attention = TUNE["paged_attention_decode"]
    return LlamaStep(step, model, max_rows, head_rows, attention["native_max_keys"], block_size,
                     min(attention.get("prompt_max_keys", 0), attention["native_max_keys"]),
                     SERVE.get("num_scheduler_steps", 1))


def _into_one_arena(model) -> None:
    """The packed weights moved into one mapping in the order the step reads them: each layer's linears, then the
    head (weight_arena.py: the eager step reads the same copies)."""
    lins = [m for layer in model.layers for m in _linears(layer)] + [model.lm_head]
    weight_arena.move([(p, key) for m in lins for p in _pieces(m) for key in _packed_keys(p)])


def _packed_rows(lin) -> int:
    """The most rows the eager step sends to this linear's packed kernels: `packed_max_m`, or every count where the
    pieces keep no dense copy (tune.yaml's `dense_copy`)."""
    return min(TUNE["linear_w4a16" if "nib" in p else "linear_w8a16"]["packed_max_m"] if "dense" in p else sys.maxsize
               for p in _pieces(lin))

"""A linear layer whose weight may be dense or a quantized bundle, possibly fused from several parts,
possibly one rank's slice of a tensor-parallel layer."""

from __future__ import annotations

import itertools

import torch
from torch import nn

from flagdeploy import ops, parallel
from flagdeploy.parallel import Shard
from flagdeploy.ops.weights import Fp8BlockWeight, Int4Weight, Int8Weight, PiecewiseWeight, W8A8Weight

# Which op runs a weight: by the bundle's type (a W8A8 bundle also quantises the activations).
_OP = {Int4Weight: "linear_w4a16", Int8Weight: "linear_w8a16", W8A8Weight: "linear_w8a8_dynamic",
       Fp8BlockWeight: "linear_fp8_block"}


class Linear(nn.Module):
    """y = x W^T (+ b). `parts` names the checkpoint tensors fused into W, in row order (q, k, v).

    Parts arrive one by one from a loader (`load_part`); `finalize` joins them and hands quantized
    bundles to the active backend to lay out. Mixed dense/quantized parts are joined dense; quantized parts of
    different layouts as pieces (`PiecewiseWeight`) where the backend runs every piece's layout natively
    (`packed_weights`), else dense.

    Under tensor parallelism `out_features` / `in_features` are this rank's, and `shards` says which
    slice of each checkpoint part this rank keeps: rows (column-parallel: q/k/v heads, gate/up) or
    columns (row-parallel: o_proj, down_proj; the partial outputs are then summed over the TP group by
    `linear_all_reduce`, and the bias is added once, after the sum). `gather` concatenates the
    column-parallel outputs of all ranks (the LM head's vocabulary shards).
    """

    def __init__(self, out_features: int, in_features: int, dtype: torch.dtype, parts: tuple[str, ...],
                 bias: bool = False, shards: dict[str, Shard | None] | None = None, gather: bool = False,
                 part_rows: dict[str, int] | None = None):
        super().__init__()
        self.out_features, self.in_features, self.dtype = out_features, in_features, dtype
        self.parts = parts
        self.part_rows = dict(part_rows or {})  # fused parts' whole checkpoint row counts, where they differ
        self.weight: torch.Tensor | None = None
        self.qweight: Int4Weight | Int8Weight | W8A8Weight | Fp8BlockWeight | PiecewiseWeight | None = None
        self.bias: torch.Tensor | None = None
        self.has_bias = bias
        self.shards = {p: s for p, s in (shards or {}).items() if s is not None}
        self.reduce = any(s.dim == 1 for s in self.shards.values())
        self.gather = gather and parallel.tp_size() > 1
        self._pending: dict[tuple[str, str], object] = {}
        self._op = "linear"

    def load_part(self, part: str, kind: str, value) -> None:
        """kind is 'weight' or 'bias'; value a tensor or a quantized weight bundle (a full checkpoint
        tensor, or already this rank's slice of it)."""
        shard = self.shards.get(part)
        if shard is not None and (kind == "weight" or shard.dim == 0):
            if not isinstance(value, torch.Tensor):  # quantized bundles are split dense (documented)
                value = value.dequantize(self.dtype)
            value = shard.take(value) if kind == "weight" else Shard(0, shard.start, shard.length, shard.full).take(value)
        self._pending[(part, kind)] = value

    def finalize(self) -> None:
        ws = [self._pending.pop((p, "weight")) for p in self.parts]
        if self.has_bias:
            self.bias = torch.cat([self._pending.pop((p, "bias")).to(self.dtype) for p in self.parts])
        layouts = {(type(w), getattr(w, "group_size", None)) for w in ws}
        q = None
        if len(layouts) == 1 and type(ws[0]) in _OP:
            try:
                q = ws[0] if len(ws) == 1 else type(ws[0]).cat(ws)
            except ValueError:  # parts that cannot share one layout are joined dense below
                q = None
        if q is None and len(ws) > 1 and all(_OP.get(type(w)) in ops.active_backend().packed_weights for w in ws):
            q = _pieces(ws)
        if isinstance(q, PiecewiseWeight):
            self._op = "pieces"
            self.qweight = PiecewiseWeight([ops.prepare_weight(_OP[type(p)], p) for p in q.pieces])
        elif q is None:
            dense = [w.to(self.dtype) if isinstance(w, torch.Tensor) else w.dequantize(self.dtype) for w in ws]
            self.weight = dense[0] if len(dense) == 1 else torch.cat(dense)
            short = self.out_features - self.weight.shape[0]
            if self.gather and short > 0:  # the last vocabulary shard: zero rows up to the common width
                self.weight = torch.cat([self.weight, self.weight.new_zeros(short, self.weight.shape[1])])
            self.weight = ops.prepare_weight("linear", self.weight)
        else:
            self._op = _OP[type(q)]
            self.qweight = ops.prepare_weight(self._op, q)
        shape = (self.out_features, self.in_features)
        got = (self.qweight.out_features, self.qweight.in_features) if q is not None else tuple(self.weight.shape)
        if got != shape:
            raise ValueError(f"fused weight {'+'.join(self.parts)} has shape {got}, the config implies {shape}")

    def bundles(self) -> list:
        """The quantized bundles this linear runs: none (a dense weight), its one, or a PiecewiseWeight's pieces."""
        if self.qweight is None:
            return []
        return list(self.qweight.pieces) if isinstance(self.qweight, PiecewiseWeight) else [self.qweight]

    def part_shape(self, part: str) -> tuple[int, int] | None:
        """A checkpoint part's [out, in] (the whole tensor, not this rank's slice), where it is known
        (one part, or fused parts whose row counts were given)."""
        if len(self.parts) != 1:
            return (self.part_rows[part], self.in_features) if part in self.part_rows else None
        shard = self.shards.get(part)
        if shard is None:
            return self.out_features, self.in_features
        return (shard.full, self.in_features) if shard.dim == 0 else (self.out_features, shard.full)

    def init_random(self, gen: torch.Generator, std: float = 0.02, device: torch.device | str = "cpu") -> None:
        """Random weights of the right shape instead of loaded parts (`--load-format dummy`); `gen` is a
        CPU generator, so the weights are the same whatever the device."""
        self._pending.clear()
        w = torch.randn(self.out_features, self.in_features, generator=gen, device="cpu") * std
        self.weight = w.to(device=device, dtype=self.dtype)
        self.bias = torch.zeros(self.out_features, dtype=self.dtype, device=device) if self.has_bias else None

    def quantize_int8(self) -> None:
        """Re-store a dense weight as per-channel int8 (used for lm_head in the quantized weight format); one loaded
        quantized (a GGUF's Q6_K head, `gguf_reader.HEAD_AS_STORED`) stays as the file holds it."""
        if self.qweight is not None:
            return
        q = Int8Weight.quantize(self.weight)
        self.weight, self._op = None, "linear_w8a16"
        self.qweight = ops.prepare_weight(self._op, q)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.reduce:
            return self._row_parallel(x)
        if self.qweight is None:  # a dense layer after a 16-bit one gets its input in its own dtype
            y = ops.linear(x.to(self.weight.dtype), self.weight, self.bias)
        elif self._op == "pieces":  # the bias after the join, as one bundle's op adds it (csrc/llama_step.cpp too)
            y = torch.cat([getattr(ops, _OP[type(p)])(x, p, None) for p in self.qweight.pieces], dim=-1)
            y = y + self.bias.to(y.dtype) if self.bias is not None else y
        else:
            y = getattr(ops, self._op)(x, self.qweight, self.bias)
        return parallel.all_gather(y, dim=-1, group=parallel.tp_group()) if self.gather else y

    def _row_parallel(self, x: torch.Tensor) -> torch.Tensor:
        group = parallel.tp_group()
        if self.qweight is None:
            return ops.linear_all_reduce(x.to(self.weight.dtype), self.weight, self.bias, group)
        y = ops.all_reduce(getattr(ops, self._op)(x, self.qweight, None), group)
        return y + self.bias.to(y.dtype) if self.bias is not None else y


def _pieces(ws: list) -> PiecewiseWeight | None:
    """Quantized parts as pieces: each run of parts of one layout joined (q and k), None where a run cannot be."""
    pieces = []
    for _, run in itertools.groupby(ws, key=lambda w: (type(w), getattr(w, "group_size", None))):
        run = list(run)
        try:
            pieces.append(run[0] if len(run) == 1 else type(run[0]).cat(run))
        except ValueError:
            return None
    return PiecewiseWeight(pieces)


def column_parallel(parts: dict[str, int], in_features: int, dtype: torch.dtype, bias: bool = False,
                    shards: dict[str, Shard | None] | None = None, what: str = "") -> Linear:
    """Output rows split over the TP group, each part (q, k, v / gate, up) on its own: `parts` maps each
    part to its full row count; `shards` overrides a part's slice (GQA key/value heads)."""
    shards = dict(shards or {})
    for p, rows in parts.items():
        if p not in shards:
            shards[p] = parallel.tp_shard(rows, 0, what or p)
    out = sum(s.length if s is not None else parts[p] for p, s in ((p, shards[p]) for p in parts))
    return Linear(out, in_features, dtype, tuple(parts), bias=bias, shards=shards, part_rows=parts)


def row_parallel(out_features: int, in_features: int, dtype: torch.dtype, part: str, bias: bool = False,
                 what: str = "") -> Linear:
    """Input features split over the TP group; the outputs are summed by `linear_all_reduce`."""
    shard = parallel.tp_shard(in_features, 1, what or part)
    local = shard.length if shard is not None else in_features
    return Linear(out_features, local, dtype, (part,), bias=bias, shards={part: shard})


def vocab_parallel_head(vocab: int, hidden: int, dtype: torch.dtype, part: str = "lm_head") -> Linear:
    """The LM head split by vocabulary rows; every rank ends with all logits (padded: trim to vocab)."""
    return Linear(parallel.padded_vocab(vocab), hidden, dtype, (part,), shards={part: parallel.vocab_shard(vocab)},
                  gather=True)


def vocab_parallel_embedding(ids: torch.Tensor, table: torch.Tensor, vocab: int) -> torch.Tensor:
    """Rows of the embedding for `ids` when each TP rank holds a slice of the vocabulary: every rank
    looks up what it holds, zeros the rest, and the sum over the group is the full lookup."""
    shard = parallel.vocab_shard(vocab)
    if shard is None:
        return ops.embedding(ids, table)
    local = ids - shard.start
    held = (local >= 0) & (local < shard.length)
    x = ops.embedding(local.clamp(0, table.shape[0] - 1), table) * held.unsqueeze(-1).to(table.dtype)
    return ops.all_reduce(x, parallel.tp_group())

"""Drafts from the model's own multi-token-prediction layer (`--speculative mtp`, GLM-5.3-Flash).

The MTP layer (models/glm5_next/mtp.py) at position i reads the target's final hidden state h_i and the
token t_{i+1} and predicts t_{i+2}. The engine hands over the target's hidden states as positions become
final (`observe`: a prompt chunk's rows, a decode's row, a verify step's last token and accepted drafts).
Before a step, `propose` runs one draft step for every ready sequence in fixed shapes (`DraftInputs`,
replayed as one CUDA graph on a GPU, one read back): the MTP layer over the positions observed since the
last draft (at most 1 + K: what a verify step makes final), writing its own per-token cache rows into the
engine's block pools, whose last row's argmax is draft 1; then K - 1 chain steps, each re-applying the
layer to its own block output and the previous draft one position further. The chain's positions lie past
the computed tokens (their blocks may not exist yet), so their rows go to two draft blocks per sequence
past the pool's own blocks, starting as a copy of the sequence's partly filled last block. A longer
backlog (a prompt) is first run through the layer in one packed forward (`_catch_up`).

Per sequence (`seq.draft_state`, an `MtpState`): how many positions the MTP cache holds, the hidden rows
observed past them, and the hidden row of its last cached position: with nothing new observed (drafted
for, then not scheduled), the draft step reruns that position, rewriting its rows with the same values.
Drafts are greedy (argmax); the target verifies them, so a wrong draft costs speed only.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from flagdeploy.errors import ConfigError
from flagdeploy.models.glm5_next import DraftInputs

from .cuda_graphs import BUCKETS, WIDTH_TOKENS, StepGraphs
from .speculative import Proposer

# observed hidden rows a sequence may hold before they are run through the MTP layer at once (a long prompt,
# or a sequence that is not drafted for: grammar / logprobs requests, batches above max_batch_rows)
MAX_PENDING_ROWS = 512


@dataclass
class MtpState:
    """One sequence's MTP bookkeeping: positions [0, cached) are in the MTP cache; `pending` holds the
    target's hidden rows of positions cached, cached + 1, ...; `last` the one of position cached - 1."""

    cached: int = 0
    pending: list[torch.Tensor] = field(default_factory=list)
    num_pending: int = 0
    last: torch.Tensor | None = None
    broken: bool = False  # a gap in the observed positions: no drafts until the sequence restarts


def check_mtp_model(model) -> None:
    """Refuse, with what to do instead, a model `--speculative mtp` cannot draft for."""
    if getattr(model, "mtp", None) is None:
        name = type(model).__name__
        raise ConfigError(f"--speculative mtp needs the model's own MTP draft layer loaded, and {name} has none "
                         "(GLM-5.3-Flash checkpoints ship one: load it through build_llm_engine / flagdeploy serve "
                         "with --speculative mtp, which attaches it). Serve with --speculative ngram or off.")


class MtpForwards:
    """The MTP layer's two forwards on one rank's caches: `catch_up` (a packed forward over a backlog) and
    `draft` (the fixed-shape draft step). Rank 0's proposer decides what to run; in a tensor / expert-parallel
    replica every rank holds its shard of the layer and its own pools, and runs the same call with the same
    plain inputs (engine/lockstep.py `LockstepRunner.call_everywhere`), since the layer's collectives need
    every rank. Inputs are host lists plus one hidden-state tensor, so they travel as they are."""

    def __init__(self, model, runner):
        pools = getattr(runner, "pools", None)
        if pools is None or model.cfg.num_layers not in pools:
            raise ValueError("--speculative mtp: the runner's cache pools have no rows for the MTP layer (the model's "
                             "MTP layer must be attached before the runner is built).")
        self.model, self.layer = model, model.mtp
        self.pool = pools[model.cfg.num_layers]  # the MTP layer's entry of the engine's pools
        self.k = runner.group - 1
        self.graphs = StepGraphs(self._step) if getattr(runner, "graphs", None) is not None else None

    @property
    def device(self) -> torch.device:
        return self.model.embed_tokens.device

    def catch_up(self, ids: list[int], spans: list[tuple[int, int, int]], tables: list[list[int]],
                 hidden: torch.Tensor) -> None:
        """The layer over packed rows (sequence i: rows spans[i][0]:spans[i][1], its cache holding spans[i][2]
        positions in the blocks of tables[i]), writing their cache rows; nothing comes back."""
        dev = self.device
        caches = [self.layer.paged_cache(self.pool, table, span[2]) for table, span in zip(tables, spans)]
        with torch.inference_mode():
            self.layer.forward_packed(self.model, torch.tensor(ids, device=dev), hidden.to(dev), spans, caches, [])

    def draft(self, key: tuple[int, int], graphed: bool, ints: list[int], hidden: torch.Tensor) -> torch.Tensor:
        """Drafts [B, K] of one draft step (`DraftInputs` packed as `ints`, key = (B, table width)). `hidden`
        holds only the observed rows; the last len(hidden) entries of `ints` are the catch-up rows they fill
        (the others stay zero), so one host-to-device copy carries every index."""
        dev = self.device
        b, _ = key
        with torch.inference_mode():
            flat = torch.tensor(ints, dtype=torch.int64).to(dev)
            flat, at = flat[: -hidden.shape[0]], flat[-hidden.shape[0]:]
            h = torch.zeros(b * (self.k + 1), self.model.cfg.hidden_size, dtype=self.model.dtype, device=dev)
            h.index_copy_(0, at, hidden.to(dev, h.dtype))
            return self.graphs.run(key, flat, h) if graphed else self._step(key, flat, h)

    def _step(self, key: tuple[int, int], ints: torch.Tensor, hidden: torch.Tensor) -> torch.Tensor:
        """The draft step on its flat inputs (the graph's static buffers): `DraftInputs` views, then the layer."""
        b, width = key
        depth, k = self.k + 1, self.k
        r = b * depth
        parts = ints.split([r, r, r * width, r, b, b, b, (k - 1) * b, (k - 1) * b, b * width])
        ids, slots, tables, ctx, last, src, dst, cslots, cctx, ctables = parts
        d = DraftInputs(ids, hidden, slots, tables.view(r, width), ctx, last, src, dst, cslots.view(k - 1, b),
                        cctx.view(k - 1, b), ctables.view(b, width))
        return self.layer.draft(self.model, self.pool, d)


class MtpProposer(Proposer):
    needs_hidden = True

    def __init__(self, model):
        check_mtp_model(model)
        self.model = model
        self.forwards: MtpForwards | None = None
        self.others = None  # a parallel replica's: runs the same forward on the other ranks first

    @property
    def graphs(self) -> StepGraphs | None:
        return self.forwards.graphs if self.forwards is not None else None

    def bind(self, runner) -> None:
        """Take the runner's pools (the MTP layer's per-token rows live in `pools[num_layers]`, its draft
        blocks after the runner's own and scratch blocks), K and CUDA graphs; with a `LockstepRunner`, its
        way to run each forward on every rank."""
        self.forwards = MtpForwards(self.model, runner)
        self.k, self.block_size, self.scratch = self.forwards.k, runner.block_size, runner.scratch_block
        self.draft_blocks = runner.scratch_block + 1
        if not 1 <= self.k <= self.block_size:
            raise ConfigError(f"--speculative mtp drafts 1 to block-size ({self.block_size}) tokens per step, "
                             f"not {self.k}: set --num-speculative-tokens in that range.")
        self.others = getattr(runner, "call_everywhere", None)

    def _run(self, name: str, *args):
        """`MtpForwards.<name>(*args)` here, and on every other rank of a parallel replica."""
        if self.others is not None:
            self.others(f"mtp.{name}", args)
        return getattr(self.forwards, name)(*args)

    # ---- the engine's calls ---------------------------------------------------------------------------

    def observe(self, seq, start: int, hidden: torch.Tensor) -> None:
        st = seq.draft_state
        if start == 0 or not isinstance(st, MtpState):
            st = seq.draft_state = MtpState(broken=start != 0)
        if st.broken or hidden.shape[0] == 0:
            return
        if start != st.cached + st.num_pending:  # a gap (or a step back, never made by the engine)
            st.broken = True
            return
        with torch.inference_mode():
            st.pending.append(hidden.detach().clone())
        st.num_pending += hidden.shape[0]
        if st.num_pending >= MAX_PENDING_ROWS:
            self._catch_up([seq])

    def propose(self, seqs: list, limits: list[int]) -> list[list[int]]:
        out: list[list[int]] = [[] for _ in seqs]
        ready = []
        for i, (seq, k) in enumerate(zip(seqs, limits)):
            st = seq.draft_state
            # every position before the last token has its hidden state: the MTP layer can reach the end
            if (k > 0 and isinstance(st, MtpState) and not st.broken and st.cached + st.num_pending == seq.num_tokens - 1
                    and st.cached + st.num_pending > 0):
                ready.append(i)
        if not ready:
            return out
        group = [seqs[i] for i in ready]
        self._catch_up([seq for seq in group if seq.draft_state.num_pending > self.k + 1])
        for i, drafts in zip(ready, self._draft(group)):
            out[i] = drafts[: limits[i]]
        return out

    def release(self, seq) -> None:
        seq.draft_state = None

    # ---- prefill-decode disaggregation (engine/kv_transfer.py) -----------------------------------------

    def export_state(self, seq) -> tuple[list[torch.Tensor], dict]:
        """What a decode instance needs to draft from its first step: the MTP cache rows of every prompt
        position (run now, into the blocks that travel) and the hidden row of the last one."""
        st = seq.draft_state
        if isinstance(st, MtpState) and not st.broken and st.num_pending:
            self._catch_up([seq])
        if not isinstance(st, MtpState) or st.broken or st.last is None:
            return [], {"mtp_cached": None}
        return [st.last.reshape(1, -1)], {"mtp_cached": st.cached}

    def state_shapes(self, meta: dict) -> list[tuple[tuple[int, ...], torch.dtype]]:
        return [] if meta.get("mtp_cached") is None else [((1, self.model.cfg.hidden_size), self.model.dtype)]

    def import_state(self, seq, tensors: list[torch.Tensor], meta: dict) -> None:
        if meta.get("mtp_cached") is not None:
            seq.draft_state = MtpState(cached=meta["mtp_cached"], last=tensors[0][0].to(self.forwards.device))

    # ---- the MTP forwards -----------------------------------------------------------------------------

    def _catch_up(self, seqs: list) -> None:
        """Run the MTP layer over every pending position of `seqs` (one packed forward), writing its cache
        rows into the pools."""
        if not seqs:
            return
        ids: list[int] = []
        spans, tables, hidden = [], [], []
        for seq in seqs:
            st = seq.draft_state
            a = len(ids)
            ids.extend(seq.token_ids[st.cached + 1 : st.cached + st.num_pending + 1])  # t_{i+1} for each pending i
            spans.append((a, len(ids), st.cached))
            tables.append(list(seq.block_table))
            hidden.extend(st.pending)
        with torch.inference_mode():
            self._run("catch_up", ids, spans, tables, torch.cat(hidden))
        for seq in seqs:
            self._cached(seq.draft_state)

    @staticmethod
    def _cached(st: MtpState) -> None:
        st.last = st.pending[-1][-1] if st.pending else st.last
        st.cached += st.num_pending
        st.pending, st.num_pending = [], 0

    def _draft(self, seqs: list) -> list[list[int]]:
        """K drafts per sequence from one fixed-shape draft step (`DraftInputs`): the catch-up rows of its
        at most 1 + K pending positions (or its last cached one again), then the chain."""
        bs, depth, k, scratch = self.block_size, self.k + 1, self.k, self.scratch
        n = len(seqs)
        graphed = self.graphs is not None and n <= BUCKETS[-1]
        b = next(x for x in BUCKETS if x >= n) if graphed else n
        rows, fill, hidden = [], [], []  # rows: (id, slot, table, ctx) per catch-up row, sequence-major
        last, src, dst, chain, chain_tables = [], [], [], [], []
        for i in range(b):
            d0 = self.draft_blocks + 2 * i
            if i >= n:  # a padding sequence: scratch rows; its chain runs in its own draft blocks at position 0
                rows += [(0, scratch * bs, [scratch], 1)] * depth
                last.append(i * depth)
                src.append(scratch)
                dst.append(d0)
                chain.append([(d0 * bs + j, j + 1) for j in range(k - 1)])
                chain_tables.append([d0, d0 + 1])
                continue
            seq, st = seqs[i], seqs[i].draft_state
            first, count = (st.cached, st.num_pending) if st.num_pending else (st.cached - 1, 1)
            table = seq.block_table
            for p in range(first, first + count):
                rows.append((seq.token_ids[p + 1], table[p // bs] * bs + p % bs, table, p + 1))
            fill.extend(range(i * depth, i * depth + count))
            hidden.extend(st.pending if st.num_pending else [st.last[None]])
            rows += [(0, scratch * bs, [scratch], 1)] * (depth - count)
            last.append(i * depth + count - 1)
            p0 = seq.num_tokens - 1  # the chain's first position
            t0 = p0 // bs
            src.append(table[t0] if t0 < len(table) else scratch)
            dst.append(d0)
            chain_tables.append(list(table[:t0]) + [d0, d0 + 1])
            chain.append([(chain_tables[-1][(p0 + j) // bs] * bs + (p0 + j) % bs, p0 + j + 1) for j in range(k - 1)])
        need = max(len(t) for t in [r[2] for r in rows] + chain_tables)
        width = need if not graphed else next(w for w in (max(1, WIDTH_TOKENS // bs) * 4**e for e in range(16)) if w >= need)
        pad = lambda t: list(t) + [scratch] * (width - len(t))  # noqa: E731
        flat = ([r[0] for r in rows] + [r[1] for r in rows] + [x for r in rows for x in pad(r[2])] + [r[3] for r in rows]
                + last + src + dst + [c[j][0] for j in range(k - 1) for c in chain]
                + [c[j][1] for j in range(k - 1) for c in chain] + [x for t in chain_tables for x in pad(t)] + fill)
        with torch.inference_mode():
            out = self._run("draft", (b, width), graphed, flat, torch.cat(hidden))[:n].tolist()
        for seq in seqs:
            self._cached(seq.draft_state)
        return out

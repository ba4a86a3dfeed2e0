"""Drafts from the model's own multi-token-prediction layer (`--speculative mtp`, GLM-5.3-Flash).

The MTP layer (models/glm5_next/mtp.py) at position i reads the target's final hidden state h_i and the
token t_{i+1} and predicts t_{i+2}. The engine hands over the target's hidden states as positions become
final (`observe`: a prompt chunk's rows, a decode's row, a verify step's last token and accepted drafts).
Before a step, `propose` first catches the MTP layer up over the positions observed since its last call,
all sequences in one packed forward that writes the layer's own per-token cache (latent, indexer key and
gate) into the engine's block pools at those positions; the argmax of each sequence's last row is draft 1.
Drafts 2..K re-apply the layer to its own block output and the previous draft, one position further each
step, all sequences batched per step; those positions lie past the computed tokens (their blocks may not
exist), so the chain's cache rows stay in local tensors (`DraftTokenRows`) and are dropped afterwards.

Per sequence (`seq.draft_state`, an `MtpState`): how many positions the MTP cache holds, the hidden rows
observed past them, and the last catch-up's result (its block output and first draft), reused while no new
position arrives. Drafts are greedy (argmax); the target verifies them, so a wrong draft costs speed only.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from .speculative import Proposer

# observed hidden rows a sequence may hold before they are run through the MTP layer at once (a long prompt,
# or a sequence that is not drafted for: grammar / logprobs requests, batches above max_batch_rows)
MAX_PENDING_ROWS = 512


@dataclass
class MtpState:
    """One sequence's MTP bookkeeping: positions [0, cached) are in the MTP cache; `pending` holds the
    target's hidden rows of positions cached, cached + 1, ...; `last_x` / `first` are the block output and
    the argmax at position cached - 1 (the last catch-up's), None before the first one."""

    cached: int = 0
    pending: list[torch.Tensor] = field(default_factory=list)
    num_pending: int = 0
    last_x: torch.Tensor | None = None
    first: int | None = None
    broken: bool = False  # a gap in the observed positions: no drafts until the sequence restarts


def check_mtp_model(model) -> None:
    """Refuse, with what to do instead, a model / layout `--speculative mtp` cannot draft for."""
    from flagdeploy import parallel

    if getattr(model, "mtp", None) is None:
        name = type(model).__name__
        raise ValueError(f"--speculative mtp needs the model's own MTP draft layer loaded, and {name} has none "
                         "(GLM-5.3-Flash checkpoints ship one: load it through build_llm_engine / flagdeploy serve "
                         "with --speculative mtp, which attaches it). Serve with --speculative ngram or off.")
    if parallel.tp_size() * parallel.ep_size() > 1:
        raise ValueError("--speculative mtp runs with --tp 1 --ep 1 only for now; serve with --speculative ngram "
                         "or off, or on one rank.")


class MtpProposer(Proposer):
    needs_hidden = True

    def __init__(self, model):
        check_mtp_model(model)
        self.model, self.layer = model, model.mtp
        self.key = model.cfg.num_layers  # the MTP layer's entry of the engine's pools
        self.pool: dict[str, torch.Tensor] | None = None

    def bind(self, runner) -> None:
        """Take the runner's block pools (the MTP layer's per-token rows live in `pools[num_layers]`)."""
        pools = getattr(runner, "pools", None)
        if pools is None or self.key not in pools:
            raise ValueError("--speculative mtp: the runner's cache pools have no rows for the MTP layer (the model's "
                             "MTP layer must be attached before the runner is built).")
        self.pool = pools[self.key]

    # ---- the engine's calls ---------------------------------------------------------------------------

    def observe(self, seq, start: int, hidden: torch.Tensor) -> None:
        st = seq.draft_state
        if start == 0 or not isinstance(st, MtpState):
            st = seq.draft_state = MtpState(broken=start != 0)
        if st.broken or hidden.shape[0] == 0:
            return
        end = st.cached + st.num_pending
        if start > end:  # positions we never saw: the MTP cache cannot be completed
            st.broken = True
            return
        if start < end:  # the sequence went back (not expected from the engine): recompute from `start`
            if start < st.cached:
                st.cached, st.pending, st.num_pending, st.last_x, st.first = start, [], 0, None, None
            else:
                kept = torch.cat(st.pending)[: start - st.cached] if st.pending else None
                st.pending = [kept] if kept is not None and kept.shape[0] else []
                st.num_pending = start - st.cached
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
        self._catch_up([seqs[i] for i in ready if seqs[i].draft_state.num_pending])
        for i in ready:
            out[i] = [seqs[i].draft_state.first]
        self._chain([seqs[i] for i in ready], [limits[i] for i in ready], [out[i] for i in ready])
        return out

    def release(self, seq) -> None:
        seq.draft_state = None

    # ---- the MTP forwards -----------------------------------------------------------------------------

    def _device(self) -> torch.device:
        return self.model.embed_tokens.device

    def _catch_up(self, seqs: list) -> None:
        """Run the MTP layer over every pending position of `seqs` (one packed forward), writing its cache
        rows into the pools; keep each sequence's last block output and argmax."""
        if not seqs:
            return
        ids: list[int] = []
        spans, caches, hidden, last = [], [], [], []
        for seq in seqs:
            st = seq.draft_state
            a = len(ids)
            ids.extend(seq.token_ids[st.cached + 1 : st.cached + st.num_pending + 1])  # t_{i+1} for each pending i
            spans.append((a, len(ids), st.cached))
            caches.append(self.layer.paged_cache(self.pool, seq.block_table, st.cached))
            hidden.extend(st.pending)
            last.append(len(ids) - 1)
        dev = self._device()
        with torch.inference_mode():
            logits, x = self.layer.forward_packed(self.model, torch.tensor(ids, device=dev), torch.cat(hidden).to(dev),
                                                  spans, caches, last)
            first = logits.argmax(-1).tolist()
            for seq, row, tok in zip(seqs, last, first):
                st = seq.draft_state
                st.cached += st.num_pending
                st.pending, st.num_pending = [], 0
                st.last_x, st.first = x[row].clone(), tok

    def _chain(self, seqs: list, limits: list[int], drafts: list[list[int]]) -> None:
        """Drafts 2..limit of each sequence: the MTP layer on (its own last block output, the last draft)
        at the next position, all sequences that still want one batched per step, caches kept local."""
        steps = max(limits)
        if steps <= 1:
            return
        dev = self._device()
        caches = {i: self.layer.draft_cache(self.layer.paged_cache(self.pool, seq.block_table, seq.draft_state.cached))
                  for i, (seq, k) in enumerate(zip(seqs, limits)) if k > 1}
        xs = {i: seqs[i].draft_state.last_x for i in caches}
        with torch.inference_mode():
            for j in range(1, steps):
                active = [i for i in caches if limits[i] > j]
                if not active:
                    break
                spans = [(r, r + 1, seqs[i].draft_state.cached + j - 1) for r, i in enumerate(active)]
                ids = torch.tensor([drafts[i][-1] for i in active], device=dev)
                logits, x = self.layer.forward_packed(self.model, ids, torch.stack([xs[i] for i in active]), spans,
                                                      [caches[i] for i in active], list(range(len(active))))
                for r, (i, tok) in enumerate(zip(active, logits.argmax(-1).tolist())):
                    drafts[i].append(tok)
                    xs[i] = x[r]

"""The synchronous core: add requests, step, get outputs. One instance per model replica."""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field

import torch

from flagdeploy import ops
from flagdeploy.errors import ConfigError, PromptTooLongError
from flagdeploy.models import has_sequence_state
from flagdeploy.tokenizer import IncrementalDetokenizer, Tokenizer

from .block_manager import BlockManager
from .grammar import Matcher
from .kv_transfer import KvTransfer, KvTransferConfig, KvTransferError, layout_key
from .lockstep import LockstepRunner, Workers
from .model_runner import build_runner, take_rows
from .mtp import MtpProposer
from .multimodal import MediaItem
from .rejection import rejection_sample
from .sampler import adjust_logits, probs_for, row_settings, sample, uniform
from .request import RequestOutput, SamplingParams, TokenLogprob
from .scheduler import ScheduledBatch, Scheduler
from .sequence import Sequence
from .speculative import NgramProposer, Proposer, SpeculativeConfig

log = logging.getLogger(__name__)


def build_proposer(config: SpeculativeConfig, model=None) -> Proposer | None:
    """The drafter `config` asks for: prompt lookup (engine/speculative.py) or the model's own MTP layer
    (engine/mtp.py, attached when the model was loaded); None when the replica does not speculate."""
    if config.method == "ngram":
        return NgramProposer(config.prompt_lookup_min, config.prompt_lookup_max)
    if config.method == "mtp":  # GLM-5.3-Flash's draft layer
        return MtpProposer(model)  # refuses a model without an attached MTP layer
    return None


@dataclass
class EngineConfig:
    """The knobs of one replica. `kv_cache_memory` is in bytes; blocks = memory / bytes per block."""

    max_model_len: int = 4096
    max_num_seqs: int = 16
    max_num_batched_tokens: int = 512
    block_size: int = 16
    kv_cache_memory: int = 2 << 30
    dtype: torch.dtype = torch.float32
    weight_format: str = "auto"  # keep a GGUF's 4-bit weights packed where the backend can; or "dense"
    # the 4-bit linears' activations at llama.cpp's precision (one int8 a value) where the backend's kernels hold them
    # finer (--q8-activations; `Backend.q8_activations`)
    q8_activations: bool = False
    load_format: str = "auto"  # or "dummy": random weights from the config (benchmarks without a checkpoint)
    device: str = "cpu"
    cuda_graphs: bool = True  # replay decode steps as CUDA graphs where the device is a GPU (paged models)
    # run decode steps through torch.compile where no graph replays them (engine/compiled_step.py): True compiles
    # before the engine is returned, None on a thread while it serves eagerly (serve's default)
    compile: bool | None = False
    tp: int = 1  # tensor-parallel ranks of this replica (flagdeploy.parallel)
    ep: int = 1  # expert-parallel ranks of this replica
    speculative: SpeculativeConfig = field(default_factory=SpeculativeConfig)  # off unless asked (--speculative)
    # decode steps per engine step where the runner can take several in one call (vLLM's --num-scheduler-steps):
    # each sequence's tokens the same as one step at a time, the Python between steps paid once per call.
    # None: the runner's default (the cpu backend's C++ step: tune.yaml's `serve`; otherwise 1)
    num_scheduler_steps: int | None = None
    kv_transfer: KvTransferConfig | None = None  # prefill-decode disaggregation (--kv-transfer-config)


class _Request:
    """Output bookkeeping of one sequence: incremental text, stop strings, what was already sent."""

    def __init__(self, seq: Sequence, tokenizer: Tokenizer):
        self.seq = seq
        self.detok = IncrementalDetokenizer(tokenizer)
        self.sent_chars = 0
        self.sent_tokens = 0
        self.hold = max((len(s) for s in seq.params.stop), default=1) - 1
        self.matcher = Matcher(tokenizer, seq.params.grammar) if seq.params.grammar is not None else None
        self.logprobs: list[TokenLogprob] = []
        self.prompt_logprobs: list[TokenLogprob | None] | None = None  # handed out with the first output


def _merged(a: RequestOutput, b: RequestOutput) -> RequestOutput:
    """Two consecutive outputs of one request as one (a speculative step emits several tokens at once)."""
    a.text += b.text
    a.token_ids = a.token_ids + b.token_ids
    a.finished, a.finish_reason = b.finished, b.finish_reason
    a.num_output_tokens = b.num_output_tokens
    if a.logprobs is not None and b.logprobs is not None:
        a.logprobs = a.logprobs + b.logprobs
    return a


def _token_logprob(row: torch.Tensor, token_id: int, k: int) -> TokenLogprob:
    """`row` is a log-softmax row on the CPU."""
    top = []
    if k:
        values, ids = row.topk(k)
        top = list(zip(ids.tolist(), values.tolist()))
    return TokenLogprob(token_id, float(row[token_id]), top)


class LLMEngine:
    # speculation and multi-step off unless __init__ turns them on (engines built on this class without its __init__:
    # edge)
    proposer = None
    multi_step = 1
    step_seconds = 0.0  # wall time inside `step` so far: tokens / this is the engine's own rate under load
    media_processor = None  # images and video → pixels and placeholder text (a model with an encoder; replica.py)
    spec_num_drafts = spec_num_draft_tokens = spec_num_accepted_tokens = 0
    spec_accepted_per_pos: list[int] = []
    # prefill-decode disaggregation off unless __init__ turns it on (never appended to then)
    kv_transfer: KvTransfer | None = None
    _handoffs: list = []
    _pending: list = []

    def __init__(self, model, tokenizer: Tokenizer, config: EngineConfig, workers: Workers | None = None):
        self.model = model
        self.tokenizer = tokenizer
        self.config = config
        stateful = has_sequence_state(model)
        spec = config.speculative or SpeculativeConfig()
        self.proposer = build_proposer(spec, model)  # refuses what the model cannot draft before anything loads
        # keep_hidden: the proposer drafts from the target's final hidden states (and nothing is compiled then)
        self.runner, num_blocks, per_block = build_runner(
            model, config, keep_hidden=self.proposer is not None and self.proposer.needs_hidden)
        if workers is not None:  # the other ranks of a tensor/expert-parallel replica run each step too
            self.runner = LockstepRunner(self.runner, workers)
        if hasattr(self.proposer, "bind"):
            self.proposer.bind(self.runner)
        # A sequence-state model cannot resume from shared blocks: its recurrent state is not in them.
        self.blocks = BlockManager(num_blocks, config.block_size, prefix_caching=not stateful)
        self.spec = spec
        # multi-step takes its cache slots as drafts do (placeholders, `_plan_steps`); never beside speculation
        steps = config.num_scheduler_steps or getattr(self.runner, "default_steps", 1)
        self.multi_step = steps if self.proposer is None else 1
        draft_rows = (spec.max_batch_rows if self.proposer is not None
                      else config.max_num_seqs * self.multi_step if self.multi_step > 1 else 0)
        # a sequence-state model's verify rows run apart from prompt chunks (SequenceStateRunner): no drafts
        # in a step that has one
        self.scheduler = Scheduler(self.blocks, config.max_num_seqs, config.max_num_batched_tokens,
                                   max_draft_rows=draft_rows, drafts_beside_prefill=not stateful)
        # speculation counters (vLLM's spec_decode_* metrics)
        self.spec_num_drafts = 0
        self.spec_num_draft_tokens = 0
        self.spec_num_accepted_tokens = 0
        self.spec_accepted_per_pos = [0] * (spec.num_speculative_tokens if spec.enabled else 0)
        self.requests: dict[str, _Request] = {}
        self.kv_transfer = None
        if config.kv_transfer is not None:
            if workers is not None:
                raise ConfigError("--kv-transfer-config runs on one process per instance for now: drop --tensor-"
                                  "parallel-size / --expert-parallel-size on the prefill and decode instances")
            self.kv_transfer = KvTransfer(config.kv_transfer)
        self._handoffs: list[tuple[_Request, RequestOutput]] = []  # prefills whose caches go to a decode instance
        self._pending: list[RequestOutput] = []  # outputs made outside a step (a received first token)
        self.eos = tokenizer.eos_token_ids | set(model.cfg.eos_token_ids)
        self.num_steps = 0
        self.num_generated_tokens = 0
        self.num_prompt_tokens = 0
        log.info("KV cache: %d blocks of %d tokens (%.2f GiB)", num_blocks, config.block_size, num_blocks * per_block / 2**30)

    # ---- requests --------------------------------------------------------------------------------

    def check_prompt(self, prompt_ids: list[int]) -> None:
        """Refuse, before anything is queued, what would fail later or take a batch down with it."""
        if not prompt_ids:
            raise ValueError("The prompt is empty; send at least one token.")
        if len(prompt_ids) >= self.config.max_model_len:
            raise PromptTooLongError(len(prompt_ids), self.config.max_model_len)
        vocab = self.model.cfg.vocab_size
        if min(prompt_ids) < 0 or max(prompt_ids) >= vocab:
            raise ValueError(f"Prompt token ids must lie in [0, {vocab}); got {min(prompt_ids)}..{max(prompt_ids)}.")

    def check_params(self, params: SamplingParams) -> None:
        """What SamplingParams cannot check alone: token ids in this model's vocabulary."""
        vocab = self.model.cfg.vocab_size
        for name, ids in (("logit_bias", params.logit_bias), ("stop_token_ids", params.stop_token_ids)):
            bad = [t for t in ids if not 0 <= t < vocab]
            if bad:
                raise ValueError(f"{name} takes token ids in [0, {vocab}); got {bad[:5]}.")

    def add_request(self, request_id: str, prompt_ids: list[int], params: SamplingParams,
                    media: list[MediaItem] | None = None) -> None:
        """media: the prompt's images and videos (multimodal.py), their placeholders already expanded in
        `prompt_ids`; only for a model with an encoder (`input_modalities`)."""
        self.check_prompt(prompt_ids)
        self.check_params(params)
        if request_id in self.requests:
            raise ValueError(f"request id {request_id!r} is already in use")
        if media:
            self._check_media(prompt_ids, media, params)
        max_tokens = min(params.max_tokens, self.config.max_model_len - len(prompt_ids))
        seq = Sequence(request_id, prompt_ids, params, max_tokens, media)
        req = _Request(seq, self.tokenizer)  # compiles the grammar: a bad one fails here, alone
        if params.prompt_logprobs is not None:
            req.prompt_logprobs = self._prompt_logprobs(prompt_ids, params.prompt_logprobs)
        ktp = params.kv_transfer_params or {}
        received = ktp.get("do_remote_prefill") and ktp.get("flagdeploy") and self.kv_transfer is not None \
            and self.kv_transfer.config.consumes and self._receive(req, ktp)
        self.requests[request_id] = req
        self.scheduler.add(seq)
        self.num_prompt_tokens += len(prompt_ids)
        if received:  # the prefill instance's first token, as this instance's first output
            self._pending.append(self._advance(req, ktp["flagdeploy"]["first_token"]))

    # ---- prefill-decode disaggregation (engine/kv_transfer.py) -----------------------------------------

    def _hands_off(self, seq: Sequence) -> bool:
        """Whether `seq` is a prefill whose caches a decode instance continues from."""
        ktp = seq.params.kv_transfer_params
        return bool(ktp and ktp.get("do_remote_decode") and self.kv_transfer is not None
                    and self.kv_transfer.config.produces)

    def _send(self, req: _Request) -> dict | None:
        """Stage the finished prefill's caches; the kv_transfer_params its response carries (None: the decode
        instance computes the prompt itself, and the output is the same)."""
        seq = req.seq
        try:
            tensors, blocks = self.runner.export_seq(seq)
            extra, meta = self.proposer.export_state(seq) if self.proposer is not None else ([], {})
            tensors += extra
            meta.update(prompt_tokens=seq.num_computed, first_token=seq.token_ids[seq.num_computed],
                        num_blocks=len(blocks), layout=layout_key([(tuple(t.shape), t.dtype) for t in tensors]))
            return self.kv_transfer.send(seq.request_id, tensors, blocks, meta)
        except KvTransferError as exc:
            self.kv_transfer.counters.failed += 1
            log.warning("request %s: caches not staged for a decode instance (%s); it will compute the prompt",
                        seq.request_id, exc)
            return None

    def _receive(self, req: _Request, ktp: dict) -> bool:
        """Take a prefill instance's caches for `req`'s prompt into this instance's blocks and state rows; False
        where there is no room now (the prompt is then computed here, the output the same). Raises
        KvTransferError (the request fails alone, its blocks freed) where the transfer itself fails."""
        seq, fd = req.seq, ktp["flagdeploy"]
        n = seq.num_prompt_tokens
        if fd.get("prompt_tokens") != n:
            raise KvTransferError(f"the prefill instance computed {fd.get('prompt_tokens')} prompt tokens, this "
                                  f"request has {n}: both instances must serve the same model and chat template")
        if not self.runner.can_take(seq) or not self.blocks.ensure_slots(seq, n):
            log.info("request %s: no free KV blocks or state rows for the received prompt now; computing it here",
                     seq.request_id)
            return False
        shapes = self.runner.transfer_shapes(fd["num_blocks"])
        extra = self.proposer.state_shapes(fd) if self.proposer is not None else []
        try:
            tensors = self.kv_transfer.receive(ktp, shapes + extra)
            self.runner.import_seq(seq, tensors[: len(shapes)])
        except BaseException:
            self.runner.release(seq)
            self.blocks.release(seq)
            raise
        if self.proposer is not None:
            self.proposer.import_state(seq, tensors[len(shapes):], fd)
        seq.num_computed = n
        seq.token_ids.append(fd["first_token"])
        self.kv_transfer.counters.received_prompt_tokens += n
        return True

    def _check_media(self, prompt_ids: list[int], media: list[MediaItem], params: SamplingParams) -> None:
        kinds = {item.kind for item in media} - set(self.input_modalities)
        if kinds:
            raise ValueError(f"{type(self.model).__name__} takes {' and '.join(sorted(self.input_modalities))} input, "
                             f"not {' or '.join(sorted(kinds))}; serve a model with a vision encoder for media input.")
        if any(not item.positions or item.positions[-1] >= len(prompt_ids) for item in media):
            raise ValueError("a media item's placeholder positions lie outside the prompt")
        if params.prompt_logprobs is not None:
            raise ValueError("prompt logprobs are not computed for prompts with images or video; leave them out.")

    @property
    def input_modalities(self) -> frozenset[str]:
        """What the served model takes: text, and image and video where it has a vision encoder."""
        return frozenset(getattr(self.model, "input_modalities", ("text",)))

    def _prompt_logprobs(self, prompt_ids: list[int], k: int) -> list[TokenLogprob | None]:
        """Each prompt token's logprob given the tokens before it, from one scratch forward pass
        (outside the paged cache: this is for scoring, e.g. perplexity through `echo`)."""
        with torch.inference_mode():
            logits = self.runner.score(prompt_ids)
        rows = logits.float().log_softmax(-1).cpu()
        return [None] + [_token_logprob(rows[j - 1], prompt_ids[j], k) for j in range(1, len(prompt_ids))]

    def abort(self, request_id: str) -> None:
        req = self.requests.pop(request_id, None)
        if req is not None:
            self.scheduler.finish(req.seq, "abort")
            self.runner.release(req.seq)
            if self.proposer is not None:
                self.proposer.release(req.seq)

    def has_work(self) -> bool:
        return self.scheduler.has_work() or bool(self._pending)

    # ---- one step --------------------------------------------------------------------------------

    def step(self) -> list[RequestOutput]:
        started = time.perf_counter()
        try:
            return self._step()
        finally:
            self.step_seconds += time.perf_counter() - started

    def _step(self) -> list[RequestOutput]:
        pending, self._pending = self._pending, []
        if self.proposer is not None:
            self._propose()
        stepping = self._plan_steps()
        batch = self.scheduler.schedule()
        if batch.empty:
            return pending
        if stepping and batch.drafts is not None:
            if self._steps_fit(batch):
                outputs = self._run_steps(batch)
            else:
                self._unplan_steps(batch)
                outputs = self._sample_step(batch)
        else:
            outputs = self._sample_step(batch)
        for req, out in self._handoffs:  # after `_observe`: an MTP proposer's state of the last chunk travels too
            out.kv_transfer_params = self._send(req)
            self._finish(req)
        self._handoffs = []
        return pending + outputs

    def _sample_step(self, batch: ScheduledBatch) -> list[RequestOutput]:
        """One step: the batch's logits, then each sampled sequence's token (or a speculating one's accepted ones)."""
        scheduled_at = time.perf_counter()
        logits, rows = self.runner.run(batch)
        drafts = batch.drafts
        for i, (seq, n) in enumerate(zip(batch.seqs, batch.num_new_tokens)):
            if seq.scheduled_at is None:
                seq.scheduled_at = scheduled_at
            # a verify step computes 1 + k positions; only the last real token counts until drafts are accepted
            seq.num_computed += 1 if drafts and drafts[i] else n
            self.blocks.register_full_blocks(seq)
        verify_rows = verify_logits = None
        speculated: set[int] = set()  # rows of sampled_seqs whose tokens come from `_accept`
        if drafts:  # several logits rows per speculating sequence: row 0 of each goes the usual way
            first, at = [], 0
            for j, i in enumerate(rows):
                first.append(at)
                at += 1 + len(drafts[i])
                if drafts[i]:
                    speculated.add(j)
            verify_rows = ops.argmax(logits).tolist()  # the target's greedy token at every row
            verify_logits = logits  # a sampled sequence's 1 + k rows: rejection sampling in `_accept`
            logits = take_rows(logits, first)
        sampled_seqs = [batch.seqs[i] for i in rows]
        reqs = [self.requests[seq.request_id] for seq in sampled_seqs]
        # Logprobs are the model's own distribution: taken before any grammar mask or temperature.
        want = [i for i, seq in enumerate(sampled_seqs) if seq.params.logprobs is not None]
        logprob_rows = logits[want].float().log_softmax(-1).cpu() if want else None
        logits = adjust_logits(logits, sampled_seqs)  # penalties, logit_bias (such requests never speculate)
        if any(req.matcher is not None for req in reqs):
            allowed = torch.ones(logits.shape, dtype=torch.bool)
            for i, req in enumerate(reqs):
                if req.matcher is not None:
                    allowed[i] = req.matcher.allowed(logits.shape[-1])
            logits = logits.masked_fill(~allowed.to(logits.device), float("-inf"))
        tokens = sample(logits, sampled_seqs, skip=speculated)  # speculated sampled rows draw in `_accept`
        self.num_steps += 1
        for row, i in enumerate(want):
            reqs[i].logprobs.append(_token_logprob(logprob_rows[row], tokens[i], sampled_seqs[i].params.logprobs))
        outputs = []
        for j, (seq, req, tok) in enumerate(zip(sampled_seqs, reqs, tokens)):
            d = drafts[rows[j]] if drafts else None
            if d:
                span = slice(first[j], first[j] + 1 + len(d))
                outputs.append(self._accept(req, d, verify_rows[span], verify_logits[span]))
                continue
            seq.token_ids.append(tok)
            self.num_generated_tokens += 1
            outputs.append(self._advance(req, tok))
        if self.proposer is not None and self.proposer.needs_hidden:
            self._observe(batch.seqs)
        return outputs

    def _observe(self, seqs: list[Sequence]) -> None:
        """Hand a model-based proposer the target's final hidden states of the positions this step made
        final: a prompt chunk's rows, a decode's row, a verify step's last real token and accepted drafts."""
        hidden = self.runner.last_hidden
        for seq in seqs:
            if seq.request_id not in self.requests or seq.seq_id not in hidden:
                continue  # finished this step (released)
            start, rows = hidden[seq.seq_id]
            self.proposer.observe(seq, start, rows[: seq.num_computed - start])

    # ---- multi-step --------------------------------------------------------------------------------

    def _plan_steps(self) -> bool:
        """Whether this engine step runs several decode steps in one call of the runner (--num-scheduler-steps):
        only while no request waits to be admitted (it would wait the whole call), every running sequence is
        decoding and chooses its token from the logits alone (no logprobs, grammar, penalties or logit_bias: each
        step's choice is made inside the runner's call), and one sequence at least has more than one token left.
        Each running sequence then carries placeholders for the slots of its next steps, which the scheduler
        grants as it grants drafts (what it cannot grant, a sequence does not step)."""
        running = self.scheduler.running
        if self.multi_step <= 1 or not hasattr(self.runner, "takes_steps") or self.scheduler.waiting or not running:
            return False
        for seq in running:
            p = seq.params
            if (seq.num_computed + 1 != seq.num_tokens or p.logprobs is not None or p.grammar is not None
                    or p.adjusts_logits):
                return False
        counts = [min(self.multi_step, seq.max_tokens - seq.num_output_tokens) for seq in running]
        if max(counts) <= 1:
            return False
        for seq, n in zip(running, counts):
            seq.draft_ids = [0] * (n - 1)
        return True

    def _steps_fit(self, batch: ScheduledBatch) -> bool:
        """Whether the scheduled batch is what `_plan_steps` planned: decoding sequences only (a preempted one
        may have come back as a prompt), within what the runner's multi-step call takes."""
        for seq, n, d in zip(batch.seqs, batch.num_new_tokens, batch.drafts):
            if n != 1 + len(d) or seq.num_computed + 1 != seq.num_tokens:
                return False
        return self.runner.takes_steps(batch)

    def _unplan_steps(self, batch: ScheduledBatch) -> None:
        """A batch that cannot run as several steps runs as one: its placeholders' slots go back."""
        for i, (seq, d) in enumerate(zip(batch.seqs, batch.drafts)):
            if d:
                batch.num_new_tokens[i] -= len(d)
                self.blocks.trim(seq, seq.num_tokens)
        batch.drafts = None

    def _run_steps(self, batch: ScheduledBatch) -> list[RequestOutput]:
        """The runner's several steps; each sequence's tokens join it as a speculating sequence's accepted ones do.
        A sampled sequence's uniforms (one a step) are drawn here from its generator, step by step in row order, as
        `sample` draws them one step at a time; a greedy one draws none."""
        scheduled_at = time.perf_counter()
        seqs = batch.seqs
        counts = [1 + len(d) for d in batch.drafts]
        uniforms: list[list[float]] = [[] for _ in seqs]
        for s in range(max(counts)):
            for seq, n, drawn in zip(seqs, counts, uniforms):
                if not seq.params.greedy and n > s:
                    drawn.append(uniform(seq.generator))
        settings = row_settings([seq.params for seq in seqs], torch.device("cpu"))
        tokens = self.runner.run_steps(batch, settings, uniforms)
        self.num_steps += 1
        outputs = []
        for seq, new in zip(seqs, tokens):
            if seq.scheduled_at is None:
                seq.scheduled_at = scheduled_at
            seq.num_computed += 1  # the last real token's k/v; `_emit` counts the rest
            self.blocks.register_full_blocks(seq)
            outputs.append(self._emit(self.requests[seq.request_id], new))
        return outputs

    # ---- speculation -----------------------------------------------------------------------------

    def _propose(self) -> None:
        """Drafts for the decoding sequences that may speculate, with room for at least one more token:
        greedy ones (verified against the argmax) and sampled ones (temperature, top_k, top_p, seeded or
        not: verified by rejection sampling, `rejection.py`). Not requests with a grammar: row j's mask
        depends on the drafts before it, so the matcher would have to be advanced through the drafts and
        rolled back past a rejection (llguidance's matcher is only stepped forward here); nor requests with
        penalties or a logit_bias (row j's adjustment depends on the drafts before it). Not requests with
        logprobs: a step reports them from row 0's log-softmax alone, one token per step; several accepted
        tokens would each need their own row's entry."""
        running = self.scheduler.running
        for seq in running:
            seq.draft_ids = []
        if len(running) >= self.spec.max_batch_rows:
            return  # no decode row would be left for a draft
        k_max = self.spec.num_speculative_tokens
        seqs, limits = [], []
        for seq in running:
            p = seq.params
            if (seq.num_computed + 1 != seq.num_tokens or p.logprobs is not None or p.grammar is not None
                    or p.adjusts_logits):
                continue
            k = min(k_max, seq.max_tokens - seq.num_output_tokens - 1)  # never past max_tokens / max_model_len
            if k > 0:
                seqs.append(seq)
                limits.append(k)
        if seqs:
            for seq, k, d in zip(seqs, limits, self.proposer.propose(seqs, limits)):
                seq.draft_ids = list(d[:k])

    def _accept(self, req: _Request, drafts: list[int], targets: list[int],
                logits: torch.Tensor | None = None) -> RequestOutput:
        """Verify k drafts. `targets[j]` is the target's argmax after the sequence's last token and the
        first j drafts, `logits[j]` its logits row there (1 + k rows). Greedy requests keep the longest
        prefix of drafts equal to the targets, then the target's own token after it. Sampled requests
        (`logits` given) keep what rejection sampling (`rejection.py`) emits from the rows as `sample` would
        process them (temperature, top_k, top_p; one softmax over the 1 + k rows), drawn with the
        sequence's own generator: the accepted drafts, then a replacement or bonus token (our proposers'
        drafts are deterministic: no draft distributions to pass). Either way 1..k+1 tokens,
        each through `_advance` (EOS, stops, max_tokens); the first finish ends it. k/v of accepted drafts
        are already in the cache; the blocks taken for rejected ones are given back, and nothing past the
        accepted tokens is ever hashed into the prefix cache."""
        seq = req.seq
        if seq.params.greedy or logits is None:
            a = 0
            while a < len(drafts) and drafts[a] == targets[a]:
                a += 1
            targets = targets[: a + 1]
        else:
            targets = rejection_sample(probs_for(logits, seq.params), drafts, seq.generator, fallback=targets)
            a = len(targets) - 1
        self.spec_num_drafts += 1
        self.spec_num_draft_tokens += len(drafts)
        self.spec_num_accepted_tokens += a
        for pos in range(a):
            self.spec_accepted_per_pos[pos] += 1
        return self._emit(req, targets[: a + 1])

    def _emit(self, req: _Request, tokens: list[int]) -> RequestOutput:
        """Several new tokens of one sequence, each through `_advance` (EOS, stops, max_tokens) until the first
        finish, as one output; all but the last had their k/v computed this step (accepted drafts, or a multi-step
        call's inputs). The blocks taken beyond the kept tokens are given back."""
        seq, out = req.seq, None
        for j, tok in enumerate(tokens):
            seq.token_ids.append(tok)
            self.num_generated_tokens += 1
            if j < len(tokens) - 1:
                seq.num_computed += 1
                self.blocks.register_full_blocks(seq)
            nxt = self._advance(req, tok)
            out = nxt if out is None else _merged(out, nxt)
            if nxt.finished:
                break
        if not out.finished:
            self.blocks.trim(seq, seq.num_tokens)
        return out

    def _advance(self, req: _Request, tok: int) -> RequestOutput:
        """`tok` (already in token_ids) joins the output: stops, stop strings, max_tokens."""
        seq, p = req.seq, req.seq.params
        req.detok.add(tok)
        text = req.detok.text
        reason = None
        grammar_done = req.matcher is not None and tok not in self.eos and req.matcher.accept(tok) and req.matcher.stopped
        if (tok in self.eos and not p.ignore_eos) or tok in p.stop_token_ids or grammar_done:
            reason = "stop"
        elif seq.num_output_tokens >= seq.max_tokens:
            reason = "length"
        end = len(text)
        if p.stop:
            begin = max(req.sent_chars - req.hold, 0)
            hits = [i for i in (text.find(s, begin) for s in p.stop) if i >= 0]
            if hits:
                reason, end = "stop", min(hits)
            elif reason is None:
                end = max(len(text) - req.hold, req.sent_chars)
        handoff = reason is not None and self._hands_off(seq)
        if reason is not None and not handoff:
            self._finish(req, reason)
        elif handoff:
            seq.finish_reason = reason
        out = RequestOutput(
            request_id=seq.request_id,
            text=text[req.sent_chars : end],
            token_ids=seq.output_ids[req.sent_tokens :],
            finished=reason is not None,
            finish_reason=reason,
            num_prompt_tokens=seq.num_prompt_tokens,
            num_output_tokens=seq.num_output_tokens,
            num_cached_tokens=seq.num_cached_tokens,
            scheduled_at=seq.scheduled_at,
            logprobs=req.logprobs[req.sent_tokens :] if p.logprobs is not None else None,
            prompt_logprobs=req.prompt_logprobs,
        )
        req.prompt_logprobs = None
        req.sent_chars = end
        req.sent_tokens = seq.num_output_tokens
        if handoff:  # finished at the end of the step, once its caches are staged (`_send`)
            self._handoffs.append((req, out))
        return out

    def _finish(self, req: _Request, reason: str | None = None) -> None:
        seq = req.seq
        self.scheduler.finish(seq, reason or seq.finish_reason)
        self.runner.release(seq)
        if self.proposer is not None:
            self.proposer.release(seq)
        del self.requests[seq.request_id]

    # ---- conveniences ----------------------------------------------------------------------------

    def generate(self, prompts: list[list[int]], params: SamplingParams | list[SamplingParams]) -> list[list[int]]:
        """Run prompts to completion together; returns each one's output token ids (tests, benchmarks)."""
        plist = params if isinstance(params, list) else [params] * len(prompts)
        ids = [f"gen-{time.monotonic_ns()}-{i}" for i in range(len(prompts))]
        for rid, prompt, p in zip(ids, prompts, plist):
            self.add_request(rid, prompt, p)
        results: dict[str, list[int]] = {rid: [] for rid in ids}
        while any(rid in self.requests for rid in ids):
            for out in self.step():
                if out.request_id in results:
                    results[out.request_id].extend(out.token_ids)
        return [results[r] for r in ids]

    def close(self) -> None:
        """Stop the other ranks of a parallel replica (nothing to do for one process)."""
        close = getattr(self.runner, "close", None)
        if close is not None:
            close()
        if self.kv_transfer is not None:
            self.kv_transfer.close()

    def stats(self) -> dict[str, int | float | list[int]]:
        return {
            "prefix_cache_hit_tokens": self.blocks.prefix_hit_tokens,
            "prefix_cache_queried_tokens": self.blocks.prefix_queried_tokens,
            "prompt_tokens": self.num_prompt_tokens,
            "generation_tokens": self.num_generated_tokens,
            "steps": self.num_steps,
            "step_seconds": self.step_seconds,
            "preemptions": self.scheduler.num_preemptions,
            "running": len(self.scheduler.running),
            "waiting": len(self.scheduler.waiting),
            "kv_blocks_free": self.blocks.num_free,
            "kv_blocks_total": self.blocks.num_blocks,
            "spec_decode_num_drafts": self.spec_num_drafts,
            "spec_decode_num_draft_tokens": self.spec_num_draft_tokens,
            "spec_decode_num_accepted_tokens": self.spec_num_accepted_tokens,
            "spec_decode_num_accepted_tokens_per_pos": list(self.spec_accepted_per_pos),
            **self._encoder_stats(),
            **self._compile_stats(),
            **(self.kv_transfer.stats() if self.kv_transfer is not None else {}),
        }

    def _compile_stats(self) -> dict[str, int]:
        """Whether decode steps run through the compiled step yet, and whether it is still being compiled."""
        if not hasattr(self.runner, "compiled"):
            return {}
        compiling = self.runner.compiling
        return {"decode_step_compiled": int(self.runner.compiled is not None),
                "decode_step_compiling": int(compiling is not None and compiling.is_alive())}

    def _encoder_stats(self) -> dict[str, int]:
        encoder = getattr(self.runner, "encoder", None)
        if encoder is None:
            return {}
        return {"mm_items_encoded": encoder.encoded, "mm_encoder_cache_hits": encoder.hits}

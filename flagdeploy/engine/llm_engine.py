"""The synchronous core: add requests, step, get outputs. One instance per model replica."""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass

import torch

from flagdeploy.errors import PromptTooLongError
from flagdeploy.models import has_sequence_state
from flagdeploy.tokenizer import IncrementalDetokenizer, Tokenizer

from .block_manager import BlockManager
from .model_runner import PagedRunner, SequenceStateRunner
from .sampler import sample
from .sampling import RequestOutput, SamplingParams
from .scheduler import Scheduler
from .sequence import Sequence

log = logging.getLogger(__name__)


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
    load_format: str = "auto"  # or "dummy": random weights from the config (benchmarks without a checkpoint)
    device: str = "cpu"
    cuda_graphs: bool = True  # replay decode steps as CUDA graphs where the device is a GPU (paged models)


class _Request:
    """Output bookkeeping of one sequence: incremental text, stop strings, what was already sent."""

    def __init__(self, seq: Sequence, tokenizer: Tokenizer):
        self.seq = seq
        self.detok = IncrementalDetokenizer(tokenizer)
        self.sent_chars = 0
        self.sent_tokens = 0
        self.hold = max((len(s) for s in seq.params.stop), default=1) - 1


class LLMEngine:
    def __init__(self, model, tokenizer: Tokenizer, config: EngineConfig):
        self.model = model
        self.tokenizer = tokenizer
        self.config = config
        stateful = has_sequence_state(model)
        runner_cls = SequenceStateRunner if stateful else PagedRunner
        per_block = runner_cls.bytes_per_block(model, config.block_size)
        num_blocks = max(config.kv_cache_memory // per_block, 1)
        min_blocks = -(-config.max_model_len // config.block_size)
        if num_blocks < min_blocks:
            raise ValueError(
                f"A KV cache of {config.kv_cache_memory / 2**30:.2f} GiB holds {num_blocks * config.block_size} tokens, "
                f"less than one sequence of --max-model-len {config.max_model_len}. Raise --kv-cache-memory or lower "
                f"--max-model-len."
            )
        # A sequence-state model cannot resume from shared blocks: its recurrent state is not in them.
        self.blocks = BlockManager(num_blocks, config.block_size, prefix_caching=not stateful)
        self.scheduler = Scheduler(self.blocks, config.max_num_seqs, config.max_num_batched_tokens)
        if runner_cls is PagedRunner and config.cuda_graphs and config.device == "cuda":
            graphs = {"max_batch": config.max_num_seqs, "max_model_len": config.max_model_len}
            self.runner = PagedRunner(model, num_blocks, config.block_size, config.device, graphs)
        else:
            self.runner = runner_cls(model, num_blocks, config.block_size, config.device)
        self.requests: dict[str, _Request] = {}
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

    def add_request(self, request_id: str, prompt_ids: list[int], params: SamplingParams) -> None:
        self.check_prompt(prompt_ids)
        if request_id in self.requests:
            raise ValueError(f"request id {request_id!r} is already in use")
        max_tokens = min(params.max_tokens, self.config.max_model_len - len(prompt_ids))
        seq = Sequence(request_id, prompt_ids, params, max_tokens)
        self.requests[request_id] = _Request(seq, self.tokenizer)
        self.scheduler.add(seq)
        self.num_prompt_tokens += len(prompt_ids)

    def abort(self, request_id: str) -> None:
        req = self.requests.pop(request_id, None)
        if req is not None:
            self.scheduler.finish(req.seq, "abort")
            self.runner.release(req.seq)

    def has_work(self) -> bool:
        return self.scheduler.has_work()

    # ---- one step --------------------------------------------------------------------------------

    def step(self) -> list[RequestOutput]:
        batch = self.scheduler.schedule()
        if batch.empty:
            return []
        logits, rows = self.runner.run(batch)
        for seq, n in zip(batch.seqs, batch.num_new_tokens):
            seq.num_computed += n
            self.blocks.register_full_blocks(seq)
        sampled_seqs = [batch.seqs[i] for i in rows]
        tokens = sample(logits, sampled_seqs)
        self.num_steps += 1
        outputs = []
        for seq, tok in zip(sampled_seqs, tokens):
            seq.token_ids.append(tok)
            self.num_generated_tokens += 1
            outputs.append(self._advance(self.requests[seq.request_id], tok))
        return outputs

    def _advance(self, req: _Request, tok: int) -> RequestOutput:
        seq, p = req.seq, req.seq.params
        req.detok.add(tok)
        text = req.detok.text
        reason = None
        if (tok in self.eos and not p.ignore_eos) or tok in p.stop_token_ids:
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
        if reason is not None:
            self.scheduler.finish(seq, reason)
            self.runner.release(seq)
            del self.requests[seq.request_id]
        out = RequestOutput(
            request_id=seq.request_id,
            text=text[req.sent_chars : end],
            token_ids=seq.output_ids[req.sent_tokens :],
            finished=reason is not None,
            finish_reason=reason,
            num_prompt_tokens=seq.num_prompt_tokens,
            num_output_tokens=seq.num_output_tokens,
            num_cached_tokens=seq.num_cached_tokens,
        )
        req.sent_chars = end
        req.sent_tokens = seq.num_output_tokens
        return out

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

    def stats(self) -> dict[str, int]:
        return {
            "prefix_cache_hit_tokens": self.blocks.prefix_hit_tokens,
            "prefix_cache_queried_tokens": self.blocks.prefix_queried_tokens,
            "prompt_tokens": self.num_prompt_tokens,
            "generation_tokens": self.num_generated_tokens,
            "steps": self.num_steps,
            "preemptions": self.scheduler.num_preemptions,
            "running": len(self.scheduler.running),
            "waiting": len(self.scheduler.waiting),
            "kv_blocks_free": self.blocks.num_free,
            "kv_blocks_total": self.blocks.num_blocks,
        }

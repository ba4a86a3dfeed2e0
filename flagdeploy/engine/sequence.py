"""A request's state inside the engine: its tokens, how many are computed, its blocks, its sampler."""

from __future__ import annotations

import enum
import itertools

import torch

from .multimodal import MediaItem, media_keys
from .request import SamplingParams

_ids = itertools.count()


class Status(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


class Sequence:
    def __init__(self, request_id: str, prompt_ids: list[int], params: SamplingParams, max_tokens: int,
                 media: list[MediaItem] | None = None):
        self.seq_id = next(_ids)
        self.request_id = request_id
        self.token_ids = list(prompt_ids)
        self.num_prompt_tokens = len(prompt_ids)
        self.params = params
        self.max_tokens = max_tokens  # params.max_tokens capped by the context window
        self.status = Status.WAITING
        self.block_table: list[int] = []
        self.num_hashed_blocks = 0  # leading full blocks registered in the prefix cache
        self.num_computed = 0  # tokens whose k/v are in the cache
        self.num_cached_tokens = 0  # of the prompt, served by the prefix cache at admission
        self.finish_reason: str | None = None
        self.scheduled_at: float | None = None  # perf_counter() of its first step (queue-time metric)
        self.generator: torch.Generator | None = None
        self.draft_ids: list[int] = []  # proposed for the next step; never in token_ids until accepted
        self.draft_state = None  # the proposer's own per-sequence bookkeeping (engine/speculative.py)
        self.media = media or []  # images and videos whose features replace prompt positions (multimodal.py)
        if params.seed is not None:
            self.generator = torch.Generator().manual_seed(params.seed)

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def output_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt_tokens :]

    @property
    def num_output_tokens(self) -> int:
        return self.num_tokens - self.num_prompt_tokens

    def block_key(self, i: int, block_size: int) -> tuple:
        """What identifies block i's contents for the prefix cache: its token ids and, where it covers
        media placeholders, the media's keys (equal placeholder ids can stand for different images)."""
        a, b = i * block_size, (i + 1) * block_size
        ids = tuple(self.token_ids[a:b])
        return (ids, media_keys(self.media, a, b)) if self.media else ids

    def reset_for_recompute(self) -> None:
        """After preemption its cache is gone: prompt and output so far are recomputed as one prefill."""
        self.block_table = []
        self.num_hashed_blocks = 0
        self.num_computed = 0
        self.draft_ids = []
        self.status = Status.WAITING

"""ONNX Runtime behind the builtin scheduler: `serve --engine onnxruntime`.

The engine is the builtin `LLMEngine` (its scheduler, stop strings, grammar masks, logprobs, sampler and
the `AsyncEngine` thread the server talks to) with the torch model runner replaced by `OnnxRunner`, which
drives one ORT session of an exported decoder (flagdeploy/edge/export.py).

Cache: one preallocated buffer per layer and k/v of shape [slots, kv_heads, max_model_len, head_dim], bound
through IO binding as both the `past_key_values.*` input and the `present.*` output (GroupQueryAttention's
shared past/present buffer: each step writes only the new token's k/v in place, nothing is copied). A
running sequence owns one slot, so `slots` is the concurrency limit: more requests wait in the scheduler's
queue (and past `--max-waiting`, get 429 from the server).

Continuous batching: every step runs the decodes of all running sequences as one batch (rows of different
lengths, each with its own attention-mask length), then each newly admitted prompt as its own prefill
(batch 1, whole prompt: the graph's attention does not take a prompt chunk on top of a cache, so prefills
are never chunked). Sequences join and leave the decode batch at every step.
"""

from __future__ import annotations

import json
import logging
import os
from pathlib import Path

import numpy as np
import torch

from flagdeploy.engine.block_manager import BlockManager
from flagdeploy.engine.llm_engine import EngineConfig, LLMEngine
from flagdeploy.engine.scheduler import ScheduledBatch, Scheduler
from flagdeploy.errors import FlagdeployError
from flagdeploy.models.config import from_hf_config
from flagdeploy.tokenizer import Tokenizer

from .export import read_manifest

log = logging.getLogger(__name__)

# Execution provider → the pip package whose onnxruntime build carries it.
EP_PACKAGES = {
    "CPUExecutionProvider": "onnxruntime",
    "CUDAExecutionProvider": "onnxruntime-gpu",
    "CANNExecutionProvider": "onnxruntime-cann",
    "QNNExecutionProvider": "onnxruntime-qnn",
    "OpenVINOExecutionProvider": "onnxruntime-openvino",
    "DmlExecutionProvider": "onnxruntime-directml",
    "CoreMLExecutionProvider": "onnxruntime (the macOS wheel)",
}
# EP → the device name OrtValue / IO binding use for its memory.
EP_DEVICES = {"CUDAExecutionProvider": "cuda", "CANNExecutionProvider": "cann", "DmlExecutionProvider": "dml"}
# flagdeploy backend → EP, for chips of the catalog that do not name one (`ort_ep`).
BACKEND_EPS = {"cpu": "CPUExecutionProvider", "cuda": "CUDAExecutionProvider", "ascend": "CANNExecutionProvider"}


class EdgeError(FlagdeployError):
    pass


def import_ort():
    try:
        import onnxruntime as ort
    except ImportError as exc:
        raise EdgeError("the onnxruntime engine needs onnxruntime: pip install 'flagdeploy[edge]' "
                        "(or `flagdeploy install --chip cpu-edge`)") from exc
    return ort


def provider_for_chip(chip: str | None) -> str:
    """The ORT execution provider of a chip id of the catalog (its `ort_ep`, else from its backend) or of
    a backend name (cpu, cuda, ascend); None: the CPU."""
    if chip is None or chip in ("auto",):
        return "CPUExecutionProvider"
    if chip.endswith("ExecutionProvider"):
        return chip
    if chip in BACKEND_EPS:
        return BACKEND_EPS[chip]
    from flagdeploy.chips import get_chip

    from . import edge_info

    spec = get_chip(chip)
    ep = edge_info(spec.id).get("ort_ep")
    if ep:
        return ep
    if spec.backend in BACKEND_EPS:
        return BACKEND_EPS[spec.backend]
    raise EdgeError(f"no ONNX Runtime execution provider is known for chip {chip!r} (backend {spec.backend})")


def check_provider(ep: str) -> None:
    ort = import_ort()
    have = ort.get_available_providers()
    if ep not in have:
        pkg = EP_PACKAGES.get(ep, "an onnxruntime build with it")
        raise EdgeError(
            f"{ep} is not in this onnxruntime build (it has: {', '.join(have)}). Install the package that "
            f"carries it instead of plain onnxruntime: pip uninstall -y onnxruntime && pip install {pkg}")


class OnnxDecoder:
    """One ORT session of an exported decoder and its preallocated, slot-addressed k/v buffers."""

    def __init__(self, model_dir: Path, ep: str = "CPUExecutionProvider", slots: int = 8, max_len: int = 1024,
                 threads: int | None = None):
        ort = import_ort()
        check_provider(ep)
        self.dir = Path(model_dir)
        self.manifest = read_manifest(self.dir)
        genai = json.loads((self.dir / "genai_config.json").read_text())["model"]
        dec = genai["decoder"]
        self.num_layers, self.kv_heads, self.head_dim = dec["num_hidden_layers"], dec["num_key_value_heads"], dec["head_size"]
        self.cfg = from_hf_config(json.loads((self.dir / "hf_config.json").read_text()))
        self.max_len = min(max_len, genai.get("context_length") or max_len)
        self.slots = slots
        so = ort.SessionOptions()
        threads = threads if threads is not None else int(os.environ.get("FLAGDEPLOY_ORT_THREADS", "0"))
        so.intra_op_num_threads = threads
        so.inter_op_num_threads = 1
        so.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_ALL
        self.ep = ep
        self.session = ort.InferenceSession(str(self.dir / dec["filename"]), so, providers=[ep])
        past = next(i for i in self.session.get_inputs() if i.name.startswith("past_key_values."))
        self.kv_dtype = np.float16 if past.type == "tensor(float16)" else np.float32
        logits = next(o for o in self.session.get_outputs() if o.name == "logits")
        self.logits_dtype = np.float16 if logits.type == "tensor(float16)" else np.float32
        self.device = EP_DEVICES.get(ep, "cpu")
        self.names = [(f"past_key_values.{i}.{kv}", f"present.{i}.{kv}")
                      for i in range(self.num_layers) for kv in ("key", "value")]
        shape = [slots, self.kv_heads, self.max_len, self.head_dim]
        # Preallocated once; never resized. On the CPU they are numpy arrays, elsewhere device OrtValues.
        if self.device == "cpu":
            self._bufs = [np.zeros(shape, self.kv_dtype) for _ in self.names]
            self._ptrs = [b.ctypes.data for b in self._bufs]
        else:
            self._bufs = [ort.OrtValue.ortvalue_from_shape_and_type(shape, self.kv_dtype, self.device, 0)
                          for _ in self.names]
            self._ptrs = [b.data_ptr() for b in self._bufs]
        self._slot_bytes = self.kv_heads * self.max_len * self.head_dim * np.dtype(self.kv_dtype).itemsize
        self._decode_logits = np.empty((slots, 1, self.cfg.vocab_size), self.logits_dtype)
        self._bindings: dict[tuple[int, int], object] = {}  # (first slot, rows) → a decode step's binding

    @staticmethod
    def bytes_per_token(num_layers: int, kv_heads: int, head_dim: int, itemsize: int = 4) -> int:
        return 2 * num_layers * kv_heads * head_dim * itemsize

    @property
    def cache_bytes(self) -> int:
        return self._slot_bytes * self.slots * len(self.names)

    def _run(self, first_slot: int, ids: np.ndarray, mask_lens: list[int], logits: np.ndarray,
             keep_binding: bool = False) -> None:
        """One bound run over slots [first_slot, first_slot + len(ids)); rows are right-padded to the
        longest mask, and each writes its new k/v at positions [mask_len - S, mask_len) of its slot.
        keep_binding: `logits` is a buffer that every such run reuses (decode), so the binding is kept."""
        nb, s = ids.shape
        mask = np.zeros((nb, max(mask_lens)), np.int64)
        for b, n in enumerate(mask_lens):
            mask[b, :n] = 1
        io = self._binding(first_slot, logits, keep_binding)
        io.bind_cpu_input("input_ids", ids)
        io.bind_cpu_input("attention_mask", mask)
        self.session.run_with_iobinding(io)

    def _binding(self, first_slot: int, logits: np.ndarray, keep: bool):
        """The IO binding of the k/v buffers of slots [first_slot, first_slot + len(logits)) and of `logits`.
        Decode steps keep theirs (`keep`): binding the 2 x layers buffers costs ~5% of a small model's step."""
        key = (first_slot, logits.shape[0])
        if keep and key in self._bindings:
            return self._bindings[key]
        io = self.session.io_binding()
        shape = [logits.shape[0], self.kv_heads, self.max_len, self.head_dim]
        offset = first_slot * self._slot_bytes
        for (past, present), ptr in zip(self.names, self._ptrs):
            io.bind_input(past, self.device, 0, self.kv_dtype, shape, ptr + offset)
            io.bind_output(present, self.device, 0, self.kv_dtype, shape, ptr + offset)
        io.bind_output("logits", "cpu", 0, self.logits_dtype, list(logits.shape), logits.ctypes.data)
        if keep:
            self._bindings[key] = io
        return io

    def prefill(self, slot: int, ids: list[int], all_logits: bool = False) -> np.ndarray:
        """The whole prompt into `slot` from position 0; logits of the last position ([V]), or of all ([S, V])."""
        if len(ids) > self.max_len:
            raise ValueError(f"{len(ids)} tokens exceed the cache length {self.max_len}")
        logits = np.empty((1, len(ids), self.cfg.vocab_size), self.logits_dtype)
        self._run(slot, np.asarray([ids], np.int64), [len(ids)], logits)
        return logits[0] if all_logits else logits[0, -1]

    def decode(self, first_slot: int, tokens: list[int], lengths: list[int]) -> np.ndarray:
        """One token for each slot of [first_slot, first_slot + len(tokens)); `lengths` are the context
        lengths including the new token. Returns logits [len(tokens), V] (a view of a reused buffer)."""
        nb = len(tokens)
        if max(lengths) > self.max_len:
            raise ValueError(f"context {max(lengths)} exceeds the cache length {self.max_len}")
        out = self._decode_logits[:nb]
        self._run(first_slot, np.asarray(tokens, np.int64).reshape(nb, 1), lengths, out, keep_binding=True)
        return out[:, 0]

    def score(self, ids: torch.Tensor) -> torch.Tensor:
        """All-position logits of one sequence, outside the slots (prompt logprobs)."""
        n = int(ids.numel())
        feeds = {"input_ids": ids.reshape(1, n).numpy().astype(np.int64), "attention_mask": np.ones((1, n), np.int64)}
        for past, _ in self.names:
            feeds[past] = np.zeros((1, self.kv_heads, 0, self.head_dim), self.kv_dtype)
        return torch.from_numpy(self.session.run(["logits"], feeds)[0][0].astype(np.float32))


class OnnxRunner:
    """The model-runner face of `OnnxDecoder` for `LLMEngine.step`: a scheduled batch in, logits out."""

    def __init__(self, decoder: OnnxDecoder):
        self.decoder = decoder
        self.slot_of: dict[int, int] = {}  # seq_id → slot
        self.seq_in: dict[int, object] = {}  # slot → its sequence
        self.free = list(range(decoder.slots))

    def release(self, seq) -> None:
        slot = self.slot_of.pop(seq.seq_id, None)
        if slot is not None:
            self.seq_in.pop(slot, None)
            self.free.append(slot)
            self.free.sort()

    def score(self, ids: list[int]) -> torch.Tensor:
        return self.decoder.score(torch.tensor(ids))

    def run(self, batch: ScheduledBatch) -> tuple[torch.Tensor, list[int]]:
        dec = self.decoder
        decodes: dict[int, int] = {}  # slot → index in the batch
        prefills: list[int] = []
        for i, (seq, n) in enumerate(zip(batch.seqs, batch.num_new_tokens)):
            if seq.num_computed == 0:
                if n != seq.num_tokens:
                    raise RuntimeError("the onnxruntime engine prefills whole prompts; raise max_num_batched_tokens")
                prefills.append(i)
            elif n == 1:
                decodes[self.slot_of[seq.seq_id]] = i
            else:
                raise RuntimeError("the onnxruntime engine cannot extend a cache by a chunk of tokens")
        rows: dict[int, np.ndarray] = {}
        if decodes:
            # one run over the contiguous slot range that holds every decoding sequence; slots in it that
            # do not decode now get a dummy row that writes only where its own next token will overwrite
            lo, hi = min(decodes), max(decodes) + 1
            tokens, lengths = [], []
            for slot in range(lo, hi):
                if slot in decodes:
                    seq = batch.seqs[decodes[slot]]
                    tokens.append(seq.token_ids[seq.num_computed])
                    lengths.append(seq.num_computed + 1)
                else:
                    other = self.seq_in.get(slot)
                    tokens.append(0)
                    lengths.append(other.num_computed + 1 if other is not None else 1)
            logits = dec.decode(lo, tokens, lengths)
            for slot, i in decodes.items():
                rows[i] = logits[slot - lo]
        for i in prefills:
            seq = batch.seqs[i]
            slot = self.slot_of.get(seq.seq_id)
            if slot is None:  # a recompute after preemption keeps its slot
                slot = self.free.pop(0)
                self.slot_of[seq.seq_id] = slot
                self.seq_in[slot] = seq
            rows[i] = dec.prefill(slot, seq.token_ids[: seq.num_tokens])
        sampled = [i for i, (seq, n) in enumerate(zip(batch.seqs, batch.num_new_tokens))
                   if seq.num_computed + n == seq.num_tokens]
        out = torch.from_numpy(np.stack([rows[i] for i in sampled]).astype(np.float32, copy=False))
        return out, sampled


class _ModelFace:
    """What LLMEngine reads of its model: the config and `score` (prompt logprobs)."""

    def __init__(self, decoder: OnnxDecoder):
        self.cfg = decoder.cfg
        self.score = decoder.score


class OnnxLLMEngine(LLMEngine):
    """LLMEngine with the ONNX runner. `config.max_num_seqs` is capped by the slots that fit in
    `config.kv_cache_memory`; prefix caching is off (the cache is per slot, not in shared blocks)."""

    def __init__(self, decoder: OnnxDecoder, tokenizer: Tokenizer, config: EngineConfig):
        self.model = _ModelFace(decoder)
        self.decoder = decoder
        self.tokenizer = tokenizer
        self.config = config
        blocks_per_seq = -(-decoder.max_len // config.block_size)
        # the block manager only counts: every slot holds a whole max-length sequence, so it never runs dry
        self.blocks = BlockManager(decoder.slots * blocks_per_seq, config.block_size, prefix_caching=False)
        # whole-prompt prefills: the step budget covers one longest prompt plus every running decode
        self.scheduler = Scheduler(self.blocks, decoder.slots, decoder.max_len + decoder.slots)
        self.runner = OnnxRunner(decoder)
        self.requests = {}
        self.eos = tokenizer.eos_token_ids | set(decoder.cfg.eos_token_ids)
        self.num_steps = 0
        self.num_generated_tokens = 0
        self.num_prompt_tokens = 0
        log.info("onnxruntime engine: %s on %s, %d slots x %d tokens (%.2f GiB cache)", decoder.dir,
                 decoder.ep, decoder.slots, decoder.max_len, decoder.cache_bytes / 2**30)

    def stats(self) -> dict[str, int]:
        s = super().stats()
        s["onnx_slots"] = self.decoder.slots
        return s


def resolve_export(model: str | Path | None, weights: str = "int4", ep: str = "CPUExecutionProvider") -> Path:
    """An export directory as given, or the cached export of a model source (made on first use)."""
    if model is not None and (Path(model) / "flagdeploy-onnx.json").exists():
        return Path(model)
    from flagdeploy.checkpoints.source import resolve

    from .export import cached_export

    target = "cuda" if ep == "CUDAExecutionProvider" else "cpu"
    return cached_export(resolve(None if model is None else str(model)), weights, target)


def build_onnx_engine(model: str | Path | None = None, config: EngineConfig | None = None, chip: str | None = None,
                      weights: str = "int4", threads: int | None = None) -> OnnxLLMEngine:
    """The synchronous ONNX engine; wrap it in `flagdeploy.engine.AsyncEngine` to serve it."""
    config = config or EngineConfig()
    ep = provider_for_chip(chip)
    check_provider(ep)  # before any export work
    model_dir = resolve_export(model, weights, ep)
    genai = json.loads((model_dir / "genai_config.json").read_text())["model"]
    d = genai["decoder"]
    per_token = OnnxDecoder.bytes_per_token(d["num_hidden_layers"], d["num_key_value_heads"], d["head_size"],
                                            2 if read_manifest(model_dir)["weights"] == "fp16" else 4)
    max_len = min(config.max_model_len, genai.get("context_length") or config.max_model_len)
    slots = max(1, min(config.max_num_seqs, config.kv_cache_memory // (per_token * max_len)))
    if slots < config.max_num_seqs:
        log.warning("a %.2f GiB cache holds %d sequences of %d tokens; serving %d at a time (the rest queue)",
                    config.kv_cache_memory / 2**30, slots, max_len, slots)
    config.max_model_len = max_len
    config.max_num_seqs = slots
    decoder = OnnxDecoder(model_dir, ep, slots, max_len, threads)
    tokenizer = Tokenizer.from_source(model_dir, "safetensors", extra_eos_ids=decoder.cfg.eos_token_ids)
    return OnnxLLMEngine(decoder, tokenizer, config)

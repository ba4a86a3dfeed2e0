"""Prefill-decode disaggregation in the builtin engine: a sequence's caches handed from one instance to another.

The two-step that vLLM's NixlConnector speaks, so vLLM's routers drive it unchanged (`vllm-router
--vllm-pd-disaggregation`): the router sends the request to a prefill instance with `max_tokens=1` and
`kv_transfer_params={"do_remote_decode": true}`; that instance computes the prompt, samples the first token,
copies everything the sequence needs to continue into a registered staging buffer and answers with
`kv_transfer_params` saying where it lies; the router hands those to a decode instance with the original
request, which pulls the bytes, scatters them into its own blocks and state rows, and decodes from the first
token on without computing any prompt position.

What moves (`runner.export_seq`): the paged cache blocks the prompt fills (llama's k/v; glm5_next's MLA
latent and DSA indexer rows, and the MTP draft layer's rows), the KDA conv and recurrent state of every linear
attention layer, and the MTP proposer's last hidden row. The bytes move through the Mooncake Transfer Engine
(PyPI `mooncake-transfer-engine`, its non-CUDA build on a CPU host; TCP by default, RDMA where configured):
the decode instance reads the producer's buffer, then writes one byte into the producer's flag area to say it
is done, and the producer frees the region. A region nobody collects is freed after `abort_timeout` seconds
(a decode instance that died); a read that fails fails its request alone, and frees what it took.

`--kv-transfer-config` takes vLLM's JSON (kv_connector, kv_role, kv_ip, kv_buffer_size,
kv_connector_extra_config); whatever the connector's name, the bytes go through the transfer engine.
"""

from __future__ import annotations

import json
import logging
import socket
import threading
import time
import uuid
from dataclasses import dataclass, field

import torch

log = logging.getLogger(__name__)

# connector names a vLLM user writes; the bytes move through Mooncake's transfer engine whichever is named
CONNECTORS = ("NixlConnector", "MooncakeConnector", "MooncakeConnectorV1", "FlagdeployConnector")
ROLES = ("kv_producer", "kv_consumer", "kv_both")
FLAG_SLOTS = 4096  # transfers one producer may have waiting for their decode instance at once
ALIGN = 64


class KvTransferError(RuntimeError):
    """A transfer that could not be made: the request fails with this message, nothing else does."""


@dataclass
class KvTransferConfig:
    """vLLM's `--kv-transfer-config`, the fields the builtin engine reads."""

    kv_connector: str
    kv_role: str
    kv_ip: str = "127.0.0.1"  # the address decode instances reach this one's transfer engine at
    kv_buffer_size: int = 1 << 30  # bytes of the registered staging buffer (vLLM's default is 1e9)
    kv_connector_extra_config: dict = field(default_factory=dict)  # protocol (tcp|rdma), device, abort_timeout

    @classmethod
    def parse(cls, text: str) -> "KvTransferConfig":
        try:
            raw = json.loads(text)
        except json.JSONDecodeError as exc:
            raise ValueError(f"--kv-transfer-config is not JSON ({exc}); e.g. "
                             '\'{"kv_connector":"NixlConnector","kv_role":"kv_producer"}\'') from None
        if not isinstance(raw, dict):
            raise ValueError("--kv-transfer-config must be a JSON object")
        known = {f for f in cls.__dataclass_fields__}
        ignored = sorted(set(raw) - known - {"kv_port", "engine_id", "kv_rank", "kv_parallel_size",
                                             "kv_load_failure_policy", "kv_buffer_device"})
        if ignored:
            raise ValueError(f"--kv-transfer-config: unknown field(s) {ignored}; known: {sorted(known)}")
        cfg = cls(**{k: v for k, v in raw.items() if k in known})
        if cfg.kv_connector not in CONNECTORS:
            raise ValueError(f"--kv-transfer-config: kv_connector {cfg.kv_connector!r} is not one of {list(CONNECTORS)}")
        if cfg.kv_role not in ROLES:
            raise ValueError(f"--kv-transfer-config: kv_role {cfg.kv_role!r} is not one of {list(ROLES)}")
        cfg.kv_buffer_size = int(float(cfg.kv_buffer_size))
        if cfg.kv_buffer_size < 1 << 20:
            raise ValueError("--kv-transfer-config: kv_buffer_size must be at least 1 MiB")
        return cfg

    @property
    def produces(self) -> bool:
        return self.kv_role in ("kv_producer", "kv_both")

    @property
    def consumes(self) -> bool:
        return self.kv_role in ("kv_consumer", "kv_both")


class Arena:
    """Regions of one registered host buffer: first fit over a sorted free list (transfers are few and
    large; nothing finer is needed)."""

    def __init__(self, size: int):
        self.size = size
        self.free: list[tuple[int, int]] = [(0, size)]

    def take(self, n: int) -> int:
        n = -(-n // ALIGN) * ALIGN
        for i, (at, length) in enumerate(self.free):
            if length >= n:
                self.free[i] = (at + n, length - n)
                if not self.free[i][1]:
                    del self.free[i]
                return at
        raise KvTransferError(f"the KV transfer buffer ({self.size >> 20} MiB) has no room for {n >> 20} MiB more: "
                              "raise kv_buffer_size in --kv-transfer-config, or lower the concurrency")

    def give(self, at: int, n: int) -> None:
        n = -(-n // ALIGN) * ALIGN
        self.free.append((at, n))
        self.free.sort()
        merged = [self.free[0]]
        for a, length in self.free[1:]:
            pa, pl = merged[-1]
            if pa + pl == a:
                merged[-1] = (pa, pl + length)
            else:
                merged.append((a, length))
        self.free = merged

    @property
    def in_use(self) -> int:
        return self.size - sum(length for _, length in self.free)


class MooncakeTransport:
    """The Mooncake Transfer Engine: this host's memory registered, peers read and written by address."""

    def __init__(self, host: str, protocol: str = "tcp", device: str = ""):
        try:
            from mooncake.engine import TransferEngine
        except ImportError as exc:
            raise KvTransferError(
                f"prefill-decode disaggregation moves caches with the Mooncake Transfer Engine, which is not "
                f"importable here ({exc}). Install it: pip install 'flagdeploy[pd]' (mooncake-transfer-engine-non-cuda "
                f"on a CPU host, mooncake-transfer-engine on an NVIDIA one); its non-CUDA build needs "
                f"libibverbs1 libnuma1 liburing2 libcurl4 (apt-get install ...).") from None
        self.engine = TransferEngine()
        if self.engine.initialize(host, "P2PHANDSHAKE", protocol, device) != 0:
            raise KvTransferError(f"the transfer engine could not start on {host} ({protocol}); check kv_ip in "
                                  "--kv-transfer-config is an address of this host")
        self.session = f"{host}:{self.engine.get_rpc_port()}"

    def register(self, t: torch.Tensor) -> None:
        if self.engine.register_memory(t.data_ptr(), t.numel() * t.element_size()) != 0:
            raise KvTransferError("the transfer engine could not register the staging buffer")

    def read(self, peer: str, local: int, remote: int, n: int) -> None:
        if self.engine.transfer_sync_read(peer, local, remote, n) != 0:
            raise KvTransferError(f"reading {n} bytes of KV from the prefill instance at {peer} failed (it may "
                                  "have stopped, or freed the transfer after its abort_timeout)")

    def write(self, peer: str, local: int, remote: int, n: int) -> None:
        if self.engine.transfer_sync_write(peer, local, remote, n) != 0:
            raise KvTransferError(f"telling the prefill instance at {peer} that the transfer is done failed")


@dataclass
class _Held:
    at: int
    nbytes: int
    deadline: float
    request_id: str


@dataclass
class TransferCounters:
    """What /metrics shows per role (engine.stats(): kv_transfer_*)."""

    sent_requests: int = 0
    sent_blocks: int = 0
    sent_bytes: int = 0
    sent_seconds: float = 0.0
    received_requests: int = 0
    received_blocks: int = 0
    received_bytes: int = 0
    received_seconds: float = 0.0
    received_prompt_tokens: int = 0  # prompt tokens a decode instance got from a prefill one, never computed
    failed: int = 0
    expired: int = 0  # held for a decode instance that never collected them


def layout_key(shapes: list[tuple[tuple[int, ...], torch.dtype]]) -> str:
    """What both sides must agree on: every tensor's shape and dtype, in order."""
    return ";".join(f"{'x'.join(map(str, s))}:{str(d).removeprefix('torch.')}" for s, d in shapes)


def _host() -> str:
    try:
        return socket.gethostbyname(socket.gethostname())
    except OSError:
        return "127.0.0.1"


class KvTransfer:
    """One instance's side of the transfers: the staging buffer, the transport and the counters."""

    def __init__(self, config: KvTransferConfig):
        self.config = config
        extra = config.kv_connector_extra_config or {}
        self.abort_timeout = float(extra.get("abort_timeout", 120.0))
        self.host = config.kv_ip or _host()
        self.transport = MooncakeTransport(self.host, extra.get("protocol", "tcp"), extra.get("device", ""))
        # the flag area first (one byte per slot, written by decode instances), then the regions
        self.buffer = torch.zeros(FLAG_SLOTS + config.kv_buffer_size, dtype=torch.uint8)
        self.transport.register(self.buffer)
        self.base = self.buffer.data_ptr()
        self.arena = Arena(config.kv_buffer_size)
        self.engine_id = uuid.uuid4().hex
        self.held: dict[int, _Held] = {}  # flag slot -> a region waiting for its decode instance
        self.free_slots = list(range(FLAG_SLOTS - 1, -1, -1))
        self.counters = TransferCounters()
        self.lock = threading.Lock()  # the consumer's reads run beside the engine thread's sends
        self._one = torch.ones(1, dtype=torch.uint8)
        self.transport.register(self._one)
        # regions are freed as their decode instances finish reading, whether or not this engine steps
        self._stop = threading.Event()
        threading.Thread(target=self._poll_loop, name="flagdeploy-kv-transfer", daemon=True).start()

    def _poll_loop(self) -> None:
        while not self._stop.wait(0.2):
            with self.lock:
                self.poll()

    def close(self) -> None:
        self._stop.set()

    # ---- the prefill side ---------------------------------------------------------------------------

    def send(self, request_id: str, tensors: list[torch.Tensor], blocks: list[int], meta: dict) -> dict:
        """Stage `tensors` for a decode instance; returns the kv_transfer_params the response carries."""
        started = time.perf_counter()
        nbytes = sum(t.numel() * t.element_size() for t in tensors)
        with self.lock:
            self.poll()
            if not self.free_slots:
                raise KvTransferError(f"{FLAG_SLOTS} transfers already wait for their decode instance")
            at = self.arena.take(nbytes)
            slot = self.free_slots.pop()
            self.buffer[slot] = 0
            self.held[slot] = _Held(at, nbytes, time.monotonic() + self.abort_timeout, request_id)
        offset = FLAG_SLOTS + at
        for t in tensors:
            n = t.numel() * t.element_size()
            self.buffer[offset: offset + n].copy_(t.detach().contiguous().view(-1).view(torch.uint8))
            offset += n
        c = self.counters
        c.sent_requests += 1
        c.sent_blocks += len(blocks)
        c.sent_bytes += nbytes
        c.sent_seconds += time.perf_counter() - started
        return {"do_remote_prefill": True, "do_remote_decode": False, "remote_engine_id": self.engine_id,
                "remote_host": self.host, "remote_port": int(self.transport.session.rsplit(":", 1)[1]),
                "remote_block_ids": list(blocks), "remote_request_id": request_id, "tp_size": 1,
                "flagdeploy": {**meta, "addr": self.base + FLAG_SLOTS + at, "bytes": nbytes,
                               "done_addr": self.base + slot}}

    def poll(self) -> None:
        """Free the regions whose decode instance said it is done, or never came (abort_timeout)."""
        now = time.monotonic()
        for slot, h in list(self.held.items()):
            done = bool(self.buffer[slot])
            if done or now > h.deadline:
                if not done:
                    self.counters.expired += 1
                    log.warning("KV of request %s was not collected within %.0f s; freed", h.request_id,
                                self.abort_timeout)
                self.arena.give(h.at, h.nbytes)
                del self.held[slot]
                self.free_slots.append(slot)

    # ---- the decode side ----------------------------------------------------------------------------

    def receive(self, params: dict, shapes: list[tuple[tuple[int, ...], torch.dtype]]) -> list[torch.Tensor]:
        """Pull what `params` (a prefill instance's kv_transfer_params) points at, as tensors of `shapes`."""
        fd = params.get("flagdeploy") or {}
        if fd.get("layout") != layout_key(shapes):
            raise KvTransferError("the prefill instance's caches are laid out differently from this one's (another "
                                  "model, block size, dtype or MTP setting): serve both roles with the same options")
        nbytes = int(fd["bytes"])
        peer = f"{params['remote_host']}:{params['remote_port']}"
        started = time.perf_counter()
        with self.lock:
            at = self.arena.take(nbytes)
        try:
            try:
                self.transport.read(peer, self.base + FLAG_SLOTS + at, int(fd["addr"]), nbytes)
                self.transport.write(peer, self._one.data_ptr(), int(fd["done_addr"]), 1)
            except KvTransferError:
                self.counters.failed += 1
                raise
            out, offset = [], FLAG_SLOTS + at
            for shape, dtype in shapes:
                n = torch.Size(shape).numel() * torch.empty((), dtype=dtype).element_size()
                out.append(self.buffer[offset: offset + n].clone().view(dtype).view(shape))
                offset += n
        finally:
            with self.lock:
                self.arena.give(at, nbytes)
        c = self.counters
        c.received_requests += 1
        c.received_blocks += len(params.get("remote_block_ids") or ())
        c.received_bytes += nbytes
        c.received_seconds += time.perf_counter() - started
        return out

    def stats(self) -> dict[str, int | float]:
        c = self.counters
        return {f"kv_transfer_{k}": v for k, v in vars(c).items()} | {
            "kv_transfer_held": len(self.held), "kv_transfer_buffer_bytes_in_use": self.arena.in_use}

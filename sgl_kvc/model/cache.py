"""The cache folder of the built-in models, and building a model folder there once, atomically."""

from __future__ import annotations

import os
import shutil
import tempfile
from pathlib import Path
from typing import Callable


def default_cache_dir() -> Path:
    """`$SGLKVC_CACHE`, else `$XDG_CACHE_HOME/sgl_kvc` (`~/.cache/sgl_kvc`)."""
    root = os.environ.get("SGLKVC_CACHE") or os.path.join(
        os.environ.get("XDG_CACHE_HOME", os.path.expanduser("~/.cache")), "sgl_kvc"
    )
    return Path(root)


def build_once(target: Path, build: Callable[[Path], None]) -> Path:
    """`target` (a model folder with a `config.json`), calling `build(folder)` into a temporary
    sibling and renaming it into place when it does not exist yet. Concurrent first launches are
    safe: the rename is atomic, and a loser finds the winner's folder."""
    if (target / "config.json").exists():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{target.name}-", dir=target.parent))
    try:
        build(tmp)
        try:
            os.rename(tmp, target)
        except OSError:
            if not (target / "config.json").exists():
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return target

"""SGLang plugin entry point (group `sglang.srt.plugins`, see pyproject.toml).

SGLang calls `load()` early in every one of its processes (launcher, scheduler, detokenizer).
The plugin is installed into the environment, so plain `python -m sglang.launch_server` calls it
too: it only acts when `python -m sgl_kvc.launch` exported a `KvcConfig`, so that plain SGLang
stays plain SGLang (the `--policy none` equivalence test depends on it).
"""

from __future__ import annotations

import logging

from sgl_kvc.config import KvcConfig

logger = logging.getLogger(__name__)


def load() -> None:
    config = KvcConfig.from_env()
    if config is None:
        logger.debug("sgl-kvc plugin inactive: not started through sgl_kvc.launch")
        return
    from sgl_kvc.adapter import install

    try:
        install(config)
    except Exception as e:
        # SGLang's plugin loader logs and swallows exceptions, which would serve with sgl-kvc
        # half applied. The user asked for sgl-kvc (the launcher exported its config): stop.
        logger.exception("sgl-kvc failed to install into SGLang")
        raise SystemExit(f"sgl-kvc failed to install into SGLang: {e}") from e

"""Where maxkv keeps what it builds or downloads: compiled kernels, models, tokenizers."""

from __future__ import annotations

import os
from pathlib import Path

from . import settings


def cache_dir() -> Path:
    """maxkv's cache folder (not created here).

    ``$MAXKV_CACHE_DIR`` if set (:data:`maxkv.settings.CACHE_DIR`), else
    ``$XDG_CACHE_HOME/maxkv``, else ``~/.cache/maxkv``.
    """
    configured = settings.CACHE_DIR.read()
    if configured:
        return Path(configured).expanduser()
    xdg = os.environ.get("XDG_CACHE_HOME")
    base = Path(xdg).expanduser() if xdg else Path.home() / ".cache"
    return base / "maxkv"

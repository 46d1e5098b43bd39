"""Where maxkv keeps what it builds or downloads: compiled kernels, models, tokenizers."""

from __future__ import annotations

import os
from pathlib import Path


def cache_dir() -> Path:
    """maxkv's cache folder (not created here).

    ``$MAXKV_CACHE_DIR`` if set, else ``$XDG_CACHE_HOME/maxkv``, else
    ``~/.cache/maxkv``.
    """
    configured = os.environ.get("MAXKV_CACHE_DIR")
    if configured:
        return Path(configured).expanduser()
    xdg = os.environ.get("XDG_CACHE_HOME")
    base = Path(xdg).expanduser() if xdg else Path.home() / ".cache"
    return base / "maxkv"

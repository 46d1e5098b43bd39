"""The registry of model families: Hugging Face ``architectures`` name -> family.

The bottom of :mod:`maxkv.models`: it imports no model code, so
:class:`~maxkv.models.config.DecoderConfig` (``from_hf``) and
:mod:`maxkv.models.family` both read it without importing each other.  The
families maxkv ships (:mod:`maxkv.models.families`) are registered when
:mod:`maxkv.models` is imported; :func:`register_family` adds another.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

from .errors import ModelLoadError

if TYPE_CHECKING:
    from .family import Family

__all__ = ["family_for", "register_family", "registered_architectures"]

_FAMILIES: dict[str, Family] = {}


def register_family(family: Family) -> Family:
    """Registers ``family`` under each of its ``architectures`` names; returns it.

    Raises:
        ValueError: If one of them is registered to another family.
    """
    for name in family.architectures:
        other = _FAMILIES.get(name)
        if other is not None and other != family:
            raise ValueError(f"{name} is already registered to the {other.name} family")
    for name in family.architectures:
        _FAMILIES[name] = family
    return family


def registered_architectures() -> dict[str, Family]:
    """Every registered Hugging Face architecture name -> its family."""
    return dict(_FAMILIES)


def family_for(raw: Mapping[str, Any]) -> Family:
    """The family of a ``config.json`` dict, by its ``architectures`` names.

    Raises:
        ModelLoadError: If it names no registered architecture.
    """
    names = raw.get("architectures") or []
    if not isinstance(names, list):
        raise ModelLoadError(f"config.json architectures must be a list, got {names!r}")
    for name in names:
        if name in _FAMILIES:
            return _FAMILIES[name]
    found = names or raw.get("model_type")
    raise ModelLoadError(
        f"unsupported architecture {found!r}: maxkv runs {', '.join(sorted(_FAMILIES))}"
    )

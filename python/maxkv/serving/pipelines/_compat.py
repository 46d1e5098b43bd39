"""The MAX versions :mod:`maxkv.pipelines` was tested on.

The adapter relies on MAX's internals (``TextGenerationPipeline`` always
building its own paged manager, the KV-manager interface, the batch
constructor's call order), which change between MAX releases, so it refuses
to load outside the tested range rather than fail later in a confusing way.
"""

from __future__ import annotations

from importlib.metadata import PackageNotFoundError, version

#: Tested: MAX 26.7.x (``max`` 26.7.0 on PyPI).
SUPPORTED_MAX_RANGE = ((26, 7), (26, 8))
SUPPORTED_MAX = ">=26.7,<26.8"


class UnsupportedMaxVersionError(RuntimeError):
    """The installed MAX is outside :data:`SUPPORTED_MAX`."""


def check_max_version(found: str | None = None) -> str:
    """Returns the installed MAX version; raises outside :data:`SUPPORTED_MAX`.

    Args:
        found: A version to check instead of the installed one (for tests).

    Raises:
        UnsupportedMaxVersionError: Naming the supported range and the version found.
    """
    if found is None:
        try:
            found = version("max")
        except PackageNotFoundError:
            raise UnsupportedMaxVersionError(
                f"maxkv.pipelines needs MAX {SUPPORTED_MAX}; the `max` package is not installed"
            ) from None
    try:
        major, minor = (int(part) for part in found.split(".")[:2])
    except ValueError:
        raise UnsupportedMaxVersionError(
            f"maxkv.pipelines supports MAX {SUPPORTED_MAX}; cannot parse MAX version {found!r}"
        ) from None
    low, high = SUPPORTED_MAX_RANGE
    if not low <= (major, minor) < high:
        raise UnsupportedMaxVersionError(
            f"maxkv.pipelines was tested with MAX {SUPPORTED_MAX} and found MAX {found}: "
            f"install max{SUPPORTED_MAX} (pip install 'maxkv[serve]'), or use maxkv's own "
            "scheduler (maxkv.serving.scheduler), which does not depend on MAX's pipeline internals"
        )
    return found

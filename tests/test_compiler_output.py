"""The Mojo compiler's harmless warning about maxkv's collections never reaches the user.

MAX's graph compiler writes it from native code to file descriptor 2 while a
graph loads; :func:`maxkv.kernels.harmless_warnings_filtered` drops exactly
those blocks and passes everything else through, in order.
"""

from __future__ import annotations

import subprocess
import sys

import pytest

from maxkv.kernels import HARMLESS_WARNING, _without_harmless

pytestmark = pytest.mark.unit

WARNING_BLOCK = (
    f"{HARMLESS_WARNING} 'ContinuousBatchingKVCacheCollection[...]' has no effect and can be "
    "removed\n        var__9 = var___10^\n                         ^\n                         \n"
)


def test_only_the_harmless_blocks_are_dropped() -> None:
    text = (
        "first line\n"
        + WARNING_BLOCK
        + WARNING_BLOCK
        + "warning: something else\n    x = y\n"
        + WARNING_BLOCK
        + "error: a real one\n"
    )
    assert _without_harmless(text) == (
        "first line\nwarning: something else\n    x = y\nerror: a real one\n"
    )


def test_native_writes_to_fd_2_are_filtered_and_kept_in_order() -> None:
    """Inside the block, writes to descriptor 2 (as the compiler's) lose the warning
    blocks and keep the rest; an exception still lets them out."""
    script = f"""
import os
from maxkv.kernels import harmless_warnings_filtered
try:
    with harmless_warnings_filtered():
        os.write(2, b"before\\n" + {WARNING_BLOCK.encode()!r} + b"after\\n")
        raise RuntimeError("compile failed")
except RuntimeError:
    os.write(2, b"raised\\n")
"""
    result = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, timeout=120
    )
    assert result.returncode == 0, result.stderr
    assert result.stderr == "before\nafter\nraised\n"

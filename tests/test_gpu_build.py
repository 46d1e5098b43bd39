"""maxkv's own GPU kernels, compiled for an H100 (sm_90) without a GPU.

``mojo build --emit asm --target-accelerator sm_90`` instantiates every GPU
kernel a program launches and writes one PTX file per kernel, so errors in
maxkv's GPU code paths show here before any GPU is lent.  The program calls
the registered ops' ``execute`` with ``target="gpu"``, as MAX's graph
compiler does, on both collections: the ctors, ``check_row_offsets``,
``copy_tokens`` (fork, prefix reuse, copy-on-write on the device) and
``cache_lengths``.  MAX's own kernels that the attention ops wrap are
instantiated by whole graphs compiled for sm_90 (virtual devices:
``tests/test_gpu_graph_compile.py``, ``benchmarks/gpu_study.py --device
virtual``), not here: they take minutes.

What the PTX must show: the copy kernels take the collection *by value* (a
kernel parameter that is a pointer to a host-stack struct faults on the
device: the bug this test was written after) and move 16-byte vectors.
"""

from __future__ import annotations

import re

import pytest

from maxkv.kernels import kernels_source_path

#: A sweep case: building maxkv's GPU kernels for sm_90 without a GPU takes minutes
#: on a small CPU (``pytest --sweeps``: before a GPU session, after a change to a GPU path).
pytestmark = [pytest.mark.compile, pytest.mark.sweep]

#: (dtype name, KV heads, head_dim, page size): float32 and SmolLM2's KV shape.
SHAPE = ("float32", 3, 64, 16)

PROGRAM = """
from extensibility import InputTensor, OutputTensor, StaticTensorSpec
from max.gpu.host import DeviceContext
from std.utils import IndexList
from mojo_ops.kv.collection import KVCollectionCtor
from mojo_ops.kv.paged_collection import PagedKVCollectionCtor
from mojo_ops.kv.checks import CheckRowOffsets, PagedCheckRowOffsets
from mojo_ops.kv.cache_write import CopyTokens, PagedCopyTokens, StoreKVRagged, PagedStoreKVRagged
from mojo_ops.kv.diagnostics import CacheLengths, PagedCacheLengths

comptime DT = DType.{dtype}


def _ptr[dtype: DType]() -> UnsafePointer[Scalar[dtype], MutUntrackedOrigin]:
    return UnsafePointer[Scalar[dtype], MutUntrackedOrigin](unsafe_from_address=4096)


def inp[dtype: DType, rank: Int](
    shape: IndexList[rank],
) -> InputTensor[static_spec=StaticTensorSpec[dtype, rank].get_unknown()]:
    return {{_ptr[dtype](), shape}}


def out[dtype: DType, rank: Int](
    shape: IndexList[rank],
) -> OutputTensor[static_spec=StaticTensorSpec[dtype, rank].get_unknown()]:
    return {{_ptr[dtype](), shape}}


def main() raises:
    var ctx = DeviceContext()
    var offsets = inp[DType.uint32, 1](IndexList[1](3))
    var lengths = out[DType.uint32, 1](IndexList[1](2))
    var copied = out[DType.uint32, 1](IndexList[1](1))
    var token_range = inp[DType.uint32, 1](IndexList[1](2))
    var layer = inp[DType.uint32, 1](IndexList[1](1))
    var q = out[DT, 2](IndexList[2](5, {q_width}))
    var qkv = inp[DT, 2](IndexList[2](5, {q_width} + 2 * {heads} * {head_dim}))
    var kv = KVCollectionCtor.execute[DT, "{dtype}", {heads}, {head_dim}, "gpu"](
        inp[DT, 6](IndexList[6](4, 2, 2, 64, {heads}, {head_dim})),
        inp[DType.uint32, 1](IndexList[1](2)),
        inp[DType.uint32, 1](IndexList[1](2)),
        inp[DType.uint32, 2](IndexList[2](1, 2)),
    )
    CheckRowOffsets.execute[target="gpu"](offsets, kv, ctx)
    CopyTokens.execute[target="gpu"](copied, kv, token_range, ctx)
    StoreKVRagged.execute[target="gpu"](q, qkv, offsets, kv, layer, ctx)
    CacheLengths.execute[target="gpu"](lengths, kv, ctx)
    var pkv = PagedKVCollectionCtor.execute[DT, "{dtype}", {heads}, {head_dim}, {page}, "gpu"](
        inp[DT, 6](IndexList[6](8, 2, 2, {page}, {heads}, {head_dim})),
        inp[DType.uint32, 1](IndexList[1](2)),
        inp[DType.uint32, 2](IndexList[2](2, 4)),
        inp[DType.uint32, 2](IndexList[2](1, 2)),
    )
    PagedCheckRowOffsets.execute[target="gpu"](offsets, pkv, ctx)
    PagedCopyTokens.execute[target="gpu"](copied, pkv, token_range, ctx)
    PagedStoreKVRagged.execute[target="gpu"](q, qkv, offsets, pkv, layer, ctx)
    PagedCacheLengths.execute[target="gpu"](lengths, pkv, ctx)
"""


@pytest.fixture(scope="module")
def ptx(tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    """Kernel name -> PTX of the program above, built for sm_90."""
    from mojo.run import subprocess_run_mojo

    folder = tmp_path_factory.mktemp("sm90")
    dtype, heads, head_dim, page = SHAPE
    source = folder / "maxkv_gpu_ops.mojo"
    source.write_text(
        PROGRAM.format(
            dtype=dtype, heads=heads, head_dim=head_dim, page=page, q_width=3 * heads * head_dim
        )
    )
    result = subprocess_run_mojo(
        [
            "build",
            "--emit",
            "asm",
            "--target-accelerator",
            "sm_90",
            "-I",
            str(kernels_source_path().parent),
            str(source),
            "-o",
            str(folder / "host.s"),
        ],
        capture_output=True,
        cwd=folder,
    )
    errors = [line for line in result.stderr.decode().splitlines() if "error" in line]
    assert result.returncode == 0, "\n".join(errors) or result.stderr.decode()[-4000:]
    return {path.stem: path.read_text() for path in folder.glob("*.ptx")}


def kernel_params(ptx: str) -> list[str]:
    """The ``.param`` declarations of the PTX's entry."""
    entry = ptx[ptx.index(".entry") : ptx.index(")", ptx.index(".entry"))]
    return re.findall(r"\.param [^\n]*", entry)


def test_maxkvs_gpu_kernels_build_for_sm_90(ptx: dict[str, str]) -> None:
    assert ptx, "no kernel was built for the GPU"
    for name, text in ptx.items():
        assert ".target sm_90" in text, name


def test_the_copy_kernels_take_the_collection_by_value_and_move_16_byte_vectors(
    ptx: dict[str, str],
) -> None:
    copies = {name: text for name, text in ptx.items() if "st.global.v4" in text}
    # One row-copy kernel per collection (and per bounds-check variant MAX's
    # elementwise emits).
    assert len(copies) >= 2, sorted(ptx)
    for name, text in copies.items():
        assert "ld.global.v4" in text, name
        # The collection's fields (pointers, shape, sizes) arrive as one
        # by-value .param struct; no parameter is a pointer to the host stack.
        assert not any(".ptr" in p and "align 1" in p for p in kernel_params(text)), name

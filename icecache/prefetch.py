"""A cache hint for numba kernels: ask for rows of an array before they are read.

A decode step reads rows it chose a moment ago from places the hardware cannot guess (the host
store's rows of the pages a step loads, in page order). :func:`prefetch_row` issues LLVM's
``llvm.prefetch`` for every cache line of ``nbytes`` bytes from the start of ``arr[i]``, so the
loads that follow find them in flight or arrived. It is only a hint: on a machine without a
prefetch instruction LLVM drops it, and nothing a kernel computes depends on it.
"""

from __future__ import annotations

from llvmlite import ir
from numba import types
from numba.core import cgutils
from numba.extending import intrinsic

from . import numba_cache  # noqa: F401  (numba's cache folder: before any kernel is defined)

LINE = 64  # bytes between two hints: the cache line of x86-64 and most ARM cores


def _hint_name() -> str:
    """``llvm.prefetch`` as this LLVM names it for a byte pointer: ``.p0`` where pointers are
    opaque (LLVM 17 on, the only kind), ``.p0i8`` on the older typed pointers."""
    import llvmlite.binding as llvm

    return "llvm.prefetch.p0" if llvm.llvm_version_info >= (17,) else "llvm.prefetch.p0i8"


@intrinsic
def prefetch_row(typingctx, arr, i, nbytes):
    """``prefetch_row(arr, i, nbytes)`` in a numba kernel: hint the ``nbytes`` bytes from the
    start of row ``i`` of ``arr`` (any array whose rows are its first axis) for reading."""
    if not isinstance(arr, types.Array) or not isinstance(i, types.Integer) \
            or not isinstance(nbytes, types.Integer):
        return None
    sig = types.void(arr, i, nbytes)

    def codegen(context, builder, signature, args):
        aty, ity, nty = signature.args
        ary = context.make_array(aty)(context, builder, args[0])
        stride = cgutils.unpack_tuple(builder, ary.strides, aty.ndim)[0]
        row = builder.mul(context.cast(builder, args[1], ity, types.intp), stride)
        byte = ir.IntType(8).as_pointer()
        start = builder.gep(builder.bitcast(ary.data, byte), [row])
        n = context.cast(builder, args[2], nty, types.intp)
        i32 = ir.IntType(32)
        hint = cgutils.get_or_insert_function(
            builder.module, ir.FunctionType(ir.VoidType(), [byte, i32, i32, i32]), _hint_name())
        step = ir.Constant(n.type, LINE)
        with cgutils.for_range_slice(builder, ir.Constant(n.type, 0), n, step, inc=True) as (at, _):
            # read (0), keep in every cache level (3), data (1)
            builder.call(hint, [builder.gep(start, [at]), i32(0), i32(3), i32(1)])
        return context.get_dummy_value()

    return sig, codegen

"""Reference-count-free views of the batch state.

Numba reference-counts every array handle that crosses a function call (and many
that are bound inside inlined code): an atomic increment and decrement of the
array's meminfo each time. A pass makes a few such calls with the whole state
bundle (~25 arrays), and with tens of thousands of passes per replay those
atomics were about a fifth of the kernel time. ``borrow`` returns a view of an
array with the same data, shape and strides but no meminfo: Numba's incref and
decref skip a null meminfo, so handing the borrowed bundles down costs no atomics.
The views own nothing; they are only valid while the caller holds the real arrays,
which ``replay_batch`` does for the whole call.
"""

from numba import types
from numba.core import cgutils
from numba.extending import intrinsic


@intrinsic
def borrow(typingctx, arr):
    """A view of ``arr`` without ownership (meminfo and parent null)."""
    if not isinstance(arr, types.Array):
        return None
    sig = arr(arr)

    def codegen(context, builder, signature, args):
        src = context.make_array(signature.args[0])(context, builder, value=args[0])
        dst = context.make_array(signature.return_type)(context, builder)
        dst.meminfo = cgutils.get_null_value(dst.meminfo.type)
        dst.parent = cgutils.get_null_value(dst.parent.type)
        dst.nitems = src.nitems
        dst.itemsize = src.itemsize
        dst.data = src.data
        dst.shape = src.shape
        dst.strides = src.strides
        return dst._getvalue()

    return sig, codegen

"""Compiled kernels for the O(model) and O(changed) hot loops.

Every kernel here is a numba ``@njit(nogil=True, cache=True)`` function over
numpy arrays: it compiles once per machine (cached next to the module), runs
without the GIL, and is parallelised by :func:`deltastore.kernels.parallel.chunked`
(threads over contiguous chunks), never by numba's own threading layer, so
kernels may be called from any number of Python threads at once.

Kernels raise nothing: callers validate inputs (sizes, ranges) first, or a
kernel returns a status code that the caller turns into a typed error.
"""


def _shield_llvmlite_lib() -> None:
    """Make ``llvmlite.binding.ffi.lib`` refuse dunder names, as every Python object should.

    Its ``__getattr__`` wraps whatever the underlying ``CDLL`` returns, so
    ``hasattr(lib, "__dict__")`` is true and ``vars(lib)`` yields a function
    wrapper. Code that scans every module's globals and reads ``vars(value)``
    (vLLM's ``triton_utils.dispatcher._rebind_kernels``, run while an engine
    starts) then fails with ``AttributeError: ... has no attribute 'get'`` in
    any process that has imported numba. Only dunder lookups change.
    """
    try:
        from llvmlite.binding import ffi
    except ImportError:  # pragma: no cover - numba always brings llvmlite
        return
    cls = type(ffi.lib)
    original = cls.__getattr__
    if getattr(original, "_deltastore_shielded", False):
        return

    def __getattr__(self, name):  # type: ignore[no-untyped-def]
        if name.startswith("__") and name.endswith("__"):
            raise AttributeError(name)
        return original(self, name)

    __getattr__._deltastore_shielded = True  # type: ignore[attr-defined]
    cls.__getattr__ = __getattr__


_shield_llvmlite_lib()

"""Compiled kernels for the O(model) and O(changed) hot loops.

Every kernel here is a numba ``@njit(nogil=True, cache=True)`` function over
numpy arrays: it compiles once per machine (cached next to the module), runs
without the GIL, and is parallelised by :func:`deltastore.kernels.parallel.chunked`
(threads over contiguous chunks), never by numba's own threading layer, so
kernels may be called from any number of Python threads at once.

Kernels raise nothing: callers validate inputs (sizes, ranges) first, or a
kernel returns a status code that the caller turns into a typed error.
"""

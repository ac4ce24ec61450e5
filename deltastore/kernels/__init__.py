"""Compiled kernels for the O(model) and O(changed) hot loops.

Each module here (``diff``, ``planes``, ``checksum``, ``bitstream``, ``ranks``, ``merge``) is the Python face
of a C extension built from the ``_<module>.pyx`` beside it (Cython) when the package is installed: the loops
run on numpy arrays and raw addresses without the GIL, nothing is compiled at run time, and nothing is cached
or written anywhere. The few loops that gain from wide vectors (``_simd.h``) carry run-time CPU dispatch
(baseline, AVX2, AVX-512 on x86-64 Linux). They are parallelised by :func:`deltastore.kernels.parallel.chunked`
(threads over contiguous chunks), so kernels may be called from any number of Python threads at once.

Kernels raise nothing on the data they are given: callers validate inputs (sizes, ranges) first, or a kernel
returns a status code that the caller turns into a typed error. Arguments of the wrong kind (dtype, layout, a
read-only output) raise ``TypeError``/``ValueError`` before any memory is touched.
"""

try:
    from . import _checksum  # noqa: F401 - the extensions are built together: one that loads stands for all
except ImportError as e:  # a source checkout that was never built, or a build for another Python
    raise ImportError(
        f"deltastore's compiled kernels do not load ({e}): install the package with pip (`pip install deltastore`, "
        "or `pip install -e .` in a checkout), or build them in place with `python setup.py build_ext --inplace` "
        "(needs Cython, numpy and a C compiler)") from e

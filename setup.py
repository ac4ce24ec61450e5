"""Builds the compiled kernels (deltastore/kernels/_*.pyx) as C extensions; everything else is in pyproject.toml.

``pip install .`` / ``pip install -e .`` / ``python -m build`` run this through setuptools with Cython and
numpy's headers from ``[build-system] requires``; ``python setup.py build_ext --inplace`` rebuilds them in a
checkout. The loops are compiled with ``-O3`` for the baseline of the target (x86-64: SSE2); the few loops that
gain from wider vectors carry their own run-time dispatch (see ``deltastore/kernels/_simd.h``).
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

import numpy as np
from Cython.Build import cythonize
from setuptools import Extension, setup

HERE = Path(__file__).parent
KERNELS = sorted((HERE / "deltastore" / "kernels").glob("_*.pyx"))
# what every module includes: a change rebuilds them all
SHARED = [str(p.relative_to(HERE)) for p in sorted((HERE / "deltastore" / "kernels").glob("_*"))
          if p.suffix in (".h", ".pxd")]
# -O3: the loops vectorise; -ffp-contract=off: no fused multiply-add, so the one float sum (code costs) is the
# same on every CPU the run-time dispatch may pick; -g0: no debug info
ARGS = [] if sys.platform == "win32" else ["-O3", "-ffp-contract=off", "-g0"]

extensions = [
    Extension(
        f"deltastore.kernels.{pyx.stem}",
        [str(pyx.relative_to(HERE))],
        include_dirs=[np.get_include(), str(pyx.parent.relative_to(HERE))],
        define_macros=[("NPY_NO_DEPRECATED_API", "NPY_1_7_API_VERSION")],
        extra_compile_args=ARGS,
        depends=SHARED,
    )
    for pyx in KERNELS
]

setup(
    # the wheel carries the compiled modules only; their sources travel in the sdist (MANIFEST.in)
    exclude_package_data={"deltastore.kernels": ["*.c", "*.pyx", "*.pxd", "*.h"]},
    ext_modules=cythonize(
        extensions,
        compiler_directives={"language_level": 3},
        nthreads=int(os.environ.get("DELTASTORE_BUILD_JOBS", "0")),
    ),
)

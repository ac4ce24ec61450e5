"""``njit``: numba's decorator, with cached kernels loaded without numba's compiler.

Every kernel of this package is ``@njit(nogil=True, cache=True)``. numba's own
cache, on loading a cached kernel, first makes its target context ready to
*compile*: it compiles its runtime (NRT: reference counts, atomics) with LLVM's
full pipeline and imports every lowering module (numba.np, numba.cpython, ...).
In a process that only runs cached kernels that costs ~43 MB of resident memory
(about 30 MB of libllvmlite code pages the compile touches, 15 MB of Python
objects) and ~0.2 s, for nothing it uses.

A kernel made by :func:`njit` with ``cache=True`` loads its cached overloads
another way (:class:`LeanFunctionCache`): the runtime library comes from its
own object-code cache (:func:`ensure_runtime`: the C helpers registered, the
object file loaded, no LLVM optimisation), and no lowering module is imported.
Everything else is numba's: the same index, the same cached files, the same
dispatch. A cache miss compiles exactly as numba does (its compile path makes
the context ready itself; the runtime already in place is kept).

The runtime's object file lives next to numba's cache files for these kernels
(``nrt-<numba version>-<target digest>.bin``): a JSON header line (numba and
llvmlite versions, the codegen's target, sizes, sha256) then the object code
and its bitcode. A file that does not match this process exactly, or is
corrupt, is ignored and written anew; one that cannot be written costs the
compile on every start and nothing else. Any failure on this path falls back
to numba's own load (``DELTASTORE_NUMBA_LEAN=0`` forces that fallback).
"""

from __future__ import annotations

import functools
import hashlib
import json
import os
import uuid
from collections.abc import Callable
from typing import Any

import llvmlite
import numba
from llvmlite import binding as ll
from numba.core import config
from numba.core.caching import FunctionCache
from numba.core.compiler_lock import global_compiler_lock
from numba.core.runtime import _nrt_python, nrtdynmod, rtsys

_MAGIC = b"deltastore-nrt-object 1\n"


def njit(fn: Callable[..., Any] | None = None, **options: Any) -> Any:
    """``numba.njit(fn, **options)``; with ``cache=True`` its cached overloads load through
    :class:`LeanFunctionCache`. Used bare (``@njit``) or with options (``@njit(nogil=True, cache=True)``)."""
    if fn is None:
        return functools.partial(njit, **options)
    dispatcher = numba.njit(**options)(fn)
    if options.get("cache") and _lean_enabled():
        dispatcher._cache = LeanFunctionCache(dispatcher.py_func)
    return dispatcher


def _lean_enabled() -> bool:
    return os.environ.get("DELTASTORE_NUMBA_LEAN", "1") != "0"


class LeanFunctionCache(FunctionCache):
    """numba's ``FunctionCache`` whose loads skip the target context's refresh (see the module docstring)."""

    def load_overload(self, sig: Any, target_context: Any) -> Any:
        """The cached overload for ``sig``, or None on a miss (numba then compiles and saves it)."""
        try:
            ensure_runtime(target_context, self._cache_path)
        except Exception:  # numba's internals moved, a file could not be read: numba's own way
            return super().load_overload(sig, target_context)
        with self._guard_against_spurious_io_errors():
            return self._load_overload(sig, target_context)
        return None  # the guard swallowed an I/O error: a miss


def ensure_runtime(target_context: Any, cache_dir: str) -> None:
    """Make numba's runtime (NRT) ready for cached kernels: as numba's ``rtsys.initialize`` does, except that
    the runtime's compiled functions come from ``cache_dir`` when a matching object file is there (else they
    are compiled once and the file written). Idempotent; raises what numba or the file system raise."""
    if rtsys._init:
        return
    with global_compiler_lock:
        if rtsys._init:
            return
        if config.NRT_STATS:
            _nrt_python.memsys_enable_stats()
        for name, address in _nrt_python.c_helpers.items():
            ll.add_symbol(name if name.startswith("_") else "NRT_" + name, address)
        codegen = target_context.codegen()
        path, header = _runtime_file(cache_dir, codegen)
        library = _load_runtime(codegen, path, header)
        if library is None:
            library = _compile_runtime(target_context)
            _write_runtime(path, header, library)
        rtsys._library = library
        rtsys._init = True


def _runtime_file(cache_dir: str, codegen: Any) -> tuple[str, dict[str, Any]]:
    target = json.dumps(codegen.magic_tuple())
    header = {"numba": numba.__version__, "llvmlite": llvmlite.__version__, "target": target}
    digest = hashlib.sha256(target.encode()).hexdigest()[:16]
    return os.path.join(cache_dir, f"nrt-{numba.__version__}-{digest}.bin"), header


def _load_runtime(codegen: Any, path: str, expect: dict[str, Any]) -> Any:
    """The runtime library from ``path``, or None when it is missing, for another build, or corrupt."""
    try:
        with open(path, "rb") as f:
            data = f.read(64 << 20)
    except OSError:
        return None
    if not data.startswith(_MAGIC):
        return None
    head, _, rest = data[len(_MAGIC):].partition(b"\n")
    try:
        header = json.loads(head)
        obj_len, bc_len, digest = int(header["object"]), int(header["bitcode"]), header["sha256"]
    except (ValueError, KeyError, TypeError):
        return None
    if ({k: header.get(k) for k in expect} != expect or len(rest) != obj_len + bc_len
            or hashlib.sha256(rest).hexdigest() != digest):
        return None
    return codegen.unserialize_library(("nrt", "object", (rest[:obj_len], rest[obj_len:])))


def _compile_runtime(target_context: Any) -> Any:
    """numba's ``nrtdynmod.compile_nrt_functions``, keeping the object code so that it can be saved."""
    module, library = nrtdynmod.create_nrt_module(target_context)
    library.enable_object_caching()
    library.add_ir_module(module)
    library.finalize()
    return library


def _write_runtime(path: str, header: dict[str, Any], library: Any) -> None:
    """Save the runtime's object code at ``path`` (atomically); a directory that refuses it is left alone."""
    _, _, (obj, bitcode) = library.serialize_using_object_code()
    body = bytes(obj) + bytes(bitcode)
    head = dict(header, object=len(obj), bitcode=len(bitcode), sha256=hashlib.sha256(body).hexdigest())
    try:
        os.makedirs(os.path.dirname(path), exist_ok=True)
        tmp = os.path.join(os.path.dirname(path), f".nrt-{uuid.uuid4().hex}")
        # os.open applies the umask, as numba's own cache files do (mkstemp would force 0600: a cache shared by
        # several users would then be unreadable, and recompiled, for all but its writer)
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o666)
        try:
            with os.fdopen(fd, "wb") as f:
                f.write(_MAGIC + json.dumps(head, sort_keys=True).encode() + b"\n" + body)
            os.replace(tmp, path)
        except BaseException:
            os.unlink(tmp)
            raise
    except OSError:
        pass

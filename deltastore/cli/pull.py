"""``deltastore pull`` (and its older spelling ``materialize``): one version as a safetensors folder.

The folder is written beside ``OUT_DIR`` under a temporary name and swapped in
only once complete, so a pull that fails (a corrupt object, a full disk, an
interrupt) leaves ``OUT_DIR`` holding the version it held before. The swap is
two renames on the same filesystem: between them (microseconds) ``OUT_DIR``
is absent, never half-written.
"""

from __future__ import annotations

import argparse
import os
import shutil
import tempfile
from typing import Any

from ._common import CliError, add_store_arguments, bar, non_negative_int, open_existing
from .keys import add_trust_arguments, latest_step, trust_of

#: files a folder written by ``pull`` holds; a non-empty OUT_DIR without one of them is not replaced
_CHECKPOINT_FILES = ("model.safetensors", "model.safetensors.index.json")


def register(sub: Any, parents: list[argparse.ArgumentParser]) -> None:
    s = sub.add_parser("pull", parents=parents, help="write a version as a safetensors folder",
                       description="Rebuild a version (default: the latest) and write it to OUT_DIR as safetensors "
                                   "(sharded past 5 GiB) with the config/tokenizer files the publisher recorded. "
                                   "OUT_DIR is replaced only once the new folder is complete.")
    add_store_arguments(s)
    s.add_argument("out_dir", metavar="OUT_DIR")
    s.add_argument("--step", type=non_negative_int, help="the version (default: the latest)")
    add_trust_arguments(s)
    s.set_defaults(func=cmd_pull)
    s = sub.add_parser("materialize", parents=parents, help="alias of pull with the step as an argument",
                       description="The older spelling of `pull URI OUT_DIR --step STEP`.")
    add_store_arguments(s)
    s.add_argument("step", type=non_negative_int)
    s.add_argument("out_dir", metavar="OUT_DIR")
    add_trust_arguments(s)
    s.set_defaults(func=cmd_pull)


def cmd_pull(args: argparse.Namespace) -> int:
    from ..pull.materialize import current_umask, materialize

    out = os.path.abspath(args.out_dir)
    _check_replaceable(out)
    trust = trust_of(args)
    with open_existing(args) as store:
        store.trust = trust  # every manifest read is checked against the keys before any object is fetched
        step = args.step if args.step is not None else latest_step(args, store)
        parent = os.path.dirname(out)
        os.makedirs(parent, exist_ok=True)
        tmp = tempfile.mkdtemp(prefix=f".{os.path.basename(out)}.pull-", dir=parent)
        try:
            with bar(args, f"pull {step}") as cb:  # closed before the result line
                files = materialize(store, step, tmp, progress=cb)
            os.chmod(tmp, 0o777 & ~current_umask())  # mkdtemp makes it 0700; a pulled folder is as readable as any
            _swap_in(tmp, out)
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
    print(f"wrote version {step} to {args.out_dir}: {', '.join(files)}")
    return 0


def _check_replaceable(out: str) -> None:
    if os.path.isdir(out):
        entries = os.listdir(out)
        if entries and not any(f in entries for f in _CHECKPOINT_FILES):
            raise CliError(f"{out} exists and holds no safetensors checkpoint; refusing to replace it")
    elif os.path.exists(out):
        raise CliError(f"{out} exists and is not a folder")


def _swap_in(new: str, out: str) -> None:
    """Put folder ``new`` at ``out``; an earlier ``out`` is removed only after the new one is in place."""
    old = None
    if os.path.exists(out):
        old = tempfile.mkdtemp(prefix=f".{os.path.basename(out)}.old-", dir=os.path.dirname(out))
        os.rmdir(old)
        os.rename(out, old)
    try:
        os.rename(new, out)
    except BaseException:
        if old is not None:
            os.rename(old, out)
        raise
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)

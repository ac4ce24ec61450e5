"""``deltastore demo``: train a small model, publish every step, keep a replica in sync (what ``make demo`` runs)."""

from __future__ import annotations

import argparse
from typing import Any

from ._common import EXIT_FAILED, UsageError, add_storage_option_arguments, positive_int, storage_options


def register(sub: Any, parents: list[argparse.ArgumentParser]) -> None:
    s = sub.add_parser("demo", parents=parents, help="train a small model, publish every step, keep a replica in sync",
                       description="Train a small language model on CPU, publish its bf16 weights after every "
                                   "step and keep a second copy in sync, comparing every step bit for bit.")
    s.add_argument("--store", metavar="URI", help="store to publish to (default: a temporary folder, removed "
                                                   "afterwards)")
    s.add_argument("--steps", type=positive_int, default=30, help="training steps (at least 1)")
    add_storage_option_arguments(s)
    s.set_defaults(func=cmd_demo)


def cmd_demo(args: argparse.Namespace) -> int:
    from ..demo import run_demo

    options = storage_options(args)
    if options and args.store is None:
        raise UsageError("deltastore demo: storage options need --store URI")
    return 0 if run_demo(args.store, steps=args.steps, storage_options=options or None) else EXIT_FAILED

"""What every command shares: the parser class, storage options, opening a store, output, progress bars."""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from datetime import datetime, timezone
from typing import TYPE_CHECKING, Any, NoReturn

if TYPE_CHECKING:  # the store (numpy) and progress bars (fsspec, tqdm) are imported when a command needs them
    from ..store import DeltaStore

EXIT_OK, EXIT_FAILED, EXIT_USAGE, EXIT_NOT_A_STORE, EXIT_INTERRUPTED = 0, 1, 2, 3, 130


class CliError(Exception):
    """An error the CLI reports as one line and exit ``code``."""

    def __init__(self, message: str, code: int = EXIT_FAILED):
        super().__init__(message)
        self.code = code


class UsageError(CliError):
    """Bad arguments (exit 2); the message starts with the command (``deltastore ls: ...``)."""

    def __init__(self, message: str):
        super().__init__(message, EXIT_USAGE)


class Parser(argparse.ArgumentParser):
    """``ArgumentParser`` whose errors are one line (raised as :class:`UsageError`), not usage + exit."""

    def error(self, message: str) -> NoReturn:
        raise UsageError(f"{self.prog}: {message} (see: {self.prog} --help)")


def _int_at_least(minimum: int, text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not an integer: {text!r}") from None
    if value < minimum:
        raise argparse.ArgumentTypeError(f"must be at least {minimum}, got {value}")
    return value


def positive_int(text: str) -> int:
    """argparse type: an integer >= 1."""
    return _int_at_least(1, text)


def non_negative_int(text: str) -> int:
    """argparse type: an integer >= 0 (a step)."""
    return _int_at_least(0, text)


def non_negative_float(text: str) -> float:
    """argparse type: a finite number >= 0 (seconds)."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a number: {text!r}") from None
    if not 0 <= value < float("inf"):
        raise argparse.ArgumentTypeError(f"must be a finite number >= 0, got {text}")
    return value


def storage_option(text: str) -> tuple[str, Any]:
    """argparse type of ``-o KEY=VALUE``: VALUE parsed as JSON when it parses, else kept as a string."""
    key, sep, value = text.partition("=")
    if not sep or not key.strip():
        raise argparse.ArgumentTypeError(f"expected KEY=VALUE, got {text!r}")
    try:
        parsed: Any = json.loads(value)
    except ValueError:
        parsed = value
    return key.strip(), parsed


def storage_options_json(text: str) -> dict[str, Any]:
    """argparse type of ``--storage-options``: a JSON object."""
    try:
        doc = json.loads(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(f"not JSON ({e})") from None
    if not isinstance(doc, dict):
        raise argparse.ArgumentTypeError(f"must be a JSON object, got {type(doc).__name__}")
    return doc


def add_store_arguments(p: argparse.ArgumentParser) -> None:
    """The URI and its storage options (``--storage-options`` first, then each ``-o`` over it)."""
    p.add_argument("uri", help="store URI: a path, file://, s3://BUCKET/PREFIX, gs://..., hf://buckets/NS/NAME/...")
    add_storage_option_arguments(p)


def add_storage_option_arguments(p: argparse.ArgumentParser) -> None:
    """``-o KEY=VALUE`` (repeatable) and ``--storage-options JSON``."""
    p.add_argument("-o", dest="options", metavar="KEY=VALUE", type=storage_option, action="append", default=[],
                   help="a storage option (repeatable); VALUE is parsed as JSON when it parses, "
                        "e.g. -o endpoint_url=http://127.0.0.1:9000 -o anon=true")
    p.add_argument("--storage-options", metavar="JSON", type=storage_options_json, default={},
                   help="storage options as one JSON object; -o values override its keys")


def add_json_argument(p: argparse.ArgumentParser) -> None:
    p.add_argument("--json", action="store_true", help="print one JSON document on stdout")


def storage_options(args: argparse.Namespace) -> dict[str, Any]:
    """``--storage-options`` merged with the ``-o`` pairs (later wins)."""
    return {**args.storage_options, **dict(args.options)}


def is_store(store: DeltaStore) -> bool:
    """A store holds its ``deltastore.json`` marker, or (written before the marker) manifests under ``versions/``."""
    from ..store import STORE_MARKER

    if store.backend.exists(STORE_MARKER):
        return True
    return next(iter(store.backend.list("versions/")), None) is not None


def open_existing(args: argparse.Namespace) -> DeltaStore:
    """Open the store ``args.uri`` names; :class:`CliError` (exit 3) when nothing there is a store."""
    from ..errors import BucketNotFoundError, UnknownBackendError, UnknownOptionError
    from ..store import STORE_MARKER, open_store

    try:
        store = open_store(args.uri, **storage_options(args))
    except BucketNotFoundError as e:
        raise CliError(f"{args.uri}: not a deltastore store ({e})", EXIT_NOT_A_STORE) from e
    except UnknownOptionError as e:  # names the URI itself
        raise UsageError(f"deltastore {args.command}: {e}") from e
    except UnknownBackendError as e:
        raise UsageError(f"deltastore {args.command}: {args.uri}: no backend serves this URI ({e})") from e
    except (TypeError, ValueError) as e:  # a malformed URI, or an option the backend does not take
        raise UsageError(f"deltastore {args.command}: {args.uri}: {e}") from e
    if not is_store(store):
        store.close()
        raise CliError(f"{args.uri}: not a deltastore store (no {STORE_MARKER} and no versions/)", EXIT_NOT_A_STORE)
    return store


def emit_json(doc: Any) -> None:
    json.dump(doc, sys.stdout, indent=2, allow_nan=False)
    sys.stdout.write("\n")


def format_time(created: float) -> str:
    """A manifest's ``created`` as UTC text, or the raw number when no calendar date fits it."""
    try:
        return datetime.fromtimestamp(created, timezone.utc).strftime("%Y-%m-%d %H:%M:%S")
    except (OverflowError, OSError, ValueError):
        return f"{created!r} (not a date)"


def iso_time(created: float) -> str | None:
    """A manifest's ``created`` as ISO 8601 UTC (``2026-03-01T12:00:00.250Z``), or None when no calendar date
    fits it (what ``--json`` prints, the epoch seconds beside it)."""
    try:
        when = datetime.fromtimestamp(created, timezone.utc)
    except (OverflowError, OSError, ValueError):
        return None
    return when.isoformat(timespec="milliseconds").replace("+00:00", "Z")


def dated(doc: dict[str, Any]) -> dict[str, Any]:
    """``doc`` with its ``created`` (epoch seconds) as :func:`iso_time` and the seconds as ``created_unix``."""
    return {**doc, "created": iso_time(doc["created"]), "created_unix": doc["created"]}


def step_ranges(steps: Iterable[int]) -> str:
    """Steps as runs of consecutive numbers: ``[1, 2, 3, 7, 9, 10]`` -> ``"1-3, 7, 9-10"``."""
    runs: list[list[int]] = []
    for s in sorted(set(steps)):
        if runs and s == runs[-1][1] + 1:
            runs[-1][1] = s
        else:
            runs.append([s, s])
    return ", ".join(str(a) if a == b else f"{a}-{b}" for a, b in runs)


def human_bytes(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:,.0f} {unit}" if unit == "B" else f"{n:,.1f} {unit}"
        n /= 1024
    raise AssertionError("unreachable")


# -- progress ------------------------------------------------------------------------

def bars_on(args: argparse.Namespace) -> bool:
    """Bars are drawn when stderr is a terminal, unless ``--quiet`` or ``DELTASTORE_NO_PROGRESS=1``."""
    if getattr(args, "quiet", False):
        return False
    isatty = getattr(sys.stderr, "isatty", None)
    if not (isatty and isatty()):
        return False
    from .. import progress

    return not progress.disabled_by_env()


@contextmanager
def bar(args: argparse.Namespace, desc: str, total: float | None = None, unit: str = "B") -> Iterator[Any]:
    """A tqdm bar as an fsspec callback (what a library call's ``progress=`` takes) when :func:`bars_on`,
    else None; closed (and wiped) on exit, before the command prints its result."""
    if not bars_on(args):
        yield None
        return
    from .. import progress

    cb = progress.tqdm_callback(desc, unit)
    try:
        if total is not None:
            cb.set_size(total)
        yield cb
    finally:
        cb.close()


def advance(cb: Any, n: int = 1) -> None:
    """Move the bar ``cb`` of :func:`bar` on by ``n`` (thread-safe; nothing when bars are off)."""
    if cb is not None:
        from .. import progress

        progress.advance(cb, n)


def tracked(args: argparse.Namespace, items: Iterable[Any], desc: str, total: int, unit: str) -> Iterator[Any]:
    """Iterate ``items`` with a bar of ``total`` units (one per item)."""
    with bar(args, desc, total, unit) as cb:
        for item in items:
            yield item
            advance(cb)


def sleeper(args: argparse.Namespace, desc: str) -> Callable[[float], None]:
    """A ``sleep(seconds)`` that shows the wait as a bar of seconds when bars are on."""

    def sleep(seconds: float) -> None:
        with bar(args, desc, total=seconds, unit="s") as cb:
            if cb is None:
                time.sleep(seconds)
                return
            end = time.monotonic() + seconds
            while (left := end - time.monotonic()) > 0:
                time.sleep(min(0.1, left))
                cb.absolute_update(round(seconds - max(end - time.monotonic(), 0.0), 1))

    return sleep

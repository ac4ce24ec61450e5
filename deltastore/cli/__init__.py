"""The ``deltastore`` command line (also ``python -m deltastore``).

Commands live in one module each (:mod:`.browse`: ls, inspect; :mod:`.verify`;
:mod:`.pull`: pull, materialize; :mod:`.gc`; :mod:`.stats`; :mod:`.plugins`;
:mod:`.keys`: keygen and ``--trusted-key``; :mod:`.demo`). Exit status: 0 success; 1 an error, or problems found by
``verify``; 2 a usage error; 3 the URI holds no store; 130 interrupted
(Ctrl-C). Every error is one line on stderr (a traceback only with
``--debug``). Importing this package imports no torch and no numpy: each
command imports what it needs when it runs.
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
import traceback
from collections.abc import Sequence

from .._version import __version__
from ..errors import DeltaStoreError
from . import browse, demo, gc, keys, mirror, plugins, pull, stats, verify
from ._common import EXIT_FAILED, EXIT_INTERRUPTED, EXIT_USAGE, CliError, Parser, UsageError

__all__ = ["build_parser", "main"]

_COMMANDS = (browse, verify, pull, gc, mirror, stats, plugins, keys, demo)


def _global_options(p: argparse.ArgumentParser, default: object) -> None:
    """-v/-q/--debug, accepted before and after the command (``default`` SUPPRESS on the subparsers)."""
    p.add_argument("-v", "--verbose", action="count", default=default,
                   help="log progress: -v INFO (each commit and pull, the first retry of an unreachable "
                        "store), -vv DEBUG (each retry)")
    p.add_argument("-q", "--quiet", action="store_true", default=default,
                   help="no progress bars and only errors on stderr")
    p.add_argument("--debug", action="store_true", default=default, help="print a traceback on errors")


def build_parser() -> argparse.ArgumentParser:
    """The full argument parser (also what the docs' CLI reference is generated from)."""
    p = Parser(prog="deltastore", description="Sparse, bit-exact weight sync through object stores.",
               epilog="Exit status: 0 ok; 1 error or verify problems; 2 usage error; 3 not a deltastore store; "
                      "130 interrupted. "
                      "Progress bars appear when stderr is a terminal (off: --quiet or DELTASTORE_NO_PROGRESS=1).")
    p.add_argument("--version", action="version", version=f"deltastore {__version__}")
    _global_options(p, None)
    common = Parser(add_help=False)
    _global_options(common, argparse.SUPPRESS)
    sub = p.add_subparsers(dest="command", required=True, metavar="COMMAND", parser_class=Parser)
    for module in _COMMANDS:
        module.register(sub, [common])
    return p


def _configure_logging(args: argparse.Namespace) -> None:
    level = logging.ERROR if args.quiet else {0: logging.WARNING, 1: logging.INFO}.get(args.verbose or 0,
                                                                                      logging.DEBUG)
    log = logging.getLogger("deltastore")
    log.setLevel(level)
    # on a terminal the first retry of an unreachable store is shown at once (INFO), not after the deadline
    on_terminal = level > logging.INFO and not args.quiet and _stderr_is_a_terminal()
    logging.getLogger("deltastore.backends.retry").setLevel(logging.INFO if on_terminal else logging.NOTSET)
    if not any(isinstance(h, _StderrHandler) for h in log.handlers):
        handler = _StderrHandler()
        handler.setFormatter(logging.Formatter("%(levelname)s %(name)s: %(message)s"))
        log.addHandler(handler)


def _stderr_is_a_terminal() -> bool:
    isatty = getattr(sys.stderr, "isatty", None)
    return bool(isatty and isatty())


class _StderrHandler(logging.StreamHandler):
    """Writes to whatever ``sys.stderr`` is at the time of the record (main() may run many times), around
    any progress bar on screen (cleared, the line written, redrawn) so that neither garbles the other."""

    @property  # type: ignore[override]
    def stream(self):  # noqa: ANN201
        return sys.stderr

    @stream.setter
    def stream(self, _value: object) -> None:
        pass

    def emit(self, record: logging.LogRecord) -> None:
        tqdm = sys.modules.get("tqdm")  # imported only where a bar was drawn
        if tqdm is None:
            super().emit(record)
            return
        with tqdm.tqdm.external_write_mode(file=sys.stderr):
            super().emit(record)


def _one_line(text: str) -> str:
    return " ".join(str(text).split())


def main(argv: Sequence[str] | None = None) -> int:
    """Run the command line; returns the exit status (see the module docstring)."""
    debug = "--debug" in (sys.argv[1:] if argv is None else argv)
    try:
        args = build_parser().parse_args(argv)
        _configure_logging(args)
        code = int(args.func(args))
        sys.stdout.flush()  # here, so that EPIPE (``ls | head``) is caught below, not at exit
        return code
    except KeyboardInterrupt:  # first: matched before any later clause is looked at
        return _interrupted(exit_now=argv is None)
    except SystemExit as e:  # --help, --version
        return e.code if isinstance(e.code, int) else (0 if e.code is None else EXIT_USAGE)
    except BrokenPipeError:
        _silence_stdout()
        return EXIT_FAILED
    except UsageError as e:
        _report(debug, str(e))
        return e.code
    except CliError as e:
        _report(debug, f"deltastore: {e}")
        return e.code
    except DeltaStoreError as e:
        _report(debug, f"deltastore: {type(e).__name__}: {e}")
        return EXIT_FAILED
    except Exception as e:  # noqa: BLE001 - the CLI's contract is one line, not a traceback
        _report(debug, f"deltastore: error: {type(e).__name__}: {e}")
        return EXIT_FAILED


def _interrupted(exit_now: bool) -> int:
    """Ctrl-C: one line and status 130. From the command line (``exit_now``) the process ends here, without
    waiting for worker threads still in a transfer (their retries could take the deadline) and without a
    traceback from a second Ctrl-C during shutdown; called from Python (``main(argv)``), it returns 130."""
    try:
        _wipe_bars()
        print("deltastore: interrupted", file=sys.stderr)
        if exit_now:
            for stream in (sys.stdout, sys.stderr):
                try:
                    stream.flush()
                except (OSError, ValueError):
                    pass
            os._exit(EXIT_INTERRUPTED)
    except KeyboardInterrupt:  # pressed again while reporting
        if exit_now:
            os._exit(EXIT_INTERRUPTED)
    return EXIT_INTERRUPTED


def _wipe_bars() -> None:
    """Close every progress bar still drawn. A bar's own ``finally`` misses one the signal cut short while it
    was being built (drawn, not yet handed to its owner); the interrupted frame still holds it here."""
    tqdm = sys.modules.get("tqdm")
    if tqdm is None:
        return
    for live in list(getattr(tqdm.tqdm, "_instances", ())):
        try:
            live.close()
        except Exception:  # noqa: BLE001 - a half-built bar may lack attributes; the line below still prints
            pass


def _report(debug: bool, message: str) -> None:
    if debug:
        traceback.print_exc()
    try:
        print(_one_line(message), file=sys.stderr)
    except BrokenPipeError:
        pass


def _silence_stdout() -> None:
    """After EPIPE on stdout (``deltastore ls | head``): point stdout at devnull so the exit flush is quiet."""
    try:
        fd = sys.stdout.fileno()
    except (AttributeError, OSError, ValueError):
        return  # not a real file (tests capture it)
    devnull = os.open(os.devnull, os.O_WRONLY)
    os.dup2(devnull, fd)
    os.close(devnull)

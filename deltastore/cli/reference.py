"""The CLI reference in Markdown, generated from the argument parser (the docs site's ``cli.md``)."""

from __future__ import annotations

import argparse
import os
from unittest import mock

from . import build_parser

#: help text is wrapped at this width, whatever the terminal, so the page is the same on every machine
WIDTH = 100


def markdown(parser: argparse.ArgumentParser | None = None) -> str:
    """One section per command: its description and its full ``--help`` text."""
    parser = parser or build_parser()
    with mock.patch.dict(os.environ, {"COLUMNS": str(WIDTH)}):
        parts = ["## `deltastore`", "", "```text", parser.format_help().rstrip(), "```", ""]
        for action in parser._subparsers._group_actions:  # type: ignore[union-attr]
            if not isinstance(action, argparse._SubParsersAction):
                continue
            for name, sub in action.choices.items():
                parts += [f"## `deltastore {name}`", "", sub.description or "", "", "```text",
                          sub.format_help().rstrip(), "```", ""]
    return "\n".join(parts)


if __name__ == "__main__":
    print(markdown())

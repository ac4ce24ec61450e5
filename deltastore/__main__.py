"""``python -m deltastore``: the command line (see :mod:`deltastore.cli`)."""

import sys

try:
    from .cli import main
except KeyboardInterrupt:  # Ctrl-C while the command line is still being imported
    print("deltastore: interrupted", file=sys.stderr)
    raise SystemExit(130) from None

raise SystemExit(main())

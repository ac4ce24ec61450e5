"""``python -m deltastore``: the command line (see :mod:`deltastore.cli`)."""

from .cli import main

raise SystemExit(main())

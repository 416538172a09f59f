"""``python -m stepprof``: the command line (see ``stepprof --help``)."""

from ._cli import main

raise SystemExit(main())

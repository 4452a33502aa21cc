"""``python -m stress``: see :mod:`stress.cli`."""

from stress.cli import main

raise SystemExit(main())

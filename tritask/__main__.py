import sys

from tritask.cli import main

sys.exit(main())

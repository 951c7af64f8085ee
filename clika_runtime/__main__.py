"""``python -m clika_runtime``: the same command as ``clika-runtime``."""

import sys

from clika_runtime.cli import main

sys.exit(main())

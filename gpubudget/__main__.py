"""``python -m gpubudget``: see :mod:`gpubudget.cli`."""

import sys

from .cli import main

sys.exit(main())

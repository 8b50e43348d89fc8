"""``python -m elastic_refit.cli``: the same as the ``elastic-refit`` console script."""

import sys

from elastic_refit.cli import main

__all__: list[str] = []

sys.exit(main())

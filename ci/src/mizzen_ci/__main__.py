"""``python -m mizzen_ci``: the same CLI as the ``mizzen-ci`` console script."""

import sys

from .cli import main

sys.exit(main())

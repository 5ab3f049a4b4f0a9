"""``python -m mizzen_rollout`` is the ``mizzen-rollout`` command."""

import sys

from .cli import main

sys.exit(main())

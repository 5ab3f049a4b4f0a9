"""``python -m mizzen_train`` is ``mizzen-train``."""

import sys

from mizzen_train.cli import main

sys.exit(main())

"""``python -m accumkernels``: what this install was built with and which backends it can run."""

import sys

from accumkernels.info import main

sys.exit(main())

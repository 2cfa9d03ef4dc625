"""``python -m accumkernels.bench``: see cli.py or ``--help``."""

from .cli import main

raise SystemExit(main())

"""``python -m benchmarks.accumbench``: see cli.py or ``--help``."""

from .cli import main

raise SystemExit(main())

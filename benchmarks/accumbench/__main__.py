"""``python -m benchmarks.accumbench [step|train|host]``: see suites.py, cli.py or ``--help``."""

from benchmarks.accumbench.suites import main

raise SystemExit(main())

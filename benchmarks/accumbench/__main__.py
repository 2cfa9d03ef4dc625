"""``python -m benchmarks.accumbench [step|train]``: see suites.py, cli.py or ``--help``."""

from benchmarks.accumbench.suites import main

raise SystemExit(main())

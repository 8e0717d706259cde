"""The ``moeguard`` command line: operator, worker, demo, bench and plan in one place."""

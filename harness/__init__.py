"""The test harness shared by hack/, bench/ and tests/: the worker launcher, the metrics text parser,
the local control plane helpers and the load generator. May import hack.stack; hack/ imports
harness, never bench/."""

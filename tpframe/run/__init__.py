"""A run's set-up: pre-flight checks before any process group, the memory estimate, --help, run locks."""

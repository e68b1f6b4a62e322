"""`python -m experiments.runner ...` (see `cli`)."""

from experiments.runner import cli

cli.main()

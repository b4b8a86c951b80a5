"""`python -m mismatch` is the `mismatch` command."""

from mismatch.cli import run

run()

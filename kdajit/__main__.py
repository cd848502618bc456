"""`python -m kdajit ...` is the `kdajit` command."""
import sys

from kdajit.cli import main

sys.exit(main())

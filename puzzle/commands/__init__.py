"""Sub-commands of the `puzzle` command line, one module each (see puzzle/cli.py)."""

"""python -m edgespec: the command line (edgespec.cli)."""
from .cli import main

main(prog_name="edgespec")

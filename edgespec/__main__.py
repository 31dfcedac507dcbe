"""python -m edgespec: the command line (edgespec.app.cli)."""
from edgespec.app.cli import main

main(prog_name="edgespec")

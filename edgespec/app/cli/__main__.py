"""python -m edgespec.app.cli: the command line (the `edgespec` console script)."""
from edgespec.app.cli import main

main()

"""``python -m functional_fsdp.planner MODEL --mesh dp=8,tp=2 ...``: see ``_cli.py``."""

from ._cli import main

main()

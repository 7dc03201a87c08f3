"""``python -m minihf.cli ARGS`` runs the ``minihf`` command (as torchrun needs it)."""

from minihf.cli.app import app

app()

"""minihf.cli: the ``minihf`` command (app.py) and the tools only it uses: ``doctor``,
``plot``, ``generate`` (text in, text out) and ``config_help`` (``config show``/``doc``)."""

from minihf.cli.app import app

__all__ = ["app"]

"""The ``minihf`` command line (Typer).

Each sub-command is a thin wrapper: it parses arguments and calls library functions, so
everything the CLI does can also be done from Python.
"""

from __future__ import annotations

import typer

from minihf import __version__

app = typer.Typer(add_completion=False, no_args_is_help=True, help="minihf: RL for language models in pure PyTorch.")


def _version(value: bool) -> None:
    if value:
        typer.echo(f"minihf {__version__}")
        raise typer.Exit()


@app.callback()
def main(
    version: bool = typer.Option(False, "--version", callback=_version, is_eager=True, help="Print the version and exit."),
) -> None:
    """minihf: RL for language models in pure PyTorch."""


@app.command()
def doctor() -> None:
    """Print what this machine offers minihf: torch, CUDA/NCCL/gloo, flash-attn, threads, versions."""
    from minihf.utils.doctor import report

    for key, value in report().items():
        typer.echo(f"{key:<22} {value}")


if __name__ == "__main__":
    app()

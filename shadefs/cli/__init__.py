"""The `shadefs` command line: argument parsing, the subcommands and the background mount."""

from shadefs.cli.commands import main

__all__ = ["main"]

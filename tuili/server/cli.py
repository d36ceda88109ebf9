"""Placeholder until this part lands."""


def register(subparsers) -> None:
    """Add this part's subcommands to the `tuili` parser."""

"""The `tuili` command: one entry point whose subcommands live beside the part they drive."""

from __future__ import annotations

import argparse
import sys

from tuili.bench import cli as bench_cli
from tuili.engine import cli as engine_cli
from tuili.perf import cli as perf_cli
from tuili.server import cli as server_cli


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="tuili",
        description="tuili (推理): LLM inference on the hardware you have, with its roofline on every run.",
    )
    subparsers = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    # Each module adds its subcommands and sets `func` to the handler taking the parsed args.
    for module in (server_cli, engine_cli, bench_cli, perf_cli):
        module.register(subparsers)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    return int(args.func(args) or 0)


if __name__ == "__main__":
    sys.exit(main())

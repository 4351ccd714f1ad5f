"""The ``ringseq`` command: a parser, one function per subcommand, and ``main``."""
from __future__ import annotations

import argparse
import sys

from ringseq.errors import RingSeqError

from . import check_cmd, demo_cmd, env_cmd, launch_cmd, plan_cmd


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="ringseq", description="Exact ring attention for long-context fine-tuning.")
    sub = parser.add_subparsers(dest="command", required=True)
    launch_cmd.add_parser(sub)
    demo_cmd.add_parser(sub)
    env_cmd.add_parser(sub)
    check_cmd.add_parser(sub)
    plan_cmd.add_parser(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return args.run(args) or 0
    except RingSeqError as err:
        print(f"ringseq: error: {err}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())

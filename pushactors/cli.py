"""The ``pushactors`` command line."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="pushactors", description="KV-cache push transport tools")
    sub = parser.add_subparsers(dest="command", required=True)
    from . import demo

    demo_p = sub.add_parser("demo", help="push synthetic requests from P to D and verify every byte")
    demo.add_arguments(demo_p)
    args = parser.parse_args(argv)
    if args.command == "demo":
        return demo.run(args)
    parser.error(f"unknown command {args.command}")
    return 2


if __name__ == "__main__":
    sys.exit(main())

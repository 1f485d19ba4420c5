"""The ``pushactors`` command line."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence


def main(argv: Sequence[str] | None = None) -> int:
    # The package is loaded before any of its modules: read its version without importing
    # upward (the apps layer imports only its own and lower layers).
    version = sys.modules[__name__.partition(".")[0]].__version__
    parser = argparse.ArgumentParser(prog="pushactors", description="KV-cache push transport tools")
    parser.add_argument("--version", action="version", version=f"pushactors {version}")
    sub = parser.add_subparsers(dest="command", required=True)
    from . import demo

    demo_p = sub.add_parser("demo", help="push synthetic requests from P to D and verify every byte")
    demo.add_arguments(demo_p)
    router_p = sub.add_parser("router", help="OpenAI-compatible router for disaggregated serving (needs aiohttp)")
    _router_arguments(router_p)
    from . import bench

    bench_p = sub.add_parser(
        "bench",
        help="performance suites beside bare-NIXL baselines (docs/performance.md)",
        description=bench.__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    bench.add_arguments(bench_p)
    from . import logs

    logs_p = sub.add_parser(
        "logs",
        help="merge, follow, filter and trace the mailbox logs of every process",
        description=logs.__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    logs.add_arguments(logs_p)
    from . import top

    top_p = sub.add_parser(
        "top",
        help="live view of a running engine's ranks from its JSON logs",
        description=top.__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    top.add_arguments(top_p)
    from . import settings

    settings_p = sub.add_parser(
        "settings",
        help="every PushConfig setting: type, default, what it does (--markdown: docs/settings.md)",
        description=settings.__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    settings.add_arguments(settings_p)
    args = parser.parse_args(argv)
    if args.command == "demo":
        return demo.run(args)
    if args.command == "bench":
        return bench.run(args)
    if args.command == "logs":
        return logs.run(args)
    if args.command == "top":
        return top.run(args)
    if args.command == "settings":
        return settings.run(args)
    if args.command == "router":
        from . import router

        return router.run(args)
    parser.error(f"unknown command {args.command}")
    return 2


def _router_arguments(p: argparse.ArgumentParser) -> None:
    try:
        from .router import add_arguments
    except ImportError:
        p.add_argument("rest", nargs="*", help="install aiohttp: pip install 'pushactors[router]'")
        return
    add_arguments(p)


if __name__ == "__main__":
    sys.exit(main())

"""``kvstrata`` console script: dispatches to one small module per subcommand."""

from __future__ import annotations

import argparse
import ssl
import sys

from kvstrata.cli import (
    bench_cmd,
    config_cmd,
    delete_cmd,
    keys_cmd,
    serve_cmd,
    sim_cmd,
    up_cmd,
    verify_cmd,
)
from kvstrata.errors import KvstrataError


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="kvstrata", description="The LLM KV cache as a tiered storage system."
    )
    sub = parser.add_subparsers(dest="command", required=True)
    serve_cmd.register(sub)
    verify_cmd.register(sub)
    bench_cmd.register(sub)
    sim_cmd.register(sub)
    up_cmd.register(sub)
    config_cmd.register(sub)
    delete_cmd.register(sub)
    keys_cmd.register(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        return int(args.func(args) or 0)
    except KvstrataError as exc:
        print(f"kvstrata: error: {exc}", file=sys.stderr)
        return 2
    except (
        FileNotFoundError,
        FileExistsError,
        IsADirectoryError,
        NotADirectoryError,
        PermissionError,
        ssl.SSLError,
        UnicodeDecodeError,
    ) as exc:
        # a path, file or certificate the user named: their mistake, not a crash to debug
        print(f"kvstrata: error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())

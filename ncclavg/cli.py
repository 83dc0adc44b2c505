"""The `ncclavg` command: info | bench | train."""
from __future__ import annotations

import argparse
import json
import sys


def _cmd_info(args: argparse.Namespace) -> int:
    from .info import build_info, env_overrides, format_info

    info = build_info()
    if args.json:
        print(json.dumps(info, indent=2, sort_keys=True))
    else:
        print(format_info(info))
        env = env_overrides()
        if env:
            print("environment   " + " ".join(f"{k}={v}" for k, v in sorted(env.items())))
    return 0


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="ncclavg", description="Fused gradient averaging for data-parallel training.")
    sub = p.add_subparsers(dest="command", metavar="{info,bench,train}")
    sub.required = True
    pi = sub.add_parser("info", help="show build options, devices, NCCL and SIMD level")
    pi.add_argument("--json", action="store_true", help="print the build_info() dict as JSON")
    pi.set_defaults(func=_cmd_info)
    # `bench` and `train` live in their own modules, each adding its subparser.
    from . import bench, train_cli

    bench.add_parser(sub)
    train_cli.add_parser(sub)
    return p


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        return args.func(args)
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())

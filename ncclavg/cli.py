"""The `ncclavg` command: info | bench | train | trace.

`info` and `trace` (the reader of the flight recorder's dumps, ncclavg/transport/flight_reader.py, imported
when the command runs) live here; `bench` and `train` live in ncclavg/bench/cli.py and
ncclavg/train/cli.py, each adding its subparser. Shared conventions: a bad argument raises
`ncclavg.errors.UsageError`, which `main` prints on one line (`ncclavg train: error: ...`) with exit code 2.
"""
from __future__ import annotations

import argparse
import json
import sys

from .errors import UsageError


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


def _cmd_trace(args: argparse.Namespace) -> int:
    from .transport import flight_reader   # on use only: building the parser stays torch-free

    try:
        return flight_reader.main(args.dumps, args.last)
    except ValueError as e:
        raise UsageError(str(e)) from None


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="ncclavg", description="Fused gradient averaging for data-parallel training.")
    sub = p.add_subparsers(dest="command", metavar="{info,bench,train,trace}")
    sub.required = True
    pi = sub.add_parser("info", help="show build options, devices, NCCL and SIMD level")
    pi.add_argument("--json", action="store_true", help="print the build_info() dict as JSON")
    pi.set_defaults(func=_cmd_info)
    pt = sub.add_parser("trace", help="merge the flight recorder's dumps of a job's ranks; say where they diverge")
    pt.add_argument("dumps", nargs="+", metavar="DUMP", help="dump files, or directories of ncclavg-trace-*.json")
    pt.add_argument("--last", type=int, default=3, help="collectives shown per dump (default 3)")
    pt.set_defaults(func=_cmd_trace)
    # Imported here, not at module level: the core never imports ncclavg.bench or ncclavg.train when it
    # loads (`import ncclavg` works without torch), only when the command line is built.
    from .bench import cli as bench_cli
    from .train import cli as train_cli

    bench_cli.add_parser(sub)
    train_cli.add_parser(sub)
    return p


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        return args.func(args)
    except UsageError as e:
        print(f"ncclavg {args.command}: error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())

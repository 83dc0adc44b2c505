"""`ncclavg bench`: an nccl-tests style sweep of all_reduce_avg over message sizes, with the peers'
way of doing the same work measured side by side in the same run.

    ncclavg bench --backend local --towers 4 --compare -b 8 -e 256M
    ncclavg bench --backend gloo --nproc 2 --compare --json out.json --plot out.png
    torchrun --nproc-per-node 8 -m ncclavg bench --backend nccl --compare

Exit codes: 0 success; 1 the run failed or some result was wrong (#wrong > 0); 2 bad arguments (one
line on stderr).
"""
from __future__ import annotations

import argparse
import re
import sys
import time

from ..errors import UsageError

BACKENDS = ("local", "gloo", "nccl")
MIN_BYTES, MAX_BYTES = 8, 1 << 30
_UNITS = {"": 1, "K": 1 << 10, "M": 1 << 20, "G": 1 << 30}
_DTYPE_ALIASES = {"float32": "float32", "fp32": "float32", "float": "float32",
                  "float16": "float16", "fp16": "float16", "half": "float16",
                  "bfloat16": "bfloat16", "bf16": "bfloat16"}


def parse_size(text: str) -> int:
    """'8', '8B', '1K', '64M', '1G', '1KiB', '1.5M' -> bytes (binary multiples, like nccl-tests)."""
    m = re.fullmatch(r"\s*(\d+(?:\.\d*)?)\s*([KMG]?)(?:I?B)?\s*", str(text), re.IGNORECASE)
    if not m:
        raise argparse.ArgumentTypeError(f"invalid size {text!r}: use bytes like 8, 8B, 1K, 64M, 1G")
    value = float(m.group(1)) * _UNITS[m.group(2).upper()]
    if value != int(value):
        raise argparse.ArgumentTypeError(f"invalid size {text!r}: not a whole number of bytes")
    return int(value)


def _dtype(text: str) -> str:
    key = str(text).lower().replace("torch.", "")
    if key not in _DTYPE_ALIASES:
        raise argparse.ArgumentTypeError(f"invalid dtype {text!r}: use float32, bfloat16 or float16")
    return _DTYPE_ALIASES[key]


def _factor(text: str) -> float:
    try:
        return float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"invalid factor {text!r}: use a number > 1") from None


def sweep_sizes(min_bytes: int, max_bytes: int, factor: float) -> list[int]:
    """min, min*f, min*f^2, ... <= max (max itself only when the steps land on it, as in nccl-tests)."""
    sizes, s = [], float(min_bytes)
    while int(s) <= max_bytes:
        if not sizes or int(s) > sizes[-1]:
            sizes.append(int(s))
        s *= factor
    return sizes


class _OneLineErrorParser(argparse.ArgumentParser):
    """argparse prints usage + error on two lines and leaves unknown options to the top-level parser;
    the bench promises one line and exit code 2 for every bad argument."""

    def error(self, message: str):  # type: ignore[override]
        print(f"ncclavg bench: error: {message}", file=sys.stderr)
        sys.exit(2)

    def parse_known_args(self, args=None, namespace=None):  # type: ignore[override]
        ns, extra = super().parse_known_args(args, namespace)
        if extra:
            self.error(f"unrecognized arguments: {' '.join(extra)}")
        return ns, extra


def add_parser(subparsers) -> argparse.ArgumentParser:
    """Registers `bench` on the `ncclavg` command's subparsers."""
    p = subparsers.add_parser(
        "bench", help="nccl-tests style sweep of all_reduce_avg over sizes, peers side by side",
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    if type(p) is argparse.ArgumentParser:  # See _OneLineErrorParser
        p.__class__ = _OneLineErrorParser
    p.add_argument("--backend", choices=BACKENDS, default="local",
                   help="local: CPU towers in this process; gloo: one CPU rank per process; nccl: GPUs")
    p.add_argument("--towers", type=int, default=None,
                   help="towers in this process (local: default 2; nccl: default every visible GPU)")
    p.add_argument("--nproc", type=int, default=None,
                   help="ranks to spawn on loopback (gloo: default 2; nccl: one GPU per rank); under "
                        "torchrun the launcher's world is used")
    p.add_argument("-b", "--minbytes", type=parse_size, default=8, metavar="SIZE",
                   help="smallest message per participant (default 8; 8B..1G, K/M/G = 2^10/2^20/2^30)")
    p.add_argument("-e", "--maxbytes", type=parse_size, default=256 << 20, metavar="SIZE",
                   help="largest message (default 256M)")
    p.add_argument("-f", "--stepfactor", type=_factor, default=2.0, metavar="F",
                   help="multiply the size by F between steps (default 2; > 1)")
    p.add_argument("-d", "--dtype", type=_dtype, default="float32", help="float32 | bfloat16 | float16")
    p.add_argument("-n", "--iters", type=int, default=20,
                   help="timed iterations per point, at most (default 20; fewer on big sizes, see --budget)")
    p.add_argument("-w", "--warmup", type=int, default=5, help="warm-up iterations, at most (default 5)")
    p.add_argument("--budget", type=float, default=0.5, metavar="SECONDS",
                   help="target time per size and contender; iterations shrink to fit it, never below 3 "
                        "(default 0.5)")
    p.add_argument("--check", action=argparse.BooleanOptionalAction, default=True,
                   help="count elements that differ bit for bit from the exact mean (#wrong; default on)")
    p.add_argument("--compare", action="store_true",
                   help="also time the peers: torch (local), torch.distributed (gloo, nccl), "
                        "cupy.cuda.nccl (nccl), and a copy of the same bytes (memory bandwidth)")
    p.add_argument("--json", metavar="FILE", help="write {header, rows, summary} as JSON")
    p.add_argument("--plot", metavar="FILE.png", help="plot busbw vs size (log-log), one line per contender")
    p.add_argument("--timeout", type=float, default=300.0, metavar="SECONDS",
                   help="bound on process-group setup and every collective wait (default 300)")
    p.add_argument("--quiet", action="store_true", help="no progress line on stderr")
    p.set_defaults(func=main_from_args)
    return p


def validate(args: argparse.Namespace) -> list[int]:
    """Checks everything that can be checked before touching a backend; returns the sizes."""
    if args.backend not in BACKENDS:
        raise UsageError(f"--backend: unknown backend {args.backend!r}; use one of {', '.join(BACKENDS)}")
    for name, lo in (("towers", 1), ("nproc", 1), ("iters", 1), ("warmup", 0)):
        UsageError.check_at_least(f"--{name}", getattr(args, name), lo)
    if args.backend == "gloo" and args.towers not in (None, 1):
        raise UsageError("--towers: the gloo backend runs one tower per process; use --nproc")
    if args.backend == "local" and args.nproc is not None:
        raise UsageError("--nproc: the local backend runs in one process; use --towers")
    if args.backend == "nccl" and args.nproc is not None and args.towers not in (None, 1):
        raise UsageError("--towers: with --nproc each nccl rank drives one GPU; drop --towers")
    for flag, v in (("-b/--minbytes", args.minbytes), ("-e/--maxbytes", args.maxbytes)):
        if not MIN_BYTES <= v <= MAX_BYTES:
            raise UsageError(f"{flag}: {v} bytes is outside the supported range 8 B .. 1 GiB")
    if args.minbytes > args.maxbytes:
        raise UsageError(f"-b/--minbytes ({args.minbytes}) is larger than -e/--maxbytes ({args.maxbytes})")
    if not args.stepfactor > 1:
        raise UsageError(f"-f/--stepfactor: must be > 1, got {args.stepfactor:g}")
    if not args.budget > 0 or not args.timeout > 0:
        raise UsageError("--budget and --timeout: must be > 0 seconds")
    if args.plot:
        try:
            import matplotlib  # noqa: F401
        except ImportError:
            raise UsageError("--plot: needs matplotlib (pip install matplotlib)") from None
    sizes = sweep_sizes(args.minbytes, args.maxbytes, args.stepfactor)
    if len(sizes) > 200:
        raise UsageError(f"-f/--stepfactor: {len(sizes)} sizes between -b and -e; use a larger factor")
    _check_host_memory(args, sizes[-1])
    return sizes


def _check_host_memory(args: argparse.Namespace, max_bytes: int) -> None:
    """Refuses a sweep whose biggest size cannot fit in host memory (before allocating anything)."""
    if args.backend == "local":
        towers = args.towers or 2
        # towers, plus with --compare: torch.stack (towers) + mean + the add_ accumulator + copy scratch
        buffers = towers + (towers + 3 if args.compare else 0) + 1
    elif args.backend == "gloo":
        buffers = (args.nproc or 2) * 4  # per rank: buffer, gloo's scratch, copy scratch, checker
    else:
        return  # device memory: the GPU reports out-of-memory itself
    need = buffers * max_bytes
    avail = _available_memory()
    if avail is not None and need > 0.85 * avail:
        raise UsageError(f"-e/--maxbytes: {max_bytes} bytes needs about {need / 2 ** 30:.1f} GiB of memory "
                         f"for this sweep, {avail / 2 ** 30:.1f} GiB available; lower -e or --towers")


def _available_memory() -> int | None:
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None


def _rank_argv(args: argparse.Namespace, nproc: int) -> list[str]:
    """The bench arguments again, for the ranks we spawn."""
    argv = ["--backend", args.backend, "--nproc", str(nproc), "-b", str(args.minbytes), "-e",
            str(args.maxbytes), "-f", repr(args.stepfactor), "-d", args.dtype, "-n", str(args.iters),
            "-w", str(args.warmup), "--budget", repr(args.budget), "--timeout", repr(args.timeout),
            "--check" if args.check else "--no-check"]
    for flag, on in (("--compare", args.compare), ("--quiet", args.quiet)):
        if on:
            argv.append(flag)
    for flag, v in (("--json", args.json), ("--plot", args.plot)):
        if v:
            argv += [flag, v]
    return argv


def main_from_args(args: argparse.Namespace) -> int:
    """Runs `ncclavg bench`; a bad argument raises UsageError (printed on one line by `ncclavg`, exit 2)."""
    from . import launch

    sizes = validate(args)
    env = launch.launched() if args.backend != "local" else None
    if env is not None and args.nproc is not None and args.nproc != env["world_size"]:
        raise UsageError(f"--nproc {args.nproc} differs from the launcher's WORLD_SIZE {env['world_size']}")
    if args.backend == "nccl":
        _check_cuda(args, env)
    if env is None and (args.backend == "gloo" or (args.backend == "nccl" and args.nproc)):
        nproc = args.nproc or 2
        return launch.spawn_ranks(nproc, _rank_argv(args, nproc), args.timeout)
    try:
        rc = _run(args, sizes, env)
    except Exception as e:  # one line for the user; the traceback helps nobody reading a bench table
        rank = f" (rank {env['rank']})" if env else ""
        print(f"ncclavg bench: failed{rank}: {type(e).__name__}: {str(e).strip().splitlines()[0] if str(e).strip() else ''}",
              file=sys.stderr)
        return 1
    if env is not None and args.backend == "gloo":
        # A launched gloo rank past its last collective leaves without torch's teardown, which aborts a
        # finished process now and then. See Note [Gloo teardown] in ncclavg/comm/dist.py.
        from ..comm import end_process

        end_process(rc)
    return rc


def _check_cuda(args: argparse.Namespace, env: dict | None) -> None:
    import torch

    if not torch.cuda.is_available():
        raise UsageError("--backend nccl: needs a CUDA device and a CUDA build of torch; none is visible here")
    visible = torch.cuda.device_count()
    want = args.nproc if env is None and args.nproc else (args.towers or visible)
    if env is not None:
        want = env["local_rank"] + 1
    if want > visible:
        raise UsageError(f"--towers/--nproc: {want} GPUs asked for, {visible} visible")


def _run(args: argparse.Namespace, sizes: list[int], env: dict | None) -> int:
    from . import launch, sweep
    from .inputs import DTYPES

    if env is not None:
        launch.init_process_group(args.backend, env["local_rank"], args.timeout)
    try:
        if args.backend == "local":
            setup = sweep.setup_local(args.towers or 2, args.compare)
        elif args.backend == "gloo":
            setup = sweep.setup_gloo(args.compare, args.timeout)
        else:
            import torch

            setup = sweep.setup_nccl(args.towers or torch.cuda.device_count(), args.compare,
                                           DTYPES[args.dtype], args.timeout, env is not None,
                                           env["local_rank"] if env else 0)
        try:
            return _sweep_and_report(args, sizes, setup)
        finally:
            for c in setup.contenders:
                c.close()
    finally:
        # Ours to tear down: the launched ranks' group, or the one-rank NCCL group of the torch peer. A
        # gloo-only group is left to the process exit (See Note [Gloo teardown] in ncclavg/comm/dist.py).
        import torch.distributed as dist

        if dist.is_available() and dist.is_initialized() and args.backend == "nccl":
            dist.destroy_process_group()


def _sweep_and_report(args, sizes, setup) -> int:
    from . import report, sweep

    root = setup.ranks.is_root
    arguments = {k: v for k, v in vars(args).items() if k not in ("func", "command")}
    header = report.make_header(arguments, {
        "backend": setup.backend, "n": setup.n, "world_size": setup.ranks.world_size,
        "launcher": _launcher(setup),
        "towers_per_process": len(setup.devices), "devices": [str(d) for d in setup.devices],
        "sizes": sizes, "busbw_factor": sweep.bus_factor(setup.n), "notes": setup.notes,
        "contenders": [{"key": c.key, "label": c.label, "reference": c.reference} for c in setup.contenders],
    }) if root else {}
    table = report.Table([(c.key, c.label) for c in setup.contenders], args.dtype)
    progress = _Progress(enabled=root and not args.quiet)
    if root:
        m, v = header["machine"], header["versions"]
        print(f"# ncclavg bench: all_reduce_avg, backend {setup.backend}, n = {setup.n} "
              f"({setup.ranks.world_size} process(es) x {len(setup.devices)} tower(s)), dtype {args.dtype}, "
              f"iters <= {args.iters}, warmup <= {args.warmup}, check {'on' if args.check else 'off'}")
        print(f"# machine: {m['cpu']}, {m['cores']} cores, {m['memory_gib']} GiB"
              + (f"; GPUs: {', '.join(m['gpus'])}" if m["gpus"] else "")
              + f"; load average {m['load_avg_1m']}; torch {v['torch']}, ncclavg {v['ncclavg']}, SIMD {m['simd_level']}")
        for c in setup.contenders:
            print(f"# {report.SHORT_LABELS.get(c.key, c.key):>18} = {c.label}")
        for note in setup.notes:
            print(f"# note: {note}")
        if header["env"]:
            print("# env: " + " ".join(f"{k}={v}" for k, v in header["env"].items()))
        print(f"# busbw = algbw x 2(n-1)/n = algbw x {sweep.bus_factor(setup.n):.3f}")
        print(table.header(), flush=True)

    def on_row(size_rows):
        if root:
            progress.clear()
            print(table.row(size_rows), flush=True)

    rows = sweep.sweep(setup, sizes, args.dtype, args.iters, args.warmup, args.check, args.budget,
                             on_row=on_row, on_progress=progress.update)
    progress.clear()
    if not root:
        return 0
    summary = report.summarize(rows)
    for line in report.summary_lines(summary):
        print(line)
    if args.json:
        report.write_json(args.json, header, rows, summary)
        print(f"# wrote {args.json}")
    if args.plot:
        report.write_plot(args.plot, header, rows)
        print(f"# wrote {args.plot}")
    sys.stdout.flush()
    if summary["wrong_total"]:
        print(f"ncclavg bench: {summary['wrong_total']} wrong elements (see #wrong)", file=sys.stderr)
        return 1
    return 0


def _launcher(setup) -> str:
    import os

    from .launch import SPAWNED_VAR

    if setup.ranks.world_size == 1 and setup.ranks.group is None:
        return "single process"
    return "spawned by ncclavg bench on loopback" if os.environ.get(SPAWNED_VAR) else "external launcher (torchrun)"


class _Progress:
    """One line on stderr, rewritten in place on a terminal, once the sweep has run for a while."""

    SHOW_AFTER_S = 2.0

    def __init__(self, enabled: bool):
        self.enabled, self.t0, self.shown = enabled, time.monotonic(), False
        self.tty = enabled and sys.stderr.isatty()
        self.last_line = 0.0

    def update(self, i: int, total: int, size: int) -> None:
        elapsed = time.monotonic() - self.t0
        if not self.enabled or elapsed < self.SHOW_AFTER_S:
            return
        msg = f"[ncclavg bench] measuring size {i + 1}/{total} ({size} B), {elapsed:.0f} s elapsed"
        if self.tty:
            sys.stderr.write("\r\033[K" + msg)
            sys.stderr.flush()
            self.shown = True
        elif elapsed - self.last_line >= 5.0:  # a log file gets a line every few seconds, not a flood
            print(msg, file=sys.stderr, flush=True)
            self.last_line = elapsed

    def clear(self) -> None:
        if self.tty and self.shown:
            sys.stderr.write("\r\033[K")
            sys.stderr.flush()
            self.shown = False

"""The measuring engine of `ncclavg bench`: sets up a backend's contenders, then for each size fills
exact inputs, checks one run bit for bit, warms up and times. Printing and files live in report.

Note [Bench timing]
~~~~~~~~~~~~~~~~~~~
- Every contender first runs once on fresh exact inputs; that run is checked (#wrong) and doubles as
  the first warm-up. Later runs average buffers that already hold the mean, which costs the same (and
  every contender leaves them holding the mean, so they can share the buffers).
- The contenders of one size are timed in interleaved rounds (A B C, A B C, ...), not one after the
  other: on a shared or throttling machine a burst of outside load then hits all of them alike, and
  the ratios between them stay meaningful even when the absolute times wobble.
- Iterations are scaled down with size: a size aims at `budget` seconds per contender, never fewer
  than min(3, iters) rounds, never more than `iters`. A 256 MiB point costs a few rounds, 8 B gets all.
- One CPU process: each run is timed on its own and the median is reported. GPU: a device
  synchronize costs about as much as a small all-reduce, so runs are timed in batches between two
  synchronizes and the median over batches of the per-run time is reported (nccl-tests times one loop
  the same way).
- Multi-process: all ranks must run the same number of collectives, so the iteration counts are
  agreed (max of each rank's estimate). Before each contender's timed batch every rank passes a
  barrier, so no rank times a contender while another still finishes the previous one (on 2 cores an
  8-byte copy read 41-69 us instead of 1.5 us that way). The ranks leave torch.distributed's gloo
  barrier up to hundreds of microseconds apart, which a batch of a few hundred 2-us calls cannot
  spread thin (an 8-byte average read 6-26 us that way instead of 1.3-2.3), so when the processes
  share the shared-memory channel its barrier is used (microseconds apart), and every contender's
  batch lasts about BATCH_SECONDS on its own (not cut to a share of the iterations by a slow
  neighbour: batches of 12-20 calls still read 3-7 us for a 1.3 us average). Each sample is the
  slowest rank's (a collective is done when the last rank is done).
"""
from __future__ import annotations

import statistics
import time
from dataclasses import dataclass, field
from typing import Callable

import torch

from .contenders import (CommAverage, Contender, CopyReference, CupyNccl, TorchAddLoop,
                               TorchDistributed, TorchStackMean, Workload)
from .inputs import ExactPattern

MIN_ITERS = 3
BATCH_SECONDS = 1e-3   # small sizes: runs per timed batch (GPU, and CPU with several processes)
MAX_CPU_BATCH = 1000


class Ranks:
    """The processes taking part: one (local, single-process nccl) or a torch.distributed group."""

    def __init__(self, group=None):
        self.group = group
        self.tight = None   # a barrier whose ranks leave within microseconds, when there is one
        if group is None:
            self.rank, self.world_size = 0, 1
        else:
            import torch.distributed as dist

            self.dist = dist
            self.rank, self.world_size = dist.get_rank(), dist.get_world_size()

    @property
    def is_root(self) -> bool:
        return self.rank == 0

    def max(self, values: list[float]) -> list[float]:
        if self.group is None or not values:
            return list(values)
        t = torch.tensor(values, dtype=torch.float64)
        self.dist.all_reduce(t, op=self.dist.ReduceOp.MAX, group=self.group)
        return t.tolist()

    def sum(self, value: int) -> int:
        if self.group is None:
            return value
        t = torch.tensor([value], dtype=torch.int64)
        self.dist.all_reduce(t, group=self.group)
        return int(t.item())

    def broadcast_object(self, obj):
        if self.group is None:
            return obj
        box = [obj]
        self.dist.broadcast_object_list(box, src=0, group=self.group)
        return box[0]

    def barrier(self) -> None:
        if self.group is not None:
            self.dist.barrier(group=self.group)

    def start_together(self) -> None:
        """A barrier before a timed batch: the tight one when the setup has one (see Note [Bench timing])."""
        if self.tight is not None:
            self.tight()
        else:
            self.barrier()


@dataclass
class Setup:
    """What a sweep runs on: local towers' devices, participants, contenders, how to synchronize."""

    backend: str
    devices: list[torch.device]
    n: int                      # participants in the average (all towers of all processes)
    first: int                  # global participant index of this process's tower 0
    contenders: list[Contender]
    ranks: Ranks
    sync: Callable[[], None]
    notes: list[str] = field(default_factory=list)   # peers skipped, and why

    @property
    def on_gpu(self) -> bool:
        return self.devices[0].type == "cuda"


def _communicator():
    from ..comm import Communicator  # imported late: `ncclavg bench --help` needs no backend

    return Communicator


def _cuda_sync(devices: list[torch.device]) -> Callable[[], None]:
    def sync() -> None:
        for d in devices:
            torch.cuda.synchronize(d)
    return sync


def _no_sync() -> None:
    return None


def setup_local(towers: int, compare: bool) -> Setup:
    comm = _communicator().local(towers)
    contenders: list[Contender] = [CommAverage(comm)]
    if compare:
        contenders += [TorchStackMean(), TorchAddLoop(), CopyReference()]
    return Setup("local", [torch.device("cpu")] * towers, towers, 0, contenders, Ranks(), _no_sync)


def setup_gloo(compare: bool, timeout: float) -> Setup:
    """One tower per process; the process group is already initialised (see launch)."""
    import torch.distributed as dist

    ranks = Ranks(dist.group.WORLD)
    comm = _communicator().from_torch_distributed(device="cpu", timeout=timeout)
    contenders: list[Contender] = [CommAverage(comm)]
    if compare:
        contenders += [TorchDistributed(dist.group.WORLD, ranks.world_size, use_avg=False), CopyReference()]
    about = {"shm": "the shared-memory channel: every process is on this host; NCCLAVG_SHM=0 for torch.distributed",
             "shm+gloo": "a shared-memory channel per host, torch.distributed between the hosts",
             "gloo": "torch.distributed"}
    notes = [f"ncclavg's transport between the processes: {comm.transport} ({about[comm.transport]})"]
    if comm.transport == "shm":   # the channel's barrier releases every rank within microseconds
        ranks.tight = lambda: comm._channel.barrier(timeout)
    return Setup("gloo", [torch.device("cpu")], ranks.world_size, ranks.rank, contenders, ranks, _no_sync, notes)


def setup_nccl(towers: int | None, compare: bool, dtype: torch.dtype, timeout: float,
               distributed: bool, local_rank: int = 0) -> Setup:
    """Single process over `towers` GPUs (Communicator.nccl), or one GPU per process when launched
    under torchrun / --nproc (Communicator.from_torch_distributed)."""
    notes: list[str] = []
    Communicator = _communicator()
    if distributed:
        import torch.distributed as dist

        ranks = Ranks(dist.group.WORLD)
        dev_ids = [local_rank]
        torch.cuda.set_device(local_rank)
        comm = Communicator.from_torch_distributed(device=f"cuda:{local_rank}", timeout=timeout)
        n, first = ranks.world_size, ranks.rank
    else:
        ranks = Ranks()
        dev_ids = list(range(towers))
        comm = Communicator.nccl(dev_ids, timeout=timeout)
        n, first = towers, 0
    devices = [torch.device("cuda", i) for i in dev_ids]
    contenders: list[Contender] = [CommAverage(comm)]
    if compare:
        peer = _torch_nccl_peer(distributed, ranks, devices, n, notes)
        if peer is not None:
            contenders.append(peer)
        cupy_peer = _cupy_peer(distributed, ranks, dev_ids, dtype, notes)
        if cupy_peer is not None:
            contenders.append(cupy_peer)
        contenders.append(CopyReference())
    return Setup("nccl", devices, n, first, contenders, ranks, _cuda_sync(devices), notes)


def _torch_nccl_peer(distributed, ranks, devices, n, notes) -> Contender | None:
    import torch.distributed as dist

    if distributed:
        return TorchDistributed(dist.group.WORLD, n, use_avg=True)
    if len(devices) != 1:
        notes.append("torch.distributed peer skipped: it drives one GPU per process; run the nccl "
                     "backend under torchrun (or with --nproc) to compare with it")
        return None
    # One tower: a world of one NCCL rank in this process.
    dist.init_process_group("nccl", store=dist.HashStore(), rank=0, world_size=1, device_id=devices[0])
    return TorchDistributed(dist.group.WORLD, 1, use_avg=True)


def _cupy_peer(distributed, ranks, dev_ids, dtype, notes) -> Contender | None:
    try:
        import cupy.cuda.nccl  # noqa: F401
    except Exception as e:  # not installed, or built without NCCL
        notes.append(f"cupy.cuda.nccl peer skipped: not importable ({type(e).__name__}: {e})")
        return None
    try:
        if distributed:
            return CupyNccl.one_rank(dev_ids[0], ranks.world_size, ranks.rank, ranks.broadcast_object, dtype)
        return CupyNccl.single_process(dev_ids, dtype)
    except Exception as e:
        notes.append(f"cupy.cuda.nccl peer skipped: {type(e).__name__}: {e}")
        return None


@dataclass
class Point:
    """One measured (size, contender)."""

    time_us: float
    wrong: int | None
    iters: int
    warmup: int


def _timed(c: Contender, sync: Callable[[], None], runs: int) -> float:
    """Seconds per run of `runs` back-to-back runs between two synchronizes."""
    sync()
    t0 = time.perf_counter()
    for _ in range(runs):
        c.op()
    sync()
    return (time.perf_counter() - t0) / runs


def measure_size(contenders: list[Contender], w: Workload, s: Setup, iters: int, warmup: int, check: bool,
                 budget: float) -> list[Point]:
    """One size, every contender. See Note [Bench timing]."""
    ranks, sync = s.ranks, s.sync
    for c in contenders:
        c.setup(w)
    try:
        wrong, first = [], []
        for c in contenders:
            w.fill()
            sync()
            ranks.barrier()
            first.append(_timed(c, sync, 1))
            wrong.append(ranks.sum(c.wrong()) if check else None)
        est = [max(t, 1e-9) for t in ranks.max(first)]
        round_s = sum(est)
        n_warm = min(max(warmup - 1, 0), int(0.25 * budget * len(contenders) / round_s))
        if n_warm:
            warm = [[_timed(c, sync, 1) for c in contenders] for _ in range(n_warm)]
            est = [max(t, 1e-9) for t in ranks.max([statistics.median(col) for col in zip(*warm)])]
            round_s = sum(est)
        rounds = max(min(iters, MIN_ITERS), min(iters, int(budget * len(contenders) / round_s)))
        batch = [1] * len(contenders)
        if s.on_gpu:
            batch = [max(1, min(rounds // MIN_ITERS, int(BATCH_SECONDS / e))) for e in est]
            rounds = max(1, -(-rounds // max(batch)))  # about `iters` runs of the cheapest contender
        elif ranks.group is not None:   # each contender's batch lasts BATCH_SECONDS, whatever the others cost
            # single runs after another contender's overstate a fast one (8 B: 40 us for a 2 us call):
            # re-estimate the small ones from 10 runs started together
            again = []
            for c, e in zip(contenders, est):
                ranks.start_together()
                again.append(_timed(c, sync, 10) if e < 1e-3 else e)
            est = [max(t, 1e-9) for t in ranks.max(again)]
            batch = [max(1, min(MAX_CPU_BATCH, int(BATCH_SECONDS / e))) for e in est]
        samples = []
        for _ in range(rounds):
            row = []
            for c, k in zip(contenders, batch):
                ranks.start_together()   # every rank starts this contender's batch together
                row.append(_timed(c, sync, k))
            samples.append(row)
        samples = [ranks.max(list(col)) for col in zip(*samples)]   # per contender, slowest rank
        return [Point(statistics.median(col) * 1e6, wr, rounds * k, 1 + n_warm)
                for col, wr, k in zip(samples, wrong, batch)]
    finally:
        for c in contenders:
            c.teardown()


def bus_factor(n: int) -> float:
    """nccl-tests' all-reduce bus bandwidth factor: each byte crosses 2(n-1)/n links."""
    return 2.0 * (n - 1) / n if n > 1 else 0.0


def make_row(c: Contender, s: Setup, dtype_name: str, count: int, size_bytes: int, p: Point) -> dict:
    algbw = size_bytes / (p.time_us * 1e-6) / 1e9 if p.time_us > 0 else 0.0
    return {
        "contender": c.key, "label": c.label, "reference": c.reference, "backend": s.backend,
        "dtype": dtype_name, "size_bytes": size_bytes, "count": count, "n": s.n,
        "time_us": p.time_us, "algbw_gbps": algbw, "busbw_gbps": algbw * bus_factor(s.n),
        "wrong": p.wrong, "iters": p.iters, "warmup": p.warmup,
    }


def sweep(s: Setup, sizes: list[int], dtype_name: str, iters: int, warmup: int, check: bool,
          budget: float, on_row: Callable[[list[dict]], None] | None = None,
          on_progress: Callable[[int, int, int], None] | None = None) -> list[dict]:
    """Measures every contender at every size (bytes, rounded down to whole elements). `on_row` gets
    the rows of one size as soon as it is done; `on_progress(i, total, size)` before each size."""
    from .inputs import DTYPES

    dtype = DTYPES[dtype_name]
    pattern = ExactPattern(s.n, dtype)
    item = torch.empty((), dtype=dtype).element_size()
    rows: list[dict] = []
    for i, size in enumerate(sizes):
        count = max(1, size // item)
        w = Workload(count, pattern, s.devices, s.first)
        if on_progress is not None:
            on_progress(i, len(sizes), count * item)
        points = measure_size(s.contenders, w, s, iters, warmup, check, budget)
        size_rows = [make_row(c, s, dtype_name, count, count * item, p) for c, p in zip(s.contenders, points)]
        del w
        rows += size_rows
        if on_row is not None:
            on_row(size_rows)
    return rows

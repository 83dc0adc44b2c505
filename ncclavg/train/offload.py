"""master="cpu" with GPU towers: the pipelined CPU-master update (ZeRO-Offload style, the seed recipe's
"variables live on the CPU" done with NCCL and a fused CPU optimizer).

Note [Pipelined CPU master]
Per bucket b, with T towers and the bucket padded to a multiple of T shards:
  1. reduce-scatter-average of b (NCCL): tower t ends up with the MEAN of shard t of b;
  2. D2H of each tower's shard into one pinned host buffer (a copy stream per tower, event recorded);
  3. a CPU worker thread waits for b's events and runs the fused fp32 optimizer step of bucket b on the
     master weights, then the copy-out of b's new weights (param dtype) into a pinned host buffer;
  4. H2D of shard t of the new weights to tower t (its copy stream, event recorded);
  5. all-gather of b (NCCL): every tower holds all new weights of b.
Towers of several processes (comm: one NCCL communicator over every tower of every process, Note [Towers
of several processes] in distributed.py): every process keeps a whole fp32 master and takes the same
update, as with CPU towers. Step 1 is then an all-reduce-average over every tower (each process needs
the whole mean gradient), and step 2 copies 1/T of each bucket per local tower; in step 4 tower t of
process p uploads global shard offset_p + t of the new weights (every process computed the same ones),
and step 5's all-gather over every tower assembles them. Buckets are padded to a multiple of the number
of all towers. With one process this is the reduce-scatter pipeline above.
The main thread enqueues steps 1-2 for every bucket first (they are asynchronous), then consumes the
worker's "bucket b is staged" notifications in bucket order and enqueues 4's dependency + 5. So while
the CPU updates bucket b, the GPUs reduce and copy out bucket b+1 and all-gather bucket b-1. Each tower
moves 1/T of the gradients and of the weights over PCIe, not all of them.
Clipping and the fp16 inf/NaN check need every bucket's gradient norm before the first update; with
either on, the norm of the reduced shards is summed on the GPUs first (one small sync), then the
pipeline runs with that global norm (the fused step derives the clip factor from it). See Note [Two
passes, no partial updates] in csrc/cpu/optim.h.

THIS PATH HAS NOT RUN ON A GPU YET (see bench/results/gpu_status.md). It relies on these properties of
Communicator.nccl: a collective is ordered after the work already enqueued on each device's current
torch stream, and work enqueued on the current stream afterwards is ordered after the collective.
"""
from __future__ import annotations

import math
import queue
import threading
from typing import Any, Sequence

import torch

from .engines import OptimConfig, check_master_state, tower_communicator, tower_plan
from ..errors import CommTimeoutError
from .metrics import StepTimes

_ALIGN_BYTES = 256


def _pad_to(n: int, multiple: int) -> int:
    return (n + multiple - 1) // multiple * multiple


def bucket_layout(numel: int, itemsize: int, towers_all: int, towers_here: int, several: bool) -> tuple:
    """(padded, shard, parts) of one bucket: padded to a multiple of towers_all shards that each start on
    a 256-byte boundary; shard = padded / towers_all elements (global tower g owns [g * shard, (g + 1) *
    shard)); parts[t] = the (lo, hi) that local tower t copies to the host: its own shard with one process,
    1/towers_here of the all-reduced bucket with several (towers_here need not divide towers_all: the
    parts are ceil-sized, the last one shorter)."""
    padded = _pad_to(numel, towers_all * max(1, _ALIGN_BYTES // itemsize))
    if not several:
        return padded, padded // towers_all, [(t * padded // towers_here, (t + 1) * padded // towers_here)
                                              for t in range(towers_here)]
    step = -(-padded // towers_here)
    return padded, padded // towers_all, [(min(padded, t * step), min(padded, (t + 1) * step))
                                          for t in range(towers_here)]


class GpuOffloadEngine:
    kind = "cpu"

    def __init__(self, tower_params: Sequence[Sequence[torch.Tensor]], names: Sequence[str],
                 devices: Sequence[torch.device], opt: OptimConfig, bucket_cap_mb: float,
                 first_bucket_mb: float, check_finite: bool = True, comm: Any = None):
        from ..master import MasterWeights

        self.devices = list(devices)
        self.tower_params = [list(ps) for ps in tower_params]
        self.T = T = len(self.devices)
        self.check_finite = bool(check_finite)
        self.plan = tower_plan(self.tower_params, names, bucket_cap_mb, first_bucket_mb)
        self.comm = comm if comm is not None else tower_communicator(self.devices)
        # every tower of every process (N), this process's first global tower, and whether others exist
        N = int(getattr(self.comm, "size", T))
        self.offset = int(getattr(self.comm, "tower_offset", 0))
        self.multi = int(getattr(self.comm, "world_size", 1)) > 1
        layouts = [bucket_layout(b.numel, torch.empty((), dtype=b.dtype).element_size(), N, T, self.multi)
                   for b in self.plan.buckets]
        self.padded = [lay[0] for lay in layouts]
        self.shard = [lay[1] for lay in layouts]
        self.parts = [lay[2] for lay in layouts]
        self.param_flats, self.grad_flats, self.grad_shards, self.param_shards = [], [], [], []
        for t, (ps, dev) in enumerate(zip(self.tower_params, self.devices)):
            pf = [torch.zeros(n, dtype=b.dtype, device=dev) for n, b in zip(self.padded, self.plan.buckets)]
            gf = [torch.zeros(n, dtype=b.dtype, device=dev) for n, b in zip(self.padded, self.plan.buckets)]
            with torch.no_grad():
                for s in self.plan.slots:  # See Note [Flat tower storage] in engines.py
                    view = self.plan.slot_view(pf[s.bucket], s.index)
                    view.copy_(ps[s.index].detach())
                    ps[s.index].data = view
                    ps[s.index].grad = self.plan.slot_view(gf[s.bucket], s.index)
            self.param_flats.append(pf)
            self.grad_flats.append(gf)
            self.grad_shards.append([] if self.multi else   # several processes: parts of grad_flats instead
                                    [torch.empty(n, dtype=b.dtype, device=dev) for n, b in zip(self.shard, self.plan.buckets)])
            self.param_shards.append([torch.empty(n, dtype=b.dtype, device=dev)
                                      for n, b in zip(self.shard, self.plan.buckets)])
        pin = torch.cuda.is_available()
        sizes = list(zip(self.padded, self.plan.buckets))
        self.host_grads = [torch.zeros(n, dtype=b.dtype, pin_memory=pin) for n, b in sizes]
        self.host_params = [torch.zeros(n, dtype=b.dtype, pin_memory=pin) for n, b in sizes]
        # Finiteness and the clip factor are decided on the GPUs (_clip_and_check) before the pipeline
        # starts, so the fused step runs its single pass (skip_nonfinite=False, grad_norm given).
        self.master = MasterWeights(self.tower_params[0], plan=self.plan, skip_nonfinite=False,
                                    **opt.master_kwargs())
        self.copy_streams = [torch.cuda.Stream(device=d) for d in self.devices]
        self._todo: queue.Queue = queue.Queue()
        self._staged: queue.Queue = queue.Queue()
        self._broken: str | None = None   # See Note [A failed CPU master step]
        self._worker = threading.Thread(target=self._worker_loop, name="ncclavg-cpu-master", daemon=True)
        self._worker.start()

    # ------------------------------------------------------------------ per step
    def zero_grad(self) -> None:
        for t, gf in enumerate(self.grad_flats):
            with torch.cuda.device(self.devices[t]):
                for flat in gf:
                    flat.zero_()

    def before_compute(self, tower_streams: Sequence[Any] | None) -> None:
        # The towers' next forward reads the all-gathered weights and writes the zeroed grads.
        for dev, s in zip(self.devices, tower_streams or ()):
            s.wait_stream(torch.cuda.current_stream(dev))

    def after_compute(self, tower_streams: Sequence[Any] | None) -> None:
        for dev, s in zip(self.devices, tower_streams or ()):
            torch.cuda.current_stream(dev).wait_stream(s)

    def _shard_of(self, full: torch.Tensor, b: int, g: int) -> torch.Tensor:
        """Shard of global tower g of a padded bucket."""
        return full.narrow(0, g * self.shard[b], self.shard[b])

    def _grad_part(self, t: int, b: int) -> torch.Tensor:
        """What local tower t copies to the host of bucket b's averaged gradient."""
        if not self.multi:
            return self.grad_shards[t][b]
        lo, hi = self.parts[b][t]
        return self.grad_flats[t][b][lo:hi]

    def _clip_and_check(self, loss_scale: float | None, max_grad_norm: float | None) -> tuple[bool, float | None, list]:
        """(skip, grad norm, non-finite buckets) from the reduced parts: the local towers' parts partition
        every bucket, so the sum of their squares over towers and buckets is the squared norm of the mean
        gradient (the same in every process: they all hold the same mean). One small host sync per step."""
        per_tower = []
        for t, dev in enumerate(self.devices):
            with torch.cuda.device(dev):
                sq = [torch.linalg.vector_norm(self._grad_part(t, b), dtype=torch.float32).square()
                      for b in range(len(self.plan.buckets))]
                per_tower.append(torch.stack(sq).to("cpu", non_blocking=False))
        by_bucket = torch.stack(per_tower).sum(0)          # [buckets]
        norm = math.sqrt(float(by_bucket.sum()))
        if loss_scale is not None:
            norm /= loss_scale
        # the reduction mixed the towers: the tower is unknown (None), the bucket is not
        bad = [(None, b) for b, v in enumerate(by_bucket.tolist()) if not math.isfinite(v)]
        return not math.isfinite(norm), norm, bad

    def step(self, lr: float, loss_scale: float | None, max_grad_norm: float | None,
             times: StepTimes) -> dict:
        """Note [A failed CPU master step]
        The worker steps the buckets one after another while the main thread all-gathers the finished
        ones. When one bucket fails (a timeout, an error in the update), the buckets before it are
        updated and the ones after it are not, and the worker still holds queued work that it would
        hand to the NEXT step's loop as if it were that step's. Nothing can be repaired from there, so
        the engine is broken for good: the worker discards what is left, and every later step raises
        naming the first failure (load a checkpoint into a new trainer to go on)."""
        if self._broken is not None:
            raise RuntimeError(f"the CPU master pipeline failed in an earlier step ({self._broken}); its "
                               "master weights are partly updated: build a new trainer from the last checkpoint")
        nb = len(self.plan.buckets)
        with times.phase("reduce"):
            for b in range(nb):
                if self.multi:   # every process needs the whole mean: it steps a whole master
                    self.comm.all_reduce_avg([gf[b] for gf in self.grad_flats], tag=f"bucket {b}")
                else:
                    self.comm.reduce_scatter_avg([gf[b] for gf in self.grad_flats],
                                                 [gs[b] for gs in self.grad_shards])
        skip, norm = False, None
        if self.check_finite or loss_scale is not None or max_grad_norm is not None:
            skip, norm, bad = self._clip_and_check(loss_scale, max_grad_norm)
            if skip:  # nothing was updated: the master step has not started
                return {"skipped": True, "grad_norm": norm, "nonfinite": bad}
        self.master.hp["lr"] = lr
        with times.phase("offload"):
            for b in range(nb):
                events = []
                for t, dev in enumerate(self.devices):
                    cs = self.copy_streams[t]
                    cs.wait_stream(torch.cuda.current_stream(dev))  # after the reduce-scatter
                    with torch.cuda.stream(cs):
                        lo, hi = self.parts[b][t]
                        self.host_grads[b][lo:hi].copy_(self._grad_part(t, b), non_blocking=True)
                        ev = torch.cuda.Event()
                        ev.record(cs)
                    events.append(ev)
                self._todo.put((b, events, loss_scale, max_grad_norm, norm))
        with times.phase("broadcast"):
            done: list = []
            for _ in range(nb):
                try:
                    item = self._staged.get(timeout=self.comm.timeout)
                except queue.Empty:
                    # A collective or copy the worker waits for never completed: abort the communicator
                    # (NCCL kernels stop, the worker's event wait returns) and say which bucket.
                    msg = (f"CPU master step: bucket {len(done)} of {nb} ({self.plan.buckets[len(done)].nbytes} "
                           f"bytes) was not staged within {self.comm.timeout:g} s (reduce-scatter, device-to-host "
                           "copy or the CPU update did not complete)")
                    self._broken = msg
                    self.comm.abort(msg)
                    raise CommTimeoutError(msg + "; the communicator was aborted") from None
                if isinstance(item, BaseException):
                    self._broken = f"bucket {len(done)} of {nb}: {type(item).__name__}: {item}"
                    raise item
                b, h2d_events, opt_s = item
                done.append(b)
                times.add("optimizer", opt_s)
                for t, dev in enumerate(self.devices):
                    torch.cuda.current_stream(dev).wait_event(h2d_events[t])
                self.comm.all_gather([ps[b] for ps in self.param_shards], [pf[b] for pf in self.param_flats])
        return {"skipped": False, "grad_norm": norm}

    def _worker_loop(self) -> None:
        import time

        failed = False
        while True:
            item = self._todo.get()
            if item is None:
                return
            if failed or self._broken is not None:   # See Note [A failed CPU master step]
                continue
            try:
                b, events, loss_scale, max_grad_norm, norm = item
                for ev in events:
                    ev.synchronize()
                t0 = time.perf_counter()
                numel = self.plan.buckets[b].numel
                # The shards were averaged by the reduce-scatter: one "tower" for the fused step, which
                # also writes the new weights (param dtype) into the pinned staging buffer.
                self.master.step([self.host_grads[b][:numel]], bucket=b, grad_scale=loss_scale,
                                 max_grad_norm=max_grad_norm, grad_norm=norm,
                                 out=self.host_params[b][:numel])
                opt_s = time.perf_counter() - t0
                h2d = []
                for t, dev in enumerate(self.devices):
                    cs = self.copy_streams[t]
                    with torch.cuda.device(dev), torch.cuda.stream(cs):
                        self.param_shards[t][b].copy_(self._shard_of(self.host_params[b], b, self.offset + t),
                                                      non_blocking=True)
                        ev = torch.cuda.Event()
                        ev.record(cs)
                    h2d.append(ev)
                self._staged.put((b, h2d, opt_s))
            except BaseException as e:  # hand the error to the main thread, which re-raises it
                failed = True
                self._staged.put(e)

    # ------------------------------------------------------------------ state
    def master_params(self) -> list[torch.Tensor]:
        return [v.detach().clone() for v in self.master.param_views()]

    def master_state(self) -> dict:
        return self.master.state_dict()

    def load_master_state(self, state: dict) -> None:
        check_master_state(state, self.plan)
        # The last step's H2D copies (non-blocking, on the copy streams) may still be reading the pinned
        # host_params that copy_out overwrites below: the towers' current streams waited for them, the host
        # did not. So the host waits for every copy stream first.
        for cs in self.copy_streams:
            cs.synchronize()
        self.master.load_state_dict(state)
        for b in range(len(self.plan.buckets)):
            numel = self.plan.buckets[b].numel
            self.master.copy_out(dtype=self.host_params[b].dtype, bucket=b, out=self.host_params[b][:numel])
            for t, dev in enumerate(self.devices):
                self.param_flats[t][b].copy_(self.host_params[b].to(dev))

    def close(self) -> None:
        if self._worker.is_alive():
            self._todo.put(None)
            self._worker.join(timeout=self.comm.timeout)
        self.comm.close()

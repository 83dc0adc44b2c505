"""GradientAverager: after backward, every tower's .grad holds the mean gradient over all towers.

Note [Zero-copy bucket views]
Each tower owns one flat storage per bucket, and each parameter's .grad IS a view into it (torch
accumulates into an existing .grad in place), so backward writes straight into the buckets and the
reduction needs no copy at all. That is DDP's gradient_as_bucket_view, made the default. A grad that is
not our view -- the user replaced .grad, zero_grad(set_to_none=True) left None and torch allocated a new
tensor, or backward ran with create_graph -- is packed into the bucket with ONE fused call per tower and
bucket, and after the reduction the parameter's .grad is pointed back at its view (as DDP does). When the
towers are nn.Modules, a forward pre-hook re-points .grad tensors that are None at their (zeroed) views
before backward, so the usual `optimizer.zero_grad()` keeps the zero-copy path.
With grad_dtype (bfloat16/float16 buckets for float32 parameters) .grad cannot be a view (torch requires
grad.dtype == param.dtype): grads stay float32 tensors, are cast into the bucket by the fused pack and the
mean is cast back by the fused unpack, with the backend's remaining 1/N (gloo) fused into that unpack.

Note [Launch order]
With overlap=True a post-accumulate-grad hook on every parameter counts down its bucket; a bucket whose
grads are complete on every local tower is reduced at once, while backward goes on (CPU backends: on the
communicator's worker thread or gloo's; CUDA: on the comm streams, or on the current stream for towers
sharing one GPU). Buckets are always launched in index order, so every process issues the same
collectives in the same order even when its grads become ready in another order: a ready bucket waits
for its predecessors. average() launches whatever is left (e.g.
buckets holding parameters that got no gradient), waits (CPU: bounded by comm.timeout; CUDA: see Note
[Stream-ordered average]) and finalizes.

Note [Stream-ordered average]
On CUDA towers nothing in average() needs the host to wait. Each collective is ordered after the towers'
work on their devices' current streams when it is launched (NCCL: an event recorded on the caller's
stream; local backend: the average kernel runs on that stream itself). Finishing a bucket orders each
tower's current stream after THAT bucket's collective (`Work.wait_stream()`: an event wait on the device,
not on the host) and enqueues the bucket's unpack there; the optimizer is stream-ordered too, so it reads
the mean without the host ever waiting. The host waits -- once, after every bucket was ordered, bounded by
comm.timeout -- only with average(block=True), which is the default when the communicator spans several
processes: a peer process that died or diverged leaves a collective that never completes, and only a
bounded host wait turns that into CommTimeoutError (the NCCL core aborts the communicator) instead of a
hang in the next host synchronisation. Towers all in this process have no such peer (one grouped NCCL
call, or one kernel). A Work without wait_stream() (a backend with no stream-only ordering) is waited for
on the host, bucket by bucket, as on CPU towers, where the collective IS host work.

Note [Parameters without a gradient]
A parameter whose .grad is None when its bucket is reduced contributes ZEROS to the average (its slot is
zeroed), and afterwards its .grad holds the mean like any other parameter -- on every rank, so ranks
always agree on which parameters have a gradient. This is logged once per parameter at debug level.
"""
from __future__ import annotations

import contextlib
import hashlib
import logging
import threading
import time
from typing import Any, Iterator, Optional, Sequence

import torch

from . import ops
from .bucketing import BucketPlan, check_across_processes, parse_dtype, plan_towers

log = logging.getLogger(__name__)


class GradientAverager:
    """Averages the gradients of `towers` (model replicas fed by this process; one per local tower of
    `comm`) across all towers of `comm`, one fused collective per bucket.

    towers: a list of nn.Module (their parameters that require grad, in registration order) or a list of
    parameter lists (all must require grad). Towers must have identical layouts (LayoutMismatchError
    otherwise, naming the first differing parameter); with several processes the layouts are compared
    across processes at construction. See Note [Zero-copy bucket views], Note [Launch order] and
    Note [Parameters without a gradient]."""

    def __init__(self, comm: Any, towers: Sequence[Any], bucket_cap_mb: float = 25, first_bucket_mb: float = 1,
                 overlap: bool = True, grad_dtype: Any = None, names: Optional[Sequence[str]] = None,
                 check_finite: bool = False):
        # Everything is validated before anything is changed: a bad argument leaves grads and hooks alone.
        for attr in ("all_reduce_avg_async", "allgather_object", "local_size", "devices", "timeout"):
            if not hasattr(comm, attr):
                raise TypeError(f"comm: expected an ncclavg Communicator, got {type(comm).__name__}")
        try:
            if not isinstance(overlap, bool):
                raise TypeError(f"overlap: expected a bool, got {type(overlap).__name__}")
            if not isinstance(check_finite, bool):
                raise TypeError(f"check_finite: expected a bool, got {type(check_finite).__name__}")
            gdt = parse_dtype(grad_dtype, "grad_dtype")
        except (ValueError, TypeError) as e:
            check_across_processes(comm, None, e)   # raises e once the peers know (none waits for this one)
            raise                                   # (not reached)
        params, modules, plan = plan_towers(comm, towers, names, bucket_cap_mb, first_bucket_mb, gdt)

        self.comm = comm
        self.plan: BucketPlan = plan
        self.params: list = params
        self.overlap = overlap
        self.grad_dtype = gdt
        self.check_finite = check_finite
        self._last_amax: list = []
        # See Note [Finiteness of the averaged gradients]; None until an average() noted it.
        self.bucket_finite: list = [None] * len(plan.buckets)
        self.stats: dict = {"steps": 0, "bytes_reduced": 0, "bucket_bytes": [b.nbytes for b in plan.buckets],
                            "bucket_time_s": [0.0] * len(plan.buckets), "buckets_overlapped": 0,
                            "fallback_packs": 0, "params_without_grad": 0, "average_time_s": 0.0}
        self._ntowers = len(params)
        self._nb = len(plan.buckets)
        self._slot_bucket = [s.bucket for s in plan.slots]
        self._bucket_fp = [_bucket_fingerprint(plan, b) for b in range(self._nb)]
        # Per bucket: slots whose .grad can be a view, and slots cast through pack/unpack (grad_dtype).
        self._view_slots = [[s.index for s in b.slots if s.dtype == b.dtype] for b in plan.buckets]
        self._cast_slots = [[s.index for s in b.slots if s.dtype != b.dtype] for b in plan.buckets]
        self._storage, self._views = self._make_storage()
        self._cuda = self._storage[0][0].is_cuda   # See Note [Stream-ordered average]
        self._side_streams: dict = {}             # device -> the stream nonfinite() reads the amax on
        self._lock = threading.Lock()
        self._sync_enabled = True
        self._fired = False         # a backward produced a grad since the last average()
        self._broken: Optional[BaseException] = None
        self._unused_logged: set = set()
        self._reset_step()
        self._install_views()
        self._handles = self._register_hooks(modules)

    def _make_storage(self) -> tuple:
        """-> (storage, views): each tower's zeroed buckets, and the views of its slots whose gradients can
        live in them (Note [Zero-copy bucket views])."""
        plan = self.plan
        storage = [[torch.zeros(b.numel, dtype=b.dtype, device=self.params[t][0].device) for b in plan.buckets]
                   for t in range(self._ntowers)]
        views: list = [[None] * len(plan.slots) for _ in range(self._ntowers)]
        for t in range(self._ntowers):
            for b in range(self._nb):
                for i in self._view_slots[b]:
                    views[t][i] = plan.slot_view(storage[t][b], i)
        return storage, views

    def _register_hooks(self, modules: list) -> list:
        """Every parameter's post-accumulate hook (Note [Launch order]) and each module tower's forward
        pre-hook that points its gradients back at the views; their handles, removed by close()."""
        handles = []
        for t in range(self._ntowers):
            for i, p in enumerate(self.params[t]):
                handles.append(p.register_post_accumulate_grad_hook(self._make_hook(t, i)))
            if modules[t] is not None:
                handles.append(modules[t].register_forward_pre_hook(self._make_rearm(t)))
        return handles

    # ------------------------------------------------------------------ public API
    def average(self, *, block: Optional[bool] = None) -> None:
        """After backward: reduces every bucket not yet reduced and finalizes, so that every tower's .grad
        holds the mean gradient over all towers.

        CPU towers: returns once the means are in place (each wait bounded by comm.timeout). CUDA towers:
        stream-ordered (Note [Stream-ordered average]): on return every bucket's collective and unpack are
        enqueued and each tower device's CURRENT stream is ordered after them, so work enqueued there next
        (the optimizer step) reads the mean; another stream must wait for that one. block=True also waits
        on the host, once and bounded by comm.timeout, until every collective completed; the default
        (None) does so only when the communicator spans several processes (comm.world_size > 1)."""
        if block is not None and not isinstance(block, bool):
            raise TypeError(f"block: expected a bool or None, got {type(block).__name__}")
        if block is None:
            block = getattr(self.comm, "world_size", 1) > 1
        if self._broken is not None:
            raise RuntimeError(f"GradientAverager: an earlier reduction failed ({self._broken}); this averager "
                               "and its communicator cannot be used any more") from self._broken
        if not self._sync_enabled:
            raise RuntimeError("average() called inside no_sync(): leave the no_sync() block first")
        t0 = time.perf_counter()
        with self._lock:
            if not self._fired and self.stats["steps"] > 0:
                raise RuntimeError("average() called twice without a backward in between: the gradients are "
                                   "already averaged (run backward first)")
            try:
                self._launch_through(self._nb)
            except BaseException as e:
                self._broken = e
                raise
        try:
            self._finish_all(block)
        except BaseException as e:
            self._broken = e
            raise
        overlapped = self._overlapped
        self._last_amax = self._amax
        self.bucket_finite = self._step_finite
        self._reset_step()
        st = self.stats
        st["steps"] += 1
        st["bytes_reduced"] += self.plan.total_bytes
        st["buckets_overlapped"] = overlapped
        st["average_time_s"] = time.perf_counter() - t0

    @contextlib.contextmanager
    def no_sync(self) -> Iterator[None]:
        """Gradients of backward passes inside accumulate locally; the next average() reduces the sum."""
        prev = self._sync_enabled
        self._sync_enabled = False
        try:
            yield
        finally:
            self._sync_enabled = prev

    def nonfinite(self) -> list:
        """(tower, bucket) pairs whose gradients held an inf or NaN BEFORE they were averaged, in the
        last average(); local towers only. Needs check_finite=True.

        Note [Finding the tower with a non-finite gradient]
        After the in-place average every tower holds the same (non-finite) mean, so which tower produced
        the inf/NaN can only be seen before the reduction. With check_finite=True each tower's bucket
        gets one max-|x| reduction (no temporary; inf and NaN propagate) right before its collective,
        left on the device (no host sync in backward); this call reads them, one sync for all. On CUDA
        the read runs on a side stream that waits only for those reductions (an event recorded after
        each), not for the collectives: see Note [Stream-ordered average]."""
        if not self.check_finite:
            raise RuntimeError("nonfinite(): build the GradientAverager with check_finite=True")
        flat = [(t, b, e) for t, row in enumerate(self._last_amax) for b, e in enumerate(row) if e is not None]
        if not flat:
            return []
        finite = torch.isfinite(self._amax_to_host([e for _, _, e in flat])).tolist()
        return [(t, b) for (t, b, _), ok in zip(flat, finite) if not ok]

    @property
    def grads_finite(self) -> Optional[bool]:
        """Whether every gradient the last average() left in the towers' .grad is finite, as the passes
        that wrote them noted it: True, False, or None when some bucket's last writer did not note it
        (CUDA towers, torch.distributed's own sum left as the result, a single tower); per bucket in
        `bucket_finite`. Reset to None by zero_grad() and by the next backward. Pass it to a step's
        grads_finite=... while the gradients are exactly as average() left them.

        Note [Finiteness of the averaged gradients]
        The pass that writes a bucket's final values (the local average, the unpack that divides or casts
        back, the gloo communicator's finishing scale) notes in the same loop whether it wrote an inf/NaN
        (Note [Finiteness from the pass that writes] in csrc/common/finite_math.h); the Work brings that
        back (Work.finite). A mean over towers and processes holds an inf/NaN exactly when a tower's
        gradient held one or the float32 sum overflowed, and every process receives the same bits: every
        process gets the same answer, with no exchange. A step given grads_finite=True skips its read-only
        scan (MasterWeights.step, CPUAdamW / CPUSGD(skip_nonfinite=True)); False or None: the scan decides."""
        return all_finite(self.bucket_finite)

    def _amax_to_host(self, entries: list) -> torch.Tensor:
        """float32 CPU tensor of the (amax, CUDA event or None) entries, in order."""
        out = torch.empty(len(entries), dtype=torch.float32)
        by_device: dict = {}
        for k, (m, ev) in enumerate(entries):
            by_device.setdefault(m.device if ev is not None else None, []).append(k)
        for dev, ks in by_device.items():
            if dev is None:
                out[ks] = torch.stack([entries[k][0].to(torch.float32) for k in ks])
                continue
            side = self._side_streams.get(dev)
            if side is None:
                side = self._side_streams[dev] = torch.cuda.Stream(device=dev)
            for k in ks:
                side.wait_event(entries[k][1])
            with torch.cuda.stream(side):   # the synchronous copy waits for `side` only
                out[ks] = torch.stack([entries[k][0].to(torch.float32) for k in ks]).to("cpu")
        return out

    def bucket_storage(self, tower: int, bucket: int) -> torch.Tensor:
        """The flat gradient storage of `bucket` on `tower` (the .grad views point into it)."""
        if not 0 <= tower < self._ntowers:
            raise IndexError(f"tower: {tower} out of range [0, {self._ntowers})")
        if not 0 <= bucket < self._nb:
            raise IndexError(f"bucket: {bucket} out of range [0, {self._nb})")
        return self._storage[tower][bucket]

    def zero_grad(self) -> None:
        """Zeroes every tower's bucket storage and points each .grad back at its view (grads that cannot
        be views, see grad_dtype, are set to None)."""
        self.bucket_finite = [None] * self._nb
        for t in range(self._ntowers):
            for s in self._storage[t]:
                s.zero_()
            for b in range(self._nb):
                for i in self._view_slots[b]:
                    self.params[t][i].grad = self._views[t][i]
                for i in self._cast_slots[b]:
                    self.params[t][i].grad = None

    def close(self) -> None:
        """Removes the hooks (the .grad views stay valid tensors)."""
        for h in self._handles:
            h.remove()
        self._handles = []

    def __enter__(self) -> "GradientAverager":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    def __repr__(self) -> str:
        return (f"GradientAverager(towers={self._ntowers}, params={len(self.plan.slots)}, buckets={self._nb}, "
                f"backend={getattr(self.comm, 'backend', '?')}, overlap={self.overlap}, grad_dtype={self.grad_dtype})")

    # ------------------------------------------------------------------ hooks
    def _make_hook(self, t: int, i: int) -> Any:
        def hook(_param: torch.Tensor) -> None:
            self._grad_ready(t, i)
        return hook

    def _make_rearm(self, t: int) -> Any:
        def rearm(_module: Any, _args: Any) -> None:
            if torch.is_grad_enabled():
                self._rearm_views(t)
        return rearm

    def _grad_ready(self, t: int, i: int) -> None:
        """Called once per parameter and backward (post-accumulate). See Note [Launch order]."""
        if not self._fired:   # a new backward: the last average()'s finiteness no longer describes .grad
            self.bucket_finite = [None] * self._nb
        self._fired = True
        if not self._sync_enabled:
            return
        with self._lock:
            flags = self._ready[t]
            b = self._slot_bucket[i]
            if flags[i]:
                if self._works[b] is not None:
                    raise RuntimeError(
                        f"parameter {i} of tower {t} got a second gradient after its bucket {b} was sent for "
                        "reduction: call average() after every backward, or run the extra backward passes "
                        "inside no_sync()")
                return
            flags[i] = 1
            self._pending[b] -= 1
            if self._pending[b] == 0 and self.overlap:
                ready = self._next
                while ready < self._nb and self._pending[ready] == 0:
                    ready += 1
                if ready > self._next:
                    self._overlapped += ready - self._next
                    try:
                        self._launch_through(ready)
                    except BaseException as e:
                        self._broken = e
                        raise

    def _rearm_views(self, t: int) -> None:
        """Points .grad tensors that are None back at their zeroed views (see Note [Zero-copy bucket views])."""
        params, views = self.params[t], self._views[t]
        for b in range(self._nb):
            slots = self._view_slots[b]
            missing = [i for i in slots if params[i].grad is None]
            if not missing:
                continue
            if len(missing) == len(slots):
                self._storage[t][b].zero_()
            else:
                for i in missing:
                    views[i].zero_()
            for i in missing:
                params[i].grad = views[i]

    # ------------------------------------------------------------------ reduction
    def _reset_step(self) -> None:
        self._ready = [bytearray(len(self.plan.slots)) for _ in range(self._ntowers)]
        self._pending = [self._ntowers * len(b.slots) for b in self.plan.buckets]
        self._works: list = [None] * self._nb
        self._next = 0
        self._overlapped = 0
        self._fired = False
        self._amax: list = [[None] * self._nb for _ in range(self._ntowers)]
        self._step_finite: list = [None] * self._nb   # filled by _finish_bucket

    def _launch_through(self, end: int) -> None:
        """Launches buckets [self._next, end) in order. Caller holds self._lock."""
        while self._next < end:
            b = self._next
            fixups = [self._prepare_bucket(t, b) for t in range(self._ntowers)]
            if self.check_finite:  # See Note [Finding the tower with a non-finite gradient]
                for t in range(self._ntowers):
                    s = self._storage[t][b]
                    if s.numel():
                        m, ev = torch.linalg.vector_norm(s, float("inf")), None
                        if s.is_cuda:   # nonfinite() waits for this event, not for the collective
                            ev = torch.cuda.Event()
                            ev.record(torch.cuda.current_stream(s.device))
                        self._amax[t][b] = (m, ev)
            # tag: timeouts and failures name the bucket; debug_key: see Note [Collective sequence check].
            work = self.comm.all_reduce_avg_async([self._storage[t][b] for t in range(self._ntowers)],
                                                  defer_scale=True, tag=f"bucket {b}",
                                                  debug_key=(self.stats["steps"], b, self._bucket_fp[b]))
            self._works[b] = (work, time.perf_counter(), fixups)
            self._next = b + 1

    def _prepare_bucket(self, t: int, b: int) -> tuple:
        """Gets tower t's grads of bucket b into its storage: views need nothing, None slots are zeroed,
        other grads are packed with ONE fused call. Returns what finalize must do after the reduction."""
        params, views, storage = self.params[t], self._views[t], self._storage[t][b]
        srcs, offs, reseat, unpack_to = [], [], [], []
        for i in self._view_slots[b]:
            g = params[i].grad
            if g is views[i]:
                continue
            reseat.append(i)
            if g is None:
                self._note_unused(t, i)
                views[i].zero_()
            else:
                srcs.append(_dense(g))
                offs.append(self.plan.slots[i].offset)
        for i in self._cast_slots[b]:
            s = self.plan.slots[i]
            g = params[i].grad
            if g is None:  # contributes zeros; receives the mean in a new tensor
                self._note_unused(t, i)
                storage.narrow(0, s.offset, s.numel).zero_()
                g = params[i].grad = torch.empty_like(params[i], memory_format=torch.contiguous_format)
            else:
                if g.is_sparse or not g.is_contiguous():
                    g = params[i].grad = _dense(g)
                srcs.append(g)
                offs.append(s.offset)
            unpack_to.append((s.offset, g))
        if srcs:
            ops.pack_(srcs, storage, offs)
            self.stats["fallback_packs"] += 1
        return reseat, unpack_to

    def _finish_all(self, block: bool) -> None:
        """Completes (CPU) or stream-orders (CUDA) every bucket in index order and finalizes it; with
        `block`, CUDA towers then wait on the host, once. See Note [Stream-ordered average]."""
        for b in range(self._nb):
            work = self._works[b][0]
            order = getattr(work, "wait_stream", None) if self._cuda else None
            if order is None:
                work.wait()
            else:
                order()
            self._finish_bucket(b)
        if self._cuda and block:
            for b in range(self._nb):   # the first wait is the long one: buckets complete in order
                work, t_launch, _ = self._works[b]
                work.wait()
                self.stats["bucket_time_s"][b] = (work.elapsed if work.elapsed is not None else
                                                  time.perf_counter() - t_launch)

    def _finish_bucket(self, b: int) -> None:
        """After bucket b's collective completed (CPU) or the towers' streams were ordered after it
        (CUDA): the remaining division, the cast back, .grad re-pointed at the views. bucket_time_s runs
        from launch to completion where known, else (stream-ordered) to when the streams were ordered."""
        work, t_launch, fixups = self._works[b]
        self.stats["bucket_time_s"][b] = work.elapsed if work.elapsed is not None else time.perf_counter() - t_launch
        divisor = float(getattr(work, "divisor", 1.0))
        has_views = bool(self._view_slots[b])
        # what each last writer of the .grad values noted: Note [Finiteness of the averaged gradients]
        finite = []
        for t, (reseat, unpack_to) in enumerate(fixups):
            storage = self._storage[t][b]
            if divisor != 1.0 and has_views:  # the .grad views ARE the storage: one in-place fused pass
                finite.append(ops.unpack_(storage, [storage], [0], divisor=divisor, check_finite=True))
            elif has_views:
                finite.append(getattr(work, "finite", None))
            if unpack_to:  # cast back, with the remaining 1/N fused in when the storage was not scaled
                finite.append(ops.unpack_(storage, [g for _, g in unpack_to], [off for off, _ in unpack_to],
                                          divisor=1.0 if has_views else divisor, check_finite=True))
            for i in reseat:
                self.params[t][i].grad = self._views[t][i]
        self._step_finite[b] = all_finite(finite)

    def _note_unused(self, t: int, i: int) -> None:
        self.stats["params_without_grad"] += 1
        if i not in self._unused_logged:
            self._unused_logged.add(i)
            s = self.plan.slots[i]
            log.debug("parameter %d%s (shape %s) has no gradient on tower %d this step: it contributes zeros "
                      "to the average", i, f" ({s.name})" if s.name else "", s.shape, t)

    def _install_views(self) -> None:
        for t in range(self._ntowers):
            for b in range(self._nb):
                for i in self._view_slots[b]:
                    p, v = self.params[t][i], self._views[t][i]
                    if p.grad is not None:  # keep gradients accumulated before the averager existed
                        v.copy_(p.grad)
                    p.grad = v


def all_finite(flags: Sequence[Optional[bool]]) -> Optional[bool]:
    """The finiteness of several parts from each part's: False when one is known not finite, True when
    every one is known finite (and there is one at least), None otherwise."""
    if any(f is False for f in flags):
        return False
    return True if flags and all(f is True for f in flags) else None


def _bucket_fingerprint(plan: BucketPlan, b: int) -> int:
    """63-bit hash of one bucket's layout (dtype, size, slots), for the debug-mode sequence check."""
    bucket = plan.buckets[b]
    h = hashlib.blake2b(digest_size=8)
    h.update(f"{plan.fingerprint}:{b}:{bucket.dtype}:{bucket.numel}:".encode())
    h.update(";".join(f"{s.index}:{s.offset}:{s.numel}" for s in bucket.slots).encode())
    return int.from_bytes(h.digest(), "little") >> 1


def _dense(g: torch.Tensor) -> torch.Tensor:
    if g.is_sparse:
        g = g.to_dense()
    return g if g.is_contiguous() else g.contiguous()

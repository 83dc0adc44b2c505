"""The `ncclavg` torch.distributed backend: `init_process_group("ncclavg")` after `import ncclavg`.

CPU tensors go through the host channel (shared memory between the processes of one host, `shm+gloo`
across hosts: exactly GlooCommunicator's choice, transport/shm.py), on the group's runner, which runs
them in order (transport/runner.py, Note [A runner per process group] in face.py); what the channel has no path for
goes through an inner gloo backend of the same group (Note [Which CPU collectives take the channel] in
transport/paths.py). CUDA tensors go to an inner
torch ProcessGroupNCCL of the same group.

Note [A ProcessGroup, not a Backend]
torch's C++ `Backend` has no Python constructor, so a backend written in Python is a `ProcessGroup`
subclass, and torch uses the object the creator returns as the whole group: "cpu:ncclavg,cuda:nccl" would
never create its NCCL half. So this group hands CUDA tensors to an NCCL group of its own (made here, its
communicators created by NCCL on first use), and registers for both devices. It is registered with the
extended API (connect.py reads the members' global ranks), and it keeps its name for the functional
collectives (`group_name`, set by torch right after creation).

Point-to-point calls (send, recv) go straight to gloo, outside the runner: a recv posted before the
matching send of the same rank must not block the collectives queued behind it.
"""
from __future__ import annotations

import atexit
import datetime
from typing import Any, List, Optional

import torch
import torch.distributed as dist
from torch._C._distributed_c10d import (AllgatherOptions, AllreduceCoalescedOptions, AllreduceOptions,
                                        AllToAllOptions, BarrierOptions, BroadcastOptions, GatherOptions, PrefixStore,
                                        ReduceOptions, ReduceScatterOptions, ScatterOptions)

from . import connect

from ..errors import BackendError
from ..transport import calls, flight, liveness, profiling, stragglers
from ..transport.calls import Call
from ..transport.failure import CHANNEL_ERRORS
from ..transport.reductions import R, red_kind
from ..transport.runner import Job, Runner
from ..transport.work import DoneWork, JobWork, done_work
from . import jobs as J
from .cpu_collectives import CpuCollectives
from .checks import UNSET_TIMEOUT, CallChecks, call_limit, list_call, one_tensor
from .devices import NcclCollectives, first_list
from .fast_path import fast_calls, fast_paths, native_allreduce
from .face import profiled_p2p

NAME = "ncclavg"
_profiling = profiling.enabled   # is torch's profiler on? ~20 ns


class ProcessGroupNcclavg(CallChecks, dist.ProcessGroup):
    """One process group of the `ncclavg` backend. Built by torch through the creator registered for
    the name "ncclavg" (init_process_group, new_group, DeviceMesh); see the module's notes."""

    def __init__(self, store: Any, rank: int, size: int, timeout: datetime.timedelta, group_name: str = "",
                 global_ranks: Optional[List[int]] = None, backend_options: Any = None):
        super().__init__(rank, size)
        self._rank, self._size = rank, size
        self._name = str(group_name)
        self._desc = "undefined"
        self._timeout = timeout.total_seconds()
        self.global_ranks = list(global_ranks) if global_ranks else list(range(size))
        self._gloo = dist.ProcessGroupGloo(PrefixStore("gloo/", store), rank, size, timeout)
        self._liveness = connect.heartbeats(PrefixStore("beat/", store), rank, size)
        try:
            self._runner: Runner = connect.runner_for(PrefixStore("lane/", store), rank, size, timeout, self._liveness)
        except BaseException:
            if self._liveness is not None:
                self._liveness.stop()
            raise
        self._cpu = CpuCollectives(self._runner.transport, self._gloo, rank, size)
        self._store = store
        self._nccl = self._nccl_options(timeout, backend_options)
        self._devices = {"cuda": NcclCollectives(self)}   # device type -> its collectives (Note [Device types])
        self._shut = False
        self._fast = fast_paths(self, self._runner)   # Note [The backend's fast path]
        self._runner.fast_paths.extend(self._fast.values())
        self._calls = fast_calls(self._runner, size)   # the same, for broadcast, all-gather, reduce-scatter
        # Note [What a job records] in face.py; the fast paths record with Recorder.done
        self._flight = flight.for_group(self._name, rank, size, self.global_ranks[rank], self.transport)
        self._runner.recorder = self._flight
        if self._flight is not None and stragglers.arrival_source(self._runner.transport) is not None:
            self._flight.stragglers = stragglers.dump_source(self._runner.transport)
        native = native_allreduce(self, self._fast, self._flight, self._timeout, UNSET_TIMEOUT)
        if native is not None:   # shadows the method below for this group: the general path is _allreduce
            self.allreduce = native
            self._runner.fast_paths.append(native)

    @staticmethod
    def _nccl_options(timeout: datetime.timedelta, backend_options: Any) -> Any:
        """(options,) for the inner NCCL group, made on the first CUDA tensor; None without CUDA or NCCL."""
        if not (dist.is_nccl_available() and torch.cuda.is_available()):
            return None
        opts = backend_options if isinstance(backend_options, dist.ProcessGroupNCCL.Options) else \
            dist.ProcessGroupNCCL.Options()
        opts._timeout = timeout
        return (opts,)

    # ------------------------------------------------------------------ identity
    @property
    def transport(self) -> str:
        """Between this group's processes on CPUs: "shm", "shm+gloo" or "gloo" (see shm.py)."""
        return self._runner.transport.kind if self._runner.transport is not None else "gloo"

    @property
    def group_name(self) -> str:
        return self._name

    def _set_group_name(self, name: str) -> None:
        self._name = str(name)
        if self._flight is not None:
            self._flight.group = self._name

    @property
    def group_desc(self) -> str:
        return self._desc

    def _set_group_desc(self, desc: str) -> None:
        self._desc = str(desc)

    def getBackendName(self) -> str:
        return NAME

    def name(self) -> str:
        return NAME

    def __repr__(self) -> str:
        return f"ProcessGroupNcclavg(rank={self._rank}, size={self._size}, transport={self.transport})"

    # ------------------------------------------------------------------ submission
    def _submit(self, job: J.TorchJob, op: str, opts: Any, tensors: List[torch.Tensor], result: Any,
                call: Optional[Call]) -> JobWork:
        """`job` described (what `op` on `tensors` is, its limit from `opts`, `call`, its Work's `result`),
        recorded and run on the group's runner: at once when the caller waits (asyncOp False) and nothing
        is pending, else queued (Note [One runner] in transport/runner.py)."""
        if self._shut:
            raise BackendError(f"ncclavg {op}: the process group was shut down")
        limit = call_limit(opts, self._timeout)
        job.describe(self._what(op, tensors), limit, call, result, own_timeout=limit != self._timeout)
        if self._flight is not None and call is not None:   # Note [What a job records] in face.py
            job.rec = self._flight.issue(call, tensors)
        if _profiling():   # Note [Profiler ranges of a Python backend] in profiling.py: on the worker
            with profiling.dispatched(op, tensors):
                job.prof = profiling.begin(op, tensors)
                self._runner.start(job, inline=False)
        else:
            self._runner.start(job, inline=not getattr(opts, "asyncOp", True))
        return JobWork(job)

    def submit_custom(self, job: J.TorchJob, op: str, tensors: List[torch.Tensor], result: Any, call: Call) -> JobWork:
        """A collective of this package's own (the DDP comm hook's average: a TorchJob made over
        `self.cpu`) run as the group's collectives are: in the group's order on its runner, under its
        timeout, recorded and profiled, compared across ranks as `call`; the work's result is `result`."""
        return self._submit(job, op, None, tensors, result, call)

    def straggler_report(self, calls: Optional[int] = None, seconds: Optional[float] = None,
                         threshold_s: float = stragglers.DEFAULT_THRESHOLD_S,
                         since: Optional[int] = None) -> Optional[stragglers.StragglerReport]:
        """Note [The straggler report] over this group's recent collectives (its host's channel's log, or
        between hosts on UCX the lanes', every rank of every host); None when nothing logs them here (alone
        on its host with gloo between the hosts). ncclavg.ddp.straggler_report finds the group's backend."""
        log = stragglers.arrival_source(self._runner.transport)
        return None if log is None else stragglers.report(log, calls, seconds, threshold_s, since)

    @property
    def cpu(self) -> CpuCollectives:
        """The group's CPU collectives, which its jobs run (jobs.py)."""
        return self._cpu

    def _profiled_p2p(self, op: str, tensors: List[torch.Tensor], issue: Any) -> Any:
        """A point-to-point call while the profiler runs: gloo's work wrapped so that the call records its
        ranges as a collective does (Note [Profiler ranges of a Python backend] in profiling.py)."""
        with profiling.dispatched(op, tensors):
            job = Job(None, self._what(op, tensors), self._timeout, result=tensors)
            job.runner = self._runner
            job.prof = profiling.begin(op, tensors)
            try:
                work = issue()
            except BaseException as e:
                job.complete(e)
                raise
            return profiled_p2p(work, job)

    def _nccl_group(self) -> Any:
        if isinstance(self._nccl, tuple):   # made on first use (NCCL makes its communicators lazily anyway)
            self._nccl = dist.ProcessGroupNCCL(PrefixStore("nccl/", self._store), self._rank, self._size, self._nccl[0])
        return self._nccl

    # ------------------------------------------------------------------ all-reduce family
    def allreduce(self, tensors: List[torch.Tensor], opts: Any = None) -> Any:
        """The general path; a group whose processes share a channel answers `allreduce` with its native
        fast path first (fast_path.native_allreduce), which hands here every call it does not take."""
        device = self._device("tensors", tensors)
        if device is not None:
            return device.allreduce(tensors, opts)
        opts = opts if opts is not None else AllreduceOptions()
        t = one_tensor(tensors, "tensors")
        if isinstance(t, torch.Tensor) and t.layout == torch.sparse_coo:
            return self._sparse_allreduce(t, tensors, opts)
        self._check_cpu([t], "tensors")
        op = self._op(opts.reduceOp, t)
        return self._submit(J.AllReduce(self._cpu, t, op), "allreduce", opts, [t], tensors,
                            calls.make("all_reduce", t.dtype, op, count=t.numel()))

    _allreduce = allreduce   # what the native fast path calls for the general path

    def _fast_allreduce_failed(self, tensors: List[torch.Tensor], op: Any, limit: float, e: BaseException) -> DoneWork:
        """The failed Work of an all_reduce whose round on the native fast path failed with `e`."""
        t = tensors[0]
        return self._fast_failed("allreduce", tensors, calls.make("all_reduce", t.dtype, op, count=t.numel()), limit, e)

    def _fast_failed(self, op: str, tensors: List[torch.Tensor], call: Call, limit: float,
                     e: BaseException) -> DoneWork:
        """The failed Work of a fast-path call: the group fails as the runner's job would have."""
        return done_work(tensors, error=self._runner.failed_without_job(self._what(op, tensors[:1]), limit, call,
                                                                         limit != self._timeout, e))

    def _sparse_allreduce(self, t: torch.Tensor, tensors: List[torch.Tensor], opts: Any) -> Any:
        if self._kind([t], "tensors") != "cpu":   # _device sent sparse CUDA tensors to NCCL
            raise ValueError("tensors: expected a CPU tensor")
        if red_kind(opts.reduceOp) != R.SUM:
            raise ValueError(f"op: sparse all_reduce supports SUM only (as gloo's), got {red_kind(opts.reduceOp).name}")
        dense = 1
        for d in t.shape:
            dense *= d
        return self._submit(J.SparseAllReduce(self._cpu, t), "sparse allreduce", opts, [t], tensors,
                            calls.make("sparse all_reduce", t.dtype, opts.reduceOp, count=dense))

    def allreduce_coalesced(self, tensors: List[torch.Tensor], opts: Any = None) -> Any:
        device = self._device("tensors", tensors)
        if device is not None:
            return device.allreduce_coalesced(tensors, opts)
        opts = opts if opts is not None else AllreduceCoalescedOptions()
        self._check_cpu(tensors, "tensors")
        for t in tensors:
            self._op(opts.reduceOp, t)
        op = opts.reduceOp
        return self._submit(J.AllReduceCoalesced(self._cpu, tensors, op), "allreduce_coalesced", opts, tensors,
                            tensors, list_call("all_reduce_coalesced", tensors, op))

    def reduce(self, tensors: List[torch.Tensor], opts: Any = None) -> Any:
        device = self._device("tensors", tensors)
        if device is not None:
            return device.reduce(tensors, opts)
        opts = opts if opts is not None else ReduceOptions()
        t = one_tensor(tensors, "tensors")
        self._check_cpu([t], "tensors")
        root, op = self._root(opts.rootRank), self._op(opts.reduceOp, t)
        return self._submit(J.Reduce(self._cpu, t, root, op), "reduce", opts, [t], tensors,
                            calls.make("reduce", t.dtype, op, root, t.numel()))

    def reduce_scatter_single(self, output: torch.Tensor, input: torch.Tensor, opts: Any = None) -> Any:
        device = self._device("output_tensor, input_tensor", output, input)
        if device is not None:
            return device.reduce_scatter_single(output, input, opts)
        if self._calls is not None and opts is not None:
            rop = opts.reduceOp   # Note [The backend's fast path]
            kind = R.SUM if rop == R.SUM else R.AVG if rop == R.AVG else None
            if kind is not None:
                limit = call_limit(opts, self._timeout)
                try:
                    if self._calls.reduce_scatter(output, input, kind, limit, opts.asyncOp):
                        return done_work([output])
                except CHANNEL_ERRORS as e:
                    return self._fast_failed("reduce_scatter_single", [input], calls.make(
                        "reduce_scatter_tensor", output.dtype, kind, count=output.numel()), limit, e)
        opts = opts if opts is not None else ReduceScatterOptions()
        self._check_cpu([output, input], "output_tensor, input_tensor")
        self._check_scatter_sizes(output, input)
        op = self._op(opts.reduceOp, output)
        return self._submit(J.ReduceScatterSingle(self._cpu, output, input, op), "reduce_scatter_single", opts,
                            [input], output,
                            calls.make("reduce_scatter_tensor", output.dtype, op, count=output.numel()))

    _reduce_scatter_base = reduce_scatter_single

    def reduce_scatter_single_coalesced(self, outputs: List[torch.Tensor], inputs: List[torch.Tensor],
                                        opts: Any = None) -> Any:
        device = self._device("outputs, inputs", outputs, inputs)
        if device is not None:
            return device.reduce_scatter_single_coalesced(outputs, inputs, opts)
        opts = opts if opts is not None else ReduceScatterOptions()
        if len(outputs) != len(inputs):
            raise ValueError(f"inputs: expected {len(outputs)} tensors like outputs, got {len(inputs)}")
        self._check_cpu(list(outputs) + list(inputs), "outputs, inputs")
        for o, i in zip(outputs, inputs):
            self._check_scatter_sizes(o, i)
            self._op(opts.reduceOp, o)
        op = opts.reduceOp
        return self._submit(J.ReduceScatterSingleCoalesced(self._cpu, outputs, inputs, op),
                            "reduce_scatter_single_coalesced", opts, list(inputs), list(outputs),
                            list_call("reduce_scatter_tensor_coalesced", outputs, op))

    reduce_scatter_tensor_coalesced = reduce_scatter_single_coalesced

    def reduce_scatter(self, outputs: List[torch.Tensor], input_lists: List[List[torch.Tensor]], opts: Any = None) -> Any:
        device = self._device("input_list", outputs, first_list(input_lists))
        if device is not None:
            return device.reduce_scatter(outputs, input_lists, opts)
        opts = opts if opts is not None else ReduceScatterOptions()
        out = one_tensor(outputs, "output")
        if len(input_lists) != 1:
            raise ValueError("input_list: expected one list of tensors")
        inputs = list(input_lists[0])
        if len(inputs) != self._size:
            raise ValueError(f"input_list: expected {self._size} tensors (one per rank), got {len(inputs)}")
        self._check_cpu([out] + inputs, "input_list")
        if inputs[self._rank].numel() != out.numel() or any(x.dtype != out.dtype for x in inputs):
            raise ValueError(f"input_list[{self._rank}]: expected {out.numel()} elements of {out.dtype} like output")
        op = self._op(opts.reduceOp, out)
        return self._submit(J.ReduceScatter(self._cpu, out, inputs, op), "reduce_scatter", opts, inputs, outputs,
                            calls.make("reduce_scatter", out.dtype, op, count=sum(x.numel() for x in inputs)))

    # ------------------------------------------------------------------ data movement
    def broadcast(self, tensors: List[torch.Tensor], opts: Any = None) -> Any:
        device = self._device("tensors", tensors)
        if device is not None:
            return device.broadcast(tensors, opts)
        if self._calls is not None and opts is not None and type(tensors) is list \
                and len(tensors) == 1:   # Note [The backend's fast path]
            root = opts.rootRank
            if type(root) is int and 0 <= root < self._size:
                limit = call_limit(opts, self._timeout)
                try:
                    if self._calls.broadcast(tensors[0], root, limit, opts.asyncOp):
                        return done_work(tensors)
                except CHANNEL_ERRORS as e:
                    t = tensors[0]
                    return self._fast_failed("broadcast", tensors, calls.make("broadcast", t.dtype, None, root, t.numel()),
                                             limit, e)
        opts = opts if opts is not None else BroadcastOptions()
        t = one_tensor(tensors, "tensors")
        self._check_cpu([t], "tensors")
        root = self._root(opts.rootRank, "src")
        return self._submit(J.Broadcast(self._cpu, t, root), "broadcast", opts, [t], tensors,
                            calls.make("broadcast", t.dtype, None, root, t.numel()))

    def all_gather_single(self, output: torch.Tensor, input: torch.Tensor, opts: Any = None) -> Any:
        device = self._device("output_tensor, input_tensor", output, input)
        if device is not None:
            return device.all_gather_single(output, input, opts)
        if self._calls is not None and opts is not None:
            limit = call_limit(opts, self._timeout)   # Note [The backend's fast path]
            try:
                if self._calls.all_gather(output, input, limit, opts.asyncOp):
                    return done_work([output])
            except CHANNEL_ERRORS as e:
                return self._fast_failed("all_gather_single", [input], calls.make(
                    "all_gather_into_tensor", input.dtype, count=input.numel()), limit, e)
        opts = opts if opts is not None else AllgatherOptions()
        self._check_cpu([output, input], "output_tensor, input_tensor")
        self._check_gather_sizes(output, input)
        return self._submit(J.AllGatherSingle(self._cpu, output, input), "all_gather_single", opts, [input], output,
                            calls.make("all_gather_into_tensor", input.dtype, count=input.numel()))

    _allgather_base = all_gather_single

    def all_gather_single_coalesced(self, outputs: List[torch.Tensor], inputs: List[torch.Tensor],
                                    opts: Any = None) -> Any:
        device = self._device("outputs, inputs", outputs, inputs)
        if device is not None:
            return device.all_gather_single_coalesced(outputs, inputs, opts)
        opts = opts if opts is not None else AllgatherOptions()
        if len(outputs) != len(inputs):
            raise ValueError(f"inputs: expected {len(outputs)} tensors like outputs, got {len(inputs)}")
        self._check_cpu(list(outputs) + list(inputs), "outputs, inputs")
        for o, i in zip(outputs, inputs):
            self._check_gather_sizes(o, i)
        return self._submit(J.AllGatherSingleCoalesced(self._cpu, outputs, inputs), "all_gather_single_coalesced",
                            opts, list(inputs), list(outputs), list_call("all_gather_into_tensor_coalesced", inputs))

    allgather_into_tensor_coalesced = all_gather_single_coalesced

    def allgather(self, output_lists: List[List[torch.Tensor]], inputs: List[torch.Tensor], opts: Any = None) -> Any:
        device = self._device("tensor_list", inputs, first_list(output_lists))
        if device is not None:
            return device.allgather(output_lists, inputs, opts)
        opts = opts if opts is not None else AllgatherOptions()
        inp = one_tensor(inputs, "tensor")
        if len(output_lists) != 1 or len(output_lists[0]) != self._size:
            raise ValueError(f"tensor_list: expected {self._size} tensors (one per rank)")
        outs = list(output_lists[0])
        self._check_cpu([inp] + outs, "tensor_list")
        # every output like the input, as gloo requires (an uneven all_gather is refused before anything moves)
        self._same_size(outs, inp, "tensor_list")
        return self._submit(J.AllGather(self._cpu, outs, inp), "allgather", opts, [inp], outs,
                            calls.make("all_gather", inp.dtype, count=inp.numel()))

    def allgather_coalesced(self, output_lists: List[List[torch.Tensor]], inputs: List[torch.Tensor],
                            opts: Any = None) -> Any:
        device = self._device("input_tensor_list", inputs)
        if device is not None:
            return device.allgather_coalesced(output_lists, inputs, opts)
        opts = opts if opts is not None else AllgatherOptions()
        if len(output_lists) != self._size or any(len(o) != len(inputs) for o in output_lists):
            raise ValueError(f"output_tensor_lists: expected {self._size} lists of {len(inputs)} tensors")
        self._check_cpu(list(inputs), "input_tensor_list")
        for r, outs in enumerate(output_lists):
            self._check_cpu(list(outs), f"output_tensor_lists[{r}]")
            for k, (o, i) in enumerate(zip(outs, inputs)):
                if o.dtype != i.dtype or o.numel() != i.numel():
                    raise ValueError(f"output_tensor_lists[{r}][{k}]: expected {i.numel()} elements of {i.dtype} "
                                     f"like input_tensor_list[{k}], got {o.numel()} of {o.dtype}")
        return self._submit(J.AllGatherCoalesced(self._cpu, output_lists, inputs), "allgather_coalesced", opts,
                            list(inputs), output_lists, list_call("all_gather_coalesced", inputs))

    def gather(self, output_lists: List[List[torch.Tensor]], inputs: List[torch.Tensor], opts: Any = None) -> Any:
        device = self._device("gather_list", inputs, first_list(output_lists))
        if device is not None:
            return device.gather(output_lists, inputs, opts)
        opts = opts if opts is not None else GatherOptions()
        inp = one_tensor(inputs, "tensor")
        root = self._root(opts.rootRank, "dst")
        outs = list(output_lists[0]) if output_lists else []
        if self._rank == root and len(outs) != self._size:
            raise ValueError(f"gather_list: expected {self._size} tensors on the destination rank, got {len(outs)}")
        self._check_cpu([inp] + outs, "gather_list")
        self._same_size(outs, inp, "gather_list")
        return self._submit(J.Gather(self._cpu, outs, inp, root), "gather", opts, [inp], outs,
                            calls.make("gather", inp.dtype, None, root, inp.numel()))

    def scatter(self, outputs: List[torch.Tensor], input_lists: List[List[torch.Tensor]], opts: Any = None) -> Any:
        device = self._device("scatter_list", outputs, first_list(input_lists))
        if device is not None:
            return device.scatter(outputs, input_lists, opts)
        opts = opts if opts is not None else ScatterOptions()
        out = one_tensor(outputs, "tensor")
        root = self._root(opts.rootRank, "src")
        inputs = list(input_lists[0]) if input_lists else []
        if self._rank == root and len(inputs) != self._size:
            raise ValueError(f"scatter_list: expected {self._size} tensors on the source rank, got {len(inputs)}")
        self._check_cpu([out] + inputs, "scatter_list")
        self._same_size(inputs, out, "scatter_list")
        return self._submit(J.Scatter(self._cpu, out, inputs if self._rank == root else None, root), "scatter", opts,
                            [out], outputs, calls.make("scatter", out.dtype, None, root, out.numel()))

    def all_to_all_single(self, output: torch.Tensor, input: torch.Tensor, output_splits: List[int],
                          input_splits: List[int], opts: Any = None) -> Any:
        device = self._device("output, input", output, input)
        if device is not None:
            return device.all_to_all_single(output, input, output_splits, input_splits, opts)
        opts = opts if opts is not None else AllToAllOptions()
        self._check_cpu([output, input], "output, input")
        if input.dtype != output.dtype:
            raise TypeError(f"output: expected {input.dtype} like input, got {output.dtype}")
        even = not output_splits and not input_splits   # then every rank moves as much as the others
        return self._submit(J.AllToAllSingle(self._cpu, output, input, output_splits, input_splits),
                            "all_to_all_single", opts, [input], output,
                            calls.make("all_to_all_single", input.dtype, count=input.numel() if even else 0))

    alltoall_base = all_to_all_single

    def alltoall(self, outputs: List[torch.Tensor], inputs: List[torch.Tensor], opts: Any = None) -> Any:
        device = self._device("output_tensor_list, input_tensor_list", outputs, inputs)
        if device is not None:
            return device.alltoall(outputs, inputs, opts)
        opts = opts if opts is not None else AllToAllOptions()
        if len(outputs) != self._size or len(inputs) != self._size:
            raise ValueError(f"output_tensor_list, input_tensor_list: expected {self._size} tensors each")
        self._check_cpu(list(outputs) + list(inputs), "output_tensor_list, input_tensor_list")
        return self._submit(J.AllToAll(self._cpu, outputs, inputs), "alltoall", opts, list(inputs), list(outputs),
                            calls.make("all_to_all", inputs[0].dtype if inputs else None))

    def barrier(self, opts: Any = None) -> Any:
        opts = opts if opts is not None else BarrierOptions()
        return self._submit(J.Barrier(self._cpu), "barrier", opts, [], [], calls.make("barrier"))

    def monitored_barrier(self, timeout: Any = None, wait_all_ranks: bool = False) -> None:
        """gloo's monitored barrier on this group's inner gloo, once the queued collectives have finished.
        (`torch.distributed.monitored_barrier` refuses every backend but gloo by name before it gets here:
        call this method on the group instead.)"""
        self._runner.drain(self._timeout)
        t = timeout if isinstance(timeout, datetime.timedelta) else datetime.timedelta(seconds=self._timeout)
        self._gloo.monitored_barrier(t, wait_all_ranks)

    # ------------------------------------------------------------------ point to point: straight to gloo
    def send(self, tensors: List[torch.Tensor], dst: int, tag: int = 0) -> Any:
        device = self._device("tensor", tensors)
        if device is not None:
            return device.send(tensors, dst, tag)
        t = one_tensor(tensors, "tensor")
        self._check_cpu([t], "tensor")
        peer = self._root(dst, "dst")
        if _profiling():
            return self._profiled_p2p("send", tensors, lambda: self._gloo.send(tensors, peer, tag))
        return self._gloo.send(tensors, peer, tag)

    def recv(self, tensors: List[torch.Tensor], src: int, tag: int = 0) -> Any:
        device = self._device("tensor", tensors)
        if device is not None:
            return device.recv(tensors, src, tag)
        t = one_tensor(tensors, "tensor")
        self._check_cpu([t], "tensor")
        peer = self._root(src, "src")
        if _profiling():
            return self._profiled_p2p("recv", tensors, lambda: self._gloo.recv(tensors, peer, tag))
        return self._gloo.recv(tensors, peer, tag)

    def recv_anysource(self, tensors: List[torch.Tensor], tag: int = 0) -> Any:
        device = self._device("tensor", tensors)
        if device is not None:
            return device.recv_anysource(tensors, tag)
        t = one_tensor(tensors, "tensor")
        self._check_cpu([t], "tensor")
        if _profiling():
            return self._profiled_p2p("recv_anysource", tensors, lambda: self._gloo.recv_anysource(tensors, tag))
        return self._gloo.recv_anysource(tensors, tag)

    # ------------------------------------------------------------------ coalescing, ending
    def start_coalescing(self, device: Any = None) -> None:
        pass   # every collective is queued in order anyway

    def end_coalescing(self, device: Any = None) -> Any:
        return self.barrier_free_marker()

    _start_coalescing, _end_coalescing = start_coalescing, end_coalescing

    def barrier_free_marker(self) -> JobWork:
        """A Work complete once every collective issued before it is (nothing is sent)."""
        return self._submit(J.Marker(self._cpu), "coalesced collectives", None, [], [], None)

    def _made_nccl(self) -> Any:
        """The inner ProcessGroupNCCL if a CUDA tensor made it, else None."""
        return None if self._nccl is None or isinstance(self._nccl, tuple) else self._nccl

    def shutdown(self) -> None:
        """Lets the queued collectives finish (bounded), then stops this group's heartbeats, its runner and
        channel, and shuts its inner NCCL group down (its communicators are destroyed now, not whenever
        the collector gets to it)."""
        if self._shut:
            return
        self._shut = True
        if self._liveness is not None:
            self._liveness.stop()
        self._runner.close(min(self._timeout, 30.0))
        nccl = self._made_nccl()
        if nccl is not None:
            _end_inner(nccl, "shutdown")

    def abort(self) -> None:
        """Fails every queued and later CPU collective of this group (and the peers' waits on its channel)
        and aborts its inner NCCL group: a hung CUDA collective ends now, not at torch's watchdog."""
        self._runner.fail(f"rank {self._rank}: the process group was aborted")
        nccl = self._made_nccl()
        if nccl is not None:
            _end_inner(nccl, "abort")
        self.shutdown()


def _end_inner(group: Any, how: str) -> None:
    """group.shutdown() or group.abort() on an inner group; a failure is a warning (the group is being
    ended anyway), never an exception out of destroy_process_group."""
    import warnings

    try:
        getattr(group, how)()
    except Exception as e:   # noqa: BLE001 (reported, not raised)
        warnings.warn(f"ncclavg: the inner NCCL group's {how}() failed: {e}", RuntimeWarning, stacklevel=3)


def _create(dist_opts: Any, backend_options: Any) -> ProcessGroupNcclavg:
    """The creator torch calls (extended API) for every group of the backend."""
    return ProcessGroupNcclavg(dist_opts.store, dist_opts.group_rank, dist_opts.group_size, dist_opts.timeout,
                               dist_opts.group_id, list(dist_opts.global_ranks_in_group), backend_options)


def _end_of_process() -> None:
    """At exit: let every runner finish what was queued (bounded) and stop the worker threads before the
    interpreter stops, so that no thread of ours returns into Python while it shuts down (Note [Gloo
    teardown] in dist.py)."""
    for runner in connect.live_runners():
        try:
            runner.close(timeout=10.0)
        except Exception:   # noqa: BLE001 (leaving anyway)
            pass
    liveness.BEATS.stop()   # the process's one heartbeat thread, for every group and communicator


atexit.register(_end_of_process)

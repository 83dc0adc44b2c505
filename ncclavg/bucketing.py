"""Bucket plan: where every parameter's gradient lives inside flat, reduction-sized buffers.

Note [Bucket layout]
Parameters are grouped by (bucket dtype, device) and walked in REVERSE registration order, the order in
which backward produces their gradients, so the first bucket fills (and can be reduced) while backward
is still running. Each group's first bucket holds up to `first_bucket_mb` (small, so the first
collective starts early), later ones up to `bucket_cap_mb`; a parameter larger than the cap gets a
bucket of its own. Every slot starts at a 256-byte boundary: the pack kernels move a slot in 16-byte
vector accesses when the tensor's own address allows it too (csrc/cuda/vector_io.h), NCCL prefers it,
and a slot view never shares a cache line with its neighbour. The bucket's own
size is rounded up to 256 bytes too. Size-0 parameters are legal: they get a slot of 0 elements.

The plan depends only on shapes, dtypes and order, so every tower (and every process) computes the
same plan from its own parameter list; the 64-bit fingerprint lets processes check that cheaply.
"""
from __future__ import annotations

import hashlib
from dataclasses import dataclass
from typing import Any, Callable, Optional, Sequence

import torch

from .errors import LayoutMismatchError

ALIGN_BYTES = 256
SUPPORTED_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
_DTYPE_ALIASES = {
    "float32": torch.float32, "fp32": torch.float32, "float": torch.float32,
    "float16": torch.float16, "fp16": torch.float16, "half": torch.float16,
    "bfloat16": torch.bfloat16, "bf16": torch.bfloat16,
}


def parse_dtype(value: Any, argname: str) -> Optional[torch.dtype]:
    """None, a torch dtype or a name ('bfloat16', 'bf16', 'float16', ...) -> torch dtype or None."""
    if value is None:
        return None
    if isinstance(value, torch.dtype):
        dt = value
    elif isinstance(value, str):
        dt = _DTYPE_ALIASES.get(value.replace("torch.", "").lower())
        if dt is None:
            raise TypeError(f"{argname}: unknown dtype {value!r}; use 'float32', 'float16' or 'bfloat16'")
    else:
        raise TypeError(f"{argname}: expected a torch.dtype or a dtype name, got {type(value).__name__}")
    if dt not in SUPPORTED_DTYPES:
        raise TypeError(f"{argname}: {dt} is not supported; use float32, float16 or bfloat16")
    return dt


def _itemsize(dtype: torch.dtype) -> int:
    return torch.empty((), dtype=dtype).element_size()


def _align_up(n: int, align: int) -> int:
    return (n + align - 1) // align * align


def _dtype_str(dtype: torch.dtype) -> str:
    return str(dtype).replace("torch.", "")


def _param_desc(name: Optional[str], index: int) -> str:
    return f"parameter {index}" + (f" ({name!r})" if name else "")


@dataclass(frozen=True)
class ParamSlot:
    """Where one parameter's gradient lives."""
    index: int                 # position in the tower's parameter list (registration order)
    name: Optional[str]
    shape: tuple
    dtype: torch.dtype         # the parameter's dtype (the bucket's dtype unless grad_dtype overrides)
    bucket: int                # bucket index
    offset: int                # ELEMENT offset inside the bucket; offset * itemsize % 256 == 0
    numel: int


@dataclass(frozen=True)
class Bucket:
    index: int
    dtype: torch.dtype         # element type of the flat storage
    device: str                # "cpu", "cuda:0", ... (tower 0's; every tower has its own storage)
    slots: tuple               # ParamSlots in the order backward produces grads (reverse registration)
    numel: int                 # total elements including alignment padding

    @property
    def nbytes(self) -> int:
        return self.numel * _itemsize(self.dtype)


class BucketPlan:
    """The bucket layout of one tower's parameters. Build with `BucketPlan.build(params, ...)`."""

    def __init__(self, buckets: list, slots: list, bucket_cap_mb: float, first_bucket_mb: float,
                 grad_dtype: Optional[torch.dtype]):
        self.buckets: list[Bucket] = buckets
        self.slots: list[ParamSlot] = slots          # indexed by parameter index
        self.bucket_cap_mb = bucket_cap_mb
        self.first_bucket_mb = first_bucket_mb
        self.grad_dtype = grad_dtype
        self.total_numel = sum(b.numel for b in buckets)
        self.total_bytes = sum(b.nbytes for b in buckets)
        self.param_numel = sum(s.numel for s in slots)  # without padding
        self.fingerprint: int = self._compute_fingerprint()

    # ------------------------------------------------------------------ construction
    @classmethod
    def build(cls, params: Sequence[torch.Tensor], names: Optional[Sequence[str]] = None,
              bucket_cap_mb: float = 25, first_bucket_mb: float = 1, grad_dtype: Any = None) -> "BucketPlan":
        """Plans buckets for `params` (registration order). See Note [Bucket layout]."""
        params = _check_param_list(params, "params")
        names = _check_names(names, len(params))
        for argname, v in (("bucket_cap_mb", bucket_cap_mb), ("first_bucket_mb", first_bucket_mb)):
            if isinstance(v, bool) or not isinstance(v, (int, float)):
                raise TypeError(f"{argname}: expected a number of MiB, got {type(v).__name__}")
            if not v > 0 or v != v or v == float("inf"):
                raise ValueError(f"{argname}: must be a positive finite number of MiB, got {v}")
        gdt = parse_dtype(grad_dtype, "grad_dtype")
        cap_bytes = int(bucket_cap_mb * 2**20)
        first_bytes = int(first_bucket_mb * 2**20)

        # Per group: the slots of the open bucket, its used element count and its byte limit.
        open_buckets: dict = {}
        groups_seen: set = set()
        finished: list = []  # (creation order, dtype, device, [(index, offset)], numel)
        creation = 0
        for i in reversed(range(len(params))):
            p = params[i]
            bdtype = gdt or p.dtype
            key = (bdtype, str(p.device))
            item = _itemsize(bdtype)
            align = ALIGN_BYTES // item
            numel = p.numel()
            cur = open_buckets.get(key)
            if cur is not None and cur["slots"] and (_align_up(cur["used"], align) + numel) * item > cur["limit"]:
                finished.append(cur)
                cur = None
            if cur is None:
                limit = cap_bytes if key in groups_seen else first_bytes
                groups_seen.add(key)
                cur = {"order": creation, "dtype": bdtype, "device": str(p.device), "slots": [], "used": 0,
                       "limit": limit, "align": align}
                creation += 1
                open_buckets[key] = cur
            offset = _align_up(cur["used"], align)
            cur["slots"].append((i, offset))
            cur["used"] = offset + numel
        finished.extend(open_buckets.values())
        finished.sort(key=lambda b: b["order"])

        slots: list = [None] * len(params)
        buckets = []
        for bidx, b in enumerate(finished):
            bslots = []
            for i, offset in b["slots"]:
                p = params[i]
                s = ParamSlot(index=i, name=names[i], shape=tuple(p.shape), dtype=p.dtype, bucket=bidx,
                              offset=offset, numel=p.numel())
                slots[i] = s
                bslots.append(s)
            buckets.append(Bucket(index=bidx, dtype=b["dtype"], device=b["device"], slots=tuple(bslots),
                                  numel=_align_up(b["used"], b["align"])))
        return cls(buckets, slots, bucket_cap_mb, first_bucket_mb, gdt)

    def _compute_fingerprint(self) -> int:
        # blake2b, not hash(): Python's string hash is salted per process.
        h = hashlib.blake2b(digest_size=8)
        h.update(b"ncclavg-plan-v1;")
        for b in self.buckets:
            h.update(f"B{b.index}:{_dtype_str(b.dtype)}:{b.device.split(':')[0]}:{b.numel};".encode())
            for s in b.slots:
                h.update(f"{s.index}:{s.shape}:{_dtype_str(s.dtype)}:{s.offset}:{s.numel};".encode())
        return int.from_bytes(h.digest(), "little")

    # ------------------------------------------------------------------ checks
    def check_same_layout(self, params: Sequence[torch.Tensor], names: Optional[Sequence[str]] = None,
                          tower: int = 0) -> None:
        """Raises LayoutMismatchError naming the first parameter of `params` whose shape or dtype differs
        from this plan (or that is missing / extra); ValueError when one bucket's tensors sit on
        different devices."""
        what = f"towers[{tower}]"
        params = _check_param_list(params, what)
        names = _check_names(names, len(params))
        n_plan = len(self.slots)
        for i in range(min(n_plan, len(params))):
            s, p = self.slots[i], params[i]
            if tuple(p.shape) != s.shape or p.dtype != s.dtype:
                name = names[i] or s.name
                raise LayoutMismatchError(
                    f"tower {tower}: {_param_desc(name, i)} has shape {tuple(p.shape)} dtype "
                    f"{_dtype_str(p.dtype)}, but the plan (tower 0) has shape {s.shape} dtype "
                    f"{_dtype_str(s.dtype)} at index {i}" + (f" ({s.name!r})" if s.name else ""))
        if len(params) != n_plan:
            i = min(n_plan, len(params))
            if len(params) > n_plan:
                p = params[i]
                extra = f"extra {_param_desc(names[i], i)} with shape {tuple(p.shape)} dtype {_dtype_str(p.dtype)}"
            else:
                s = self.slots[i]
                extra = (f"missing {_param_desc(s.name, i)} with shape {s.shape} dtype {_dtype_str(s.dtype)}")
            raise LayoutMismatchError(f"tower {tower}: has {len(params)} parameters but the plan (tower 0) "
                                      f"has {n_plan}; first difference: {extra}")
        for b in self.buckets:
            first = None
            for s in b.slots:
                dev = params[s.index].device
                if dev.type != b.device.split(":")[0]:
                    raise ValueError(f"{what}[{s.index}]: is on {dev} but tower 0's parameter {s.index} is "
                                     f"on {b.device}; every tower must use one kind of device")
                if first is None:
                    first = (s.index, dev)
                elif dev != first[1]:
                    raise ValueError(f"{what}[{s.index}]: is on {dev} but {what}[{first[0]}] (same bucket) "
                                     f"is on {first[1]}; a tower's tensors must share a device")

    # ------------------------------------------------------------------ helpers
    def slot_view(self, storage: torch.Tensor, index: int) -> torch.Tensor:
        """The view of parameter `index`'s gradient inside its bucket's flat `storage`."""
        s = self.slots[index]
        return storage.narrow(0, s.offset, s.numel).view(s.shape)

    def allocate(self, device: Any = None) -> list:
        """Zeroed flat storage for every bucket, on `device` (default: each bucket's own device)."""
        return [torch.zeros(b.numel, dtype=b.dtype, device=device if device is not None else b.device)
                for b in self.buckets]

    def describe(self) -> str:
        lines = [f"BucketPlan: {len(self.slots)} params, {len(self.buckets)} buckets, "
                 f"{self.total_bytes / 2**20:.2f} MiB, fingerprint {self.fingerprint:016x}"]
        for b in self.buckets:
            lines.append(f"  bucket {b.index}: {len(b.slots)} params, {b.numel} x {_dtype_str(b.dtype)} "
                         f"({b.nbytes / 2**20:.2f} MiB) on {b.device}")
        return "\n".join(lines)

    def __repr__(self) -> str:
        return (f"BucketPlan(params={len(self.slots)}, buckets={len(self.buckets)}, "
                f"bytes={self.total_bytes}, fingerprint=0x{self.fingerprint:016x})")


def _check_param_list(params: Any, argname: str) -> list:
    if isinstance(params, torch.Tensor) or isinstance(params, (str, bytes)) or not hasattr(params, "__iter__"):
        raise TypeError(f"{argname}: expected a sequence of tensors, got {type(params).__name__}")
    params = list(params)
    for i, p in enumerate(params):
        if not isinstance(p, torch.Tensor):
            raise TypeError(f"{argname}[{i}]: expected a torch.Tensor, got {type(p).__name__}")
        if p.dtype not in SUPPORTED_DTYPES:
            raise TypeError(f"{argname}[{i}]: dtype {p.dtype} is not supported; use float32, float16 or bfloat16")
        if p.is_sparse:
            raise TypeError(f"{argname}[{i}]: sparse parameters are not supported")
    return params


def _check_names(names: Any, n: int) -> list:
    if names is None:
        return [None] * n
    if isinstance(names, (str, bytes)) or not hasattr(names, "__iter__"):
        raise TypeError(f"names: expected a sequence of strings, got {type(names).__name__}")
    names = list(names)
    if len(names) != n:
        raise ValueError(f"names: has {len(names)} entries but there are {n} parameters")
    for i, s in enumerate(names):
        if s is not None and not isinstance(s, str):
            raise TypeError(f"names[{i}]: expected a string, got {type(s).__name__}")
    return names


# ---------------------------------------------------------------------- the towers' plan
# The towers a GradientAverager (or a trainer's engine) is given, checked before anything is changed:
# their parameters collected with names, on the communicator's devices, each tensor in one place only, one
# bucket plan they all share; then the processes compare their plans (or learn of a peer's failure) in one
# exchange, so that no process waits in a collective for a peer that gave up.

def plan_towers(comm: Any, towers: Any, names: Any, bucket_cap_mb: float, first_bucket_mb: float,
                grad_dtype: Any) -> tuple:
    """-> (params per tower, module or None per tower, the shared BucketPlan), the plan agreed by every
    process (plan_everywhere)."""
    got: dict = {}

    def build() -> BucketPlan:
        params, tnames, got["modules"] = collect_towers(towers, names)
        got["params"] = params
        if len(params) != comm.local_size:
            raise ValueError(f"towers: got {len(params)} towers but comm.local_size is {comm.local_size} "
                             f"(one tower per local device of the communicator: {comm.devices})")
        check_devices(params, comm.devices)
        check_distinct(params)
        plan = BucketPlan.build(params[0], tnames[0], bucket_cap_mb, first_bucket_mb, grad_dtype)
        for t in range(1, len(params)):
            plan.check_same_layout(params[t], tnames[t], tower=t)
        return plan

    plan = plan_everywhere(comm, build)
    return got["params"], got["modules"], plan


def plan_everywhere(comm: Any, build: Callable[[], BucketPlan]) -> BucketPlan:
    """The plan `build` makes here, once every process of `comm` (None: this one alone) has reported
    whether its own `build` succeeded and with which layout: a ValueError / TypeError of `build` is raised
    here after the exchange, a peer's failure or a different layout as a LayoutMismatchError."""
    plan, error = None, None
    try:
        plan = build()
    except (ValueError, TypeError) as e:
        error = e
    check_across_processes(comm, plan, error)
    return plan


def collect_towers(towers: Any, names: Any) -> tuple:
    """-> (params per tower, names per tower, module or None per tower), with errors naming towers[t][i]."""
    if isinstance(towers, (torch.nn.Module, torch.Tensor)) or not hasattr(towers, "__len__"):
        raise TypeError(f"towers: expected a list of nn.Module or of parameter lists (one per local tower), "
                        f"got {type(towers).__name__}")
    if len(towers) == 0:
        raise ValueError("towers: expected at least one tower, got an empty list")
    params, tnames, modules = [], [], []
    for t, tower in enumerate(towers):
        if isinstance(tower, torch.nn.Module):
            named = [(n, p) for n, p in tower.named_parameters() if p.requires_grad]
            params.append([p for _, p in named])
            tnames.append([n for n, _ in named])
            modules.append(tower)
        elif isinstance(tower, torch.Tensor) or not hasattr(tower, "__iter__"):
            raise TypeError(f"towers[{t}]: expected an nn.Module or a list of parameters, got {type(tower).__name__}")
        else:
            plist = list(tower)
            for i, p in enumerate(plist):
                if not isinstance(p, torch.Tensor):
                    raise TypeError(f"towers[{t}][{i}]: expected a torch.Tensor, got {type(p).__name__}")
                if not p.requires_grad or not p.is_leaf:
                    raise ValueError(f"towers[{t}][{i}]: must be a leaf tensor that requires grad (shape "
                                     f"{tuple(p.shape)}); leave frozen parameters out")
            params.append(plist)
            tnames.append([None] * len(plist))
            modules.append(None)
        if len(params[-1]) == 0:
            raise ValueError(f"towers[{t}]: has no parameters that require grad")
        for i, p in enumerate(params[-1]):
            if p.dtype not in SUPPORTED_DTYPES:
                raise TypeError(f"towers[{t}][{i}]: dtype {p.dtype} is not supported; use float32, float16 or "
                                "bfloat16 parameters")
    if names is not None:
        if isinstance(names, (str, bytes)) or not hasattr(names, "__len__"):
            raise TypeError(f"names: expected a list of parameter names, got {type(names).__name__}")
        if len(names) != len(params[0]):
            raise ValueError(f"names: has {len(names)} entries but towers[0] has {len(params[0])} parameters")
        tnames = [list(names) for _ in params]
    return params, tnames, modules


def check_devices(params: list, devices: Sequence[Any]) -> None:
    for t, plist in enumerate(params):
        want = torch.device(devices[t])
        for i, p in enumerate(plist):
            if p.device != want:
                raise ValueError(f"towers[{t}][{i}]: is on {p.device} but the communicator's local tower {t} is on "
                                 f"{want}; every parameter of a tower must be on that tower's device")


def check_distinct(params: list) -> None:
    """No tensor (or memory) may belong to two places: its gradient would be reduced twice."""
    spans = []
    for t, plist in enumerate(params):
        for i, p in enumerate(plist):
            start = p.data_ptr()
            spans.append((str(p.device), start, start + p.numel() * p.element_size(), id(p), t, i))
    seen: dict = {}
    for dev, start, end, pid, t, i in spans:
        if pid in seen:
            t0, i0 = seen[pid]
            raise ValueError(f"towers[{t}][{i}]: is the same tensor as towers[{t0}][{i0}]; pass each parameter once")
        seen[pid] = (t, i)
    spans.sort()
    for a, b in zip(spans, spans[1:]):
        if a[0] == b[0] and a[2] > b[1] and a[2] > a[1] and b[2] > b[1]:
            raise ValueError(f"towers[{b[4]}][{b[5]}]: shares memory with towers[{a[4]}][{a[5]}]; each tower needs "
                             "its own parameters (a replica, not a view of another tower's)")


def check_across_processes(comm: Any, plan: Optional[BucketPlan], error: Optional[BaseException]) -> None:
    """Every process reports (its error or its layout); all raise when any failed or layouts differ, so no
    process is left waiting in a collective for a peer that gave up."""
    if plan is not None:
        layout = [(s.shape, str(s.dtype).replace("torch.", ""), s.name) for s in plan.slots]
        mine = {"ok": True, "fingerprint": plan.fingerprint, "layout": layout}
    else:
        mine = {"ok": False, "error": f"{type(error).__name__}: {error}"}
    if getattr(comm, "world_size", 1) > 1:
        everyone = comm.allgather_object(mine)
        rank = getattr(comm, "rank", 0)
    else:
        everyone, rank = [mine], 0
    if error is not None:
        raise error
    for r, other in enumerate(everyone):
        if not other["ok"]:
            raise LayoutMismatchError(f"rank {r} could not build its bucket plan: {other['error']}")
    ref = everyone[0]
    for r, other in enumerate(everyone):
        if other["fingerprint"] == ref["fingerprint"]:
            continue
        a, b = ref["layout"], other["layout"]
        for i in range(max(len(a), len(b))):
            if i >= len(a) or i >= len(b) or a[i][:2] != b[i][:2]:
                desc0 = (f"has shape {a[i][0]} dtype {a[i][1]}" if i < len(a) else
                         f"has no parameter {i} ({len(a)} parameters)")
                descr = (f"has shape {b[i][0]} dtype {b[i][1]}" if i < len(b) else
                         f"is missing ({len(b)} parameters)")
                name = (b[i][2] if i < len(b) else None) or (a[i][2] if i < len(a) else None)
                raise LayoutMismatchError(
                    f"rank {r} (this is rank {rank}): parameter {i}" + (f" ({name!r})" if name else "") +
                    f" {descr} but rank 0 {desc0}")
        raise LayoutMismatchError(f"rank {r} (this is rank {rank}): bucket plan fingerprint "
                                  f"{other['fingerprint']:016x} differs from rank 0's {ref['fingerprint']:016x} "
                                  "(same parameters, different bucket_cap_mb / first_bucket_mb / grad_dtype?)")

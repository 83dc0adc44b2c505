"""What bench/hosts.py reports: the launches' rank files merged into one row per size and contender, the
ratios, and the markdown table. Pure functions of the JSON the run keeps (tests feed them made-up
rows)."""
from __future__ import annotations

import statistics

from hosts_net import Link

LABELS = {"gloo": "gloo", "ncclavg": "ncclavg", "ncclavg-gloo": "ncclavg, gloo lanes", "ncclavg-api": "ncclavg API",
          "mpi": "Open MPI",
          "mpi-tcp": "Open MPI tcp"}
MPIS = ("mpi", "mpi-tcp")


def human(n: int) -> str:
    for unit, step in (("MiB", 1 << 20), ("KiB", 1 << 10)):
        if n >= step and n % step == 0:
            return f"{n // step} {unit}"
    return f"{n} B"


def t_star_s(size: int, hosts: int, rate_mbit: float, collective: str = "all_reduce") -> float:
    """The line-rate bound of a collective of `size` bytes over `hosts` hosts, each with one link of
    rate_mbit. An all-reduce: every host must send (and receive) 2(H-1)/H x S (a reduce-scatter and an
    all-gather of the host's data), T* = 2(H-1)/H x S / R. A broadcast: every other host must receive S
    over its one link, T* = S / R. An all-gather into S bytes: every host must receive the other hosts'
    (H-1)/H of them; a reduce-scatter of S bytes: every host must send the other hosts' (H-1)/H of its
    sums: T* = (H-1)/H x S / R."""
    if collective == "broadcast":
        return size / (rate_mbit * 1e6 / 8)
    if collective in ("all_gather", "reduce_scatter"):
        return (hosts - 1) / hosts * size / (rate_mbit * 1e6 / 8)
    return 2 * (hosts - 1) / hosts * size / (rate_mbit * 1e6 / 8)


def is_veth(shape: dict) -> bool:
    return bool(shape["link"].get("veth"))


def reference_mbit(shape: dict) -> float | None:
    """R of T* and T*/t: the link's rate; an unshaped veth link has none, so the TCP ceiling measured in
    the same run stands for it: one stream each way at once, their mean (an all-reduce, all-gather or
    reduce-scatter has every host send and receive at once), or one way for a broadcast (the root's host
    only sends). None before the link is measured."""
    if not is_veth(shape):
        return shape["link"]["rate_mbit"]
    m = shape.get("measured") or {}
    if shape.get("collective", "all_reduce") == "broadcast":
        return m.get("tcp_one_way_mbit") or None
    both = m.get("tcp_both_ways_mbit")
    return statistics.mean(both) if both else None


def link_label(link: dict) -> str:
    """A results file's link in the words of hosts_net.Link.label (files before veth links lack "veth")."""
    return Link(link["rate_mbit"], link["delay_ms"], bool(link.get("veth"))).label


def call_samples(launch: dict, size: int) -> list[float]:
    """Per call of one launch: the slowest rank's time (a collective ends when its last rank does)."""
    per_rank = [r["sizes"][str(size)]["times_s"] for r in launch["ranks"]]
    return [max(ts) for ts in zip(*per_rank)]


def wire_per_op(launch: dict, size: int, calls: int) -> float | None:
    """Bytes each host sent over its NICs per call, the syncs' bytes taken out (mean over the hosts):
    the bytes on the wire per op and direction."""
    per_host = []
    for r in launch["ranks"]:
        s = r["sizes"][str(size)]
        if s.get("calls_bytes") is None:
            continue
        sent = sum(v["tx_bytes"] for v in s["calls_bytes"].values())
        syncs = sum(v["tx_bytes"] for v in s["syncs_bytes"].values())
        per_host.append((sent - syncs) / calls)
    return statistics.mean(per_host) if per_host else None


def cpu_per_op(launch: dict, size: int, calls: int) -> float | None:
    """CPU seconds per call summed over every rank of every host: each rank's process CPU time (all its
    threads) over the timed calls with their syncs, less that over as many syncs alone, over the calls.
    None for a result that lacks it (a file written before ranks measured it)."""
    per_rank = []
    for r in launch["ranks"]:
        s = r["sizes"][str(size)]
        if s.get("calls_cpu_s") is None or s.get("syncs_cpu_s") is None:
            return None
        per_rank.append((s["calls_cpu_s"] - s["syncs_cpu_s"]) / calls)
    return sum(per_rank) if per_rank else None


def _median(values: list) -> float | None:
    got = [v for v in values if v is not None]
    return statistics.median(got) if got else None


def merge(shape: dict, calls: int) -> list[dict]:
    """One row per (size, contender) over the shape's successful launches: the median of every call's
    slowest-rank time, T*/t, the wire bytes per op and direction (median over launches) and /S, the CPU
    seconds per call of all ranks together (median over launches), the elements that came out wrong
    (sum), how many calls and launches."""
    hosts, rate = shape["hosts"], reference_mbit(shape)
    collective = shape.get("collective", "all_reduce")
    rows = []
    for size in shape["sizes"]:
        for c in shape["contenders"]:
            ok = [ln for ln in shape["launches"] if ln["contender"] == c and ln.get("result")]
            if not ok:
                rows.append({"size": size, "contender": c, "median_s": None, "launches": 0})
                continue
            samples = [t for ln in ok for t in call_samples(ln["result"], size)]
            med = statistics.median(samples)
            wire = _median([wire_per_op(ln["result"], size, calls) for ln in ok])
            wrong = sum(r["sizes"][str(size)]["wrong"] for ln in ok for r in ln["result"]["ranks"])
            rows.append({"size": size, "contender": c, "median_s": med, "calls": len(samples),
                         "launches": len(ok),
                         "t_star_over_t": t_star_s(size, hosts, rate, collective) / med if rate else None,
                         "wire_bytes_per_op": wire, "wire_over_size": wire / size if wire is not None else None,
                         "cpu_s_per_op": _median([cpu_per_op(ln["result"], size, calls) for ln in ok]),
                         "wrong": wrong})
    return rows


def ratio(rows: list[dict], size: int, a: str, b: str) -> float | None:
    """Time of contender a over contender b at `size` (below 1: a is faster); b "best MPI": the faster
    of the MPI contenders at that size."""
    got = {r["contender"]: r["median_s"] for r in rows if r["size"] == size}
    if b == "best MPI":
        mpis = [got[m] for m in MPIS if got.get(m)]
        den = min(mpis) if mpis else None
    else:
        den = got.get(b)
    return got[a] / den if got.get(a) and den else None


def _ms(v: float | None) -> str:
    return "-" if v is None else (f"{v * 1e3:.2f}" if v < 0.1 else f"{v * 1e3:.1f}")


def _x(v: float | None, digits: int = 2) -> str:
    return "-" if v is None else f"{v:.{digits}f}"


def t_star_cell(shape: dict, size: int) -> str:
    rate = reference_mbit(shape)
    return _ms(t_star_s(size, shape["hosts"], rate, shape.get("collective", "all_reduce")) if rate else None)


def table(shape: dict, rows: list[dict]) -> list[str]:
    """The markdown table of one shape: per size, each contender's median time, the ratios of ncclavg
    (torch backend) to gloo and to the best MPI, then T*/t, wire bytes / S and CPU ms per call per
    contender. On an unshaped veth link T* is at the measured TCP ceiling (reference_mbit)."""
    cs = shape["contenders"]
    names = [LABELS.get(c, c) for c in cs]
    others = [o for o in ("gloo", "best MPI") if "ncclavg" in cs and (o in cs or any(m in cs for m in MPIS))]
    head = (["size", "T* (TCP) ms" if is_veth(shape) else "T* ms"] + [f"{n} ms" for n in names] +
            [f"ncclavg / {o}" for o in others] +
            ["T*/t " + " / ".join(names), "wire/S " + " / ".join(names), "CPU ms/call " + " / ".join(names)])
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for size in shape["sizes"]:
        by = {r["contender"]: r for r in rows if r["size"] == size}
        cells = [human(size), t_star_cell(shape, size)]
        cells += [_ms(by[c]["median_s"]) + (" (!)" if by[c].get("wrong") else "") for c in cs]
        cells += [_x(ratio(rows, size, "ncclavg", o)) for o in others]
        cells.append(" / ".join(_x(by[c].get("t_star_over_t")) for c in cs))
        cells.append(" / ".join(_x(by[c].get("wire_over_size")) for c in cs))
        cells.append(" / ".join(_ms(by[c].get("cpu_s_per_op")) for c in cs))
        lines.append("| " + " | ".join(cells) + " |")
    return lines


def shape_title(shape: dict) -> str:
    nics = shape.get("nics", 1)
    each = "" if is_veth(shape) else f"each {shape['link']['rate_mbit'] / nics:g} Mbit/s, "
    extra = f", {nics} NICs per host ({each}gloo: {shape['nic_use']})" if nics > 1 else ""
    procs = f"{shape['procs']} process" + ("es" if shape["procs"] > 1 else "")
    what = "" if shape.get("collective", "all_reduce") == "all_reduce" else f"{shape['collective']}, "
    return f"{what}{shape['hosts']} hosts x {procs}, {link_label(shape['link'])}{extra}"


def veth_reference_lines(shape: dict) -> list[str]:
    """What stands for the line rate on an unshaped veth link (reference_mbit), said once above its table."""
    rate = reference_mbit(shape)
    if not is_veth(shape) or not rate:
        return []
    which = "one way" if shape.get("collective", "all_reduce") == "broadcast" else "each way at once, mean"
    return [f"Unshaped veth: no line rate; T* and T*/t take R = {rate:.0f} Mbit/s, the TCP ceiling measured "
            f"above ({which})."]


def ucx_fraction(shape: dict, mbit: float) -> str:
    rate = reference_mbit(shape)
    if not rate:
        return ""
    return f"{mbit / rate:.3f} of the {'TCP ceiling' if is_veth(shape) else 'line rate'}, "


def shape_lines(shape: dict, rows: list[dict]) -> list[str]:
    link = shape.get("measured", {})
    out = [f"### {shape_title(shape)}", ""]
    if link:
        per = "" if len(link.get("tcp_per_nic_mbit", [])) < 2 else \
            " (" + " + ".join(f"{v:.0f}" for v in link["tcp_per_nic_mbit"]) + ": one stream per NIC)"
        out.append(f"Link measured in this run: TCP one way {link['tcp_one_way_mbit']:.0f} Mbit/s{per}, each way at "
                   f"once {' / '.join(f'{v:.0f}' for v in link['tcp_both_ways_mbit'])} Mbit/s; UDP round trip "
                   f"min {link['rtt_ms']['min']:.3f} ms, median {link['rtt_ms']['median']:.3f} ms "
                   + ("(no delay configured)." if is_veth(shape) else
                      f"(2 x {shape['link']['delay_ms']:g} ms configured)."))
        out += veth_reference_lines(shape)
        ucx = link.get("ucx_perftest")
        if ucx:
            out.append(f"UCX's ucx_perftest on the same link (TCP): tag bandwidth {ucx['tag_bw_mbit']:.0f} Mbit/s "
                       f"({ucx_fraction(shape, ucx['tag_bw_mbit'])}4 MiB messages), "
                       f"tag latency {ucx['tag_lat_ms']:.3f} ms one way (4 KiB).")
    loads = [ln["loadavg"] for ln in shape["launches"] if ln.get("loadavg")]
    if loads:
        one = [v[0] for v in loads]
        out.append(f"Load average (1 min) during the launches: {min(one):.2f} to {max(one):.2f}.")
    fwd = [f for f in shape.get("forwarders") or [] if f]
    if fwd:
        f = fwd[0]
        out.append(f"Delay line: scheduling {f['sched']}, writes late by {f['late_mean_ns'] / 1e3:.0f} us on average "
                   f"(max {f['late_max_ns'] / 1e3:.0f} us; {f['late_over_50us']} of {f['late_n']} packets over 50 us), "
                   f"{f['cpu_s']:.1f} s CPU in {f['wall_s']:.0f} s, drops "
                   f"{sum(p['drop_queue'] + p['drop_write'] for p in f['ports'])}.")
    transports = {}
    for ln in shape["launches"]:
        t = (ln.get("result") or {}).get("transport")
        if t and ln["contender"].startswith("ncclavg"):
            transports[LABELS.get(ln["contender"])] = t
    if transports:
        out.append("ncclavg's transport: " + ", ".join(f"{k} {v}" for k, v in transports.items()) + ".")
    out += [""] + table(shape, rows)
    wrong = [r for r in rows if r.get("wrong")]
    if wrong:
        out += ["", "(!) wrong elements: " + ", ".join(f"{LABELS.get(r['contender'])} {human(r['size'])}: "
                                                      f"{r['wrong']}" for r in wrong)]
    failed = [ln for ln in shape["launches"] if not ln.get("result")]
    if failed:
        out += ["", "Failed launches: " + "; ".join(f"{LABELS.get(ln['contender'])} #{ln['index']}: {ln['error']}"
                                                  for ln in failed)]
    return out + [""]


COLUMNS = """Columns: `T* ms` = 2(H-1)/H x S / R (a broadcast: S / R; an all-gather or reduce-scatter of S
bytes in all: (H-1)/H x S / R), the time each host needs to send its share at
the line rate R (S = the size each rank hands in); per contender the median over every timed call of all its launches of
the slowest rank's time; `ncclavg / gloo`, `ncclavg / best MPI` = the ncclavg torch backend's time over
gloo's and over the faster Open MPI contender's at that size (below 1: ncclavg is faster); `T*/t` = T*
over the median time (1 = line rate) for each contender in the order of the time columns; `wire/S` = the
bytes each host sent over its NICs per call (the NICs' byte counters, the 8-byte syncs' bytes taken out,
TCP/IP headers included) over S, per contender in the same order (2(H-1)/H is the minimum of an
all-reduce that moves each byte across once each way, (H-1)/H of an all-gather or reduce-scatter; a flat
ring over all ranks crosses more); `CPU ms/call` = the CPU time per call of all ranks of all hosts
together (each rank's process CPU time, user + system, every thread of it, over the timed calls with
their syncs less that over as many syncs alone, over the calls: a mean over a launch's calls, where the
times are medians, so one slow call weighs in; median over the launches), per contender in the same
order. Every contender has it (all run the same Python worker, the MPI ones through mpi4py; "-" only
for results written before ranks measured it). It leaves out torchrun's agents, Open MPI's launcher and
daemons and the delay line (its own CPU is in the line above the table), and includes the kernel's
network work that ran while a rank was on the CPU (without IRQ time accounting a softirq counts for the
process it interrupts: on a veth link the sender's also carries the packet up the receiving host's
stack, which on a TUN link the delay line's write does). On an unshaped veth link (no line rate) R is
the TCP ceiling measured in the same run, `T* (TCP) ms`."""

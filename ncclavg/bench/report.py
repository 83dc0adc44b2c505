"""What `ncclavg bench` prints and writes: the nccl-tests style table, the ratio summary, the JSON file
and the busbw-vs-size plot."""
from __future__ import annotations

import datetime as _dt
import json
import os
import platform
import statistics

LARGE = 1 << 20  # sizes from 1 MiB up are bandwidth-bound; below, latency-bound

SHORT_LABELS = {
    "ncclavg": "ncclavg", "torch_stack_mean": "torch stack.mean", "torch_add_loop": "torch add_ loop",
    "copy": "memcpy (bw ref)", "torch_dist": "torch.distributed", "cupy_nccl": "cupy nccl",
}


def cpu_model(default: str | None = None) -> str:
    """The CPU's model name from /proc/cpuinfo, else platform.processor(), else `default` (None:
    platform.machine(), the architecture). The standalone scripts in bench/ pass their own default so
    that their committed results keep the value they have always written."""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or (platform.machine() if default is None else default)


def machine_info() -> dict:
    """CPU model, cores, memory, OS and GPUs: enough to tell two machines' results apart."""
    from ..info import build_info

    cpu = cpu_model()
    mem_gib = None
    try:
        mem_gib = round(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2 ** 30, 1)
    except (ValueError, OSError, AttributeError):
        pass
    info = build_info()
    load = round(os.getloadavg()[0], 2) if hasattr(os, "getloadavg") else None  # a busy machine skews timings
    return {"cpu": cpu, "load_avg_1m": load, "cores": os.cpu_count(), "memory_gib": mem_gib, "platform": platform.platform(),
            "gpus": info["devices"], "simd_level": info["simd_level"], "openmp_threads": info["openmp_threads"]}


def versions() -> dict:
    import numpy
    import torch

    from ..info import build_info

    info = build_info()
    return {"ncclavg": info["version"], "torch": torch.__version__, "numpy": numpy.__version__,
            "python": platform.python_version(), "cupy": info["cupy"], "cuda_built": info["cuda"],
            "cuda_runtime": info["cuda_runtime"], "nccl": info["nccl"].get("version") or None,
            "torch_threads": torch.get_num_threads()}


# Variables that change the numbers: thread counts, OpenMP wait policy, NCCL / gloo transport choices.
_ENV_PREFIXES = ("OMP_", "GOMP_", "KMP_", "MKL_NUM", "NCCLAVG_", "NCCL_", "GLOO_", "CUDA_VISIBLE", "TORCH_NCCL")


def timing_env() -> dict:
    from .launch import SPAWNED_VAR  # how the ranks were started is recorded as "launcher"

    return {k: v for k, v in sorted(os.environ.items()) if k.startswith(_ENV_PREFIXES) and k != SPAWNED_VAR}


def make_header(arguments: dict, setup_info: dict) -> dict:
    return {"tool": "ncclavg bench", "date": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
            "machine": machine_info(), "versions": versions(), "env": timing_env(), "arguments": arguments,
            **setup_info}


# ---------------------------------------------------------------------------------------------- table

def _fmt_time(us: float) -> str:
    return f"{us:10.2f}" if us < 1e6 else f"{us:10.0f}"


def _fmt_wrong(w) -> str:
    return f"{'N/A' if w is None else w:>7}"


class Table:
    """nccl-tests layout: size, count, type, redop, then per contender time/algbw/busbw/#wrong (the
    first, ncclavg) and time/busbw/#wrong (each peer)."""

    def __init__(self, contenders: list[tuple[str, str]], dtype: str):
        self.keys = [k for k, _ in contenders]
        self.labels = [SHORT_LABELS.get(k, k) for k in self.keys]
        self.dtype = dtype

    def header(self) -> str:
        lead = " " * 44
        groups = [f"{self.labels[0]:^34}"] + [f"{lab:^26}" for lab in self.labels[1:]]
        cols = [f"{'time':>10}{'algbw':>8}{'busbw':>8}{'#wrong':>8}"] + \
               [f"{'time':>10}{'busbw':>8}{'#wrong':>8}"] * (len(self.keys) - 1)
        units = [f"{'(us)':>10}{'(GB/s)':>8}{'(GB/s)':>8}{'':>8}"] + \
                [f"{'(us)':>10}{'(GB/s)':>8}{'':>8}"] * (len(self.keys) - 1)
        return "\n".join([
            "#" + lead[1:] + "".join(groups),
            f"#{'size':>13}{'count':>13}{'type':>10}{'redop':>8}" + "".join(cols),
            f"#{'(B)':>13}{'(elements)':>13}{'':>10}{'':>8}" + "".join(units),
        ])

    def row(self, size_rows: list[dict]) -> str:
        by_key = {r["contender"]: r for r in size_rows}
        first = size_rows[0]
        out = f"{first['size_bytes']:>14}{first['count']:>13}{self.dtype:>10}{'avg':>8}"
        for i, k in enumerate(self.keys):
            r = by_key[k]
            if i == 0:
                out += f"{_fmt_time(r['time_us'])}{r['algbw_gbps']:8.2f}{r['busbw_gbps']:8.2f}{_fmt_wrong(r['wrong'])} "
            else:
                out += f"{_fmt_time(r['time_us'])}{r['busbw_gbps']:8.2f}{_fmt_wrong(r['wrong'])} "
        return out.rstrip()


# -------------------------------------------------------------------------------------------- summary

def summarize(rows: list[dict], main: str = "ncclavg") -> dict:
    """Ratios per peer, as medians over sizes >= 1 MiB (bandwidth-bound) and below (latency-bound):
    speedup = peer time / ncclavg time (> 1: ncclavg is faster); for the copy reference the same ratio
    is the fraction of the copy bandwidth ncclavg reaches."""
    by_size: dict[int, dict[str, dict]] = {}
    for r in rows:
        by_size.setdefault(r["size_bytes"], {})[r["contender"]] = r
    mains = [r for r in rows if r["contender"] == main]
    wrong = [r["wrong"] for r in rows if r["wrong"] is not None]
    out = {"wrong_total": sum(wrong) if wrong else None,
           "avg_busbw_gbps": statistics.fmean(r["busbw_gbps"] for r in mains) if mains else None,
           "peak_busbw_gbps": max((r["busbw_gbps"] for r in mains), default=None),
           "peers": {}}
    peers = sorted({r["contender"] for r in rows} - {main})
    for p in peers:
        entry = {"label": next(r["label"] for r in rows if r["contender"] == p)}
        for name, pick in (("large", lambda s: s >= LARGE), ("small", lambda s: s < LARGE)):
            ratios = [c[p]["time_us"] / c[main]["time_us"] for s, c in by_size.items()
                      if pick(s) and p in c and main in c and c[main]["time_us"] > 0]
            entry[f"ratio_{name}"] = statistics.median(ratios) if ratios else None
            entry[f"sizes_{name}"] = len(ratios)
        out["peers"][p] = entry
    return out


def summary_lines(summary: dict) -> list[str]:
    lines = []
    w = summary["wrong_total"]
    lines.append(f"# #wrong total      : {'not checked' if w is None else w}{'' if w is None else (' OK' if w == 0 else ' FAILED')}")
    if summary["avg_busbw_gbps"] is not None:
        lines.append(f"# Avg bus bandwidth : {summary['avg_busbw_gbps']:.3f} GB/s (ncclavg, mean over sizes; "
                     f"peak {summary['peak_busbw_gbps']:.2f} GB/s)")
    for key, e in summary["peers"].items():
        def fmt(v, copy=key == "copy"):
            if v is None:
                return "n/a"
            return f"{100 * v:.0f}% of copy bandwidth" if copy else f"{v:.2f}x"
        what = "ncclavg reaches" if key == "copy" else "ncclavg speedup vs"
        target = "" if key == "copy" else f" {e['label']}"
        lines.append(f"# {what}{target}: {fmt(e['ratio_large'])} (median, >= 1 MiB, {e['sizes_large']} sizes), "
                     f"{fmt(e['ratio_small'])} (< 1 MiB, {e['sizes_small']} sizes)")
    return lines


def dump_json(path: str, payload: dict, indent: int = 1) -> None:
    """payload as JSON at path (its folder made), with a final newline, written atomically. Encoded
    before any file is opened, so a payload that cannot be encoded leaves nothing behind. indent: the standalone
    scripts in bench/ keep the 2 of their committed results."""
    text = json.dumps(payload, indent=indent) + "\n"
    folder = os.path.dirname(os.path.abspath(path))
    os.makedirs(folder, exist_ok=True)
    # written beside the target and renamed over it: a run stopped halfway leaves the old file whole
    tmp = os.path.join(folder, f".{os.path.basename(path)}.{os.getpid()}.tmp")
    try:
        with open(tmp, "w") as f:
            f.write(text)
        os.replace(tmp, path)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)


def write_json(path: str, header: dict, rows: list[dict], summary: dict) -> None:
    dump_json(path, {"header": header, "rows": rows, "summary": summary})


# ----------------------------------------------------------------------------------------------- plot

def _size_label(b: int) -> str:
    for unit, shift in (("G", 30), ("M", 20), ("K", 10)):
        if b >= 1 << shift and b % (1 << shift) == 0:
            return f"{b >> shift}{unit}"
    return f"{b}"


def write_plot(path: str, header: dict, rows: list[dict]) -> None:
    """Bus bandwidth vs message size, log-log, one line per contender (algbw when n == 1)."""
    import matplotlib

    matplotlib.use("Agg")  # files only: never needs a display
    import matplotlib.pyplot as plt

    args = header["arguments"]
    fig, ax = plt.subplots(figsize=(10, 6), dpi=110)
    keys = list(dict.fromkeys(r["contender"] for r in rows))
    styles = {"ncclavg": dict(color="C3", lw=2.4, marker="o", zorder=5),
              "copy": dict(color="0.45", lw=1.6, ls="--", marker="", zorder=2)}
    # One participant moves nothing over a bus (busbw = 0 by the nccl-tests formula): plot algbw then.
    ykey = "busbw_gbps" if header.get("n", 2) > 1 else "algbw_gbps"
    for i, k in enumerate(keys):
        pts = [(r["size_bytes"], r[ykey]) for r in rows if r["contender"] == k and r[ykey] > 0]
        if not pts:
            continue
        label = next(r["label"] for r in rows if r["contender"] == k)
        style = styles.get(k, dict(color=f"C{i % 10}", lw=1.6, marker="s", ms=3.5))
        ax.plot([p[0] for p in pts], [p[1] for p in pts], label=label, ms=style.pop("ms", 4), **style)
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    sizes = sorted({r["size_bytes"] for r in rows})
    step = max(1, -(-len(sizes) // 13))  # at most 13 labels: they must not overlap
    ax.set_xticks(sizes[::step])
    ax.set_xticklabels([_size_label(s) for s in sizes[::step]], rotation=0)
    ax.set_xlabel("message size per participant (bytes; K/M/G = 2^10/2^20/2^30)")
    ax.set_ylabel("bus bandwidth (GB/s) = algbw x 2(n-1)/n" if ykey == "busbw_gbps"
                  else "algorithm bandwidth (GB/s) = bytes / time")
    m = header["machine"]
    where = ", ".join(m["gpus"]) if header.get("backend") == "nccl" and m["gpus"] else f"{m['cpu']}, {m['cores']} cores"
    ax.set_title(f"ncclavg bench: all_reduce_avg, backend {header.get('backend')}, n = {header.get('n')}, "
                 f"{args.get('dtype')}\n{where}, load average {m.get('load_avg_1m')}, {header['date'][:10]}", fontsize=11)
    ax.grid(True, which="major", alpha=0.45)
    ax.grid(True, which="minor", alpha=0.15)
    ax.legend(loc="upper left", fontsize=9, framealpha=0.9)
    fig.tight_layout()
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    fig.savefig(path)
    plt.close(fig)

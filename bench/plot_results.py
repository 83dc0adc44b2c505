"""The figures and tables of docs/performance.md, made from the committed results in bench/results/.

Every number on that page comes from here: each question has one table of ratios and one figure, both
computed from the results files named in SOURCES: their markdown tables (every results file has one;
some have no JSON), or the JSON beside them where it holds the unrounded medians. Nothing is measured
here.

    python bench/plot_results.py            # writes docs/figures/*.png and prints the tables
    python bench/plot_results.py --tables   # the tables only (no matplotlib needed)

Ratios are "times faster": the other's time over ncclavg's (or ncclavg's samples/s over the other's),
so above 1.00x ncclavg is faster and below it slower. tests/test_performance_page.py checks that every
table below is in docs/performance.md as printed here and that every figure there names its sources.
"""
from __future__ import annotations

import argparse
import json
import re
import sys
from pathlib import Path
from typing import Callable

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "bench" / "results"
FIGURES = ROOT / "docs" / "figures"

# question -> the results files its table and figure are computed from (paths under bench/results)
SOURCES = {
    "one_host": ["mpi-peers-cpu-2026-12-05-async-inline-quiet.md",
                 "mpi-peers-cpu-2026-12-05-native-allreduce-quiet-4proc.md"],
    "torch_face": ["torch_face-async-inline-cpu-2026-12-05.md"],
    "stock": ["stock_ddp-cpu-2026-12-05-async-inline.md", "stock_ddp-frameworks-cpu-2026-12-05-async-inline-2proc.md"],
    "cpu_master": ["optim-amd-epyc-2c-2026-12-01.md", "cpu-2026-12-01.md"],
    "hosts": ["hosts-intel-r-xeon-r-processor-2c-2026-12-07-ucx-r3.md",
              "hosts-intel-r-xeon-r-processor-2c-2026-12-07-ucx-r3-three.md",
              "hosts-intel-r-xeon-r-processor-2c-2026-12-07-ucx-r3-1000.md",
              "hosts-intel-r-xeon-r-processor-2c-2026-12-07-ucx-r3-veth.md"],
}
MPI_COLUMNS = ("Open MPI 5.0.11 us", "MPICH 4.1.2 us", "MPICH 5.0.2 us", "Intel MPI 2021.19.0 us")
UNITS = {"B": 1, "KiB": 1 << 10, "MiB": 1 << 20, "GiB": 1 << 30}


# ---------------------------------------------------------------- reading the results
def md_tables(name: str) -> list[list[dict]]:
    """Every markdown table of bench/results/`name`, as lists of {header: cell} rows."""
    tables, header, rows = [], None, []
    for line in (RESULTS / name).read_text().splitlines() + [""]:
        if line.startswith("|"):
            cells = [c.strip() for c in line.strip().strip("|").split("|")]
            if header is None:
                header = cells
            elif not all(re.fullmatch(r":?-+:?", c) for c in cells):
                rows.append(dict(zip(header, cells)))
            continue
        if header is not None:
            tables.append(rows)
        header, rows = None, []
    return tables


def table_with(name: str, column: str) -> list[dict]:
    """The first table of `name` that has `column`."""
    for t in md_tables(name):
        if t and column in t[0]:
            return t
    raise ValueError(f"{name}: no table with a column {column!r}")


def size_bytes(text: str) -> int:
    n, unit = text.split()
    return int(n) * UNITS[unit]


def number(cell: str) -> float | None:
    m = re.match(r"-?[\d.]+", cell.strip())
    return float(m.group()) if m and cell.strip() not in ("", "-") else None


def x(v: float | None) -> str:
    return "-" if v is None else f"{v:.2f}x"


def md(header: list[str], rows: list[list[str]], right_from: int = 1) -> str:
    align = ["---"] * right_from + ["---:"] * (len(header) - right_from)
    return "\n".join(["| " + " | ".join(header) + " |", "|" + "|".join(align) + "|"]
                     + ["| " + " | ".join(r) + " |" for r in rows])


# ---------------------------------------------------------------- the questions
def one_host_data() -> dict[int, list[dict]]:
    """P -> [{size, mpi: best MPI time / ncclavg's, mpi_name, gloo: gloo time / ncclavg's}] (public API),
    from the JSON next to each markdown source (its unrounded medians)."""
    out: dict[int, list[dict]] = {}
    for name in SOURCES["one_host"]:
        doc = json.loads((RESULTS / name).with_suffix(".json").read_text())
        # "MPICH 4" + "MPICH Version: 4.1.2" -> "MPICH 4.1.2"
        labels = {p["peer"]: f"{re.sub(r' [0-9]+$', '', p['label'])} {mpi_version(p['mpi'])}" for p in doc["peers"]}
        for r in doc["merged"]:
            ours = r["time_us"]["ncclavg"]
            out.setdefault(int(r["procs"]), []).append({
                "size": human(r["size_bytes"]), "bytes": r["size_bytes"],
                "mpi": r["mpi_us"][r["best_mpi"]] / ours, "mpi_name": labels[r["best_mpi"]],
                "gloo": r["time_us"]["torch gloo"] / ours})
    return out


def mpi_version(text: str) -> str:
    """The version in an MPI_Get_library_version line: 'Open MPI v5.0.11, ...' -> 5.0.11."""
    m = re.search(r"v?(\d+\.\d+(?:\.\d+)?)", text)
    return m.group(1) if m else ""


def human(n: int) -> str:
    for unit in ("MiB", "KiB"):
        if n >= UNITS[unit] and n % UNITS[unit] == 0:
            return f"{n // UNITS[unit]} {unit}"
    return f"{n} B"


def one_host_table() -> str:
    data = one_host_data()
    sizes = [r["size"] for r in data[2]]
    rows = []
    for i, size in enumerate(sizes):
        row = [size]
        for p in (2, 4):
            r = data[p][i]
            row += [f"{x(r['mpi'])} ({r['mpi_name']})", x(r["gloo"])]
        rows.append(row)
    return md(["size", "2 processes: vs best MPI", "vs gloo", "4 processes: vs best MPI", "vs gloo"], rows)


TORCH_SIZES = ("8 B", "64 KiB", "16 MiB")


def torch_face_data() -> dict[str, list[dict]]:
    """collective -> [{size, gloo: torch gloo time / torch ncclavg's, api: torch ncclavg time / public API's}],
    from the file's own ratio columns (computed from its unrounded times)."""
    out: dict[str, list[dict]] = {}
    for r in table_with(SOURCES["torch_face"][0], "ncclavg/API"):
        ours, gloo = number(r["ncclavg/API"]), number(r["gloo/API"])
        out.setdefault(r["collective"], []).append({
            "size": r["size"], "bytes": size_bytes(r["size"]), "gloo": gloo / ours, "api": ours})
    return out


def torch_face_table() -> str:
    rows = []
    for coll, rs in torch_face_data().items():
        by = {r["size"]: r for r in rs}
        rows.append([f"`{coll}`" if coll != "async x8" else "all_reduce, bursts of 8 async"]
                    + [x(by[s]["gloo"]) for s in TORCH_SIZES] + [x(by[s]["api"]) for s in TORCH_SIZES])
    head = [f"vs gloo, {s}" for s in TORCH_SIZES] + [f"time / public API's, {s}" for s in TORCH_SIZES]
    return md(["collective through `torch.distributed`"] + head, rows)


STOCK_ROWS = (("ddp ncclavg", "DDP, `init_process_group(\"ncclavg\")`"),
              ("ddp gloo+hook", "DDP on gloo + `ncclavg.ddp.register`"),
              ("fsdp2 ncclavg", "FSDP2 on `ncclavg`"),
              ("fsdp2 gloo+comms", "FSDP2 on gloo + `use_ncclavg`"),
              ("zero1 ncclavg", "DeepSpeed ZeRO-1 on `ncclavg`"),
              ("zero2 ncclavg", "DeepSpeed ZeRO-2 on `ncclavg`"),
              ("zero3 ncclavg", "DeepSpeed ZeRO-3 on `ncclavg`"))
STOCK_COLUMNS = (("mlp-3M", 2), ("mlp-3M", 4), ("digits-mlp", 2), ("digits-mlp", 4))


def stock_data() -> dict[tuple, float]:
    """(contender, workload, processes) -> samples/s over the same on gloo."""
    out = {}
    for name in SOURCES["stock"]:
        for r in table_with(name, "x gloo"):
            if number(r["x gloo"]) is not None:
                out[(r["contender"], r["workload"], int(r["processes"]))] = number(r["x gloo"])
    return out


def stock_table() -> str:
    data = stock_data()
    rows = [[label] + [x(data.get((key, w, p))) for w, p in STOCK_COLUMNS] for key, label in STOCK_ROWS]
    return md(["samples/s vs the same on gloo"] + [f"{w}, {p} processes" for w, p in STOCK_COLUMNS], rows)


OPTIM_CASES = (("adamw {n} params: CPUAdamW.step (default, no inf/NaN check: torch's work)",
                "`CPUAdamW.step` vs `torch.optim.AdamW(fused=True)`"),
               ("avg1xbf16+adamw+bf16-out {n}: MasterWeights.step (inf/NaN check on, default)",
                "`MasterWeights.step`: average 1 bf16 tower + AdamW + bf16 copy-out"),
               ("avg4xbf16+adamw+bf16-out {n}: MasterWeights.step (inf/NaN check on, default)",
                "the same, 4 towers"),
               ("avg8xbf16+adamw+bf16-out {n}: MasterWeights.step (inf/NaN check on, default)",
                "the same, 8 towers"))
TRAINER_CASE = "TowerTrainer(master='cpu') step, 2 towers, 8.4 M params, vs naive torch offload"


def cpu_master_data() -> dict[str, dict[str, float]]:
    """row label -> {"8M": x torch, "64M": x torch} (avx512), and the trainer step's ratio."""
    optim = {r["case"]: r for r in table_with(SOURCES["cpu_master"][0], "case")}
    out = {}
    for case, label in OPTIM_CASES:
        out[label] = {n: number(optim[case.format(n=n)]["avx512: ms, x torch, of copy, check"].split(",")[1])
                      for n in ("8M", "64M")}
    suite = {r["case"]: r for r in table_with(SOURCES["cpu_master"][1], "x torch")}
    out["`TowerTrainer(master=\"cpu\")` step, 2 CPU towers, 8.4 M-param MLP, vs the naive torch offload loop"] = {
        "8M": number(suite[TRAINER_CASE]["x torch"])}
    return out


def cpu_master_table() -> str:
    rows = [[label, x(v.get("8M")), x(v.get("64M"))] for label, v in cpu_master_data().items()]
    return md(["step (AVX-512)", "8 M parameters", "64 M parameters"], rows)


def hosts_data() -> list[tuple[str, list[dict]]]:
    """[(shape and link, [{size, bytes, ms: ncclavg's, gloo: gloo's time / ncclavg's, mpi: the faster Open
    MPI's / ncclavg's, line: T* / ncclavg's time}])], one per section of the hosts results files, in their
    order (their own medians; the torch backend's column). On an unshaped veth link T* is the time at the
    TCP ceiling measured in the same run (its column "T* (TCP) ms")."""
    out = []
    for name in SOURCES["hosts"]:
        section = None
        tables = iter(md_tables(name))
        for line in (RESULTS / name).read_text().splitlines():
            if line.startswith("### "):
                section = line[4:].strip()
            elif line.startswith("| size |") and section is not None:
                rows = []
                for r in next(t for t in tables if t and "size" in t[0]):
                    ours = number(r["ncclavg ms"])
                    mpis = [number(v) for k, v in r.items() if k.startswith("Open MPI") and k.endswith(" ms")]
                    mpis = [m for m in mpis if m is not None]
                    rows.append({"size": r["size"], "bytes": size_bytes(r["size"]), "ms": ours,
                                 "gloo": number(r["gloo ms"]) / ours, "mpi": min(mpis) / ours if mpis else None,
                                 "line": number(r.get("T* ms", r.get("T* (TCP) ms"))) / ours})
                out.append((section, rows))
                section = None
    return out


def hosts_table() -> str:
    rows = []
    for section, rs in hosts_data():
        for r in rs:
            rows.append([section, r["size"], f"{r['ms']:.2f}", x(r["gloo"]), x(r["mpi"]),
                         "-" if r["bytes"] < (1 << 20) else f"{r['line']:.2f}"])
    return md(["hosts x processes, link", "size", "ncclavg ms", "vs gloo", "vs best Open MPI", "of the line rate"],
              rows, right_from=2)


TABLES: dict[str, Callable[[], str]] = {"one_host": one_host_table, "torch_face": torch_face_table,
                                        "stock": stock_table, "cpu_master": cpu_master_table,
                                        "hosts": hosts_table}


# ---------------------------------------------------------------- the figures
def _axes_ratio(ax, title: str) -> None:
    ax.axhline(1.0, color="grey", lw=1, ls="--")
    ax.set_yscale("log")
    ax.set_title(title, fontsize=10)
    ax.grid(alpha=0.3, which="both")


def one_host_figure(plt):
    data = one_host_data()
    fig, axes = plt.subplots(1, 2, figsize=(10, 4), sharey=True)
    for ax, p in zip(axes, (2, 4)):
        rs = data[p]
        xs = [r["bytes"] for r in rs]
        ax.plot(xs, [r["mpi"] for r in rs], marker="o", label="vs the best MPI at that size")
        ax.plot(xs, [r["gloo"] for r in rs], marker="s", label="vs torch.distributed gloo")
        ax.set_xscale("log", base=2)
        ax.set_xlabel("bytes per rank")
        _axes_ratio(ax, f"{p} processes, one host")
    axes[0].set_ylabel("times faster (their time / ncclavg's)")
    axes[0].legend(fontsize=8)
    fig.suptitle("all_reduce_avg between the processes of one host")
    return fig


def _vs_gloo_figure(plt, series, title: str, width: float, legend_size: int):
    """Lines of 'times faster than gloo' over bytes per rank, one per (label, rows) of `series`."""
    fig, ax = plt.subplots(figsize=(width, 4))
    for label, rs in series:
        ax.plot([r["bytes"] for r in rs], [r["gloo"] for r in rs], marker="o", label=label)
    ax.set_xscale("log", base=2)
    ax.set_xlabel("bytes per rank")
    ax.set_ylabel("times faster than gloo")
    _axes_ratio(ax, title)
    ax.legend(fontsize=legend_size)
    return fig


def torch_face_figure(plt):
    return _vs_gloo_figure(plt, torch_face_data().items(),
                           "torch.distributed collectives: backend ncclavg vs gloo, 2 processes", 7, 8)


def stock_figure(plt):
    data = stock_data()
    fig, ax = plt.subplots(figsize=(10, 4))
    width = 0.8 / len(STOCK_COLUMNS)
    for j, (w, p) in enumerate(STOCK_COLUMNS):
        ys = [data.get((key, w, p), 0.0) for key, _ in STOCK_ROWS]
        ax.bar([i + j * width for i in range(len(STOCK_ROWS))], ys, width, label=f"{w}, {p} processes")
    ax.set_xticks([i + 0.4 - width / 2 for i in range(len(STOCK_ROWS))])
    ax.set_xticklabels([k.replace(" ncclavg", "").replace("gloo+", "gloo + ") for k, _ in STOCK_ROWS], fontsize=8)
    ax.axhline(1.0, color="grey", lw=1, ls="--")
    ax.set_ylabel("samples/s vs the same on gloo")
    ax.set_title("stock PyTorch trainers on the ncclavg backend", fontsize=10)
    ax.legend(fontsize=8)
    ax.grid(alpha=0.3, axis="y")
    return fig


def cpu_master_figure(plt):
    data = cpu_master_data()
    labels = ["CPUAdamW", "Master 1 tower", "Master 4 towers", "Master 8 towers", "TowerTrainer step"]
    fig, ax = plt.subplots(figsize=(8, 4))
    for j, n in enumerate(("8M", "64M")):
        ys = [v.get(n, 0.0) for v in data.values()]
        ax.bar([i + j * 0.4 for i in range(len(ys))], ys, 0.4, label=f"{n[:-1]} M parameters")
    ax.set_xticks([i + 0.2 for i in range(len(labels))])
    ax.set_xticklabels(labels, fontsize=8)
    ax.axhline(1.0, color="grey", lw=1, ls="--")
    ax.set_ylabel("times faster than the best torch way")
    ax.set_title("CPU master weights and the fused optimizer (AVX-512, 2 cores)", fontsize=10)
    ax.legend(fontsize=8)
    ax.grid(alpha=0.3, axis="y")
    return fig


def hosts_figure(plt):
    return _vs_gloo_figure(plt, hosts_data(), "all_reduce between emulated hosts: backend ncclavg vs gloo", 8, 7)


FIGURE_MAKERS = {"one_host": one_host_figure, "torch_face": torch_face_figure, "stock": stock_figure,
                 "cpu_master": cpu_master_figure, "hosts": hosts_figure}


def figure_path(question: str) -> Path:
    return FIGURES / f"performance-{question.replace('_', '-')}.png"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tables", action="store_true", help="print the tables only, write no figure")
    args = ap.parse_args(argv)
    for q, make in TABLES.items():
        print(f"<!-- {q}: {', '.join('bench/results/' + s for s in SOURCES[q])} -->\n{make()}\n")
    if args.tables:
        return 0
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    FIGURES.mkdir(parents=True, exist_ok=True)
    for q, make in FIGURE_MAKERS.items():
        fig = make(plt)
        try:
            fig.tight_layout()
            # no date in the PNG's metadata: the same results give the same bytes
            fig.savefig(figure_path(q), dpi=90, metadata={"Software": None})
        finally:
            plt.close(fig)
        print(f"wrote {figure_path(q).relative_to(ROOT)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""Stock DDP training between emulated hosts: the user's view of bench/hosts.py. The same hosts (network
namespaces joined by shaped, delayed links or unshaped veth ones: bench/hosts_net.py), torchrun in every
host, and in every rank an unchanged DDP training loop (bench/hosts_ddp_worker.py: an MLP of --params
parameters, AdamW, the global batch split over the ranks) on `init_process_group("gloo")` or
`init_process_group("ncclavg")`, launch by launch, alternated (the order rotates). Reported per shape,
link and model: each backend's samples/s (the global batch over the median of every timed step of all
its launches, a step being its slowest rank's) and ncclavg / gloo (above 1: ncclavg trains faster).

    python bench/hosts_ddp.py                                   # 2x2 and 2x1, 2500:0.1 and 1000:0.5, 2 M and 20 M
    python bench/hosts_ddp.py --shapes 2x2 --links 2500:0.1 --params 2M --launches 1 --steps 4
    python bench/hosts_ddp.py --shapes 2x2 --links veth --params 20M     # unshaped veth links
Needs root, `ip` and `tc`, gcc and /dev/net/tun (not for veth links alone; bench/hosts.py's). Writes
bench/results/hosts-ddp-<cpu>-<date>[-tag].{md,json}.
"""
from __future__ import annotations

import argparse
import datetime
import json
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import hosts as hb  # noqa: E402
import hosts_launch as launch  # noqa: E402
import hosts_net as net_mod  # noqa: E402

WORKER = Path(__file__).resolve().parent / "hosts_ddp_worker.py"
BACKENDS = ("gloo", "ncclavg")


def parse_params(text: str) -> list[int]:
    out = []
    for part in [p.strip() for p in text.split(",") if p.strip()]:
        mult = {"K": 10 ** 3, "M": 10 ** 6}.get(part[-1].upper(), 1)
        try:
            n = int(float(part[:-1] if mult > 1 else part) * mult)
        except ValueError:
            n = 0
        if not 10 ** 4 <= n <= 10 ** 9:
            raise ValueError(f"--params: {part!r} is not a parameter count from 10K to 1000M (e.g. 2M)")
        out.append(n)
    if not out:
        raise ValueError("--params: none given")
    return out


def parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--shapes", default="2x2,2x1", help="HOSTSxPROCS, comma-separated (default 2x2,2x1)")
    ap.add_argument("--links", default="2500:0.1,1000:0.5",
                    help="RATE_MBIT:DELAY_MS or veth (unshaped), comma-separated")
    ap.add_argument("--params", default="2M,20M", help="model sizes, comma-separated (default 2M,20M)")
    ap.add_argument("--batch", type=int, default=64, help="global batch (default 64)")
    ap.add_argument("--steps", type=int, default=8, help="timed steps per launch (default 8)")
    ap.add_argument("--warmup", type=int, default=2, help="untimed steps first (default 2)")
    ap.add_argument("--launches", type=int, default=2, help="launches per backend (default 2)")
    ap.add_argument("--timeout", type=float, default=600.0, help="limit of each launch in seconds")
    ap.add_argument("--tag", default="")
    ap.add_argument("--out-dir", type=Path, default=Path(__file__).resolve().parent / "results")
    ap.add_argument("--verbose", action="store_true")
    return ap


def one_launch(net, args, backend: str, params: int, procs: int, index: int) -> dict:
    result = Path(net.workdir) / f"ddp-{index}.json"
    script = [str(WORKER), "--backend", backend, "--params", str(params), "--batch", str(args.batch),
              "--steps", str(args.steps), "--warmup", str(args.warmup), "--timeout", str(args.timeout),
              "--result", str(result)]
    cmds = [[*net.netns_exec(h), sys.executable, "-m", "torch.distributed.run", "--nnodes", str(net.hosts_n),
             "--nproc-per-node", str(procs), "--node-rank", str(h), "--master-addr", net.hosts[0].addrs[0],
             "--master-port", str(launch.MASTER_PORT + index), "--max-restarts", "0", *script]
            for h in range(net.hosts_n)]
    env = dict(launch.base_env(net.workdir), GLOO_SOCKET_IFNAME=net.ifnames[0])
    got = launch._run_all(cmds, env, args.timeout, net, echo=args.verbose)
    entry = {"backend": backend, "params": params, "index": index, "wall_s": got.wall_s, "error": got.error}
    if got.ok and result.exists():
        entry["result"] = json.loads(result.read_text())
    else:
        entry["error"] = got.error or "no result file"
        entry["tail"] = got.tail[-3000:]
    print(f"   launch {index} {backend} {params / 1e6:g} M: {'ok' if entry.get('result') else entry['error']} "
          f"in {got.wall_s:.0f} s", file=sys.stderr, flush=True)
    return entry


def summary(runs: list[dict]) -> list[dict]:
    rows = []
    for run in runs:
        for params in run["params"]:
            row = {"shape": f"{run['hosts']}x{run['procs']}", "link": run["link"], "params": params}
            for b in BACKENDS:
                steps = [s for ln in run["launches"] if ln["backend"] == b and ln["params"] == params and ln.get("result")
                         for s in ln["result"]["step_s"]]
                batch = next((ln["result"]["batch"] for ln in run["launches"] if ln.get("result")), 0)
                row[b] = batch / statistics.median(steps) if steps else None
                row[b + "_transport"] = next((ln["result"]["transport"] for ln in run["launches"]
                                              if ln["backend"] == b and ln.get("result")), None)
            row["ratio"] = row["ncclavg"] / row["gloo"] if row["ncclavg"] and row["gloo"] else None
            rows.append(row)
    return rows


def markdown(rows: list[dict], command: str, machine: str) -> str:
    out = [f"# Stock DDP between emulated hosts ({machine}, {datetime.date.today()})", "",
           f"Command: `{command}`", "",
           "samples/s = the global batch over the median step (a step: its slowest rank's time) over every "
           "timed step of a backend's launches; ncclavg / gloo above 1: ncclavg trains faster.", "",
           "| shape | link | parameters | gloo samples/s | ncclavg samples/s | ncclavg / gloo | ncclavg's transport |",
           "|---|---|---:|---:|---:|---:|---|"]
    for r in rows:
        f = lambda v: f"{v:.1f}" if v else "-"   # noqa: E731
        out.append(f"| {r['shape']} | {r['link']} | {r['params'] / 1e6:.1f} M | {f(r['gloo'])} | {f(r['ncclavg'])} | "
                   f"{(format(r['ratio'], '.2f') + 'x') if r['ratio'] else '-'} | {r['ncclavg_transport']} |")
    return "\n".join(out) + "\n"


def main(argv: list[str] | None = None) -> int:
    args = parser().parse_args(argv)
    shapes = [hb.parse_shape(s) for s in args.shapes.split(",") if s.strip()]
    links = net_mod.parse_links(args.links)
    params = parse_params(args.params)
    net_mod.preflight(tun=any(not link.veth for link in links))
    runs = []
    index = 0
    for link in links:
        for hosts, procs in shapes:
            net = net_mod.Network(hosts, link, nics=1)
            run = {"hosts": hosts, "procs": procs, "link": link.label,
                   "params": params, "launches": []}
            print(f"== {hosts} hosts x {procs}, {run['link']}", file=sys.stderr, flush=True)
            net.up()
            try:
                for n in params:
                    for i in range(args.launches):
                        order = BACKENDS if i % 2 == 0 else BACKENDS[::-1]
                        for b in order:
                            run["launches"].append(one_launch(net, args, b, n, procs, index))
                            index += 1
            finally:
                net.down()
            runs.append(run)
    rows = summary(runs)
    command = "python bench/hosts_ddp.py " + " ".join(argv if argv is not None else sys.argv[1:])
    m = hb.machine()
    md_path, json_path = hb.result_paths(args, m)
    md_path = md_path.with_name(md_path.name.replace("hosts-", "hosts-ddp-", 1))
    json_path = json_path.with_name(json_path.name.replace("hosts-", "hosts-ddp-", 1))
    text = markdown(rows, command.strip(), f"{m['cpu']}, {m['cores']} cores, torch {m['torch']}")
    print(text)
    args.out_dir.mkdir(parents=True, exist_ok=True)
    md_path.write_text(text)
    json_path.write_text(json.dumps({"command": command, "machine": m, "runs": runs, "rows": rows}, indent=1))
    print(f"wrote {md_path} and {json_path}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

"""`ncclavg train`: multi-tower training on real data out of the box (scikit-learn's bundled digits, no
download), or on synthetic data for throughput. Ends with one machine-readable line:

    summary: test_accuracy=0.973 epochs=5 samples_per_s=1234.5 wall_s=41.2 processes=1 towers=2 devices=cpu,cpu

Under torchrun every process runs this command with its own towers (--towers / --devices are per
process) and the average spans the towers of every process (Note [Towers of several processes] in
distributed.py); rank 0 alone prints, plots and writes metrics and checkpoints.
"""
from __future__ import annotations

import argparse
import os
import sys
from typing import Any, Callable

from ..errors import UsageError

DEFAULTS = {
    "epochs": 10, "batch_size": 64, "optimizer": "adamw", "lr_schedule": "cosine", "weight_decay": 0.0,
    "momentum": 0.9, "amp": "none", "master": "cpu", "model": "cnn", "seed": 0,
    "synthetic_samples": 8192, "test_fraction": 0.2, "checkpoint_every": 1, "keep": 2,
}
DEFAULT_LR = {"adamw": 3e-3, "adam": 3e-3, "sgd": 0.05}
DEFAULT_PLOT = "ncclavg-train.png"


def add_parser(subparsers: Any) -> argparse.ArgumentParser:
    p = subparsers.add_parser(
        "train", help="train a small model with N towers (digits data, no download)",
        description="Data-parallel training with one model replica (tower) per device in one process: "
                    "each batch is split across the towers, gradients are averaged by ncclavg and fp32 "
                    "master weights are updated on the CPU. Default: 2 CPU towers (all visible GPUs on a "
                    "GPU machine), a small CNN on scikit-learn's bundled 8x8 digits.")
    g = p.add_argument_group("towers")
    g.add_argument("--towers", type=int, help="towers of this process (default: all GPUs, else 2 CPU towers; "
                   "under torchrun: the GPU of LOCAL_RANK, else 2 CPU towers per process)")
    g.add_argument("--devices", help="comma-separated tower devices of this process, e.g. cpu,cpu or "
                   "cuda:0,cuda:1 or 0,1 ('cpu' once per CPU tower: there is one CPU device)")
    g.add_argument("--master", choices=("cpu", "device"),
                   help="where the optimizer runs: fp32 master weights on the CPU (default) or on each device "
                        "(the default for GPU towers under torchrun)")
    g.add_argument("--shard-master", action="store_true", default=None,
                   help="under torchrun with CPU towers: split the CPU master weights and optimizer state over "
                        "the processes (ZeRO-1), each process steps 1/P of them")
    g.add_argument("--amp", choices=("none", "bf16", "fp16"), help="autocast the towers (default none)")
    t = p.add_argument_group("training")
    t.add_argument("--model", choices=("cnn", "mlp"), help="model (default cnn)")
    t.add_argument("--epochs", type=int, help=f"total epochs (default {DEFAULTS['epochs']})")
    t.add_argument("--batch-size", type=int,
                   help=f"global batch size, split across towers (default {DEFAULTS['batch_size']})")
    t.add_argument("--optimizer", choices=("adamw", "adam", "sgd"), help="optimizer (default adamw)")
    t.add_argument("--lr", type=float, help="peak learning rate (default 3e-3 for adam(w), 0.05 for sgd)")
    t.add_argument("--lr-schedule", choices=("constant", "exponential", "cosine"),
                   help="constant | exponential (x0.9 per epoch, staircase) | cosine with warm-up (default)")
    t.add_argument("--weight-decay", type=float, help="weight decay (default 0)")
    t.add_argument("--momentum", type=float, help="SGD momentum (default 0.9)")
    t.add_argument("--nesterov", action="store_true", default=None, help="SGD with Nesterov momentum")
    t.add_argument("--grad-clip", type=float, help="clip the global gradient norm to this value")
    t.add_argument("--on-nonfinite", choices=("skip", "raise", "ignore"),
                   help="a step with an inf/NaN gradient: skip it and go on (default), stop with an error, or "
                        "ignore (no check, one pass less)")
    t.add_argument("--replica-check-every", type=int,
                   help="compare the replicas' parameters and master weights across towers and processes every N "
                        "steps, an error naming the first that differs (default 100; 0: never)")
    t.add_argument("--seed", type=int, help="seed of the model init, data split and shuffling (default 0)")
    t.add_argument("--max-steps", type=int, help="stop after this many optimizer steps in total")
    t.add_argument("--threads", type=int, help="torch intra-op threads (default for CPU towers: cores / (CPU towers x "
                   "torchrun processes on this host), as TowerTrainer does)")
    d = p.add_argument_group("data")
    d.add_argument("--synthetic", action="store_true", help="random Gaussian-cluster data instead of digits")
    d.add_argument("--synthetic-samples", type=int, help="samples of synthetic data (default 8192)")
    d.add_argument("--test-fraction", type=float, help="held-out share (default 0.2)")
    o = p.add_argument_group("outputs")
    o.add_argument("--checkpoint-dir", help="save a checkpoint here after every epoch (keeps the newest two)")
    o.add_argument("--checkpoint-every", type=int, help="epochs between checkpoints (default 1)")
    o.add_argument("--keep", type=int, help="complete checkpoints to keep (default 2)")
    o.add_argument("--resume", metavar="PATH", help="checkpoint file, or a directory: its newest complete one, "
                   "on its CPU towers unless --towers / --devices say otherwise. With another --epochs (or --lr) "
                   "than the saved run, a named lr schedule is planned again over the new total from the step "
                   "reached (cosine keeps decaying to 0 at the new end); a checkpoint at --epochs already says "
                   "there is nothing to train")
    o.add_argument("--keep-schedule", action="store_true", default=None,
                   help="with --resume: keep the saved lr schedule as it was planned, even past its end")
    o.add_argument("--metrics", metavar="FILE", help="write metrics as JSON lines to FILE")
    o.add_argument("--plot", metavar="FILE", nargs="?", const=DEFAULT_PLOT,
                   help=f"PNG of loss and accuracy per epoch (default file {DEFAULT_PLOT})")
    o.add_argument("--progress", dest="progress", action="store_true", default=None,
                   help="a progress bar per epoch on stderr (default: when stderr is a terminal, else one line "
                        "per epoch)")
    o.add_argument("--no-progress", dest="progress", action="store_false",
                   help="one line per epoch on stdout, never a bar")
    p.set_defaults(func=run)
    return p


def _resolve_devices(args: argparse.Namespace, resuming: bool) -> list | None:
    """This process's tower devices from --towers / --devices, or None when a run resumed without either
    takes its CPU towers from the checkpoint (TowerTrainer.load spreads the saved towers over the
    processes). GPU towers come from this machine's GPUs, resumed or not."""
    import torch

    from .distributed import launched_with_processes
    from .towers import default_devices, parse_devices

    UsageError.check_at_least("--towers", args.towers)
    if args.devices is not None:
        try:
            devices = parse_devices([x for x in args.devices.split(",")] if args.devices.strip() else [])
        except (ValueError, TypeError) as e:
            raise UsageError(f"--devices: {e}") from None
        if args.towers is not None and args.towers != len(devices):
            raise UsageError(f"--towers: {args.towers} does not match the {len(devices)} devices of --devices")
        return devices
    base = default_devices()
    if resuming and args.towers is None and base[0].type == "cpu":
        return None
    if launched_with_processes() and base[0].type == "cuda":
        # one GPU per process: LOCAL_RANK's; more processes than GPUs share them round robin (several NCCL
        # ranks on one GPU: NCCL >= 2.30 with NCCL_MULTI_RANK_GPU_ENABLE=1, checked when the ranks start)
        base = [torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")) % len(base))]
    if args.towers is None:
        return base
    if base[0].type == "cpu":
        return [torch.device("cpu")] * args.towers
    if len(base) == 1:   # towers sharing one GPU: averaged by one kernel launch per bucket
        return base * args.towers
    if args.towers > len(base):
        raise UsageError(f"--towers: {args.towers} towers on {len(base)} GPUs; towers either share ONE GPU or "
                         f"have a GPU each: use --towers {len(base)} or less, or --devices "
                         f"{','.join([str(base[0])] * args.towers)}")
    return base[:args.towers]


def _load_data(args: argparse.Namespace, seed: int):
    from .data import load_digits, synthetic

    test_fraction = args.test_fraction if args.test_fraction is not None else DEFAULTS["test_fraction"]
    if not 0.0 < test_fraction < 1.0:
        raise UsageError(f"--test-fraction: must be in (0, 1), got {test_fraction}")
    if args.synthetic:
        n = args.synthetic_samples if args.synthetic_samples is not None else DEFAULTS["synthetic_samples"]
        UsageError.check_at_least("--synthetic-samples", n)
        return synthetic(num_samples=n, test_fraction=test_fraction, seed=seed)
    if args.synthetic_samples is not None:
        raise UsageError("--synthetic-samples: only applies with --synthetic")
    return load_digits(test_fraction=test_fraction, seed=seed)


def _elastic_resume(args: argparse.Namespace) -> str | None:
    """The newest complete checkpoint of --checkpoint-dir when torchrun restarted this run, else None.

    Note [Elastic restart]
    Under `torchrun --max-restarts K`, a worker that dies makes torchrun stop the others and start the
    whole group again, with TORCHELASTIC_RESTART_COUNT raised by one and the same arguments. A restarted
    `ncclavg train` with --checkpoint-dir therefore resumes from the newest checkpoint there that verifies
    (checkpoints are written atomically: a write cut short is never taken), or from --resume when the
    directory holds none yet, or starts afresh. Every process takes the same file (one file system shared
    by the hosts; processes that find different ones refuse to start, see check_same_start), and resuming
    is bit for bit on CPU towers, so the run ends with the weights of an uninterrupted one. Without --checkpoint-dir
    a restart starts from the beginning (or from --resume)."""
    from .checkpoint import CheckpointManager

    if int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") or 0) < 1 or not args.checkpoint_dir:
        return None
    if not os.path.isdir(args.checkpoint_dir):
        return None
    return CheckpointManager(args.checkpoint_dir).latest()


def _value(args: argparse.Namespace, name: str) -> Any:
    v = getattr(args, name)
    return DEFAULTS[name] if v is None else v


def run(args: argparse.Namespace) -> int:
    """Runs `ncclavg train`. A bad flag, or a value the library refuses before training starts (its
    ValueError / TypeError / ImportError), becomes a UsageError: one line from `ncclavg`, exit 2."""
    try:
        return _run(args)
    except UsageError:
        raise
    except (ValueError, TypeError, ImportError) as e:
        raise UsageError(str(e)) from e


def _run(args: argparse.Namespace) -> int:
    """`ncclavg train`: everything validated and built before the first file is written, then the fit."""
    from .data import TensorLoader
    from .models import build_model

    restarted = _checked_args(args)
    devices = _resolve_devices(args, resuming=bool(restarted or args.resume))
    seed, batch_size = _value(args, "seed"), _value(args, "batch_size")
    if devices is not None and batch_size < len(devices):
        raise UsageError(f"--batch-size: {batch_size} is smaller than the number of towers ({len(devices)}); "
                          "every tower needs at least one sample")
    split = _load_data(args, seed)
    model = build_model(_value(args, "model"), input_shape=split.input_shape, num_classes=split.num_classes,
                        seed=seed)
    train_loader = TensorLoader(split.x_train, split.y_train, batch_size=batch_size, shuffle=True, seed=seed)
    test_loader = TensorLoader(split.x_test, split.y_test, batch_size=max(256, batch_size), shuffle=False)
    epochs = _value(args, "epochs")
    trainer, resume_path = _trainer(args, model, devices, seed, restarted, batch_size)

    # Under torchrun rank 0 alone prints and writes; every process saves (rank 0 writes the file).
    # See Note [Towers of several processes].
    say = print if trainer.is_main else (lambda *a, **k: None)
    metrics, saver, plot = _callbacks(args, trainer, split, resumed=resume_path is not None)
    _say_setup(say, args, trainer, split)
    if resume_path and _said_nothing_left(say, args, trainer, resume_path, restarted, epochs):
        return _finish(trainer)
    # See Note [Schedules over a resumed run]: what this run's schedule is, and what changed.
    note = trainer.plan_schedule(len(train_loader), epochs, args.max_steps, log_note=False)
    say(note if note else f"lr schedule: {trainer.schedule!r}")
    sys.stdout.flush()

    from .callbacks import OutputsReport

    outputs = OutputsReport(say, metrics, saver, plot, args.checkpoint_dir)
    # --progress: the bar; --no-progress: epoch lines; neither: the bar on a terminal, else epoch lines.
    # fit() ends with the summary line (Note [Progress of fit] in fit_report.py), after `outputs`.
    progress = None if args.progress is None else ("bar" if args.progress else "lines")
    callbacks = [c for c in (metrics, saver, plot) if c]
    trainer.fit(train_loader, epochs=epochs, eval_loader=test_loader, callbacks=callbacks + [outputs],
                max_steps=args.max_steps, progress=progress)
    return _finish(trainer)


def _checked_args(args: argparse.Namespace) -> str | None:
    """The flags' bounds checked; the checkpoint a torchrun restart resumes from (Note [Elastic restart]),
    or None."""
    for flag, v in (("--epochs", args.epochs), ("--batch-size", args.batch_size), ("--max-steps", args.max_steps),
                    ("--checkpoint-every", args.checkpoint_every), ("--keep", args.keep), ("--threads", args.threads)):
        UsageError.check_at_least(flag, v)
    if args.keep_schedule and not args.resume:
        raise UsageError("--keep-schedule: only applies with --resume")
    return _elastic_resume(args)


def _trainer(args: argparse.Namespace, model: Any, devices: Any, seed: int, restarted: str | None,
             batch_size: int) -> tuple:
    """(the TowerTrainer, the checkpoint it resumed from or None): built from the flags, or loaded from
    --resume (or a torchrun restart's checkpoint) with the flags given overriding; every process checked to
    start from the same step (a collective, before anything else can fail alone)."""
    from . import checkpoint as ckpt
    from .distributed import check_same_start
    from .trainer import TowerTrainer

    # threads: See Note [Threads of CPU towers] in towers.py (the trainer applies the rule)
    overrides = {k: getattr(args, k) for k in ("optimizer", "lr", "weight_decay", "momentum", "nesterov",
                                              "grad_clip", "master", "on_nonfinite", "shard_master", "threads",
                                              "replica_check_every")
                 if getattr(args, k) is not None}
    if args.amp is not None:
        overrides["amp"] = None if args.amp == "none" else args.amp
    if args.keep_schedule:
        overrides["replan_schedule"] = False
    if restarted or args.resume:
        resume_path = restarted or ckpt.resolve(args.resume)
        if args.lr_schedule is not None:
            overrides["lr_schedule"] = args.lr_schedule
        trainer = TowerTrainer.load(resume_path, model, devices=devices, **overrides)
    else:
        resume_path = None
        optimizer = overrides.pop("optimizer", DEFAULTS["optimizer"])
        cfg = {"optimizer": optimizer, "lr": DEFAULT_LR[optimizer],
               "weight_decay": DEFAULTS["weight_decay"], "momentum": DEFAULTS["momentum"], "seed": seed,
               "lr_schedule": _value(args, "lr_schedule")}
        cfg.update(overrides)
        trainer = TowerTrainer(model, devices=devices, **cfg)   # devices is None only when resuming
    check_same_start(trainer.comm, trainer.step, resume_path)
    if batch_size < trainer.total_towers:
        raise UsageError(f"--batch-size: {batch_size} is smaller than the number of towers of all processes "
                         f"({trainer.total_towers}); every tower needs at least one sample")
    return trainer, resume_path


def _callbacks(args: argparse.Namespace, trainer: Any, split: Any, resumed: bool) -> tuple:
    """(metrics logger, checkpoint saver, plot), each None when its flag is off; the logger and the plot on
    the main process only (every process saves: rank 0 writes the file)."""
    from .callbacks import CheckpointCallback, MetricsLogger, PlotCallback

    main = trainer.is_main
    metrics = MetricsLogger(args.metrics, append=resumed) if args.metrics and main else None
    saver = (CheckpointCallback(args.checkpoint_dir, every_epochs=_value(args, "checkpoint_every"),
                                keep=_value(args, "keep")) if args.checkpoint_dir else None)
    title = f"ncclavg train: {split.name}, {trainer.total_towers} towers"
    plot = PlotCallback(args.plot, title=title) if args.plot and main else None
    return metrics, saver, plot


def _say_setup(say: Callable[..., None], args: argparse.Namespace, trainer: Any, split: Any) -> None:
    """The data and the towers' lines."""
    info = trainer.describe()
    say(f"data: {split.name} ({len(split.y_train)} train / {len(split.y_test)} test samples, "
        f"{'x'.join(map(str, split.input_shape))}, {split.num_classes} classes)")
    where = (f"{info['towers']} on {','.join(info['devices'])}" if info["processes"] == 1 else
             f"{info['towers']} in {info['processes']} processes ({','.join(info['devices'])} on rank 0, "
             f"{info['transport']} between them)")
    sharded = f" sharded over {info['processes']} processes" if info["shard_master"] else ""
    threads = f"; threads={info['threads']}" if info["threads"] is not None else ""
    say(f"towers: {where}{threads}; master={info['master']}{sharded}; "
        f"optimizer={info['optimizer']} lr={trainer.config['lr']:g}; amp={info['amp'] or 'none'}; "
        f"model={_value(args, 'model')} ({info['params']} params, {info['buckets']} bucket"
        f"{'s' if info['buckets'] != 1 else ''})")


def _said_nothing_left(say: Callable[..., None], args: argparse.Namespace, trainer: Any, resume_path: str,
                       restarted: str | None, epochs: int) -> bool:
    """The resume's lines; True (after saying so) when the checkpoint already holds what the run asks for
    (every process decides alike: same checkpoint, same flags)."""
    from .fit_report import nothing_left

    how = f" after torchrun restart {os.environ.get('TORCHELASTIC_RESTART_COUNT')}" if restarted else ""
    say(f"resumed{how}: {resume_path} (step {trainer.step}, epoch {trainer.epoch})")
    if trainer.resume_note:
        say(trainer.resume_note)
    if nothing_left(trainer, epochs, args.max_steps) is None:
        return False
    more = (f"--max-steps above {trainer.step}" if args.max_steps is not None and trainer.step >= args.max_steps
            else f"--epochs {trainer.epoch + 1} or more")
    say(f"nothing to train: the checkpoint is at epoch {trainer.epoch} (step {trainer.step}) and the run "
        f"asks for {_asked(epochs, args.max_steps)}; pass {more} to train on", flush=True)
    return True


def _asked(epochs: int, max_steps: int | None) -> str:
    return (f"{epochs} epoch{'s' if epochs != 1 else ''}" +
            (f" or {max_steps} step{'s' if max_steps != 1 else ''}" if max_steps is not None else ""))


def _finish(trainer: Any) -> int:
    trainer.close()
    if trainer.processes > 1 and trainer.comm.backend == "gloo":
        # Every process is past its last collective (the final evaluation): leave without torch's gloo
        # teardown, which aborts now and then. See Note [Gloo teardown] in ncclavg/comm/dist.py.
        from ..comm import end_process

        end_process(0)
    return 0


"""ncclavg.train: TowerTrainer and everything only training needs.

What lives here: trainer.py (`TowerTrainer`: split a batch over the towers, forward/backward, one
average, the update), fit.py (its epoch loop, `fit`), fit_report.py (what fit shows and returns: the
progress, the summary line), trainer_state.py (its checkpoints: `state_dict`, `save`, `restore`,
`load`), engines.py (the update: CPU master weights or one optimizer per device), offload.py (the
pipelined CPU-master update for GPU towers), towers.py (devices, replicas, the thread-per-tower runner,
torch's threads for CPU towers), amp.py, schedules.py, state.py and checkpoint.py (what a checkpoint
holds and how it is written atomically), callbacks.py and metrics.py (progress, JSON lines, plots),
data.py and models.py (digits, synthetic data, the demo models) and cli.py (`ncclavg train`).
What it may import: the core (`ncclavg.averager`, `master`, `optim`, `bucketing`, ...),
`ncclavg.transport`, `ncclavg.comm` and `ncclavg.process_group`; never `ncclavg.bench`. Nothing is imported here, so `ncclavg train --help` and
`ncclavg info` load no torch.
Where to start reading: trainer.py (`TowerTrainer.train_step`), fit.py (`fit`), then engines.py.
"""

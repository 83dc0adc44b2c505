"""The framework recipes of examples/ under torchrun, 2 processes on the `ncclavg` backend: transformers'
Trainer (with ncclavg's DDP comm hook on the model Trainer wraps) and DeepSpeed ZeRO 0-3 (and ZeRO-1/2
with ncclavg.optim.CPUAdamW as the client optimizer). Each recipe checks itself that the backend in use is
ncclavg and that the ranks' weights are identical at the end; these tests read its summary line and
check that it trained. Skipped with the reason when the framework is not installed (.ci/run installs
them). Lightning and Accelerate: tests/test_stock_examples.py."""
import importlib.util
import re

import pytest

from test_stock_examples import _torchrun

needs_transformers = pytest.mark.skipif(
    importlib.util.find_spec("transformers") is None or importlib.util.find_spec("accelerate") is None,
    reason="transformers or accelerate is not installed (pip install \"torch==<yours>\" transformers accelerate)")
needs_deepspeed = pytest.mark.skipif(importlib.util.find_spec("deepspeed") is None,
                                     reason="DeepSpeed is not installed (DS_BUILD_OPS=0 pip install deepspeed)")


def _losses_fell(m) -> None:
    first, last = float(m.group("first")), float(m.group("last"))
    assert last < 0.9 * first, (first, last)


@pytest.mark.slow
@needs_transformers
def test_transformers_trainer_with_the_hook():
    out = _torchrun("transformers_trainer.py", "--hook", "--steps", "30")
    m = re.search(r"transformers_trainer: backend=ncclavg world_size=2 wrapped=DistributedDataParallel "
                  r"hook=DistributedDataParallel first_loss=(?P<first>[\d.]+) last_loss=(?P<last>[\d.]+) "
                  r"replicas_identical=True", out)
    assert m, out[-3000:]
    _losses_fell(m)


@pytest.mark.slow
@needs_deepspeed
@pytest.mark.parametrize("stage,optimizer,wrapper,inner", [
    (0, "torch", "AdamW", "AdamW"),
    (1, "torch", "DeepSpeedZeroOptimizer", "AdamW"),
    (2, "torch", "DeepSpeedZeroOptimizer", "AdamW"),
    (3, "torch", "DeepSpeedZeroOptimizer_Stage3", "AdamW"),
    (1, "ncclavg", "DeepSpeedZeroOptimizer", "CPUAdamW"),
    (2, "ncclavg", "DeepSpeedZeroOptimizer", "CPUAdamW"),
])
def test_deepspeed_zero(stage, optimizer, wrapper, inner):
    out = _torchrun("deepspeed_zero.py", "--stage", str(stage), "--optimizer", optimizer, "--epochs", "2")
    m = re.search(rf"deepspeed_zero: stage={stage} optimizer={wrapper}/{inner} test_accuracy=(?P<acc>\d\.\d+) "
                  r"first_loss=(?P<first>[\d.]+) last_loss=(?P<last>[\d.]+) backend=ncclavg world_size=2 "
                  r"replicas_identical=True", out)
    assert m, out[-3000:]
    _losses_fell(m)
    assert float(m.group("acc")) > 0.7   # two epochs of the digits MLP (0.90 here)

"""The `ncclavg` backend's registration and argument checks that need no second process: `import ncclavg`
stays light (no torch) and registers the backend when torch.distributed loads, before or after it; the
hook's and the FSDP2 helper's bad arguments raise naming the argument."""
import subprocess
import sys

import pytest
import torch


def _python(code):
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return proc.stdout


def test_import_stays_light_and_registers_once_torch_distributed_loads():
    out = _python("import sys, ncclavg\n"
                  "assert 'torch' not in sys.modules, 'import ncclavg imported torch'\n"
                  "import torch.distributed as dist\n"
                  "print(dist.Backend.backend_capability['ncclavg'], 'NCCLAVG' in dist.Backend._plugins)")
    assert out.split() == ["['cpu',", "'cuda']", "True"], out


def test_registers_at_once_when_torch_is_already_imported():
    out = _python("import torch.distributed as dist, ncclavg\nprint(dist.Backend('ncclavg'))")
    assert out.strip() == "ncclavg", out


def test_hook_bad_arguments_name_them():
    import ncclavg

    with pytest.raises(TypeError, match="model"):
        ncclavg.ddp.register(torch.nn.Linear(2, 2))
    from ncclavg.process_group.ddp_hook import HookState

    with pytest.raises(ValueError, match="wire"):
        HookState(wire="int8")
    with pytest.raises(TypeError, match="predivide"):
        HookState(predivide="yes")
    with pytest.raises(ValueError, match="timeout"):
        HookState(timeout=-1)


def test_fsdp_helper_bad_arguments_name_them():
    from ncclavg.process_group.fsdp_comms import use_ncclavg

    with pytest.raises(TypeError, match="model"):
        use_ncclavg("not a module")
    with pytest.raises(ValueError, match="model"):
        use_ncclavg(torch.nn.Linear(2, 2))

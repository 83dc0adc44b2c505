"""bench/gpu_check/sanitizer_driver.py, the program gpu_check.sh runs under compute-sanitizer: on CPU tensors every
check holds, a wrong kernel answer fails it (it is a test of results as well as the thing memcheck
watches), and without a CUDA device it says "not run" in gpu_check.sh's way."""
from __future__ import annotations


import pytest

from _paths import ROOT, load_script

pytest.importorskip("torch")


@pytest.fixture
def driver():
    return load_script(ROOT / "bench" / "gpu_check" / "sanitizer_driver.py", "sanitizer_driver")


def test_every_check_holds_on_cpu_tensors(driver, capsys):
    assert driver.main(["--device", "cpu"]) == 0
    out = capsys.readouterr().out
    assert "WRONG" not in out and ", 0 wrong" in out
    assert int(out.strip().splitlines()[-1].split()[0]) > 200   # the number of checks made


def test_a_wrong_answer_fails_the_driver(driver, capsys, monkeypatch):
    # a pack that rounded differently: the reference of the pack checks moves by one step
    real = driver.reference
    monkeypatch.setattr(driver, "reference", lambda torch, x, dt, s, d: real(torch, x, dt, s * 1.5, d))
    assert driver.main(["--device", "cpu"]) == 1
    out = capsys.readouterr().out
    assert "WRONG: pack float32->float32 tensor 0" in out


def test_without_a_cuda_device_it_is_not_run(driver, capsys):
    import torch

    import ncclavg

    if ncclavg.cuda_built() and torch.cuda.is_available():
        pytest.skip("a CUDA device is here: the driver runs")
    assert driver.main([]) == driver.NOT_RUN_RC
    assert capsys.readouterr().out.strip().splitlines()[-1].startswith("not run: ")

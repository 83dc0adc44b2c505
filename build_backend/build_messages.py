"""What the build tells the person who runs `pip install`: setup.py's decision line (CUDA=yes) and its
note on a CPU-only build, through pip's capture of the build's output.

Note [Telling pip users about the build]
pip runs the build backend with stdout and stderr on one pipe and logs what comes out at its VERBOSE
level (pip/_internal/utils/subprocess.py, call_subprocess with show_stdout=False): without -v nothing
the build prints reaches the user unless the build fails. What does reach the user is a UserWarning
raised inside the backend's hook: pip's runner (pyproject_hooks' _in_process.py, "captured_warnings")
records it and pip 26 logs it as a BuildBackendWarning, at WARNING level when the source is a local
directory (`pip install .`, `pip install -e .`) and at DEBUG level otherwise (an sdist from an index),
and older pips not at all. pip writes such a warning as `warnings.formatwarning` does:
"FILE:LINE: BuildBackendWarning: TEXT", followed by the source line at FILE:LINE when pip's process can
read one. The warning is therefore raised with FILE "setup.py" and LINE 0, a line linecache never
returns: one line, `setup.py:0: BuildBackendWarning: ncclavg build: CUDA=yes (...)`, whatever
directory pip runs in (with the real line number pip would print a line of the user's own setup.py, or
of none, depending on its working directory).
So a message is printed (the -v log), raised as a warning when the runner forwards warnings, and, when
the warning will not be shown and stdout is not a terminal, written to the controlling terminal
(/dev/tty), which the backend still shares with an interactive `pip install`. In CI (no terminal, an
old pip, an sdist) it is in the -v log only; `ncclavg info` says the decision at run time.
Two messages go this way: the decision line when the build includes CUDA (the one line a user needs to
know that nvcc was found and used, GPU or not), and the note of a CPU-only build under
NCCLAVG_CUDA=auto, which says why and the ways out. NCCLAVG_CUDA=0 is a choice, so it is not announced.
"""
from __future__ import annotations

import os
import sys
import tempfile
import warnings
from pathlib import Path


class BuildDecision(UserWarning):
    """The build's CUDA decision line, shown by pip without -v."""


class CpuOnlyBuild(UserWarning):
    """The note of a CPU-only build under NCCLAVG_CUDA=auto."""


def frontend_forwards_warnings() -> bool:
    """True under a PEP 517 runner that hands the backend's UserWarnings to the frontend."""
    main = getattr(sys.modules.get("__main__"), "__file__", None) or ""
    try:
        return main.endswith("_in_process.py") and "captured_warnings" in Path(main).read_text()
    except OSError:
        return False


def building_a_local_directory() -> bool:
    """False when pip unpacked an sdist into its temporary directory (pip-install-*, pip-req-build-*)."""
    cwd = os.path.realpath(os.getcwd())
    return not (cwd.startswith(os.path.realpath(tempfile.gettempdir())) and "/pip-" in cwd)


def warn_in_one_line(text: str, category: type[Warning]) -> None:
    """A warning pip writes as one line (and a text of several lines as those lines, no source line
    after them). See Note [Telling pip users about the build]."""
    warnings.warn_explicit(text, category, filename="setup.py", lineno=0)


def tell_user(text: str, category: type[Warning]) -> None:
    """Makes `text` visible through pip's capture. See Note [Telling pip users about the build]."""
    print(text, flush=True)
    if frontend_forwards_warnings():
        warn_in_one_line(text, category)
        if building_a_local_directory():
            return  # pip shows it at WARNING level
    try:
        if sys.stdout.isatty():
            return
        with open("/dev/tty", "w") as tty:
            tty.write("\n" + text + "\n")
    except OSError:  # no controlling terminal (CI, nohup): the -v log and `ncclavg info` remain
        pass

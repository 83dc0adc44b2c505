"""Where NCCL_RUNTIME_CONNECT=0 (connections inside the bounded init) is set: once per process, in Python,
at the import of ncclavg.comm or the first _ext.nccl_comm_class(); never at `import ncclavg`, never by
the C++ init (which may run on any thread while others read the environment), never over a user's value.
Note [Setting NCCL_RUNTIME_CONNECT once] in ncclavg/_ext.py.

Each case is a fresh interpreter (the default is applied once per process). The C library's own view of
the environment is read through ctypes: what NCCL's getenv would see, not os.environ's copy. The C++
init runs here without a GPU up to its first failure (no device or no NCCL), which comes after the point
where it used to set the variable."""
from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

import ncclavg

C_GETENV = """
import ctypes, json, os
_libc = ctypes.CDLL(None)
_libc.getenv.restype = ctypes.c_char_p
def c_env():
    v = _libc.getenv(b"NCCL_RUNTIME_CONNECT")
    return None if v is None else v.decode()
seen = {}
"""


def _run(body, **env):
    e = {k: v for k, v in os.environ.items() if k not in ("NCCL_RUNTIME_CONNECT", "NCCLAVG_NCCL_COLLECTIVES")}
    e.update(env)
    code = C_GETENV + body + "\nprint(json.dumps(seen))\n"
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, env=e)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return json.loads(proc.stdout.strip().splitlines()[-1])


def test_set_once_at_import_of_comm_never_at_import_of_the_core():
    seen = _run("""
import ncclavg
import torch.distributed   # registers the ncclavg backend (lightly: ncclavg.comm is not imported)
ncclavg.build_info()
seen["core"] = c_env()
import ncclavg.comm
seen["comm"] = c_env()
seen["os.environ"] = os.environ.get("NCCL_RUNTIME_CONNECT")
from ncclavg import _ext
os.environ.pop("NCCL_RUNTIME_CONNECT")   # the user takes it back: ncclavg does not set it again
try:
    _ext.nccl_comm_class()
except Exception as e:
    seen["class"] = type(e).__name__
seen["again"] = c_env()
""")
    assert seen["core"] is None, "import ncclavg (the core, and the backend's registration) set it"
    assert seen["comm"] == "0" and seen["os.environ"] == "0", seen
    assert seen["again"] is None, seen


def test_nccl_comm_class_sets_it_for_code_that_skips_ncclavg_comm():
    seen = _run("""
from ncclavg import _ext
try:
    _ext.nccl_comm_class()
except Exception as e:
    seen["class"] = type(e).__name__
seen["after"] = c_env()
""")
    assert seen["after"] == "0", seen


@pytest.mark.parametrize("env, want", [({"NCCL_RUNTIME_CONNECT": "1"}, "1"),
                                       ({"NCCL_RUNTIME_CONNECT": "0"}, "0"),
                                       ({"NCCLAVG_NCCL_COLLECTIVES": "nonblocking"}, None),
                                       ({"NCCLAVG_NCCL_COLLECTIVES": "blocking"}, "0"),
                                       ({"NCCLAVG_NCCL_COLLECTIVES": "bogus"}, None)])
def test_a_users_value_is_kept_and_nonblocking_sets_nothing(env, want):
    seen = _run("import ncclavg.comm\nseen['v'] = c_env()\n", **env)
    assert seen["v"] == want, (env, seen)


@pytest.mark.skipif(not ncclavg.cuda_built(), reason="the NCCL communicator is part of the CUDA build")
def test_the_cpp_init_does_not_write_the_environment():
    seen = _run("""
import ncclavg.comm
from ncclavg import _C
os.environ.pop("NCCL_RUNTIME_CONNECT")   # what the C++ init finds: unset, blocking collectives asked for
for name, call in (("init_all", lambda: _C.NcclComm.init_all([0], 5.0)),
                   ("init_rank", lambda: _C.NcclComm.init_rank(bytes(128), 1, 0, 0, 5.0)),
                   ("init_ranks", lambda: _C.NcclComm.init_ranks(bytes(128), 1, 0, [0], 5.0))):
    try:
        call()
        seen[name] = "made a communicator"
    except Exception as e:   # no GPU / no NCCL here: after the point where the mode is read
        seen[name] = type(e).__name__
    seen[name + " env"] = c_env()
""")
    for name in ("init_all", "init_rank", "init_ranks"):
        assert seen[name] != "made a communicator", seen
        assert seen[name + " env"] is None, f"{name} set NCCL_RUNTIME_CONNECT from C++: {seen}"

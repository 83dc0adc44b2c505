"""`ncclavg train` for the elastic-restart test: in the first attempt (TORCHELASTIC_RESTART_COUNT=0) the
rank named by ELASTIC_VICTIM_RANK kills itself (SIGKILL) at optimizer step ELASTIC_KILL_STEP; torchrun
then restarts the group, and the run must resume from its newest checkpoint."""
import os
import signal
import sys

from ncclavg.train import callbacks

if (os.environ.get("TORCHELASTIC_RESTART_COUNT") == "0"
        and os.environ.get("RANK") == os.environ.get("ELASTIC_VICTIM_RANK")):
    kill_step = int(os.environ["ELASTIC_KILL_STEP"])
    original = callbacks.CheckpointCallback.on_step_end

    def on_step_end(self, trainer, record):   # every process has one: --checkpoint-dir (rank 0 writes)
        if trainer.step == kill_step:
            os.kill(os.getpid(), signal.SIGKILL)
        original(self, trainer, record)

    callbacks.CheckpointCallback.on_step_end = on_step_end

from ncclavg.cli import main  # noqa: E402

sys.exit(main(["train", *sys.argv[1:]]))

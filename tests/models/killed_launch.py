"""What torchrun starts in tests/models/test_resume_torchrun.py: habitus.models.train.launch, whose rank 0
kills itself with SIGKILL right after its KILL_AFTER_SAVES-th save of the resumable state, in torchrun's
first attempt only (TORCHELASTIC_RESTART_COUNT 0): a preempted machine, as far as torchrun can tell."""

import os
import signal
import sys

from habitus.models.train import launch, resume

if os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") == "0" and os.environ.get("RANK") == "0":
    saves, real = int(os.environ["KILL_AFTER_SAVES"]), resume.Resumer.save

    def save_then_die(self, *args, **kwargs):
        real(self, *args, **kwargs)
        if self.saves == saves:
            os.kill(os.getpid(), signal.SIGKILL)

    resume.Resumer.save = save_then_die

launch.run(sys.argv[1])
sys.stdout.flush()
os._exit(0)  # (as habitus.models.train.launch's own __main__)

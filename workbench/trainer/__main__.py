"""``python -m workbench.trainer runs/<id>/config.json`` (started by torchrun)."""

import sys

from workbench.trainer.console import say
from workbench.trainer.lifeline import tie_to_parent

# Before torch is imported (seconds): a torchrun killed meanwhile must not leave this rank behind.
if __name__ == "__main__" and not tie_to_parent():
    say("[workbench] the process that started this rank has already exited; not starting")
    sys.exit(1)

from workbench.trainer.train import main  # noqa: E402 - after the parent-death signal is armed

if __name__ == "__main__":
    sys.exit(main())

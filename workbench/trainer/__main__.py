"""``python -m workbench.trainer runs/<id>/config.json`` (started by torchrun)."""

import sys

from workbench.trainer.train import main

if __name__ == "__main__":
    sys.exit(main())

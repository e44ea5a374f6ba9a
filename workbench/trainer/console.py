"""One line to stderr in one write.

Every rank of a job writes to the same log (torchrun passes its stderr to each rank), and Python's
stderr is write-through: ``print(msg, file=sys.stderr)`` writes the text and its newline in two
system calls, between which another rank's line can land (two ranks' lines then read as one).
"""

from __future__ import annotations

import sys


def say(line: str) -> None:
    sys.stderr.write(line + "\n")
    sys.stderr.flush()

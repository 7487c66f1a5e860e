"""Several ``bertpipe`` commands, one after the other, in one process: a rank of a torchrun
job that runs more than one training (``tests/training/test_faults.py``), one interpreter
per rank for all of them. Each argument is one command line, split as a shell would; the
first command forms the job's process group, the next ones join it. Exits with the first
non-zero status."""

from __future__ import annotations

import shlex
import sys

from bertpipe.app.cli import main


def run(commands: list[str]) -> int:
    for command in commands:
        code = main(shlex.split(command))
        if code:
            return code
    return 0


if __name__ == "__main__":
    sys.exit(run(sys.argv[1:]))

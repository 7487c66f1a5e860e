"""The test suite's fault-injection entry point in child processes (never installed with
bertpipe): Python imports ``sitecustomize`` at start-up from ``PYTHONPATH``, which the tests
set to this folder first for the processes they start (``tests/faultenv.py``). Only when a
``BERTPIPE_FAULT_*`` variable is set does it install the environment's faults."""

import os

if any(key.startswith("BERTPIPE_FAULT_") for key in os.environ):
    from tests.faultenv import install_from_environ

    install_from_environ()

"""bertpipe: BERT pre-training from raw text to fine-tuned models.

This package is the core every stage shares: typed config loading and its help
(:mod:`~bertpipe.config`, :mod:`~bertpipe.config_help`), the arguments stage commands share
(:mod:`~bertpipe.cli_args`), errors, fsspec helpers, launch detection, logging, progress
lines, shipped recipes, stable seeding, MLflow helpers (:mod:`~bertpipe.tracking`) and the
formatting of durations, numbers and tables (:mod:`~bertpipe.formatting`). It imports no
stage, not even lazily; the stages (folders ``preprocessing/``, ``training/``,
``finetuning/``, installed as ``bertpipe.preprocessing``, ...) build on it, and the
application layer :mod:`bertpipe.app` (the ``bertpipe`` program, ``demo``, ``bench``,
``runs compare``) sits on top of both. tests/unit/test_import_graph.py keeps it so.
"""

__version__ = "0.1.0"

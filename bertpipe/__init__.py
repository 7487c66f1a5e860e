"""bertpipe: BERT pre-training from raw text to fine-tuned models.

This package holds only what every stage shares (config loading, logging, MLflow and
fsspec helpers, stable seeding, the ``bertpipe`` command line). It imports no stage at
module import time; the stages live in the top-level packages ``preprocessing``,
``training`` and ``finetuning``.
"""

__version__ = "0.1.0"

"""Pre-training BERT with DeepSpeed, and what both training stages share.

Its packages, each one component (``docs/architecture.md`` has the whole tree and the data
flow):

- :mod:`~bertpipe.training.models`: the encoder families (BERT, ModernBERT) as plain torch,
  their configs, FLOP and memory terms and transformers conversion, behind one family table.
- :mod:`~bertpipe.training.checkpoint`: the checkpoint on disk or object storage: DeepSpeed's
  layout plus bertpipe's state, whole or damaged, RNG states, disk space.
- :mod:`~bertpipe.training.core`: what pre-training and fine-tuning both run on: the one
  training loop, the guarded optimizer step, the DeepSpeed engine and optimizers, the
  learning-rate curves, the checkpoint manager and resume rules, the watch over peer ranks.
  It imports no pre-training module.
- :mod:`~bertpipe.training.pretrain`: the pre-training stage: its config, phases, trainer,
  metrics and WebDataset loader (``data``).
- :mod:`~bertpipe.training.plan`: ``bertpipe plan``: batch, memory and time arithmetic
  without starting anything, and ``--fit``.

And two modules: :mod:`~bertpipe.training.cli` (the ``pretrain`` and ``export`` commands)
and :mod:`~bertpipe.training.export` (a checkpoint as a transformers folder).
"""

"""The pre-training stage: BERT's two phases (128 then 512 tokens) with DeepSpeed.

- :mod:`~bertpipe.training.pretrain.config`: ``PretrainConfig`` (phases, data, evaluation;
  the shared sections come from :mod:`bertpipe.training.core.config`).
- :mod:`~bertpipe.training.pretrain.phases`: the model config fitted to the data, and a
  phase's engine: ``phase_engine`` (batch, peak learning rate, ``lr_lambda`` curve),
  ``ds_config``.
- :mod:`~bertpipe.training.pretrain.trainer`: ``run_pretraining``, the ``Stage`` the core
  loop runs.
- :mod:`~bertpipe.training.pretrain.batches`: ``BatchPrep``: host batches to the device,
  unpadded, with their FLOPs counted.
- :mod:`~bertpipe.training.pretrain.metrics`: the logged window of losses and throughput.
- :mod:`~bertpipe.training.pretrain.data`: the WebDataset loader.
"""

"""The training core both stages run on (pre-training and fine-tuning); it imports no
pre-training module (a test keeps it so).

- :mod:`~bertpipe.training.core.loop`: ``run_loop`` and the ``Stage`` a stage implements.
- :mod:`~bertpipe.training.core.step`: ``OptimizerStep`` (forward, backward, the guarded
  DeepSpeed step), ``StepResult``, ``to_device``.
- :mod:`~bertpipe.training.core.guard`: non-finite losses and gradients skipped on every rank.
- :mod:`~bertpipe.training.core.cadence`: when to log, evaluate, save and check for SIGTERM.
- :mod:`~bertpipe.training.core.engine`: ``EngineSpec``, ``engine_spec``, ``build_engine``
  (the only ``deepspeed.initialize``), ``init_distributed``, the generated DeepSpeed config.
- :mod:`~bertpipe.training.core.optim`: AdamW and per-layer LAMB under ZeRO,
  ``schedule_learning_rate`` (the one place a learning rate is set), ``apply_settings``.
- :mod:`~bertpipe.training.core.schedules`: the curves (warmup-decay, warmup-stable-decay).
- :mod:`~bertpipe.training.core.config`: the shared config sections (optimizer, ZeRO,
  distributed, checkpoint).
- :mod:`~bertpipe.training.core.checkpoints`: ``CheckpointManager``: what a resume restores,
  checks and refuses, and saving a stage's position.
- :mod:`~bertpipe.training.core.resume`: which settings a resume may change.
- :mod:`~bertpipe.training.core.peers`: the heartbeat that names a lost rank.
- :mod:`~bertpipe.training.core.hardware`: precision checks against the device.
- :mod:`~bertpipe.training.core.faults`: the fault-injection seam the tests use.
"""

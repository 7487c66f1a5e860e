"""The encoder families, plain torch, no DeepSpeed (a test keeps it so).

:mod:`~bertpipe.training.models.families` is the table: ``FAMILIES``, ``family_of(cfg)``,
``preset_config``, ``config_from_dict``, ``pretraining_model``, ``with_dropout``. Each family
is a package with the same modules: ``config`` (torch-free, for ``bertpipe plan``), ``model``
(the modules, the pre-training model, a task model's encoder), ``hf`` (transformers'
config.json), ``costs`` (FLOP and activation terms): :mod:`~bertpipe.training.models.bert`,
:mod:`~bertpipe.training.models.modernbert`. Shared by both: :mod:`~.attention` (padded and
variable-length attention), :mod:`~.hf` (transformers folders: ``save_hf_folder``,
``load_hf_folder``, ``load_into``), :mod:`~.flops` (``training_flops``, MFU, GPU peaks) and
:mod:`~.spec` (the config's ``model`` section, ``ModelSpec``).
"""

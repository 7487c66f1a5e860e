"""``bertpipe plan``: what a pre-training config will do and need, without starting anything.

:mod:`~bertpipe.training.plan.plan` (``make_plan`` -> ``Plan``) combines the world and GPU
table (:mod:`~.world`), per-GPU memory (:mod:`~.memory`), step time (:mod:`~.time`) and data
per rank (:mod:`~.data`) under :class:`~bertpipe.training.plan.options.PlanOptions`;
:mod:`~.fit` searches the settings that fit (``--fit``, ``--write``); :mod:`~.cli` is the
command and its table.
"""

"""The application layer: the ``bertpipe`` program and the commands that combine stages.

The core package (:mod:`bertpipe` outside this folder) holds what every stage shares and
imports no stage; the stages (:mod:`bertpipe.preprocessing`, :mod:`bertpipe.training`,
:mod:`bertpipe.finetuning`) build on it. This layer sits on top of both:

* :mod:`bertpipe.app.cli`: the ``bertpipe`` console script, one subcommand per stage
  (``python -m bertpipe.app.cli`` without the script);
* :mod:`bertpipe.app.demo`: ``bertpipe demo``, the whole flow on a small embedded corpus;
* :mod:`bertpipe.app.bench`: ``bertpipe bench NAME``, each stage's benchmarks;
* :mod:`bertpipe.app.compare`: ``bertpipe runs compare``, the MLflow runs of all stages with
  their lineage, as a table, CSV, JSON and plots.

tests/unit/test_import_graph.py checks the direction: nothing outside this folder imports it.
"""

"""``bertpipe evaluate``: what a pre-trained model is worth, measured the BERT paper's way.

A **suite** (GLUE, SQuAD, CoNLL-2003, KLUE, or a user's YAML naming task folders) is
fine-tuned under a **protocol** (per task the learning-rate grid 5e-5, 4e-5, 3e-5, 2e-5, batch
32, 3 epochs; N seeds, default 3): every (task, learning rate, seed) is one **trial**, a complete
``bertpipe finetune`` run with its own folder and MLflow child run. Per task the learning rate
with the best mean dev score over the seeds is chosen; the task's result is that setting's
mean and standard deviation over the seeds; the suite's average is GLUE's (a task with two
metrics averages them first; MNLI's matched and mismatched accuracies are one task).

Split by concern:

* :mod:`~bertpipe.finetuning.evaluation.config`: :class:`EvaluateConfig` (the protocol, the
  suite, the model, parallelism, the watcher);
* :mod:`~bertpipe.finetuning.evaluation.suite`: the suites' tasks, found in the standard
  download layouts and checked before any trial runs;
* :mod:`~bertpipe.finetuning.evaluation.model_source`: the model given (an export folder, a
  pre-training checkpoint folder or one of its ``global_stepN``, ``models:/NAME/VERSION``,
  local or object storage) as one local HF folder every trial reads;
* :mod:`~bertpipe.finetuning.evaluation.scores`: trials' results into the per-task and
  average scores (the selection rule and the GLUE average);
* :mod:`~bertpipe.finetuning.evaluation.runner`: :func:`run_suite`, the trials (resumable,
  several at a time) and the suite's MLflow run;
* :mod:`~bertpipe.finetuning.evaluation.watch`: :func:`watch_checkpoints`, a suite run on
  every Kth new checkpoint of a pre-training run while it trains, its average logged into
  the pre-training run at the checkpoint's step.

What the suite's MLflow run holds (``bertpipe runs compare --suites`` reads it):

* tags: ``bertpipe.stage`` = ``evaluate``; ``bertpipe.suite`` (``glue``, ``squad``,
  ``conll``, ``klue`` or the YAML's name); ``bertpipe.model`` (the model as given);
  ``bertpipe.model_name`` (a short label for tables: ``model_name``, else the model's folder
  name with `` (random init)`` added for random weights); ``bertpipe.suite_tasks`` (the
  tasks, comma-separated, in suite order); ``bertpipe.parent_run_id`` (the pre-training run)
  and ``bertpipe.pretrain_step`` (its global step), where known;
* metrics, all fractions (SQuAD's percentages divided by 100: one scale, see
  :mod:`~bertpipe.finetuning.evaluation.scores`), for each task ``T``: ``T/score`` and
  ``T/score_std`` (the chosen setting's mean and standard deviation over seeds of the task's
  score), ``T/<metric>`` and ``T/<metric>_std`` for each of the task's metrics (``mrpc/f1``,
  ``mrpc/accuracy``), ``T/learning_rate`` (the chosen one); and ``average`` /
  ``average_std`` (the suite's average score, its standard deviation over seeds);
* artifacts: ``suite_results.json`` (every trial's score, the grid, the choice) and
  ``suite_table.md``;
* child runs: the trials (stage ``finetune``, tags ``bertpipe.trial`` = ``T/lr<lr>-seed<s>``).

In the pre-training run, a watcher logs ``downstream/<suite>/average`` and
``downstream/<suite>/<T>`` at the checkpoint's global step.
"""

"""Task data for fine-tuning: readers, featurization, span decoding and prediction files.

- :mod:`.base`: read reports, :class:`TaskSpec`, the feature-dict conventions, writers
- :mod:`.glue`: GLUE files, generic CSV/TSV/JSONL tables, sentence-pair features
- :mod:`.glue_tasks`: the nine GLUE tasks (spec, columns, file names)
- :mod:`.squad`: SQuAD v1.1/v2.0 reader, windowed features, decoding, EM/F1
- :mod:`.conll`: CoNLL-2003 NER reader, first-sub-token features, entity-level scores
- :mod:`.klue`: KLUE's YNAT, STS, NLI, NER (characters through offsets) and MRC files as its
  release lays them out, and KLUE's metrics
"""

from bertpipe.finetuning.tasks.base import (
    IGNORE_INDEX,
    Features,
    ReadProblem,
    ReadReport,
    TaskDataError,
    TaskSpec,
    check_max_seq_length,
    take,
)
from bertpipe.finetuning.tasks.conll import (
    Sentence,
    align_predictions,
    conll_spec,
    entity_scores,
    featurize_conll,
    read_conll,
    write_conll_predictions,
)
from bertpipe.finetuning.tasks.glue import (
    PairExample,
    TableColumns,
    encode_pairs,
    featurize_pairs,
    read_glue,
    read_table,
    table_spec,
    write_glue_predictions,
)
from bertpipe.finetuning.tasks.glue_tasks import GLUE_TASKS, glue_file, glue_task
from bertpipe.finetuning.tasks.squad import (
    SquadExample,
    check_squad_lengths,
    decode,
    featurize_squad,
    read_squad,
    squad_spec,
    write_squad_predictions,
)
from bertpipe.finetuning.tasks.squad_scores import gold_answers, squad_metrics

__all__ = [
    "GLUE_TASKS",
    "IGNORE_INDEX",
    "Features",
    "PairExample",
    "ReadProblem",
    "ReadReport",
    "Sentence",
    "SquadExample",
    "TableColumns",
    "TaskDataError",
    "TaskSpec",
    "align_predictions",
    "check_max_seq_length",
    "check_squad_lengths",
    "conll_spec",
    "decode",
    "encode_pairs",
    "entity_scores",
    "featurize_conll",
    "featurize_pairs",
    "featurize_squad",
    "glue_file",
    "glue_task",
    "gold_answers",
    "read_conll",
    "read_glue",
    "read_squad",
    "read_table",
    "squad_metrics",
    "squad_spec",
    "table_spec",
    "take",
    "write_conll_predictions",
    "write_glue_predictions",
    "write_squad_predictions",
]

"""Checkpoints: DeepSpeed's own layout plus bertpipe's state, published atomically.

Layout under the checkpoint folder::

    global_step300/            DeepSpeed's files (model, optimizer partitions per rank)
      bertpipe_state.json      phase, steps, data position, MLflow run id, config (rank 0)
      bertpipe_rank00001.json  this rank's completion marker: RNG states, data position and
                               the files it wrote with their sizes and CRC-32 (every rank)
    latest                     the newest WHOLE checkpoint's tag
    bertpipe_index.json        every kept checkpoint: tag, phase, step, phase_end

Every rank writes its part, its completion marker last, then all ranks meet at a barrier,
each checks another rank's marker against the files it sees, and only then does rank 0
rewrite ``latest`` (temporary file + rename). A job killed while saving therefore resumes
from the previous checkpoint, never from half of one. A checkpoint damaged afterwards (a
truncated file, a changed byte) is found at the resume (:func:`latest_complete_tag`, file
checks in :mod:`bertpipe.training.checkpoint.files`), which falls back to the newest whole one.
On object storage (``s3://``, ``gs://``) ranks write locally and upload, and ``latest``
moves once every rank's upload is on the store (:mod:`bertpipe.training.checkpoint.store`). Older
checkpoints beyond ``keep_last`` are deleted after that, except the final checkpoint of each
phase (phase 2 and exports start from it) and the newest good one (see :func:`save`'s
``good``). Our own state is JSON (RNG states base64-encoded): nothing of ours is pickled.
"""

from bertpipe.training.checkpoint.folder import (
    _Folder,
    check_named,
    has_checkpoints,
    latest_complete_tag,
    latest_tag,
    loadable,
    phase_end_tag,
    prune,
    published_tags,
    read_state,
    remove_all,
    resume_tag,
    tags,
)
from bertpipe.training.checkpoint.rng import capture_rng, restore_rng
from bertpipe.training.checkpoint.save import configure, save, save_and_prune, wait_uploads
from bertpipe.training.checkpoint.state import (
    INDEX_FILE,
    STATE_FILE,
    STATE_VERSION,
    CheckpointDamagedError,
    CheckpointState,
    DataChangedError,
    ResumeState,
    check_data,
)

__all__ = [
    "INDEX_FILE",
    "STATE_FILE",
    "STATE_VERSION",
    "CheckpointDamagedError",
    "CheckpointState",
    "DataChangedError",
    "ResumeState",
    "_Folder",
    "capture_rng",
    "check_data",
    "check_named",
    "configure",
    "has_checkpoints",
    "latest_complete_tag",
    "latest_tag",
    "loadable",
    "phase_end_tag",
    "prune",
    "published_tags",
    "read_state",
    "remove_all",
    "restore_rng",
    "resume_tag",
    "save",
    "save_and_prune",
    "tags",
    "wait_uploads",
]

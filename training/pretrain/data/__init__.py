"""Pre-training's data: a phase folder's manifest (:mod:`~.manifest`: ``read_phase_data``),
its shards read whole from any fsspec storage (:mod:`~.shards`), the loader that partitions
them over ranks and workers and shuffles, masks and collates (:mod:`~.loader`:
``build_pretraining_data``), its worker processes (:mod:`~.workers`) and the collator
(:mod:`~.collate`: padded batches, ``unpad_batch``, dynamic masking)."""

"""The training tests share the root conftest's fixtures (``pretrain_shards``: small pre-training
shards made by the real pipeline, used by the storage tests too)."""

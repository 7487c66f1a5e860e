"""The training tests share the root conftest's fixtures (``pretrain_shards``: small pre-training
shards made by the real pipeline, used by the storage tests too)."""

from tests.langtext import gimp_help  # noqa: F401  (the GIMP manual's text: the Korean recipe)

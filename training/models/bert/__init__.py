"""BERT (Devlin et al. 2019): ``config`` (``BertModelConfig``, Google's presets), ``model``
(``BertModel``, ``BertForPreTraining``, a task model's encoder), ``hf`` (transformers'
``BertConfig``), ``costs`` (FLOPs and activations per layer)."""

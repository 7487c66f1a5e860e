"""ModernBERT (Warner et al. 2024): ``config`` (``ModernBertModelConfig``, its presets),
``model`` (``ModernBertModel``, ``ModernBertForMaskedLM``, a task model's encoder), ``hf``
(transformers' ``ModernBertConfig``), ``costs`` (FLOPs and activations per layer)."""

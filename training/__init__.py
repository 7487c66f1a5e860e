"""BERT pre-training: the model, its data loading and trainer, FLOP counts, transformers export."""

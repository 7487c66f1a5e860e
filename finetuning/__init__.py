"""Fine-tuning: task heads on top of the pre-trained BERT encoder."""

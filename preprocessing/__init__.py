"""Preprocessing: tokenizer, readers, NSP/MLM instance creation and the Beam job writing shards."""

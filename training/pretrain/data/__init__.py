"""training.pretrain.data"""

"""training.pretrain"""

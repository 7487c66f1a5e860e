"""training.models.modernbert"""

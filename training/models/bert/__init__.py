"""training.models.bert"""

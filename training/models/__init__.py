"""training.models"""

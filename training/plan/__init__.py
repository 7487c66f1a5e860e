"""training.plan"""

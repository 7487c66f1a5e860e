"""training.core"""

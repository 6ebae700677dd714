"""Distributed-training helpers that any PyTorch project can copy as one folder."""

"""Tracks core: framework-free training, checkpointing, evaluation and promotion.

Nothing in this package imports Dagster except ``pipeline.definitions``.
"""

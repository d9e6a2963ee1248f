"""Tracks core: framework-free training, checkpointing, evaluation and promotion.

Nothing in this package imports Dagster: the Dagster layers are ``assets/``, ``resources/``
and ``sensors/``, assembled by the top-level ``definitions.py``. The CLI imports Dagster only
inside the commands that run it (``tracks demo``, ``tracks canary``).
"""

"""Helpers to run real multi-process pipelines on one machine (tests, demo, benchmarks)."""

from .launch import RankFailure, run_ranks

__all__ = ["RankFailure", "run_ranks"]

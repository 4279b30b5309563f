"""Searches over plans of any family: local search that only shortens a plan (``improve``), the
exact MILP refinement with bounds (``milp``) and the fastest plan whose peak fits a per-rank
byte budget (``within_budget``)."""

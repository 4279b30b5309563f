"""Hypothesis strategies shared by the plan-layer property tests (no torch: plan layer only).

A plain module, imported as ``from _strategies import costs_st`` the way the ``_*_cases``
modules are: pytest puts tests/ on ``sys.path``, and a conftest is not meant to be imported.
Files whose properties need other cost ranges (test_plan_auto.py's memory, test_plan_continuous.py's
wider lower bounds) keep their own strategy beside the test.
"""

from __future__ import annotations

from hypothesis import strategies as st

from zbpipe.planning.costs import Costs

# Random costs, the same for every stage: F and B from 0.2 to 2, W from 0.1 to 2, comm from 0 to
# 0.3; memory at Costs' defaults.
costs_st = st.builds(
    lambda f, b, w, c: Costs(f=f, b=b, w=w, comm=c),
    st.floats(0.2, 2),
    st.floats(0.2, 2),
    st.floats(0.1, 2),
    st.floats(0, 0.3),
)

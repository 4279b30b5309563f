"""The Trainer tests' run server is :mod:`zbpipe.testing.torchtitan_runs` (shared with
benchmarks/trainer.py, run as ``python -m zbpipe.testing.torchtitan_runs``); what the tests'
ranks log besides is tests/integrations/_torchtitan_hooks.py."""

from tests.integrations._torchtitan_hooks import MOE_MARKER, W_MARKER
from zbpipe.testing.torchtitan_runs import MARKER

__all__ = ["MARKER", "MOE_MARKER", "W_MARKER"]

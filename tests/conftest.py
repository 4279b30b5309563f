"""Fixtures shared by more than one test file.

Only fixtures live here: pytest finds them by name, and a conftest is not meant to be imported.
Plain helpers that tests import are modules beside it (``_strategies.py``, the ``_*_cases.py``
bodies of the multi-rank tests). Imports are inside the fixtures, so the plan-layer tests that
need none of them do not pay for importing torch.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest


@pytest.fixture
def torch_get() -> Iterator[Any]:
    """torch's own get_schedule_class, with zbpipe registered for the test and unregistered after.

    Registering rebinds torch's module-level function; unregistering puts torch's back, so no
    other test sees zbpipe's names in torch's lookup unless it registers them itself.
    """
    import torch.distributed.pipelining.schedules as torch_schedules

    from zbpipe.integrations import names as registration

    registration.register()
    yield torch_schedules.get_schedule_class
    registration.unregister()

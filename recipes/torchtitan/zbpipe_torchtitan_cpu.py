"""torchtitan 0.2.x ``custom_import`` for CPU runs: zbpipe's integration, then torchtitan on CPU.

    [experimental]
    custom_import = "zbpipe_torchtitan_cpu"   # this file's folder on PYTHONPATH

torchtitan 0.2.x imports the module named by ``custom_import`` at the start of its Trainer,
before it picks a device, so this is the one place both steps fit:

1. ``import zbpipe.torchtitan``: the integration (on GPUs, ``custom_import =
   "zbpipe.torchtitan"`` is all it takes, as in ``llama3_8b_zbv.toml``);
2. :func:`torchtitan_cpu.use_cpu_device`: without an accelerator, torchtitan 0.2.x would ask
   CUDA for a device (``torchtitan_cpu.py`` says why and what changes). A no-op on GPUs.

The tests run exactly this file (tests/integrations/test_torchtitan02_trainer.py).
"""

from __future__ import annotations

from torchtitan_cpu import use_cpu_device

import zbpipe.torchtitan  # noqa: F401  (the integration: registers zbpipe's names, patches torchtitan)

use_cpu_device()

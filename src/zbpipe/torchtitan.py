"""``zbpipe.torchtitan``, the name torchtitan imports (``custom_import = "zbpipe.torchtitan"``,
``--module zbpipe.torchtitan``): the integration itself lives in
:mod:`zbpipe.integrations.torchtitan_integration`. Importing this module imports that one
(which installs the integration) and makes this name that very module object, so its
functions, configs and ``INSTALLED_LINE`` are reached, and patched, under either name.
"""

import sys

from .integrations import torchtitan_integration as _integration

sys.modules[__name__] = _integration

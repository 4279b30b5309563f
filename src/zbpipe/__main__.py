"""``python -m zbpipe ...``: the command line (:mod:`zbpipe.cli`), where the ``zbpipe`` script
is not on PATH (``python -m zbpipe build-native`` before a job, say)."""

from .cli import main

raise SystemExit(main())

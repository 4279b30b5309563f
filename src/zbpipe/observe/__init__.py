"""Seeing what ran: measured traces of real steps (``trace``), the timeline record and its
Chrome/Perfetto writer (``timeline``), pictures (``draw``), profiling and profile-guided
re-planning (``profile``, ``replan``), and the ranks' agreement on a configuration (``agree``).

Nothing is imported here: ``draw`` and ``timeline`` serve the torch-free command line, the rest
imports torch.
"""

"""One stage per rank: 1F1B (``onef1b``), ZB-H1 (``zbh1``), ZB-H2 (``zbh2``) and the paper's
automatic ZB-1p / ZB-2p list scheduler (``heuristic``)."""

"""V placement (rank ``r`` holds stages ``r`` and ``2p - 1 - r``): ZB-V, V-Half and V-Min
(``zbv``), the greedy list scheduler behind them (``greedy``), the paper's hand-made ZB-V order and
the executor that times it (``paper_order``), the building-block candidates of V-Half and V-Min
(``blocks``) and the types they share (``timed_order``)."""

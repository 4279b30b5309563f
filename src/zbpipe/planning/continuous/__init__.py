"""Flush-free plans over several mini-batches: warm-up, period and drain (``periods``), the stale
modes' stream orders (``stale_orders``), what a stale mode buys over ``sync`` (``tradeoff``) and
which actions each rank can run given the mini-batches handed in so far (``frontier``)."""

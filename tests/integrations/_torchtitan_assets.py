"""The Trainer tests' dataset and tokenizer writer: :mod:`zbpipe.testing.torchtitan_assets`
(shared with benchmarks/trainer.py and benchmarks/torchtitan_w_share.py)."""

from zbpipe.testing.torchtitan_assets import write_dataset, write_tokenizer

__all__ = ["write_dataset", "write_tokenizer"]

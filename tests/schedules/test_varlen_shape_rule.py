"""A stage's shape rule (zbpipe._compat.fake.shape_rule): one symbolic fake forward gives its
output shapes as expressions of its input sizes; each is checked here against a concrete fake
forward at that shape (output_specs), and a size the forward branched on falls back (None)."""

import torch
import torch.nn as nn

from zbpipe._compat import TensorSpec, output_specs, shape_rule
from zbpipe.testing.models import TinyGPTConfig, build_stages

CPU = torch.device("cpu")


class Cut(nn.Module):
    """Branches on its input's length: the rule holds only where the branch is the same."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x[:, :10] if x.shape[1] > 10 else x * 2


def test_rule_matches_a_concrete_fake_forward_at_each_length():
    cfg = TinyGPTConfig(vocab=64, hidden=16, seq=64, heads=2, blocks_per_stage=1)
    first, last = build_stages(cfg, 2)
    rule0 = shape_rule(first, (TensorSpec((1, 20), torch.int64),), CPU)
    rule1 = shape_rule(last, (TensorSpec((1, 20, 16), torch.float32),), CPU)
    assert rule0 is not None and rule1 is not None
    for n in (2, 7, 33, 63):
        ids = torch.zeros(1, n, dtype=torch.int64)
        assert rule0.apply(((1, n),)) == output_specs(first, (ids,), {}, CPU)
        act = TensorSpec((1, n, 16), torch.float32)
        assert rule1.apply(((1, n, 16),)) == output_specs(last, (act,), {}, CPU)
    # the position table has 64 rows: the forward's slicing guarded the length, no rule there
    assert rule0.apply(((1, 65),)) is None
    assert rule1.apply(((1, 7, 17),)) is None  # a width the forward's weights fixed


def test_a_branch_on_a_size_is_a_guard():
    rule = shape_rule(Cut(), (TensorSpec((1, 20), torch.float32),), CPU)
    assert rule is not None
    assert rule.apply(((1, 30),)) == output_specs(
        Cut(), (TensorSpec((1, 30), torch.float32),), {}, CPU
    )
    assert rule.apply(((1, 5),)) is None  # the other branch: a concrete forward decides

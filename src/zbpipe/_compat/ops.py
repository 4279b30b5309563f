"""Private torch operators zbpipe calls: ``torch._grouped_mm``, the grouped GEMM of MoE experts
(torchtitan's ``GroupedExperts`` computes every routed expert with it)."""

from __future__ import annotations

import torch
from torch import Tensor


def grouped_mm(a: Tensor, b: Tensor, offs: Tensor) -> Tensor:
    """``torch._grouped_mm(a, b, offs=offs)``: one matrix product per group of rows (a 2-D ``a``
    and a 3-D ``b``: group ``i`` is ``a[offs[i-1]:offs[i]] @ b[i]``), or, with a 2-D ``b`` too,
    one product per group of the shared dimension (``a[:, rows_i] @ b[rows_i]``, stacked: the
    3-D weight gradient). Rows past ``offs[-1]`` are not read; an empty group gives zeros."""
    out: Tensor = torch._grouped_mm(a, b, offs=offs)
    return out


def has_grouped_mm() -> bool:
    """Whether this torch has ``torch._grouped_mm`` (every torch zbpipe supports does)."""
    return hasattr(torch, "_grouped_mm")


def grouped_mm_function() -> object:
    """The function object ``torch._grouped_mm`` (what a ``TorchFunctionMode`` receives as
    ``func`` when a model calls it), or a placeholder nothing equals where torch lacks it."""
    return getattr(torch, "_grouped_mm", object())

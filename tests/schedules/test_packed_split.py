"""split_packed (zbpipe.schedules.packed): a packed row split into microbatches of whole
documents, each microbatch's metadata rebuilt for it. No process group: references are built by
hand or from the documents themselves."""

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from zbpipe.planning.by_cost import group_by_cost
from zbpipe.schedules.packed import document_mask, split_packed

ALL = ("positions", "cu_seqlens", "document_ids", "max_seqlen")


def test_hand_built_split_of_four_documents():
    """Documents of 3, 1, 5, 1 tokens into 2 microbatches by tokens: the 5-token document alone
    (greedy: 5 -> mb A, 3 -> B, 1 -> B, 1 -> B), the others together, in packed order."""
    tokens = torch.arange(10)[None]
    labels = tokens + 100
    out = split_packed(
        tokens, 2, cu_seqlens=torch.tensor([0, 3, 4, 9, 10]), labels=labels, metadata=ALL
    )
    assert out.documents == ((0, 1, 3), (2,))
    assert [a[0].tolist() for a in out.arg_mbs] == [[[0, 1, 2, 3, 9]], [[4, 5, 6, 7, 8]]]
    assert [t.tolist() for t in out.target_mbs] == [
        [[100, 101, 102, 103, 109]],
        [[104, 105, 106, 107, 108]],
    ]
    first, second = out.kwarg_mbs
    assert first["positions"].tolist() == [[0, 1, 2, 0, 0]]
    assert first["cu_seqlens"].tolist() == [0, 3, 4, 5]
    assert first["cu_seqlens"].dtype == torch.int64  # the given cu_seqlens' dtype
    assert first["document_ids"].tolist() == [[0, 0, 0, 1, 2]]
    assert first["max_seqlen"] == 3
    assert second["positions"].tolist() == [[0, 1, 2, 3, 4]]
    assert second["cu_seqlens"].tolist() == [0, 5]
    assert second["document_ids"].tolist() == [[0, 0, 0, 0, 0]]
    assert out.costs == (1.0, 1.0)
    assert out.num_tokens == 10


def test_document_ids_give_the_same_split_as_cu_seqlens():
    tokens = torch.arange(10)
    by_cu = split_packed(tokens, 2, cu_seqlens=torch.tensor([0, 3, 4, 9, 10], dtype=torch.int32))
    by_ids = split_packed(tokens, 2, document_ids=torch.tensor([7, 7, 7, 2, 5, 5, 5, 5, 5, 9]))
    assert by_cu.documents == by_ids.documents
    for a, b in zip(by_cu.arg_mbs + by_cu.kwarg_mbs, by_ids.arg_mbs + by_ids.kwarg_mbs):
        for x, y in zip(
            a.values() if isinstance(a, dict) else a, b.values() if isinstance(b, dict) else b
        ):
            assert torch.equal(x, y)
    assert by_cu.kwarg_mbs[0]["cu_seqlens"].dtype == torch.int32
    assert by_ids.kwarg_mbs[0]["cu_seqlens"].dtype == torch.int32  # flash attention's


def test_attention_cost_changes_the_grouping():
    """Lengths 6, 4, 4, 2: by tokens {6, 2} and {4, 4} (8 each); by tokens squared (36, 16, 16,
    4) the 6-token document alone (36) against the rest (36)."""
    cu = torch.tensor([0, 6, 10, 14, 16])
    linear = split_packed(torch.zeros(16), 2, cu_seqlens=cu)
    square = split_packed(torch.zeros(16), 2, cu_seqlens=cu, quadratic_at=1e-6)
    assert linear.documents == ((0, 3), (1, 2))
    assert square.documents == ((0,), (1, 2, 3))
    assert square.costs == pytest.approx((1.0, 1.0), rel=1e-4)


def test_num_tokens_leaves_out_ignored_labels():
    labels = torch.tensor([1, 2, -100, 4, -100, 6])
    out = split_packed(torch.zeros(6), 2, cu_seqlens=torch.tensor([0, 3, 6]), labels=labels)
    assert out.num_tokens == 4


@settings(max_examples=40, deadline=None, derandomize=True)
@given(st.lists(st.integers(1, 12), min_size=1, max_size=12), st.data())
def test_no_document_is_split_and_every_microbatch_is_its_own(lengths, data):
    """Every document in exactly one microbatch, whole and in order; each microbatch's
    metadata is what its documents alone give; the grouping's costliest microbatch is at most
    the mean plus the costliest document (greedy list scheduling's bound)."""
    m = data.draw(st.integers(1, len(lengths)))
    cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()])
    tokens = torch.arange(int(cu[-1]))[None]
    out = split_packed(tokens, m, cu_seqlens=cu, metadata=ALL)
    assert len(out.arg_mbs) == m
    assert sorted(d for docs in out.documents for d in docs) == list(range(len(lengths)))
    for (x,), meta, docs in zip(out.arg_mbs, out.kwarg_mbs, out.documents):
        assert list(docs) == sorted(docs)
        expected = [list(range(int(cu[d]), int(cu[d + 1]))) for d in docs]
        assert x.tolist() == [sum(expected, [])]
        assert meta["positions"].tolist() == [sum((list(range(len(e))) for e in expected), [])]
        assert meta["cu_seqlens"].tolist() == [
            0,
            *torch.tensor([len(e) for e in expected]).cumsum(0).tolist(),
        ]
        assert meta["document_ids"].tolist() == [
            sum(([j] * len(e) for j, e in enumerate(expected)), [])
        ]
        assert meta["max_seqlen"] == max(len(e) for e in expected)
    totals = [sum(lengths[d] for d in docs) for docs in out.documents]
    assert max(totals) <= sum(lengths) / m + max(lengths)


def test_document_mask_is_block_diagonal_and_causal():
    ids = torch.tensor([0, 0, 1])
    expected = torch.tensor([[1, 0, 0], [1, 1, 0], [0, 0, 1]], dtype=torch.bool)
    assert torch.equal(document_mask(ids), expected)
    full = torch.tensor([[1, 1, 0], [1, 1, 0], [0, 0, 1]], dtype=torch.bool)
    assert torch.equal(document_mask(ids[None], causal=False), full[None])


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"cu_seqlens": torch.tensor([1, 4, 6])}, "start at 0"),
        ({"cu_seqlens": torch.tensor([0, 4, 5])}, "end at the row's 6 tokens"),
        ({"cu_seqlens": torch.tensor([0, 4, 4, 6])}, "strictly increasing"),
        ({"cu_seqlens": torch.tensor([0.0, 6.0])}, "1-D integer tensor"),
        ({"document_ids": torch.tensor([0, 0, 1, 1, 0, 0])}, "appears again at token 4"),
        ({"document_ids": torch.tensor([0, 1])}, "tokens' shape"),
        ({}, "exactly one of cu_seqlens or document_ids"),
        (
            {"cu_seqlens": torch.tensor([0, 6]), "document_ids": torch.zeros(6, dtype=torch.long)},
            "exactly one",
        ),
        ({"cu_seqlens": torch.tensor([0, 6]), "n": 2}, "batch of 1 documents"),
        ({"cu_seqlens": torch.tensor([0, 6]), "labels": torch.zeros(5)}, "one label per token"),
        ({"cu_seqlens": torch.tensor([0, 6]), "metadata": ("mask",)}, "unknown metadata"),
        ({"cu_seqlens": torch.tensor([0, 6]), "tokens": torch.zeros(2, 3)}, "one packed row"),
    ],
)
def test_bad_boundaries_raise_a_clear_value_error(kwargs, message):
    kwargs = dict(kwargs)
    tokens = kwargs.pop("tokens", torch.zeros(6))
    n = kwargs.pop("n", 1)
    with pytest.raises(ValueError, match=message):
        split_packed(tokens, n, **kwargs)


def test_group_by_cost_rejects_more_groups_than_items():
    with pytest.raises(ValueError, match="cannot fill 3 groups"):
        group_by_cost([1.0, 2.0], 3)

"""zbpipe.schedules.sends: which receive proves which send complete, and when pending sends are let
go of.

The action lists below are written by hand (1F1B, p = 2, m = 2, receives where torch's lowering
puts them), not produced by zbpipe or torch.
"""

from types import SimpleNamespace

import zbpipe.schedules.sends as sends_module
from zbpipe import _compat as C
from zbpipe.schedules.sends import PendingSends, proven_sends


def _a(kind, stage, mb):
    return C.torch_action(stage, kind, mb)


F, B = C.FORWARD, C.FULL_BACKWARD
ORDERS = {
    0: [
        _a(F, 0, 0),
        _a(C.SEND_F, 0, 0),
        _a(F, 0, 1),
        _a(C.SEND_F, 0, 1),
        _a(C.RECV_B, 0, 0),
        _a(B, 0, 0),
        _a(C.RECV_B, 0, 1),
        _a(B, 0, 1),
    ],
    1: [
        _a(C.RECV_F, 1, 0),
        _a(F, 1, 0),
        _a(C.RECV_F, 1, 1),
        _a(B, 1, 0),
        _a(C.SEND_B, 1, 0),
        _a(F, 1, 1),
        _a(B, 1, 1),
        _a(C.SEND_B, 1, 1),
    ],
}
RANK_OF = {0: 0, 1: 1}.__getitem__


def test_a_send_is_proven_by_the_first_message_back_after_the_peer_posted_its_receive():
    # Rank 1 posts both receives of rank 0's outputs before it sends the gradient of mb 0, so
    # receiving that gradient proves both outputs were received.
    assert proven_sends(ORDERS, 0, RANK_OF) == {(False, 0, 0): [(True, 1, 0), (True, 1, 1)]}
    # Rank 0 posts its gradient receives after its last send: nothing proves rank 1's sends.
    assert proven_sends(ORDERS, 1, RANK_OF) == {}


class _Work:
    def __init__(self, completed=False):
        self.completed, self.waited = completed, False

    def is_completed(self):
        return self.completed

    def wait(self):
        self.waited = True
        return True


class _Stage:
    def __init__(self, index):
        self.stage_index = index

    def get_fwd_send_ops(self, mb):
        return [SimpleNamespace(tensor=None, group=None, tag=0, group_peer=self.stage_index + 1)]

    def get_bwd_send_ops(self, mb):
        return [SimpleNamespace(tensor=None, group=None, tag=0, group_peer=self.stage_index - 1)]


def test_pending_sends_let_go_of_completed_and_proven_sends_and_wait_for_the_rest(monkeypatch):
    works = [_Work(), _Work(completed=True), _Work(), _Work(), _Work()]
    posted = iter(works)
    monkeypatch.setattr(sends_module.dist, "isend", lambda *args, **kwargs: next(posted))
    sends = PendingSends()
    sends.set_proofs({(False, 0, 0): [(True, 1, 0)]})
    stage0 = _Stage(0)
    sends.post(stage0, 0, forward=True)  # (True, 1, 0): proven by the gradient of mb 0
    sends.post(stage0, 1, forward=True)  # completed: the next prune lets it go
    sends.post(stage0, 2, forward=True)
    assert len(sends) == 2 and works[1].waited  # completed: dropped (waited: errors surface)
    sends.received((True, 5, 5))  # proves nothing
    assert len(sends) == 2
    sends.received((False, 0, 0))
    assert works[0].waited and len(sends) == 1
    sends.post(_Stage(1), 0, forward=False)  # named (False, 0, 0) by its receiver
    sends.wait_all()
    assert works[2].waited and works[3].waited and len(sends) == 0
    sends.post(stage0, 3, forward=True)
    sends.abandon()  # a failed step: forgotten, never waited for (the peer may be gone)
    assert len(sends) == 0 and not works[4].waited


def test_chain_proofs_from_the_previous_ranks_stream():
    from zbpipe.planning import Action
    from zbpipe.schedules.sends import ChainProofs

    proofs = ChainProofs(stage=1)
    # An output of mb 3 sent to stage 2 is proven by stage 2's gradient of mb 3.
    assert proofs.output_sent(3) == {(False, 1, 3): [(True, 2, 3)]}
    # Stage 0 runs F0 F1 B0 B1 | F2 ... : its F of mb 2, after B0 and B1 (which received this
    # rank's gradients of mb 0 and 1), proves both; the B at the end of a slice waits for the
    # next slice's first F.
    first = [Action(0, "F", 0), Action(0, "F", 1), Action(0, "B", 0), Action(0, "B", 1)]
    assert proofs.previous_rank_ran(first) == {}
    second = [Action(0, "F", 2), Action(0, "W", 0), Action(0, "B", 2), Action(0, "F", 3)]
    assert proofs.previous_rank_ran(second) == {
        (True, 1, 2): [(False, 0, 0), (False, 0, 1)],
        (True, 1, 3): [(False, 0, 2)],
    }

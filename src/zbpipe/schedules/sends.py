"""Posted sends, let go of as soon as they are known to be complete.

A send's ``Work`` keeps the tensor it sends (a stage output, an input gradient) alive until the
``Work`` itself goes. torch's action runtime keeps every send of a step in one list and waits
for them only when the step ends, so each stage output and each input gradient it sent lives
to the end of the step, whatever the plan's memory model says. zbpipe's runtimes post their
sends into :class:`PendingSends` instead, which lets a send go once it is known complete:

* ``Work.is_completed()`` (NCCL answers it without waiting), checked before every compute
  action (:meth:`PendingSends.prune`);
* or once the peer has provably posted the matching receive. gloo answers
  ``is_completed()`` with False until someone waits, and a wait with a timeout that expires
  poisons gloo's whole context, so a send is waited for only when it cannot block: when this
  rank has received a message its peer sent *after* posting that receive (a rank runs its
  action list in order). :func:`proven_sends` finds, from every rank's action list, which
  receive proves which send; the runtime calls :meth:`PendingSends.received` after each
  non-empty receive it waited for. The wait then only lets the transport finish the copy.

Whatever is left is waited for at the end of the step (:meth:`PendingSends.wait_all`), as torch
does; after a failed step the sends are forgotten instead (:meth:`PendingSends.abandon`): a dead
peer would never receive them.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch.distributed as dist

from .. import _compat as C

#: a message, as its receiver names it: (forward, receiving stage, microbatch); ``forward``: a
#: stage output going down the pipeline, else an input gradient going back up
Message = tuple[bool, int, int]


class PendingSends:
    """The posted, not yet let go of, sends of one runtime.

    ``consume_proofs``: each proof is used once and forgotten (a stream that never repeats its
    messages, :class:`ChainProofs`); otherwise the proofs serve every step of a fixed plan.
    """

    def __init__(self, consume_proofs: bool = False) -> None:
        self._works: dict[Message, list[dist.Work]] = {}
        self._proofs: dict[Message, list[Message]] = {}
        self._consume = consume_proofs

    def __len__(self) -> int:
        return len(self._works)

    def set_proofs(self, proofs: Mapping[Message, Sequence[Message]]) -> None:
        """``received message -> this rank's sends it proves posted`` (:func:`proven_sends`)."""
        self._proofs = {k: list(v) for k, v in proofs.items()}

    def add_proofs(self, proofs: Mapping[Message, Sequence[Message]]) -> None:
        """More proofs, for messages of a stream still to come."""
        for k, v in proofs.items():
            self._proofs.setdefault(k, []).extend(v)

    def post(self, stage: Any, mb: int, forward: bool) -> None:
        """Post ``stage``'s sends of ``mb``: its outputs (``forward``) or input gradients."""
        self.prune()
        ops = stage.get_fwd_send_ops(mb) if forward else stage.get_bwd_send_ops(mb)
        if ops:  # named as the receiving stage names it (see Message)
            to = stage.stage_index + 1 if forward else stage.stage_index - 1
            # one isend per tensor, never coalesced (torch 2.11's _batch_p2p coalesces on NCCL)
            self._works.setdefault((forward, to, mb), []).extend(
                dist.isend(op.tensor, group=op.group, tag=op.tag, group_dst=op.group_peer)
                for op in ops
            )

    def attach(self, message: Message, work: dist.Work) -> None:
        """Hold ``work``, a send posted before ``message`` on the same channel (the continuous
        stream's shape header, :mod:`zbpipe.continuous.shapes`), until ``message``'s send is let
        go of: whatever proves that one received proves this one."""
        self._works.setdefault(message, []).append(work)

    def prune(self) -> None:
        """Let go of the sends whose works say they completed (not gloo's: see the module).

        A completed work is still waited for: NCCL reports a failed work as completed, and the
        wait raises its error instead of dropping it.
        """
        done = [k for k, works in self._works.items() if all(w.is_completed() for w in works)]
        for k in done:
            for w in self._works.pop(k):
                w.wait()

    def received(self, message: Message) -> None:
        """This rank waited for ``message``: let go of the sends it proves the peer receives."""
        proven = self._proofs.pop(message, ()) if self._consume else self._proofs.get(message, ())
        for sent in proven:
            for w in self._works.pop(sent, ()):
                w.wait()

    def wait_all(self) -> None:
        """Wait for every pending send (the end of a step, or a flush)."""
        works, self._works = self._works, {}
        for ws in works.values():
            for w in ws:
                w.wait()

    def abandon(self) -> None:
        """Forget the pending sends without waiting (a failed step: the peer may be gone)."""
        self._works = {}


def proven_sends(
    orders: Mapping[int, Sequence[Any]], rank: int, rank_of: Callable[[int], int]
) -> dict[Message, list[Message]]:
    """For ``rank``: each message it receives -> its sends the receive proves the peer posted.

    ``orders``: every rank's torch action list with communication (SEND_F, SEND_B, RECV_F,
    RECV_B in the order each rank posts them); ``rank_of``: stage -> rank. A send of ``rank``
    is proven by the first send its peer posts to ``rank`` after posting the matching receive.
    Sends with no such later message (the last of a step) are in no list.
    """
    posted: dict[Message, tuple[int, int]] = {}  # a receive -> (its rank, index in its list)
    for q, acts in orders.items():
        for i, a in enumerate(acts):
            msg = _received(a)
            if msg is not None:
                posted[msg] = (q, i)
    proofs: dict[Message, list[Message]] = defaultdict(list)
    for a in orders[rank]:
        sent = _sent(a)
        if sent is None:
            continue
        peer, i = posted[sent]
        for b in orders[peer][i + 1 :]:
            back = _sent(b)
            if back is not None and rank_of(back[1]) == rank:  # back[1]: its receiving stage
                proofs[back].append(sent)
                break
    return dict(proofs)


class ChainProofs:
    """Proofs for one rank of a chain with one stage per rank, whose ranks run their F and B
    passes in microbatch order and post each receive right before the pass that consumes it
    (the continuous runtime), found as its stream grows.

    * An output sent down for microbatch ``g`` is received by the next rank's F of ``g``, before
      its B of ``g`` sends that gradient back: receiving the gradient proves it
      (:meth:`output_sent`).
    * An input gradient sent up for ``g`` is received by the previous rank's B of ``g``; the
      first F that rank runs after that B sends an activation down, and receiving it proves the
      gradient (:meth:`previous_rank_ran`, given that rank's actions as the stream grows).
    """

    def __init__(self, stage: int) -> None:
        self.stage = stage
        self._unproven: list[int] = []  # the previous rank's B passes with no F after them yet

    def output_sent(self, mb: int) -> dict[Message, list[Message]]:
        return {(False, self.stage, mb): [(True, self.stage + 1, mb)]}

    def previous_rank_ran(self, actions: Sequence[Any]) -> dict[Message, list[Message]]:
        """The proofs the previous rank's next ``actions`` (planning ``Action``s) give."""
        proofs: dict[Message, list[Message]] = {}
        for a in actions:
            if a.kind == "B":
                self._unproven.append(a.microbatch)
            elif a.kind == "F" and self._unproven:
                sent = [(False, self.stage - 1, mb) for mb in self._unproven]
                proofs[(True, self.stage, a.microbatch)] = sent
                self._unproven = []
        return proofs


def _sent(a: Any) -> Message | None:
    """The message a SEND action posts, named as its receive will name it."""
    if a.computation_type == C.SEND_F:
        return (True, a.stage_index + 1, a.microbatch_index)
    if a.computation_type == C.SEND_B:
        return (False, a.stage_index - 1, a.microbatch_index)
    return None


def _received(a: Any) -> Message | None:
    if a.computation_type == C.RECV_F:
        return (True, a.stage_index, a.microbatch_index)
    if a.computation_type == C.RECV_B:
        return (False, a.stage_index, a.microbatch_index)
    return None

"""Read and write torch's schedule CSV (``_dump_csv`` / ``_load_csv``, torchtitan's
``pipeline_parallel_schedule_csv``), without importing torch.

One row per rank; each cell is an action printed like ``1F0`` (stage 1, forward, microbatch 0).
torch's letters differ from the paper's for backward passes:

=====  ============================  =====
torch  meaning                       ours
=====  ============================  =====
F      forward                       F
I      input gradient                B
W      weight gradient               W
B      full backward                 BW
=====  ============================  =====

Empty cells (torch pads its orders with ``None``) are skipped. Communication and FSDP actions
(``SEND_F``, ``UNSHARD``, ``REDUCE_GRAD``, ...) are dropped on read: a plan holds compute only.
An overlapped pair is one cell, ``(0F3;1I2)OVERLAP_F_B`` (torch's own printing of its
``OVERLAP_F_B`` action): written for each of a plan's ``pairs``, read back as a pair (an F with
a backward of another stage; any other overlap cell is read as its actions in turn).
"""

from __future__ import annotations

import csv
import io
import re

from .core import TORCH_LETTERS, Action, Layout, Plan, PlanError, make_plan, v_placement

_KIND_OF_LETTER = {letter: kind for kind, letter in TORCH_LETTERS.items()}
_NON_COMPUTE = ("UNSHARD", "RESHARD", "REDUCE_GRAD", "SEND_F", "RECV_F", "SEND_B", "RECV_B")
_ACTION = re.compile(
    r"^(\d+)(UNSHARD|RESHARD|REDUCE_GRAD|SEND_F|RECV_F|SEND_B|RECV_B|F|I|W|B)(\d*)$"
)


def action_to_torch_str(a: Action) -> str:
    """``Action(1, "B", 0)`` -> ``"1I0"`` (torch's ``str(_Action)``)."""
    return f"{a.stage}{TORCH_LETTERS[a.kind]}{a.microbatch}"


def plan_to_csv(plan: Plan) -> str:
    """The plan in torch's compute-only CSV format (rows: rank 0 .. p-1)."""
    buf = io.StringIO()
    writer = csv.writer(buf, lineterminator="\n")
    partner = dict(plan.pairs)
    seconds = set(partner.values())
    for r in range(plan.num_ranks):
        row = []
        for a in plan.order[r]:
            if a in partner:
                b = partner[a]
                row.append(f"({action_to_torch_str(a)};{action_to_torch_str(b)})OVERLAP_F_B")
            elif a not in seconds:
                row.append(action_to_torch_str(a))
        writer.writerow(row)
    return buf.getvalue()


def parse_torch_action(cell: str, where: str = "") -> list[Action]:
    """One CSV cell -> zero or more compute actions (see the module docstring)."""
    cell = cell.strip()
    if not cell or cell == "None":
        return []
    if cell.startswith("("):
        inner, sep, kind = cell[1:].partition(")")
        if not sep or kind != "OVERLAP_F_B":
            raise PlanError(f"{where}: cannot parse {cell!r}; expected (a;b)OVERLAP_F_B")
        return [a for sub in inner.split(";") for a in parse_torch_action(sub, where)]
    match = _ACTION.match(cell)
    if match is None:
        raise PlanError(
            f"{where}: cannot parse {cell!r}; expected [stage][F|I|W|B][microbatch], e.g. 2F0"
        )
    stage, kind, mb = match.groups()
    if kind in _NON_COMPUTE:
        return []
    if not mb:
        raise PlanError(f"{where}: compute action {cell!r} has no microbatch index")
    return [Action(int(stage), _KIND_OF_LETTER[kind], int(mb))]


def plan_from_csv(text: str, name: str = "csv", n_microbatches: int | None = None) -> Plan:
    """Read a torch schedule CSV. Placement is inferred from which rank runs which stage,
    ``n_microbatches`` (if not given) from the largest microbatch index.
    """
    rows = list(csv.reader(io.StringIO(text)))
    while rows and not any(c.strip() for c in rows[-1]):
        rows.pop()  # trailing blank lines
    if not rows:
        raise PlanError("plan_from_csv: the CSV has no rows; expected one row per rank")
    order: dict[int, list[Action]] = {}
    pairs: list[tuple[Action, Action]] = []
    for r, row in enumerate(rows):
        order[r] = []
        for step, cell in enumerate(row):
            actions = parse_torch_action(cell, f"row {r} column {step}")
            if cell.strip().startswith("(") and len(actions) == 2:
                f, b = actions
                if f.kind == "F" and b.kind in ("B", "BW") and f.stage != b.stage:
                    pairs.append((f, b))  # else two actions in turn (zbpipe pairs two stages)
            order[r].extend(actions)
    placement: dict[int, int] = {}
    for r, actions in order.items():
        for a in actions:
            if placement.setdefault(a.stage, r) != r:
                raise PlanError(
                    f"plan_from_csv: stage {a.stage} appears on rank {placement[a.stage]} "
                    f"and on rank {r}; "
                    "a stage must live on one rank"
                )
    if not placement:
        raise PlanError("plan_from_csv: the CSV has no compute actions")
    num_ranks = len(rows)
    m = n_microbatches or 1 + max(a.microbatch for acts in order.values() for a in acts)
    layout: Layout = "v" if placement == v_placement(num_ranks) else "loop"
    return make_plan(name, num_ranks, m, placement, order, layout=layout, pairs=pairs)

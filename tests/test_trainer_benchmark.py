"""benchmarks/trainer.py's pure parts: reading torchtitan's step lines, tokens/s, pairing ratios
per repetition, the schedule option's syntax, the trace summary. No torchtitan run (the script
itself is a benchmark, run by hand)."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest

_PATH = Path(__file__).resolve().parents[1] / "benchmarks" / "trainer.py"
_spec = importlib.util.spec_from_file_location("trainer_benchmark", _PATH)
assert _spec is not None and _spec.loader is not None
T = importlib.util.module_from_spec(_spec)
sys.modules["trainer_benchmark"] = T
_spec.loader.exec_module(T)

#: torchtitan 0.3.0's step lines as a rank prints them (colour codes included); rank 0 holds no
#: loss in this loop placement (-1), rank 1 does
RANK0 = (
    "[titan] 2026-12-03 17:18:50,100 - root - INFO - \x1b[31mstep:  1  \x1b[32mloss: -1.00000  "
    "\x1b[33mgrad_norm: 1.0\n"
    "[titan] 2026-12-03 17:18:51,900 - root - INFO - \x1b[31mstep:  2  \x1b[32mloss: -1.00000\n"
)
RANK1 = (
    "[titan] 2026-12-03 17:18:50,000 - root - INFO - \x1b[31mstep:  1  \x1b[32mloss:  7.81234  "
    "\x1b[38;2;54;234;195mmemory: -0.00GiB(-0.00%)  \x1b[34mtps: 391\n"
    "some other line\n"
    "[titan] 2026-12-03 17:18:51,250 - root - INFO - \x1b[31mstep:  2  \x1b[32mloss:  7.70000\n"
    "[titan] 2026-12-03 17:18:52,000 - root - INFO - \x1b[31mstep:  3  \x1b[32mloss:  7.60000\n"
    "[titan] 2026-12-03 17:18:53,000 - root - INFO - \x1b[31mstep:  4  \x1b[32mloss:  7.50000\n"
)


def test_step_times_come_from_the_rank_that_logs_the_loss():
    assert T.step_times(RANK0) == {}
    times = T.step_times(RANK0 + RANK1)
    assert sorted(times) == [1, 2, 3, 4]
    assert times[3] - times[2] == pytest.approx(0.75, abs=1e-6)  # ms in the log's clock


def test_tokens_per_second_counts_the_steps_after_the_warm_up():
    times = T.step_times(RANK1)
    # steps 3 and 4 (512 tokens each) took 53.000 - 51.250 s
    assert T.tokens_per_second(times, 2, 4, 512) == pytest.approx(2 * 512 / 1.75)
    with pytest.raises(ValueError, match="no step line"):
        T.tokens_per_second(times, 2, 6, 512)
    with pytest.raises(ValueError, match="warmup"):
        T.tokens_per_second(times, 4, 4, 512)


def test_ratios_pair_each_repetition_with_its_own_baseline():
    by_rep = [
        {"1F1B": 100.0, "ZBV": 110.0, "torch ZB": None},
        {"1F1B": 50.0, "ZBV": 60.0, "torch ZB": None},
        {"1F1B": 80.0, "ZBV": 72.0, "torch ZB": None},
    ]
    got = T.ratios(by_rep, "1F1B")
    assert got["ZBV"] == {"median": 1.1, "min": 0.9, "max": 1.2, "pairs": 3}
    assert got["1F1B"]["median"] == 1.0
    assert got["torch ZB"] == {"median": None, "min": None, "max": None, "pairs": 0}
    # a repetition whose baseline crashed pairs nothing
    assert T.ratios([{"1F1B": None, "ZBV": 1.0}], "1F1B")["ZBV"]["pairs"] == 0


def test_rotation_and_schedule_specs():
    names = ["a", "b", "c"]
    assert [T.rotated(names, r) for r in range(4)] == [
        ["a", "b", "c"],
        ["b", "c", "a"],
        ["c", "a", "b"],
        ["a", "b", "c"],
    ]
    assert T.parse_schedule("ZBV") == ("ZBV", {})
    assert T.parse_schedule("ZBV@ZBPIPE_SPLIT=default,X=1") == (
        "ZBV",
        {"ZBPIPE_SPLIT": "default", "X": "1"},
    )
    with pytest.raises(ValueError, match="NAME@VAR=VALUE"):
        T.parse_schedule("ZBV@ZBPIPE_SPLIT")


def test_trace_summary_prefers_zbpipes_spans_and_skips_the_warm_up():
    # (kind, stage, microbatch, wall start, wall end, CPU seconds); step: wall start, end, CPU
    warm = {"step": [0.0, 9.0, 9.0], "stage_spans": [], "zbpipe_events": [["F", 0, 0, 0, 9, 9]]}
    torch_step = {
        "step": [10.0, 12.0, 1.8],
        "stage_spans": [["F", 0, 0, 10.0, 10.5, 0.4], ["BW", 0, 0, 11.0, 12.0, 1.0]],
        "zbpipe_events": [],
    }
    zb_step = {
        "step": [20.0, 21.0, 0.5],
        "stage_spans": [["F", 0, 0, 20.0, 20.9, 0.9]],
        "zbpipe_events": [["F", 0, 0, 20.0, 20.2, 0.2], ["B", 0, 0, 20.3, 20.5, 0.1]],
    }
    got = T.trace_summary([[warm, torch_step], [warm, zb_step]], warmup=1)
    assert got["rank0"]["busy_wall_s"] == {"BW": 1.0, "F": 0.5}
    assert got["rank0"]["idle_wall_s"] == pytest.approx(0.5)
    assert got["rank0"]["host_cpu_s"] == pytest.approx(0.4)
    assert got["rank1"]["busy_wall_s"] == pytest.approx({"B": 0.2, "F": 0.2})
    assert got["rank1"]["busy_cpu_s"] == pytest.approx({"B": 0.1, "F": 0.2})
    assert got["rank1"]["idle_wall_s"] == pytest.approx(0.6)
    assert got["rank1"]["source"] == "zbpipe spans"


def test_a_cut_short_runs_printed_lines_give_its_results():
    printed = "\n".join(
        [
            "  llama3 rep 0 1F1B                             900.0",
            "  llama3 rep 0 ZBH1                             990.0",
            "  llama3 rep 0 ZBVZeroBubble                    run 'run': exit codes [1]: boom",
            "  llama3 rep 1 ZBH1                             1100.0",
            "  llama3 rep 1 1F1B                             1000.0",
            "llama3: tokens/s / torch 1F1B's (a summary line: not a run)",
        ]
    )
    got = T.results_from_log(printed)["llama3"]
    assert [r["status"] for r in got["runs"]] == ["ok", "ok", "crash", "ok", "ok"]
    assert got["runs"][2]["error"].endswith("boom")
    zbh1 = got["ratios_to_1F1B"]["ZBH1"]
    assert zbh1["pairs"] == 2 and zbh1["min"] == pytest.approx(1.1)
    assert zbh1["max"] == pytest.approx(1.1)
    assert got["ratios_to_1F1B"]["ZBVZeroBubble"]["pairs"] == 0


def test_a_profiled_runs_measured_costs_are_read_from_its_line():
    line = (
        "INFO zbpipe profile: ScheduleZBV:profile measured costs (ms) F=[70,40,80,60] "
        "B=[110,50,150,60] W=[20,10,30,10] comm=[0.04,0.04,0.04,0.04]; plan ZBV a -> b"
    )
    costs = T.profile_costs(["INFO zbpipe memory: something else", line])
    assert costs["F"] == [70, 40, 80, 60] and costs["W"] == [20, 10, 30, 10]
    assert costs["w_share_of_backward"] == pytest.approx(70 / (370 + 70))
    assert T.profile_costs(["INFO zbpipe memory: no profile here"]) is None

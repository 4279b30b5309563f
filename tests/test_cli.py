"""The zbpipe command line prints what the simulator computes."""

import json
import re

import pytest

from zbpipe.cli import build_parser, main
from zbpipe.planning import Costs, plan, plan_from_csv, simulate


def test_simulate_prints_bubble_rate(capsys, tmp_path):
    out_json, out_csv = tmp_path / "r.json", tmp_path / "p.csv"
    rc = main(
        [
            "simulate",
            "--schedule",
            "ZBH1",
            "-p",
            "4",
            "-m",
            "8",
            "--costs",
            "f=1,b=1.5,w=0.5,comm=0.1",
            "--grid",
            "--json",
            str(out_json),
            "--csv",
            str(out_csv),
        ]
    )
    assert rc == 0
    text = capsys.readouterr().out
    costs = Costs(f=1, b=1.5, w=0.5, comm=0.1)
    ref = simulate(plan("ZBH1", 4, 8, costs), costs)
    assert float(re.search(r"bubble rate: ([0-9.]+)", text).group(1)) == pytest.approx(
        ref.bubble_rate, abs=1e-4
    )
    assert float(re.search(r"makespan: ([0-9.]+)", text).group(1)) == pytest.approx(
        ref.makespan, abs=1e-4
    )
    assert "rank  3 |" in text  # the grid
    assert json.loads(out_json.read_text())["bubble_rate"] == pytest.approx(ref.bubble_rate)
    assert (
        plan_from_csv(out_csv.read_text(), n_microbatches=8).order
        == plan("ZBH1", 4, 8, costs).order
    )


def test_compare_lists_every_schedule(capsys):
    assert main(["compare", "-p", "4", "-m", "6"]) == 0
    text = capsys.readouterr().out
    rows = {
        line.split()[0]: line.split()[1:]
        for line in text.splitlines()[1:]
        if not line.endswith(")")
    }
    assert float(rows["1F1B"][0]) == pytest.approx(3 / 9, abs=1e-4)  # (p-1)/(m+p-1)
    assert "torch:ZBVZeroBubble" in rows
    assert "torch:DualPipeV: skipped" in text  # torch needs m >= 2p = 8


def test_bad_schedule_is_an_error_exit(capsys):
    assert main(["simulate", "--schedule", "nope", "-p", "2", "-m", "2"]) == 2
    assert "known names" in capsys.readouterr().err


def test_parser_has_subcommands():
    parser = build_parser()
    assert parser.parse_args(["compare", "-p", "2", "-m", "3"]).command == "compare"
    with pytest.raises(SystemExit):
        parser.parse_args(["simulate", "-p", "2", "-m", "3", "--costs", "x=1"])


def test_compare_says_what_2bw_would_save_over_sync(capsys):
    assert main(["compare", "-p", "4", "-m", "4"]) == 0
    out = capsys.readouterr().out
    assert "continuous, p=4, m=4: sync leaves a bubble rate of 20.0%" in out
    assert "2bw would save" in out


def test_choose_prints_every_candidate_and_the_fastest_within_the_budget(capsys):
    from zbpipe.cli import main

    assert main(["choose", "-p", "4", "-m", "16", "--budget", "80MiB", "--mem-f", "19MiB"]) == 0
    out = capsys.readouterr().out
    for name in ("1F1B", "ZBH1", "ZB1P", "ZB2P", "ZBV", "ZBVHalf", "ZBVMin"):
        assert f"\n{name} " in out
    # unit times: ZB-V (no bubble at m >= 2p) is the fastest that holds 1F1B's 4 x 19 MiB
    assert "chosen: ZBV (peak 76 MiB per rank" in out


def test_choose_with_an_unreachable_budget_exits_2_naming_the_least_need(capsys):
    from zbpipe.cli import main

    assert main(["choose", "-p", "4", "-m", "16", "--budget", "30MiB", "--mem-f", "19MiB"]) == 2
    err = capsys.readouterr().err
    assert "no schedule fits memory_limit 30 MiB per rank" in err
    assert "(ZBVMin)" in err

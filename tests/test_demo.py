"""The main job runs end to end (small sizes) and reports what the README says it reports."""

import json

import pytest

from zbpipe.demo import DemoConfig, main

pytestmark = pytest.mark.dist


def test_demo_trains_both_schedules_with_identical_losses(tmp_path, capsys):
    out = tmp_path / "demo.json"
    assert (
        main(
            [
                "--steps",
                "3",
                "--hidden",
                "64",
                "--seq",
                "16",
                "--microbatches",
                "4",
                "--json",
                str(out),
            ]
        )
        == 0
    )
    data = json.loads(out.read_text())
    by_step = {}
    for row in data["rows"]:
        assert 0.0 <= row["bubble_rate"] < 1.0 and row["step_time_s"] > 0
        by_step.setdefault(row["step"], {})[row["schedule"]] = row["loss"]
    assert sorted(by_step) == [0, 1, 2]
    for losses in by_step.values():  # same init, same data, same math: the same loss
        assert losses["torch 1F1B"] == pytest.approx(losses["zbpipe ZBH1"], rel=1e-6)
    assert by_step[2]["torch 1F1B"] < by_step[0]["torch 1F1B"]  # it trains
    printed = capsys.readouterr().out
    assert "ZBH1 / 1F1B step time: median" in printed


def test_demo_config_rejects_nonsense():
    with pytest.raises(ValueError, match="DemoConfig.steps must be >= 1"):
        DemoConfig(steps=0)
    with pytest.raises(ValueError, match="hidden must be even"):
        DemoConfig(hidden=33)

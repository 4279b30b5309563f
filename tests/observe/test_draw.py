"""``zbpipe draw``: timeline PNGs and Chrome JSON of simulated plans and measured traces."""

import json
import sys

import pytest

pytest.importorskip("matplotlib")
import numpy as np  # noqa: E402
from matplotlib.image import imread  # noqa: E402

from zbpipe.cli import main  # noqa: E402
from zbpipe.observe import draw  # noqa: E402
from zbpipe.planning import Costs, plan, simulate  # noqa: E402

DPI = 120


def _rgb(hex_color: str) -> np.ndarray:
    return np.array([int(hex_color[i : i + 2], 16) / 255 for i in (1, 3, 5)])


def _pixels_of(img: np.ndarray, hex_color: str) -> int:
    """How many pixels are (within PNG rounding) exactly this colour."""
    return int((np.abs(img[..., :3] - _rgb(hex_color)).max(axis=-1) < 2 / 255).sum())


def test_plan_png_has_expected_size_and_each_kind_colour(tmp_path):
    costs = Costs(f=1, b=1, w=1)
    pl = plan("ZBH1", 4, 8, costs)
    out = tmp_path / "zbh1.png"
    res = draw.plan_timeline_png(pl, costs, str(out))
    img = imread(out)
    # Spec of the layout: 0.45 in per rank row plus 1.05 in of title/axis margins; width at
    # least 8 in.
    assert img.shape[0] == round((1.05 + 0.45 * 4) * DPI)
    assert img.shape[1] >= 8 * DPI
    # Every kind the plan uses is painted over a sizeable area (boxes, not just the legend swatch).
    for kind in ("F", "B", "W"):
        assert _pixels_of(img, draw.KIND_COLORS[kind]) > 2000, kind
    assert _pixels_of(img, draw.KIND_COLORS["BW"]) < 200  # ZB-H1 has no fused backward: legend only
    assert res.bubble_rate == pytest.approx(simulate(pl, costs).bubble_rate)


def test_bubbles_stay_blank(tmp_path):
    """1F1B, p=2, m=2 with unit costs (BW = B + W = 2): rank 0 runs F0 [0,1], F1 [1,2], idles in
    [2,4] waiting for rank 1's BW0, then BW0 [4,6]. The top row is F-coloured at t=0.25, white at
    t=3, BW-coloured at t=5."""
    pl = plan("1F1B", 2, 2)
    res = simulate(pl)
    assert [(iv.start, iv.end) for iv in res.timeline[0]][:3] == [(0, 1), (1, 2), (4, 6)]
    out = tmp_path / "gap.png"
    draw.plan_timeline_png(pl, None, str(out), result=res)
    img = imread(out)[..., :3]
    # Layout spec: 8 in wide (the minimum), axes from 0.8 in to 8 - 2.0 in, x range padded by 0.5 %
    # of the span on each side; rows 0.45 in tall below a 0.45 in title margin.
    t0, t1 = 0.0, res.makespan
    pad = 0.005 * (t1 - t0)

    def col(t: float) -> int:
        return round((0.8 + (t - (t0 - pad)) / (t1 - t0 + 2 * pad) * (8 - 2.8)) * DPI)

    row0 = round((0.45 + 0.45 * 0.5) * DPI)
    np.testing.assert_allclose(img[row0, col(0.25)], _rgb(draw.KIND_COLORS["F"]), atol=2 / 255)
    np.testing.assert_allclose(img[row0, col(3.0)], [1.0, 1.0, 1.0])
    np.testing.assert_allclose(img[row0, col(5.0)], _rgb(draw.KIND_COLORS["BW"]), atol=2 / 255)


def test_plan_json_has_one_event_per_action_with_cost_durations(tmp_path):
    costs = Costs(f=1.0, b=2.0, w=0.5, comm=0.25)
    out = tmp_path / "zbv.json"
    assert (
        main(
            [
                "draw",
                "--schedule",
                "ZBV",
                "-p",
                "2",
                "-m",
                "4",
                "--costs",
                "f=2,b=4,w=1,comm=0.25",
                "--json",
                str(out),
            ]
        )
        == 0
    )
    data = json.loads(out.read_text())
    spans = [e for e in data["traceEvents"] if e["ph"] == "X"]
    pl = plan("ZBV", 2, 4, costs)  # the CLI halves per-rank costs for 2 chunks per rank
    expected = sorted(
        (r, f"{a.kind}{a.microbatch}", a.stage) for r, acts in pl.order.items() for a in acts
    )
    assert sorted((e["tid"], e["name"], e["args"]["stage"]) for e in spans) == expected
    unit_us = {"F": 1000.0, "B": 2000.0, "W": 500.0}
    for e in spans:
        assert e["dur"] == pytest.approx(unit_us[e["cat"]])
    assert data["otherData"]["bubble_rate"] == pytest.approx(simulate(pl, costs).bubble_rate)


def test_measured_trace_round_trip(tmp_path):
    from zbpipe.observe.trace import Event, Trace

    # Hand-made measured events (seconds): rank 1 starts later and idles 2 ms between F1 and B0.
    ev = {
        0: [
            Event(0, "F", 0, 0, 10.000, 10.002),
            Event(0, "F", 0, 1, 10.002, 10.004),
            Event(0, "B", 0, 0, 10.010, 10.013),
            Event(0, "W", 0, 0, 10.013, 10.014),
        ],
        1: [
            Event(1, "F", 1, 0, 10.003, 10.005),
            Event(1, "F", 1, 1, 10.005, 10.007),
            Event(1, "B", 1, 0, 10.009, 10.012),
            Event(1, "W", 1, 0, 10.012, 10.016),
        ],
    }
    trace = Trace(ev)
    src, png, back = tmp_path / "trace.json", tmp_path / "trace.png", tmp_path / "back.json"
    trace.write_chrome(str(src))
    assert main(["draw", "--trace", str(src), "--png", str(png), "--json", str(back)]) == 0
    boxes = draw.boxes_from_chrome(json.loads(back.read_text()))
    for rank, events in ev.items():
        got = [(b.kind, b.stage, b.microbatch, b.start, b.end) for b in boxes[rank]]
        want = [(e.kind, e.stage, e.microbatch, e.start - 10.0, e.end - 10.0) for e in events]
        assert [g[:3] for g in got] == [w[:3] for w in want]
        np.testing.assert_allclose([g[3:] for g in got], [w[3:] for w in want], atol=1e-9)
    # Busy 8 ms (rank 0) and 11 ms (rank 1); longest span 14 ms (rank 0): 1 - 19 / 28.
    assert draw.trace_png(trace, str(tmp_path / "t2.png")) == pytest.approx(1 - 19 / 28)
    assert trace.bubble_rate == pytest.approx(1 - 19 / 28)
    img = imread(png)
    assert img.shape[0] == round((1.05 + 0.45 * 2) * DPI)
    assert _pixels_of(img, draw.KIND_COLORS["W"]) > 500


def test_missing_matplotlib_says_how_to_install(monkeypatch, tmp_path):
    for name in [m for m in sys.modules if m == "matplotlib" or m.startswith("matplotlib.")]:
        monkeypatch.delitem(sys.modules, name)
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # import matplotlib -> ImportError
    with pytest.raises(ImportError, match=r"pip install 'zbpipe\[draw\]'"):
        draw.plan_timeline_png(plan("1F1B", 2, 2), None, str(tmp_path / "x.png"))


def test_draw_without_sizes_or_outputs_is_an_error(capsys):
    assert main(["draw", "--schedule", "ZBH1", "--png", "x.png"]) == 2
    assert "-p/--num-ranks" in capsys.readouterr().err
    assert main(["draw", "--schedule", "ZBH1", "-p", "2", "-m", "2"]) == 2
    assert "--png" in capsys.readouterr().err

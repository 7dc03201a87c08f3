"""`minihf plot`: figures from runs' metrics.jsonl, several runs overlaid; clear errors."""

import json

import pytest

from typer.testing import CliRunner

from minihf.cli import app
from minihf.cli.plot import read_run


def fake_run(path, scale, steps=12):
    path.mkdir(parents=True)
    rows = [{"step": 0, "val-core/mean": 0.3}]
    for s in range(1, steps + 1):
        rows.append({"step": s, "critic/score/mean": scale * s / steps, "actor/kl_loss": 0.01 * s,
                     "actor/entropy": 2.0 - 0.1 * s, "response_length/mean": 10 + s,
                     "response_length/max": 20, "response_length/clip_ratio": 0.0,
                     "actor/pg_clipfrac": 0.05, "timing_s/step": 2.0, "timing_s/gen": 0.8,
                     "timing_s/update_actor": 1.0, "timing_s/ref": 0.2,
                     **({"val-core/mean": scale * s / steps} if s % 4 == 0 else {})})
    rows.append({"step": 3, "critic/score/mean": 0.0})  # a rewritten step: the last row wins
    (path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))


def test_plot_two_runs(tmp_path):
    fake_run(tmp_path / "a" / "run", 1.0)
    fake_run(tmp_path / "b" / "run", 0.5)
    assert [r["step"] for r in read_run(tmp_path / "a" / "run")] == list(range(13))
    assert read_run(tmp_path / "a" / "run")[3]["critic/score/mean"] == 0.0
    res = CliRunner().invoke(app, ["plot", str(tmp_path / "a" / "run"), str(tmp_path / "b" / "run"),
                                   "--out", str(tmp_path / "plots")])
    assert res.exit_code == 0, res.output
    for name in ("overview.png", "timing.png"):
        png = (tmp_path / "plots" / name).read_bytes()
        assert png[:8] == b"\x89PNG\r\n\x1a\n" and len(png) > 20_000, name


def flat(text):
    return "".join(text.replace("│", " ").split())


def test_plot_errors(tmp_path):
    res = CliRunner().invoke(app, ["plot", str(tmp_path / "nope")])
    assert res.exit_code != 0 and "metrics.jsonldoesnotexist" in flat(res.output)
    (tmp_path / "bad").mkdir()
    (tmp_path / "bad" / "metrics.jsonl").write_text('{"step": 1}\n{"step": 2, "x\n')
    res = CliRunner().invoke(app, ["plot", str(tmp_path / "bad")])
    assert res.exit_code != 0 and "metrics.jsonl:2isnotJSON" in flat(res.output)
    (tmp_path / "empty").mkdir()  # a run before its first step: blank figures before
    (tmp_path / "empty" / "metrics.jsonl").write_text("")
    res = CliRunner().invoke(app, ["plot", str(tmp_path / "empty"), "--out", str(tmp_path / "plots")])
    assert res.exit_code != 0 and "hasnorowsyet" in flat(res.output) and not (tmp_path / "plots").exists()
    fake_run(tmp_path / "full", 1.0)  # beside a run with rows, an empty one is left out, with a warning
    with pytest.warns(UserWarning, match="empty/metrics.jsonl has no rows yet; that run is left out"):
        res = CliRunner().invoke(app, ["plot", str(tmp_path / "empty"), str(tmp_path / "full"),
                                       "--out", str(tmp_path / "plots")])
    assert res.exit_code == 0 and (tmp_path / "plots" / "overview.png").is_file(), res.output

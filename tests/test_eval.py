"""``minihf eval``: pass@k by hand, a checkpoint scored like its export, 2 ranks like 1,
and a failure on one rank reported on every rank (no hang)."""

import subprocess
import sys
from pathlib import Path

import pytest

from minihf.trainer.evaluate import EvalConfig, evaluate, pass_at_k, ks_for, summarize
from minihf.testing import spawn_ranks

ROOT = Path(__file__).resolve().parents[1]


def test_pass_at_k_by_hand():
    assert pass_at_k(4, 0, 1) == 0.0 and pass_at_k(4, 4, 1) == 1.0
    # float64 ratios of binomials: approx's default rel=1e-6 only absorbs decimal rounding
    assert pass_at_k(4, 1, 1) == pytest.approx(0.25)
    assert pass_at_k(4, 1, 2) == pytest.approx(1 - 3 / 6)       # C(3,2) / C(4,2)
    assert pass_at_k(4, 2, 2) == pytest.approx(1 - 1 / 6)       # C(2,2) / C(4,2)
    assert pass_at_k(4, 1, 4) == 1.0 and pass_at_k(5, 2, 4) == 1.0
    assert ks_for(1) == [1] and ks_for(4) == [1, 2, 4] and ks_for(6) == [1, 2, 4, 6]


def test_summarize_by_hand():
    # (prompt, sample, source, score, length, truncated): prompt 0 passes once of 2, prompt 1 never
    rows = [(0, 0, "a", 1.0, 3, False), (0, 1, "a", 0.5, 4, True), (1, 0, "a", 0.0, 2, False),
            (1, 1, "a", 0.25, 1, False), (2, 0, "b", 1.0, 5, False), (2, 1, "b", 1.0, 5, False)]
    # float64 means of a few scores: approx's default rel=1e-6 only absorbs decimal rounding
    m = summarize({"mean@2": rows}, 3, EvalConfig(n=2))
    assert m["a/mean@2"] == pytest.approx(1.75 / 4) and m["b/mean@2"] == 1.0
    assert m["a/pass@1"] == pytest.approx((0.5 + 0.0) / 2) and m["a/pass@2"] == pytest.approx(0.5)
    assert m["b/pass@1"] == 1.0 and m["mean@2/truncated"] == pytest.approx(1 / 6)
    assert m["mean@2/response_length/mean"] == pytest.approx(20 / 6)
    lenient = summarize({"mean@2": rows}, 3, EvalConfig(n=2, pass_threshold=0.5))
    assert lenient["a/pass@1"] == pytest.approx((1.0 + 0.0) / 2)


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    """A 2-step SFT checkpoint of a tiny digits model, its export, and test prompts."""
    from minihf.data import make_task_data
    from minihf.hub import init_model

    root = tmp_path_factory.mktemp("eval")
    init_model(root / "model", size="tiny", task="digits")
    make_task_data("digits", root / "data", 16, 7, seed=0)
    res = subprocess.run(
        [sys.executable, str(ROOT / "scripts" / "train_sft.py"), "recipe=sft_digits", f"model.path={root}/model",
         f"data.train_files={root}/data/train.parquet", f"data.val_files={root}/data/test.parquet",
         "data.train_batch_size=8", "trainer.total_training_steps=2", f"trainer.default_local_dir={root}/run"],
        capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stderr[-3000:]
    return root


def _eval_rank(rank, world, model, data, reward):
    return evaluate(model, data, EvalConfig(n=3, max_tokens=6, reward=reward, seed=5))


def test_checkpoint_and_ranks_give_the_same_metrics(ckpt, tmp_path):
    from minihf.hub import export_hf

    data = str(ckpt / "data" / "test.parquet")
    hf = export_hf(ckpt / "run" / "global_step_2", tmp_path / "hf")
    one = evaluate(hf, data, EvalConfig(n=3, max_tokens=6, seed=5))
    assert one["prompts"] == 7 and {"minihf/digits/pass@1", "minihf/digits/pass@2", "minihf/digits/pass@3",
                                    "minihf/digits/mean@3", "minihf/digits/greedy"} <= set(one)
    assert evaluate(ckpt / "run" / "global_step_2", data, EvalConfig(n=3, max_tokens=6, seed=5)) == one
    # 7 prompts over 2 ranks (4 + 3): every sample drawn as in one process
    two = spawn_ranks(_eval_rank, 2, str(ckpt / "run" / "global_step_2"), data, None, timeout_s=300)
    assert two[0] == one and two[1] == one
    other_seed = evaluate(hf, data, EvalConfig(n=3, max_tokens=6, seed=6))
    assert other_seed["mean@3/response_length/mean"] != one["mean@3/response_length/mean"] or \
        other_seed["minihf/digits/mean@3"] != one["minihf/digits/mean@3"]


def test_a_failing_rank_is_reported_on_every_rank(ckpt, tmp_path):
    (tmp_path / "r.py").write_text(
        "def fn(data_source, solution_str, ground_truth, extra_info):\n"
        "    if extra_info['index'] == 3:\n"
        "        raise KeyError('prompt 3 is broken')\n"
        "    return 0.0\n")
    out = spawn_ranks(_safe_eval_rank, 2, str(ckpt / "model"), str(ckpt / "data" / "test.parquet"),
                      f"{tmp_path}/r.py:fn", timeout_s=300)
    for msg in out:  # prompt 3 is on rank 1; rank 0 learns of it too
        assert msg.startswith("ValueError") and "rank 1" in msg and "prompt 3 is broken" in msg, msg


def _safe_eval_rank(rank, world, model, data, reward):
    try:
        _eval_rank(rank, world, model, data, reward)
    except ValueError as e:
        return f"ValueError: {e}"
    return "no error"


def test_cli_errors_name_the_fix(ckpt, tmp_path):
    from typer.testing import CliRunner

    from minihf.cli import app

    runner = CliRunner()
    res = runner.invoke(app, ["eval", str(ckpt / "model")])
    assert res.exit_code == 2 and "--data" in res.output
    res = runner.invoke(app, ["eval", str(tmp_path), "--data", str(ckpt / "data" / "test.parquet")])
    assert res.exit_code == 2 and "neither an HF model dir" in res.output
    res = runner.invoke(app, ["eval", str(ckpt / "run" / "global_step_2"), "--data",
                              str(ckpt / "data" / "test.parquet"), "-n", "2", "--max-tokens", "4", "--no-greedy"])
    assert res.exit_code == 0 and "minihf/digits/pass@2" in res.output, res.output
    # a --json path that cannot be written fails before the evaluation runs, not after it
    for bad, why in ((tmp_path / "missing" / "m.json", "does not exist"), (tmp_path, "is a directory")):
        res = runner.invoke(app, ["eval", str(ckpt / "run" / "global_step_2"), "--data",
                                  str(ckpt / "data" / "test.parquet"), "--json", str(bad)])
        flat = " ".join(res.output.replace("│", " ").split())   # rich wraps the message in a box
        assert res.exit_code == 2 and why in flat and "pass@" not in flat, res.output

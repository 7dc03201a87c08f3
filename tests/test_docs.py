"""The commands and files of docs/writing-a-recipe.md, run as written on a tiny model: fork
the grpo recipe, add the reward, estimator and loss files and the YAML that names them, run
the fork twice (one process instead of torchrun's two, with overrides that make the run
tiny), and plot the two runs."""

import json
import re
import shlex
import shutil
import subprocess
import sys
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parents[1]
DOC = ROOT / "docs" / "writing-a-recipe.md"
BLOCK = re.compile(r"(?:`([^`\n]+)`:\n\n)?```(\w+)\n(.*?)```", re.S)


def blocks():
    """``(file name or None, language, text)`` of each fenced block, in order."""
    return [(m.group(1), m.group(2), m.group(3)) for m in BLOCK.finditer(DOC.read_text())]


def merge(base: dict, extra: dict) -> dict:
    for k, v in extra.items():
        base[k] = merge(base.get(k) or {}, v) if isinstance(v, dict) else v
    return base


def test_writing_a_recipe_runs_as_written(tmp_path):
    from minihf.data import init_model, make_task_data

    init_model(tmp_path / "m", size="tiny", task="sort")
    make_task_data("sort", tmp_path / "d", 16, 4)
    shutil.copytree(ROOT / "recipes" / "grpo", tmp_path / "recipes" / "grpo")
    tiny = [f"actor_rollout_ref.model.path={tmp_path}/m", f"data.train_files={tmp_path}/d/train.parquet",
            f"data.val_files={tmp_path}/d/test.parquet", "data.max_prompt_length=16", "data.max_response_length=8",
            "data.train_batch_size=4", "actor_rollout_ref.rollout.n=2", "actor_rollout_ref.actor.ppo_mini_batch_size=8",
            "trainer.total_training_steps=2", "trainer.test_freq=2", "prepare.task=null", "prepare.sft_recipe=null"]
    ran = []
    for name, lang, text in blocks():
        if name:                                             # a file of the recipe
            (tmp_path / name).write_text(text)
        elif lang == "yaml":                                 # settings for the fork's config
            config = tmp_path / "recipes" / "my_exp" / "config.yaml"
            config.write_text(yaml.safe_dump(merge(yaml.safe_load(config.read_text()), yaml.safe_load(text))))
        elif lang == "bash":
            for line in text.strip().splitlines():
                argv = shlex.split(line)
                if argv[0] == "torchrun":                    # one process here
                    argv = [sys.executable] + argv[argv.index("scripts/train_ppo.py"):] + tiny
                    argv[1] = str(ROOT / argv[1])
                elif argv[0] == "minihf":
                    argv = [sys.executable, "-m", "minihf.cli"] + argv[1:]
                res = subprocess.run(argv, cwd=tmp_path, capture_output=True, text=True, timeout=300)
                assert res.returncode == 0, (line, res.stdout[-2000:], res.stderr[-2000:])
                ran.append(argv[0])
    assert len(ran) == 4
    rows = [json.loads(x) for x in (tmp_path / "outputs/my_exp_v2/metrics.jsonl").read_text().splitlines()]
    assert "reward_extra/brevity/mean" in rows[-1]           # the recipe's reward ran
    saved = yaml.safe_load((tmp_path / "outputs/my_exp_v2/config.yaml").read_text())
    assert saved["algorithm"]["adv_estimator"].endswith("algo.py:centered_grpo")
    assert saved["actor_rollout_ref"]["actor"]["policy_loss"]["loss_mode"].endswith("algo.py:tempered_loss")
    assert "reward_extra/brevity/mean" not in json.loads(
        (tmp_path / "outputs/my_exp/metrics.jsonl").read_text().splitlines()[-1])  # the baseline ran before
    assert (tmp_path / "plots" / "overview.png").stat().st_size > 0   # minihf plot's default --out

"""``minihf recipe new`` / ``minihf recipe list``: a user's recipe is written to the user's own
folder, builds on (or copies) a shipped one, resolves to the same config, and bad input fails in
one line naming the value."""

import os
from dataclasses import asdict
from pathlib import Path

import pytest
from typer.testing import CliRunner

from minihf.cli.app import app
from minihf.cli.recipe_cmd import new_recipe
from minihf.config import DEFAULT_RECIPES_DIR, ConfigError, load_config
from minihf.trainer.ppo_job import PPOJobConfig


@pytest.fixture
def cwd(tmp_path):
    old = os.getcwd()
    os.chdir(tmp_path)
    yield tmp_path
    os.chdir(old)


def test_new_builds_on_the_base_and_resolves_to_it(cwd):
    target = new_recipe("my_exp", "dapo")
    assert target == Path("recipes/my_exp") and sorted(os.listdir(target)) == ["config.yaml"]
    assert "base: dapo" in (target / "config.yaml").read_text()
    assert asdict(load_config(PPOJobConfig, "my_exp")) == asdict(load_config(PPOJobConfig, "dapo"))
    (target / "config.yaml").write_text((target / "config.yaml").read_text() + "trainer:\n  total_training_steps: 7\n")
    assert load_config(PPOJobConfig, "my_exp").trainer.total_training_steps == 7
    assert load_config(PPOJobConfig, "dapo").trainer.total_training_steps != 7   # the shipped one untouched


def test_a_base_given_as_a_path_resolves_from_the_new_recipe(cwd):
    """`recipe new g3 --base recipes/g2` wrote `base: recipes/g2`, which a recipe reads from
    its own folder (recipes/g3/recipes/g2: not found); written relative to the new one."""
    new_recipe("g2", "dapo")
    for base, out_dir in (("recipes/g2", "recipes"), (str(cwd / "recipes" / "g2"), "elsewhere")):
        target = new_recipe("g3", base, out_dir=out_dir)
        assert asdict(load_config(PPOJobConfig, str(target))) == asdict(load_config(PPOJobConfig, "dapo"))


def test_copy_takes_the_base_files(cwd):
    target = new_recipe("d2", "distill", out_dir="mine", copy=True)
    assert sorted(os.listdir(target)) == sorted(p.name for p in (DEFAULT_RECIPES_DIR / "distill").iterdir()
                                                if p.is_file() and not p.name.endswith(".pyc"))
    assert (target / "distill.py").read_text() == (DEFAULT_RECIPES_DIR / "distill" / "distill.py").read_text()
    mine, shipped = load_config(PPOJobConfig, str(target)), load_config(PPOJobConfig, "distill")
    assert mine.algorithm.adv_estimator.startswith(str((cwd / target).resolve()))   # its own copy of the code
    assert mine.algorithm.adv_estimator.split(":")[-1] == shipped.algorithm.adv_estimator.split(":")[-1]


def test_a_copy_of_a_recipe_with_a_relative_base_path_keeps_its_base(cwd):
    """A copied config.yaml's `base: ../g2` was read from its new folder (another --dir: not
    found); it is rewritten relative to the copy, and a comment beside it is kept. So is a
    `base: g2` found beside the original; a name found from anywhere (shipped) stays."""
    new_recipe("g2", "dapo", out_dir="lab")
    Path("lab/g4").mkdir()
    Path("lab/g4/config.yaml").write_text("base: '../g2'  # the dapo run\ntrainer:\n  total_training_steps: 7\n")
    target = new_recipe("g5", "lab/g4", out_dir="elsewhere/deeper", copy=True)
    assert "# the dapo run" in (target / "config.yaml").read_text()
    got = load_config(PPOJobConfig, str(target))
    assert got.trainer.total_training_steps == 7
    got.trainer.total_training_steps = load_config(PPOJobConfig, "dapo").trainer.total_training_steps
    assert asdict(got) == asdict(load_config(PPOJobConfig, "dapo"))
    Path("lab/g6").mkdir()  # a base by name, found beside the original (not from elsewhere/)
    Path("lab/g6/config.yaml").write_text("base: g2\ntrainer:\n  total_training_steps: 9\n")
    target = new_recipe("g7", "lab/g6", out_dir="elsewhere", copy=True)
    assert load_config(PPOJobConfig, str(target)).trainer.total_training_steps == 9
    target = new_recipe("g8", "dapo", out_dir="elsewhere", copy=True)  # a name found anywhere: kept
    assert "\nbase: grpo\n" in (target / "config.yaml").read_text()


@pytest.mark.parametrize("name, kwargs, message", [
    ("my exp", {}, "recipe name 'my exp': use letters"),
    ("x", {"base": "gpro"}, "recipe 'gpro' not found"),
    ("grpo", {"out_dir": str(DEFAULT_RECIPES_DIR)}, "read-only examples"),
    ("y", {"out_dir": str(DEFAULT_RECIPES_DIR / "grpo")}, "read-only examples"),
])
def test_bad_input(cwd, name, kwargs, message):
    with pytest.raises(ConfigError, match=message):
        new_recipe(name, kwargs.pop("base", "grpo"), **kwargs)
    assert not Path("recipes").exists() and not (DEFAULT_RECIPES_DIR / "y").exists()


def test_a_base_that_is_not_a_recipe_a_name_that_shadows_its_base_and_a_file_as_dir(cwd):
    """A YAML that is no recipe was written as `base: ../..` (its folder), and with --copy its
    folder's every file was copied, with no config.yaml; `recipe new grpo --base grpo` wrote a
    recipe that shadows the shipped one and builds on itself (a loop); --dir FILE failed in
    pathlib. A recipe YAML file as the base is that file, copied as config.yaml."""
    Path("notes.yaml").write_text("just: [some notes\n")
    Path("list.yaml").write_text("- a\n- b\n")
    Path("f").touch()
    Path("other").mkdir()
    Path("other/exp.yaml").write_text("base: grpo\ntrainer:\n  total_training_steps: 11\n")
    Path("other/README.txt").touch()
    for name, base, kwargs, says in (("x", "notes.yaml", {}, "cannot parse recipe notes.yaml as YAML"),
                                     ("x", "list.yaml", {"copy": True}, "must be a mapping of keys, got list"),
                                     ("grpo", "grpo", {}, "would shadow it .* and build on itself"),
                                     ("y", "grpo", {"out_dir": "f"}, "--dir f is a file")):
        with pytest.raises(ConfigError, match=says):
            new_recipe(name, base, **kwargs)
    assert not Path("recipes").exists()
    for name, copy in (("z", False), ("z2", True)):
        target = new_recipe(name, "other/exp.yaml", copy=copy)
        assert sorted(os.listdir(target)) == ["config.yaml"]
        assert load_config(PPOJobConfig, name).trainer.total_training_steps == 11


def test_cli_new_list_and_existing(cwd):
    runner = CliRunner()
    res = runner.invoke(app, ["recipe", "new", "my_exp", "--base", "grpo"])
    assert res.exit_code == 0 and "recipe=my_exp" in res.output
    res = runner.invoke(app, ["recipe", "new", "my_exp"])
    assert res.exit_code != 0 and "already exists" in res.output
    res = runner.invoke(app, ["recipe", "list"])
    assert res.exit_code == 0
    yours, shipped = res.output.split("# shipped")
    assert "my_exp" in yours and "grpo " not in yours
    assert "grpo " in shipped and "GRPO on the synthetic `sort` task" in shipped

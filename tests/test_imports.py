"""Recipe code named in config (``file.py:function``): imported once per process, found
from the recipe folder, and bad references are one clear config error."""

import pytest

from minihf.algorithms import get_adv_estimator_fn, get_policy_loss_fn
from minihf.config import ConfigError, load_config
from minihf.utils.imports import import_file, is_code_ref, load_ref, split_ref


def test_code_refs(tmp_path):
    f = tmp_path / "algo.py"
    f.write_text("from minihf.algorithms import register_adv_est\n"
                 "CALLS = []\n"
                 "@register_adv_est('test_imports_est')\n"
                 "def est(token_level_rewards, response_mask):\n"
                 "    return token_level_rewards, token_level_rewards\n"
                 "VALUE = 3\n")
    assert is_code_ref(f"{f}:est") and not is_code_ref("grpo") and not is_code_ref(f"{f}:1x")
    assert split_ref("a/b.py:fn") == ("a/b.py", "fn")
    # imported once: the decorator inside ran once, a second lookup is the same object
    assert import_file(f) is import_file(str(f))
    assert get_adv_estimator_fn(f"{f}:est") is load_ref(f"{f}:est") is get_adv_estimator_fn("test_imports_est")
    with pytest.raises(ValueError, match=r"algo.py has no policy loss 'nope'; callables defined there: \['est'\]"):
        get_policy_loss_fn(f"{f}:nope")
    with pytest.raises(ValueError, match="'VALUE' .* is a int, not a policy loss"):
        get_policy_loss_fn(f"{f}:VALUE")
    with pytest.raises(ValueError, match="missing.py does not exist"):
        get_policy_loss_fn(f"{tmp_path}/missing.py:fn")
    with pytest.raises(ValueError, match=r"path/to/file.py:function"):
        get_policy_loss_fn("no_such_loss")
    broken = tmp_path / "broken.py"
    broken.write_text("def compute_score(*a):\n    return 1.0 +\n")
    with pytest.raises(ValueError, match=r"broken.py, line 2: invalid syntax: return 1.0 \+; fix the file"):
        import_file(broken)
    broken.write_text("def compute_score(*a):\n    return 1.0\n")   # fixed: imports now
    assert import_file(broken).compute_score() == 1.0
    failing = tmp_path / "failing.py"
    failing.write_text("raise RuntimeError('module-level code failed')\n")
    with pytest.raises(RuntimeError, match="module-level code failed"):   # its own traceback
        import_file(failing)
    exits = tmp_path / "exits.py"
    exits.write_text("import sys\nsys.exit(4)\n")
    with pytest.raises(RuntimeError, match=r"exits.py called sys.exit\(4\) while it was imported; recipe code"):
        import_file(exits)  # a SystemExit ended an in-process minihf.train without a word


def test_recipe_relative_paths(tmp_path, monkeypatch):
    from minihf.trainer.ppo_config import PPOConfig

    recipe = tmp_path / "r"
    recipe.mkdir()
    (recipe / "reward.py").write_text("def compute_score(*a):\n    return 0.0\n")
    (recipe / "config.yaml").write_text("custom_reward_function:\n  path: reward.py\n"
                                        "algorithm:\n  adv_estimator: grpo\n")
    monkeypatch.chdir(tmp_path)
    cfg = load_config(PPOConfig, str(recipe / "config.yaml"))
    assert cfg.custom_reward_function.path == str((recipe / "reward.py").resolve())
    # on the command line a path is from the working directory
    with pytest.raises(ConfigError, match=r"custom_reward_function: path='reward.py' does not exist"):
        load_config(PPOConfig, str(recipe / "config.yaml"), ["custom_reward_function.path=reward.py"])
    cfg = load_config(PPOConfig, str(recipe / "config.yaml"),
                      ["custom_reward_function.path=r/reward.py"])
    assert cfg.custom_reward_function.path == "r/reward.py"


def test_loading_a_config_runs_no_recipe_code(tmp_path):
    """``minihf config show`` (and every config load) checks a ``file.py:name`` estimator by
    reading the file, not running it: a module-level side effect never happens, and a
    missing name or a syntax error is still one line."""
    from typer.testing import CliRunner

    from minihf.cli import app
    from minihf.config import ConfigError, load_config
    from minihf.trainer.ppo_job import PPOJobConfig

    marker = tmp_path / "marker"
    algo = tmp_path / "algo.py"
    algo.write_text(f"open({str(marker)!r}, 'w').write('ran')\n\n"
                    "def my_adv(token_level_rewards, response_mask, index, **kw):\n    return 0, 0\n")
    cfg = load_config(PPOJobConfig, "grpo", [f"algorithm.adv_estimator={algo}:my_adv"])
    assert cfg.algorithm.adv_estimator.endswith("algo.py:my_adv")
    res = CliRunner().invoke(app, ["config", "show", "grpo", f"algorithm.adv_estimator={algo}:my_adv"])
    assert res.exit_code == 0, res.output
    assert not marker.exists()
    with pytest.raises(ConfigError, match=r"algo.py has no advantage estimator 'nope'; names defined "
                                          r"there: \['my_adv'\]"):
        load_config(PPOJobConfig, "grpo", [f"algorithm.adv_estimator={algo}:nope"])
    algo.write_text("def broken(:\n")
    with pytest.raises(ConfigError, match=r"algo.py, line 1: .*def broken\(:; fix the file"):
        load_config(PPOJobConfig, "grpo", [f"algorithm.adv_estimator={algo}:broken"])
    assert not marker.exists()


def test_a_reward_functions_file_and_name_are_checked_at_load(tmp_path):
    """``custom_reward_function`` / ``custom_cost_function``: a name the file does not bind, or
    a file that does not parse, is one config error at load (it surfaced after the warm start
    and the workers had started); a file binding names in ways the syntax tree cannot list
    fully (a star import) or inside a top-level ``try``/``if`` is accepted."""
    from minihf.trainer.ppo_config import PPOConfig

    (tmp_path / "reward.py").write_text("def compute_score(*a):\n    return 0.0\n")
    (tmp_path / "broken.py").write_text("def compute_score(*a)\n    return 0.0\n")
    (tmp_path / "star.py").write_text("from math import *\n")
    (tmp_path / "guarded.py").write_text("try:\n    import numpy\nexcept ImportError:\n    numpy = None\n"
                                         "if numpy is None:\n    def compute_cost(*a):\n        return 0.0\n"
                                         "else:\n    compute_cost = None\n")
    with pytest.raises(ConfigError, match=r"custom_reward_function: name='nope': .*reward.py has no function 'nope'; "
                                          r"names defined there: \['compute_score'\]; set name to the function"):
        load_config(PPOConfig, None, [f"custom_reward_function.path={tmp_path}/reward.py",
                                      "custom_reward_function.name=nope"])
    with pytest.raises(ConfigError, match=r"custom_cost_function: name='compute_cost': .*reward.py has no function"):
        load_config(PPOConfig, None, [f"custom_cost_function.path={tmp_path}/reward.py"])
    with pytest.raises(ConfigError, match=r"custom_reward_function: .*broken.py, line 1: expected ':'"):
        load_config(PPOConfig, None, [f"custom_reward_function.path={tmp_path}/broken.py"])
    for ok in ([f"custom_reward_function.path={tmp_path}/reward.py"], [f"custom_reward_function.path={tmp_path}/star.py"],
               [f"custom_cost_function.path={tmp_path}/guarded.py"]):
        load_config(PPOConfig, None, ok)

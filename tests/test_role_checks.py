"""What the job checks of its roles' models at start-up, before any worker starts."""

import shutil

import pytest


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    from minihf.hub import init_model

    root = tmp_path_factory.mktemp("roles")
    init_model(root / "m", size="tiny", task="sort")
    return root / "m"


def test_a_role_model_of_another_tokenizer_is_refused_at_start_up(model_dir, tmp_path):
    """Every role reads the actor's token ids: a critic (or teacher, or reward model) of
    another tokenizer scored meaningless tokens in silence, and one with a smaller vocabulary
    failed inside F.embedding mid-run. A role of the same tokenizer (a copy of the actor) passes."""
    from minihf.config import ConfigError, load_config
    from minihf.data import make_task_data
    from minihf.hub import init_model
    from minihf.trainer.ppo_job import PPOJobConfig, check_paths

    make_task_data("sort", tmp_path / "d", 4, 2)
    init_model(tmp_path / "arith", size="tiny", task="arith")     # another alphabet
    shutil.copytree(model_dir, tmp_path / "copy")
    common = [f"data.train_files={tmp_path}/d/train.parquet", f"data.val_files={tmp_path}/d/test.parquet",
              f"actor_rollout_ref.model.path={model_dir}", f"trainer.default_local_dir={tmp_path}/run"]
    cfg = load_config(PPOJobConfig, "ppo", common + [f"critic.model.path={tmp_path}/arith"])
    with pytest.raises(ConfigError, match=r"critic.model.path=.*arith' (has another tokenizer than the actor's|embeds "
                                          r"\d+ token ids, but the actor's tokenizer makes ids up to)"):
        check_paths(cfg)
    check_paths(load_config(PPOJobConfig, "ppo", common + [f"critic.model.path={tmp_path}/copy"]))

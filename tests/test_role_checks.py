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
    failed inside F.embedding mid-run. A role of the actor's tokenizer passes, with a token
    added (a pad token: the actor's ids are its ids) or a larger embedding."""
    import json

    from minihf.config import ConfigError, load_config
    from minihf.data import load_tokenizer, make_task_data
    from minihf.hub import init_model
    from minihf.trainer.ppo_job import PPOJobConfig, check_paths

    make_task_data("sort", tmp_path / "d", 4, 2)
    init_model(tmp_path / "arith", size="tiny", task="arith")     # another alphabet, the same embedding size
    for name in ("small", "padded"):
        shutil.copytree(model_dir, tmp_path / name)
    config = json.loads((tmp_path / "small" / "config.json").read_text())
    (tmp_path / "small" / "config.json").write_text(json.dumps({**config, "vocab_size": 8}))
    tok = load_tokenizer(tmp_path / "padded")
    tok.add_special_tokens({"additional_special_tokens": ["[EXTRA]"]})
    tok.save_pretrained(tmp_path / "padded")
    common = [f"data.train_files={tmp_path}/d/train.parquet", f"data.val_files={tmp_path}/d/test.parquet",
              f"actor_rollout_ref.model.path={model_dir}", f"trainer.default_local_dir={tmp_path}/run"]
    for role, says in (("arith", r"critic.model.path=.*arith' has another tokenizer than the actor's \(.*; e.g. "
                                 r"the actor's \[.*\] are not its\)"),
                       ("small", r"critic.model.path=.*small' embeds 8 token ids, but the actor's tokenizer makes "
                                 r"ids up to \d+")):
        with pytest.raises(ConfigError, match=says):
            check_paths(load_config(PPOJobConfig, "ppo", common + [f"critic.model.path={tmp_path}/{role}"]))
    assert len(load_tokenizer(tmp_path / "padded")) == len(load_tokenizer(model_dir)) + 1
    check_paths(load_config(PPOJobConfig, "ppo", common + [f"critic.model.path={tmp_path}/padded"]))

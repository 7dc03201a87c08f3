"""Every prepared artefact is complete or absent, and an interrupt is reported as one
(docs/reliability.md): a build (model dir, data, export) interrupted at any point leaves
nothing a rerun would trust, and the rerun redoes it; Ctrl-C while checkpoint shards load
is a ``KeyboardInterrupt``, not a damaged-file error."""

import pytest

from minihf.utils.files import staged_dir


def interrupt(*args, **kwargs):
    raise KeyboardInterrupt


def test_staged_dir_is_complete_or_absent(tmp_path):
    out = tmp_path / "out"
    with pytest.raises(KeyboardInterrupt):
        with staged_dir(out) as tmp:
            (tmp / "a").write_text("1")
            interrupt()
    assert not out.exists() and list(tmp_path.iterdir()) == []
    (tmp_path / ".out.partial").mkdir()                        # a killed build's leftover
    (tmp_path / ".out.partial" / "junk").write_text("x")
    with staged_dir(out) as tmp:
        (tmp / "a").write_text("1")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out"] and [p.name for p in out.iterdir()] == ["a"]
    with staged_dir(out, replace=False) as tmp:                # merged into an existing dir
        (tmp / "b").write_text("2")
    assert sorted(p.name for p in out.iterdir()) == ["a", "b"]
    with staged_dir(out) as tmp:                               # replaced as a whole
        (tmp / "c").write_text("3")
    assert [p.name for p in out.iterdir()] == ["c"]


def test_interrupted_model_and_data_builds_leave_nothing(tmp_path, monkeypatch):
    import minihf.models
    from minihf.data import make_task_data
    from minihf.hub import init_model
    from minihf.data.files import read_many

    with monkeypatch.context() as m:
        m.setattr(minihf.models, "save_hf", interrupt)          # after config.json, before the weights
        with pytest.raises(KeyboardInterrupt):
            init_model(tmp_path / "model", size="tiny", task="sort")
    assert list(tmp_path.iterdir()) == []                      # no config.json without weights
    init_model(tmp_path / "model", size="tiny", task="sort")   # the rerun builds it
    assert (tmp_path / "model" / "model.safetensors").is_file()

    make_task_data("sort", tmp_path / "data", 8, 2)
    before = (tmp_path / "data" / "train.parquet").read_bytes()
    import pyarrow.parquet as pq
    def torn(table, where):                                     # Ctrl-C half way through the write
        open(where, "wb").write(b"PAR1 half a file")
        raise KeyboardInterrupt
    with monkeypatch.context() as m:
        m.setattr(pq, "write_table", torn)
        with pytest.raises(KeyboardInterrupt):
            make_task_data("sort", tmp_path / "data", 20, 2, seed=1)
    assert (tmp_path / "data" / "train.parquet").read_bytes() == before  # the old file, intact
    assert len(read_many(tmp_path / "data" / "train.parquet")) == 8
    assert sorted(p.name for p in (tmp_path / "data").iterdir()) == [
        "test.jsonl", "test.parquet", "train.jsonl", "train.parquet"]  # no temporary left


def test_prepare_redoes_data_it_finds_incomplete(tmp_path, monkeypatch):
    from minihf.config import load_config
    from minihf.trainer.ppo_job import PPOJobConfig
    from minihf.trainer.prepare import prepare_files

    monkeypatch.chdir(tmp_path)
    cfg = load_config(PPOJobConfig, "grpo", ["prepare.num_train=8", "prepare.num_test=2", "prepare.size=tiny"])
    data = tmp_path / "outputs" / "data" / "sort"
    data.mkdir(parents=True)
    (data / "train.parquet").write_text("left by an old version that wrote in place")
    assert prepare_files(cfg) is True                           # the model is absent: warm start due
    assert sorted(p.name for p in data.iterdir()) == ["test.jsonl", "test.parquet", "train.jsonl", "train.parquet"]
    from minihf.data.files import read_many
    assert len(read_many(data / "train.parquet")) == 8
    assert (tmp_path / "outputs" / "models" / "sort-mini" / "model.safetensors").is_file()
    assert not list((tmp_path / "outputs").glob("**/.*"))     # no lock or temporary left


def test_ctrl_c_while_loading_shards_is_an_interrupt(tmp_path, monkeypatch):
    from minihf.utils import safe_load
    from minihf.hub import export_hf
    from minihf.utils.checkpoint import load_checkpoint, save_checkpoint

    from test_reliability import small

    save_checkpoint(tmp_path / "ckpt", small(), extra={"step": 1})
    monkeypatch.setattr(safe_load.SafeFileSystemReader, "read_data", interrupt)
    with pytest.raises(KeyboardInterrupt):                     # was: CorruptFileError ... (a damaged shard?)
        load_checkpoint(tmp_path / "ckpt", small())
    with pytest.raises(KeyboardInterrupt):
        export_hf(tmp_path / "ckpt", tmp_path / "hf")


def _sft_export_interrupted_then_rerun(rank, world, cfg):
    import minihf.hub.export
    from minihf.controller import run
    from minihf.trainer.sft import SFTDriver, sft_roles

    logs, real = [], minihf.hub.export.save_hf

    def drive(groups):
        driver = SFTDriver(cfg, groups["sft"])
        driver.log = logs.append
        return driver.fit()
    minihf.hub.export.save_hf = interrupt
    try:
        run(drive, sft_roles(cfg), cfg.controller)
        outcome = "no interrupt"
    except KeyboardInterrupt:
        outcome = "interrupted"
    minihf.hub.export.save_hf = real
    run(drive, sft_roles(cfg), cfg.controller)
    return outcome, logs


def test_sft_interrupted_while_exporting_exports_on_the_rerun(tmp_path):
    """Ctrl-C after the SFT's last checkpoint, while it exports: nothing at hf/, and the rerun
    (which has no step left) exports instead of saying "nothing to train" and leaving the
    RL job a model dir without config.json."""
    from minihf.data import make_task_data
    from minihf.hub import init_model
    from minihf.models import load_hf
    from minihf.testing import spawn_ranks

    from test_sft import config

    model = str(init_model(tmp_path / "model", size="tiny", task="digits"))
    make_task_data("digits", tmp_path / "data", num_train=32, num_test=4)
    cfg = config(model, str(tmp_path / "data"), str(tmp_path / "run"), 2)
    outcome, logs = spawn_ranks(_sft_export_interrupted_then_rerun, 1, cfg, timeout_s=240)[0]
    assert outcome == "interrupted"
    assert any("has trained all 2 steps but has no HF export (interrupted while exporting?): exporting "
               "global_step_2" in line for line in logs), logs
    assert not any("nothing to train" in line for line in logs), logs
    load_hf(tmp_path / "run" / "hf")
    assert sorted(p.name for p in tmp_path.joinpath("run").iterdir() if p.name.startswith(".")) == []

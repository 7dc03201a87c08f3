"""Checkpoint round trip in one process (the 2-rank resume tests live in test_workers.py
and test_sft.py), RNG state, and `minihf export` loading in transformers."""

import random

import numpy as np
import pytest
import torch
from typer.testing import CliRunner

from minihf.cli import app
from minihf.models import ModelArgs, build_model, init_weights
from minihf.workers.optim import OptimConfig, build_lr_scheduler, build_optimizer
from minihf.hub import export_hf
from minihf.utils.checkpoint import (capture_rng_state, load_checkpoint,
                                     restore_rng_state, save_checkpoint)

from test_fsdp import ARGS


def draw():
    return (torch.rand(3).tolist(), random.random(), float(np.random.rand()))


def test_rng_state_round_trip():
    state = capture_rng_state()
    first = draw()
    restore_rng_state(state)
    assert draw() == first


def test_load_checkpoint_restores_the_global_rng(tmp_path):
    """The RNG states go through save/load, not just the helpers: draws after a load repeat
    the draws made after the save."""
    model, opt, sched, cfg = trained(False)
    save_checkpoint(tmp_path / "ckpt", model, opt, sched)
    first = draw()
    draw()                                                  # the RNGs move on
    load_checkpoint(tmp_path / "ckpt", model, opt, sched)
    assert draw() == first
    load_checkpoint(tmp_path / "ckpt", model, opt, sched, restore_rng=False)
    assert draw() != first


def test_a_rank_the_checkpoint_lacks_takes_rank_0s_schedule(tmp_path, monkeypatch):
    """Resumed on more ranks than it was saved with, a rank without extra/rank_N.pt started
    its LR schedule over (warm-up from step 0) while rank 0 went on: each rank's FSDP shard
    of every weight moved at another learning rate. It now takes rank 0's schedule."""
    import minihf.utils.checkpoint as ckpt

    model, opt, sched, cfg = trained(False)
    save_checkpoint(tmp_path / "ckpt", model, opt, sched)
    fresh_opt = build_optimizer(model.parameters(), cfg)
    fresh = build_lr_scheduler(fresh_opt, cfg)
    monkeypatch.setattr(ckpt, "_rank", lambda group: (1, 2))          # rank 1 of 2; saved by 1
    with pytest.warns(UserWarning, match=r"rank_1.pt missing .* RNG starts fresh; its LR schedule comes from"):
        assert load_checkpoint(tmp_path / "ckpt", model, fresh_opt, fresh) == {}
    assert fresh.last_epoch == sched.last_epoch == 2 and fresh.get_last_lr() == sched.get_last_lr()
    (tmp_path / "ckpt" / "extra" / "rank_0.pt").unlink()
    with pytest.raises(ckpt.CorruptFileError, match="has no extra/rank_0.pt"):
        load_checkpoint(tmp_path / "ckpt", model, fresh_opt, fresh)


def trained(tie, seed=0):
    model = init_weights(build_model(ModelArgs(**ARGS, tie_word_embeddings=tie), "lm"), seed=seed)
    cfg = OptimConfig(lr=1e-2, warmup_steps=3)
    opt = build_optimizer(model.parameters(), cfg)
    sched = build_lr_scheduler(opt, cfg)
    ids = torch.randint(0, 48, (2, 7), generator=torch.Generator().manual_seed(seed))
    for _ in range(2):
        model(ids).float().logsumexp(-1).mean().backward()
        opt.step()
        opt.zero_grad()
        sched.step()
    return model, opt, sched, cfg


@pytest.mark.parametrize("tie", [True, False])
def test_save_load_round_trip_and_export_loads_in_transformers(tmp_path, tie):
    from transformers import AutoModelForCausalLM

    model, opt, sched, cfg = trained(tie)
    save_checkpoint(tmp_path / "ckpt", model, opt, sched, extra={"step": 2})
    fresh, _, _, _ = trained(tie, seed=1)
    fopt = build_optimizer(fresh.parameters(), cfg)
    fsched = build_lr_scheduler(fopt, cfg)
    assert load_checkpoint(tmp_path / "ckpt", fresh, fopt, fsched) == {"step": 2}
    for (n, p), q in zip(model.state_dict().items(), fresh.state_dict().values()):
        assert torch.equal(p, q), n
    assert fsched.last_epoch == sched.last_epoch == 2
    s0, s1 = opt.state_dict()["state"], fopt.state_dict()["state"]
    assert all(torch.equal(s0[k]["exp_avg"], s1[k]["exp_avg"]) for k in s0)

    result = CliRunner().invoke(app, ["export", str(tmp_path / "ckpt"), str(tmp_path / "hf")])
    assert result.exit_code == 0, result.output
    theirs = AutoModelForCausalLM.from_pretrained(str(tmp_path / "hf")).eval()
    ids = torch.tensor([[3, 9, 27, 1, 5], [44, 2, 8, 30, 17]])
    with torch.no_grad():
        diff = (model(ids) - theirs(ids).logits).abs().max().item()
    assert diff < 1e-5  # other kernels; fp32 logits |z| < 1 (ulp 6e-8): 1e-5 is 150+ ulp
    # an RL run's global_step_N holds the policy in actor/: exporting the step dir exports it
    (tmp_path / "global_step_2").mkdir()
    (tmp_path / "ckpt").rename(tmp_path / "global_step_2" / "actor")
    result = CliRunner().invoke(app, ["export", str(tmp_path / "global_step_2"), str(tmp_path / "hf2")])
    assert result.exit_code == 0, result.output
    weights = [(tmp_path / d / "model.safetensors").read_bytes() for d in ("hf", "hf2")]
    assert weights[0] == weights[1]


def test_errors_name_the_path(tmp_path):
    with pytest.raises(FileNotFoundError, match="not a minihf checkpoint"):
        export_hf(tmp_path, tmp_path / "out")
    model, opt, sched, _ = trained(False)
    with pytest.raises(FileNotFoundError, match="no checkpoint at"):
        load_checkpoint(tmp_path / "missing", model)
    save_checkpoint(tmp_path / "noopt", model)
    with pytest.raises(FileNotFoundError, match="without an optimizer"):
        load_checkpoint(tmp_path / "noopt", model, opt)
    result = CliRunner().invoke(app, ["export", str(tmp_path), str(tmp_path / "o")])
    assert result.exit_code != 0 and "not a minihf checkpoint" in result.output
    (tmp_path / "afile").write_text("")
    result = CliRunner().invoke(app, ["export", str(tmp_path / "noopt"), str(tmp_path / "afile")])
    assert result.exit_code == 2 and "is a file" in result.output
    from minihf.data.tokenizer import load_tokenizer
    with pytest.raises(FileNotFoundError, match="training checkpoint.*minihf export"):
        load_tokenizer(tmp_path / "noopt")  # e.g. `minihf generate CKPT`


class _Payload:
    """Unpickling it would create ``marker``: what a crafted checkpoint file would run."""

    def __init__(self, marker):
        self.marker = str(marker)

    def __reduce__(self):
        import os

        return os.system, (f"touch {self.marker}",)


def test_dcp_metadata_paths_pickled_by_any_python_load():
    """DCP's ``.metadata`` holds paths: Python 3.13 pickles one as ``pathlib._local.PosixPath``,
    earlier Pythons as ``pathlib.PosixPath``. Both load under the running Python (the first
    was refused as not checkpoint data, so no checkpoint written under 3.13 could resume);
    another class of those modules is still refused."""
    import io
    import pathlib

    from minihf.utils.safe_load import UnsafeCheckpointError, _MetadataUnpickler

    def pickled(module: str, name: str) -> bytes:  # protocol 2: GLOBAL, one str arg, REDUCE
        return b"\x80\x02c" + f"{module}\n{name}\n".encode() + b"X\x04\x00\x00\x00/a/q\x85R."

    for module in ("pathlib", "pathlib._local"):
        loaded = _MetadataUnpickler(io.BytesIO(pickled(module, "PurePosixPath")), "m").load()
        assert loaded == pathlib.PurePosixPath("/a/q") and type(loaded) is pathlib.PurePosixPath
    with pytest.raises(UnsafeCheckpointError, match=r"it asks for pathlib\._local\.os"):
        _MetadataUnpickler(io.BytesIO(pickled("pathlib._local", "os")), "m").load()


def test_a_crafted_checkpoint_never_runs_code(tmp_path):
    """Every pickle of a checkpoint is replaced by one whose unpickling would write a marker
    file: each load path (resume, export; DCP's metadata, its byte items, extra/rank_N.pt)
    refuses it by name, and the marker never appears. An honest checkpoint still loads,
    numpy RNG state of earlier checkpoints included."""
    import io
    import pickle

    from minihf.utils.safe_load import SafeLoadPlanner, UnsafeCheckpointError

    model, opt, sched, cfg = trained(False)
    ckpt = save_checkpoint(tmp_path / "ckpt", model, opt, sched, extra={"step": 2})
    marker = tmp_path / "marker"
    # extra/rank_0.pt: the resume path
    good_extra = (ckpt / "extra" / "rank_0.pt").read_bytes()
    torch.save({"lr_scheduler": None, "rng": _Payload(marker), "extra": {}}, ckpt / "extra" / "rank_0.pt")
    with pytest.raises(UnsafeCheckpointError, match=r"refusing to load .*rank_0\.pt.*never runs code"):
        load_checkpoint(ckpt, model, opt, sched)
    (ckpt / "extra" / "rank_0.pt").write_bytes(good_extra)
    # model/.metadata: export, eval, generate and resume all read it
    good_meta = (ckpt / "model" / ".metadata").read_bytes()
    (ckpt / "model" / ".metadata").write_bytes(pickle.dumps(_Payload(marker)))
    with pytest.raises(UnsafeCheckpointError, match=r"\.metadata: it asks for posix\.system"):
        export_hf(ckpt, tmp_path / "hf")
    with pytest.raises(UnsafeCheckpointError, match="posix.system"):
        load_checkpoint(ckpt, model, opt, sched)
    (ckpt / "model" / ".metadata").write_bytes(good_meta)
    # a DCP byte item (the optimizer's param_groups are stored as such)
    buf = io.BytesIO()
    torch.save(_Payload(marker), buf)
    buf.seek(0)
    item = type("Item", (), {"dest_index": type("Index", (), {"fqn": "optim.param_groups"})()})()
    with pytest.raises(UnsafeCheckpointError, match="optim.param_groups"):
        SafeLoadPlanner().load_bytes(item, buf)
    assert not marker.exists()
    # the honest checkpoint loads, and so does an extra file holding numpy's RNG state as an
    # ndarray (as checkpoints written before this change do)
    assert load_checkpoint(ckpt, model, opt, sched) == {"step": 2}
    state = {"lr_scheduler": None, "rng": {**capture_rng_state(), "numpy": np.random.get_state()},
             "extra": {"step": 3}}
    torch.save(state, ckpt / "extra" / "rank_0.pt")
    first = draw()
    assert load_checkpoint(ckpt, model, opt, sched) == {"step": 3} and draw() == first


@pytest.mark.parametrize("damage", ["empty", "truncated", "junk", "not_a_dict"])
def test_a_damaged_extra_file_is_named(tmp_path, damage):
    """An empty, truncated or foreign ``extra/rank_0.pt`` is one line naming the file and
    the way out, not a traceback from inside torch."""
    from minihf.utils.files import CorruptFileError

    model, opt, sched, _ = trained(False)
    ckpt = save_checkpoint(tmp_path / "ckpt", model, opt, sched)
    f = ckpt / "extra" / "rank_0.pt"
    if damage == "not_a_dict":
        torch.save([1, 2], f)
    else:
        f.write_bytes({"empty": b"", "truncated": f.read_bytes()[:200], "junk": b"hello world"}[damage])
    with pytest.raises(CorruptFileError, match=r"rank_0\.pt (is empty, truncated or damaged|is not a "
                                               r"minihf extra-state file).*resume an earlier"):
        load_checkpoint(ckpt, model, opt, sched)

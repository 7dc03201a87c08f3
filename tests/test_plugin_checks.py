"""Plug-ins that break the interface, and plug-in state through a checkpoint.

* state round trip: ``minihf.utils.state_json`` gives back what was saved, types included
  (int and tuple keys, tuples, exact floats, tensors and NumPy arrays by their bytes);
  what it cannot hold is refused naming the path; plain-JSON files of earlier versions load
  as they are; a damaged file names itself;
* one line naming the plug-in (``plug-in <key> (<file>:<Class>)``) for: ``hooks()`` of the
  wrong type or with items of the wrong kind, ``validate()`` figures that are not one number
  per row (or named ``reward``), an ``algorithm.plugins`` entry that is a
  function or a non-callable, two plug-ins under one name, state a checkpoint cannot hold
  (when the trainer is built, before step 1, and at a save, before any shard is written),
  and ``load_state_dict`` raising on resume (with the checkpoint file);
* end to end on the driver alone (test_ppo's scripted actor): a run stopped after step 1
  and resumed has its plug-in's state exactly as the uninterrupted run had it.
"""

import json
import math
from collections import OrderedDict
from enum import IntEnum
from pathlib import Path

import numpy as np
import pytest
import torch

from minihf.config import ConfigError
from minihf.trainer.phases import Call, Hook, Phase, Plugin, PluginError, Together, after, apply_hooks, before, wrap
from minihf.utils.files import CorruptFileError
from minihf.utils.state_json import StateError, dumps, encode, loads
from test_ppo import ScriptedActor, job_config


def same(a, b) -> bool:
    """Equal values of the same types all the way down (tensors and arrays: dtype, shape,
    bytes); NaN equals NaN."""
    if type(a) is not type(b):
        return False
    if isinstance(a, torch.Tensor):
        def raw(t):
            return t.contiguous().reshape(-1).view(torch.uint8)
        return (a.dtype, a.shape) == (b.dtype, b.shape) and (a.numel() == 0 or torch.equal(raw(a), raw(b)))
    if isinstance(a, (np.ndarray, np.generic)):
        return a.dtype == b.dtype and np.shape(a) == np.shape(b) and a.tobytes() == b.tobytes()
    if isinstance(a, float):
        return (math.isnan(a) and math.isnan(b)) or (a == b and math.copysign(1, a) == math.copysign(1, b))
    if isinstance(a, (list, tuple)):
        return len(a) == len(b) and all(same(x, y) for x, y in zip(a, b))
    if isinstance(a, dict):
        return list(a) == list(b) and all(same(a[k], b[k]) and same(k, kb) for k, kb in zip(a, b))
    return a == b


def round_trip(state):
    return loads(json.loads(dumps(state)), "driver_state.json", "start fresh")


def test_state_round_trips_exactly():
    state = {"step": 3, "counts": {1: 2, -7: (3, 4.5)}, "pairs": [(1, "a"), [2, None]],
             "by_key": {(0, "x"): True, None: 1, 2.5: "f", False: [], "$not_a_tag": {"$x": 1}},
             "floats": [0.1, 1 / 3, -0.0, 1e-310, float("inf"), float("-inf"), float("nan")],
             "big": 2**80, "text": "ünï", "nested": {"a": {"b": ({1: (2,)},)}},
             "tensors": [torch.arange(6, dtype=torch.bfloat16).reshape(2, 3), torch.tensor(2.5),
                         torch.empty(0, 3), torch.tensor([True, False]), torch.randn(3, 4).t(),
                         torch.tensor([1 + 2j]), torch.tensor([2**62], dtype=torch.int64)],
             "arrays": [np.arange(5, dtype=np.int16), np.float32(1.25), np.int64(-3),
                        np.zeros((2, 0)), np.arange(6.0).reshape(2, 3).T],
             "module": OrderedDict(w=torch.ones(2))}
    back = round_trip(state)
    state["module"] = dict(state["module"])  # an OrderedDict comes back a dict (equal, same order)
    assert same(back, state)
    text = dumps({"kl_ctrl": {"value": 0.1}})  # JSON's own types are written as themselves
    assert json.loads(text)["kl_ctrl"] == {"value": 0.1}


@pytest.mark.parametrize("value, what", [
    ({1, 2}, "is a set"), (np.array([object()]), "NumPy array of dtype object"),
    (torch.zeros(2).to_sparse(), "layout torch.sparse_coo"), (IntEnum("C", "A").A, "a subclass of int"),
    ({(1, frozenset()): 0}, r"\[\(1, frozenset\(\)\)\]\[1\] \(a dict key\) is a frozenset"),
    (object(), "is an object"),
    (torch.empty(2, device="meta"), "meta device")])
def test_state_a_checkpoint_cannot_hold_is_refused_by_path(value, what):
    with pytest.raises(StateError, match=r"^state\['k'\]\[0\].*" + what + ".*may hold only None, bool"):
        encode({"k": [value]})


def test_earlier_plain_json_and_damaged_files():
    old = {"step": 2, "plugins": {"p": {"1": [1, 2], "$tuple": [1]}}}  # written before the encoding
    assert loads(json.loads(json.dumps(old)), "f.json", "fix") == old
    for raw, why in [({"$encoding": "minihf/1", "step": {"$tuple": 1}}, r"\$tuple"),
                     ({"$encoding": "minihf/1", "t": {"$tensor": {"dtype": "float32", "shape": [2],
                                                                  "data": "AAAA"}}}, "3 bytes for shape"),
                     ({"$encoding": "minihf/1", "t": {"$ndarray": {"dtype": "O", "shape": [1],
                                                                   "data": "AAAAAAAAAAA="}}}, "dtype object"),
                     ({"$encoding": "minihf/1", "x": {"$tuple": [], "y": 1}}, "among other keys"),
                     ({"$encoding": "minihf/9", "step": 1}, "written by a newer minihf")]:
        with pytest.raises(CorruptFileError, match=f"^/run/driver_state.json .*{why}.*; start fresh"):
            loads(raw, "/run/driver_state.json", "start fresh")


def probe(hooks=(), state=None, **attrs):
    """A plug-in class named Probe (its label names this file) with these hooks and state."""
    return type("Probe", (Plugin,), {"hooks": lambda self: hooks,
                                     "state_dict": lambda self: state if state is not None else {},
                                     "__init__": lambda self, ctx=None: None, **attrs})


def noop(ctx, batch, metrics):
    return None


PROGRAMS = {"step": [Phase("gen", noop), Together((Call("values", "critic", "compute_values"),)),
                     Phase("adv", noop)]}
LABEL = r"plug-in Probe \(.*test_plugin_checks.py:Probe\): "


@pytest.mark.parametrize("hooks, match", [
    (after("gen", Phase("x", noop)), r"hooks\(\) returned Hook .*return a list of Hooks made with before/after"),
    (None, r"hooks\(\) returned NoneType None; return a list of Hooks"),
    ([Phase("x", noop)], r"hooks\(\)\[0\] is Phase .*not a Hook; return a list of Hooks"),
    ([before("gen", noop)], r"hooks\(\)\[0\] = before\('gen', \.\.\.\) got function .*before takes a Phase whose"),
    ([after("adv", Phase("x", "not a function"))],
     r"hooks\(\)\[0\] = after\('adv', \.\.\.\) got Phase .*; after takes a Phase whose run is a function"),
    ([wrap("adv", Phase("x", noop))],
     r"hooks\(\)\[0\] = wrap\('adv', \.\.\.\) got Phase .*wrap takes a function fn\(ctx, batch"),
    ([Hook("around", "adv", noop)], r"hooks\(\)\[0\] is Hook\('around', 'adv'\); make it with one of \['before'"),
    ([wrap("values", lambda *a: None)], r"phase 'values' is a remote call sent with others"),
    ([before("nope", Phase("x", noop))], r"no phase 'nope' to before; phases: \['gen', 'adv', 'values'\]")])
def test_hooks_of_the_wrong_kind_name_the_plugin(hooks, match):
    with pytest.raises(PluginError, match="^" + LABEL + match):
        apply_hooks(PROGRAMS, [probe(hooks)()])


@pytest.mark.parametrize("figures, match", [
    ([0.0, 1.0], r"validate\(out\) returned list \[0.0, 1.0\]; return a dict of figure name -> one number"),
    ({"reward": [0.0, 1.0]}, r"validate\(out\) has a figure named 'reward'; name it with a str other than"),
    ({"cost": [0.0]}, r"validate\(out\)\['cost'\] is list \[0.0\]; give one number per row of out \(2 rows\)"),
    ({"cost": 0.5}, r"validate\(out\)\['cost'\] is float 0.5; give one number per row")])
def test_validation_figures_of_the_wrong_shape_name_the_plugin(figures, match):
    from minihf.protocol import Batch
    from minihf.trainer.phases import plugin_figures

    out = Batch({"responses": torch.zeros(2, 3)})
    assert plugin_figures(probe(validate=lambda self, out: {"cost": [0.0, 1.0]})(), out) == {"cost": [0.0, 1.0]}
    with pytest.raises(PluginError, match="^" + LABEL + match):
        plugin_figures(probe(validate=lambda self, out: figures)(), out)


ENTRIES = '''
from minihf.trainer.phases import Plugin

def a_function(ctx):
    return []

NOT_CALLABLE = 3

class First(Plugin):
    name = "same"

class Second(Plugin):
    name = "same"

class Unnamed(Plugin):
    name = 7

class Baseline(Plugin):
    name = "reward_baseline"
'''


def test_plugin_entries_that_are_not_plugin_classes_or_share_a_name(tmp_path):
    from minihf.config import load_config
    from minihf.trainer.plugins import plugin_classes
    from minihf.trainer.ppo_job import PPOJobConfig

    f = tmp_path / "entries.py"
    f.write_text(ENTRIES)

    def fails(match, *refs, **kw):
        cfg = load_config(PPOJobConfig, "grpo", [f"algorithm.plugins=[{', '.join(refs)}]"] +
                          [f"{k}={v}" for k, v in kw.items()])
        with pytest.raises(ConfigError, match=match):
            plugin_classes(cfg)
    fails(r"^algorithm.plugins\[0\]='.*entries.py:a_function' is not a Plugin subclass \(it is a function\); "
          "make it a class that subclasses minihf.trainer.phases.Plugin", f"{f}:a_function")
    fails(r"^algorithm.plugins\[1\]='.*entries.py:NOT_CALLABLE': 'NOT_CALLABLE' in .* is a int, not a plug-in "
          "class", f"{f}:First", f"{f}:NOT_CALLABLE")
    fails(r"^algorithm.plugins\[0\]=.*Unnamed': its name is 7; set the class attribute name",
          f"{f}:Unnamed")
    fails(r"^algorithm.plugins: plug-in same \(.*entries.py:Second\) and plug-in same \(.*entries.py:First\) "
          "have the same name 'same'; ", f"{f}:First", f"{f}:Second")
    fails(r"plug-in same \(.*entries.py:First\) .* the same name 'same' \(listed twice\)", f"{f}:First", f"{f}:First")
    fails(r"plug-in reward_baseline \(.*entries.py:Baseline\) and plug-in reward_baseline "
          r"\(minihf.trainer.plugins.baseline:RewardBaseline\) have the same name", f"{f}:Baseline",
          **{"algorithm.adv_estimator": "remax"})


class Keeper(Plugin):
    """Counts rewards per step in state with int keys and tuples, as a plug-in might."""
    name = "keeper"
    fail_load = False

    def __init__(self, ctx):
        super().__init__(ctx)
        self.seen = {}

    def hooks(self):
        return [after("reward", Phase("keep", self.keep, timed=False))]

    def keep(self, ctx, batch, metrics):
        scores = batch["token_level_scores"].sum(-1)
        self.seen[ctx.step] = (len(batch), float(scores.sum()), torch.tensor([ctx.step, 2 * ctx.step]))

    def state_dict(self):
        return {"seen": self.seen, "last": max(self.seen, default=None)}

    def load_state_dict(self, state):
        if self.fail_load:
            raise KeyError("seen_v2")
        self.seen = state["seen"]


class SetKeeper(Keeper):
    """State that becomes a set after step 1: caught at the first save, naming the plug-in."""
    name = "set_keeper"

    def state_dict(self):
        return {"seen": self.seen, "steps": set(self.seen)} if self.seen else {}


class SavingActor(ScriptedActor):
    """The scripted actor with checkpoints that record what was asked."""

    def __init__(self):
        self.saved, self.loaded = [], []

    def init_model(self, *args):
        pass

    def save_checkpoint(self, path):
        Path(path).mkdir(parents=True)
        self.saved.append(path)

    def load_checkpoint(self, path):
        self.loaded.append(path)


def trainer(cfg, plugin):
    from minihf.trainer.ppo import PPOTrainer

    class WithPlugin(PPOTrainer):  # the plug-in as algorithm.plugins would add it
        def __init__(self, cfg, groups, log):
            import minihf.trainer.ppo as ppo

            classes = ppo.plugin_classes
            ppo.plugin_classes = lambda cfg: classes(cfg) + [plugin]
            try:
                super().__init__(cfg, groups, log)
            finally:
                ppo.plugin_classes = classes
    actor = SavingActor()
    return WithPlugin(cfg, {"actor": actor}, log=lambda *a: None), actor


def test_plugin_state_resumes_exactly_and_bad_state_stops_early(tiny_job, tmp_path):  # noqa: F811
    model, data = tiny_job
    opts = {"trainer.total_training_steps": 2, "trainer.save_freq": 1, "trainer.test_freq": -1,
            "trainer.val_before_train": "false", "trainer.logger": "[]"}
    cfg = job_config(model, data, tmp_path / "run", "grpo", **opts)
    first, _ = trainer(cfg, Keeper)
    first.fit(stop_after=1)
    saved = first.plugins[-1].state_dict()
    assert list(saved["seen"]) == [1] and isinstance(saved["seen"][1], tuple)
    resumed, actor = trainer(cfg, Keeper)
    resumed.fit(stop_after=0)
    assert actor.loaded and same(resumed.plugins[-1].state_dict(), saved)  # int keys, tuples, tensors

    # a file as minihf wrote it before the encoding (plain JSON) still resumes, read as it is
    state_file = tmp_path / "run" / "global_step_1" / "driver_state.json"
    text = state_file.read_text()
    old = json.loads(text)
    del old["$encoding"]
    old["plugins"]["keeper"] = {"seen": {"1": [8, 0.5]}, "last": 1}
    state_file.write_text(json.dumps(old))
    resumed, _ = trainer(cfg, Keeper)
    resumed.fit(stop_after=0)
    assert resumed.plugins[-1].seen == {"1": [8, 0.5]} and resumed.loader.state_dict() == old["loader"]
    state_file.write_text(text)

    Keeper.fail_load = True
    try:
        with pytest.raises(StateError, match=r"^cannot resume from .*global_step_1/driver_state.json: plug-in "
                                             r"keeper \(.*test_plugin_checks.py:Keeper\): load_state_dict\(\) "
                                             r"raised KeyError: 'seen_v2' on the state saved for it; .*; or start "
                                             "fresh with trainer.resume_mode=disable"):
            trainer(cfg, Keeper)[0].fit(stop_after=0)
    finally:
        Keeper.fail_load = False

    # not encodable when built: before any model loads, naming the plug-in and the path
    bad = type("Bad", (Keeper,), {"name": "bad", "state_dict": lambda self: {"w": [np.array([None])]}})
    with pytest.raises(StateError, match=r"^plug-in bad \(.*test_plugin_checks.py:Bad\): state_dict\(\)\['w'\]"
                                         r"\[0\] is a NumPy array of dtype object"):
        trainer(job_config(model, data, tmp_path / "bad", "grpo", **opts), bad)
    # becomes a set at step 1: the save stops the run naming it, before any shard or marker
    cfg = job_config(model, data, tmp_path / "later", "grpo", **opts)
    late, actor = trainer(cfg, SetKeeper)
    with pytest.raises(StateError, match=r"^plug-in set_keeper \(.*:SetKeeper\): state_dict\(\)\['steps'\] "
                                         "is a set, which a checkpoint cannot hold"):
        late.fit()
    assert actor.saved == [] and not (tmp_path / "later" / "latest_checkpointed_iteration.txt").exists()

"""Inputs a reviewer broke by hand (issue 54, round 3), each refused or reported in one line:

* YAML: an alias bomb ("billion laughs") as a recipe, an override value or a planner
  profile; aliases a recipe really uses still load (``minihf.utils.yaml_load``);
* the launcher: ``--nproc-per-node`` past what the node can start, ``--rdzv-endpoint`` with
  port 0 (or no host, or one that does not resolve), and a multi-node job whose peer never
  comes (a waiting line, then which side was missing; ``minihf.controller.rendezvous``);
* the planner: ``--devices`` past what it can enumerate, ``--measure`` with more ranks
  than the machine holds, broken profile files;
* a placement that leaves ranks without a role (a warning naming them);
* bad values in a model's ``config.json`` (zeros, negatives, strings, heads that do not
  divide), through ``load_args`` and ``minihf plan``.

Anything that could hang or start processes on the code before these checks runs in a
subprocess with a deadline, or is ordered so that the old code fails fast instead.
"""

import contextlib
import io
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest
from typer.testing import CliRunner

from minihf.cli import app
from minihf.controller import Worker, register
from minihf.testing import free_port, spawn_ranks

ROOT = Path(__file__).resolve().parents[1]
BOMB = "\n".join([
    "# each list holds the one above it nine times",
    'a: &a ["lol","lol","lol","lol","lol","lol","lol","lol","lol"]',
    *[f"{n}: &{n} [{','.join([f'*{p}'] * 9)}]" for p, n in zip("abcdefgh", "bcdefghi")],
    "trainer:",
    "  project_name: *i",
]) + "\n"  # 12 lines standing for 9**9 = 387 million strings


def cli(*args, timeout=60, **env):
    """``python -m minihf.cli ARGS``: (exit code, stdout, stderr); killed after ``timeout``."""
    full = {**os.environ, "OMP_NUM_THREADS": "1", **env}  # COLUMNS: conftest's wide_terminal
    proc = subprocess.Popen([sys.executable, "-m", "minihf.cli", *map(str, args)], cwd=ROOT, env=full,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        out, err = proc.communicate(timeout=timeout)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()
    return proc.returncode, out, err


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    from minihf.hub import init_model

    path = tmp_path_factory.mktemp("inputs") / "m"
    init_model(path, size="tiny", task="sort")
    return path


# ---------------------------------------------------------------------------- YAML


def test_a_yaml_alias_bomb_recipe_is_refused_fast_naming_the_file(tmp_path):
    from minihf.config import ConfigError, load_config
    from minihf.trainer.ppo_job import PPOJobConfig

    bomb = tmp_path / "bomb.yaml"
    bomb.write_text(BOMB)
    assert len(BOMB.splitlines()) == 12
    code, out, err = cli("config", "show", bomb)  # it ran for minutes, growing to gigabytes
    assert code != 0 and f"recipe {bomb}: its aliases (*name) expand to more than 100,000 values" in out + err, \
        out + err
    t0 = time.monotonic()
    with pytest.raises(ConfigError, match=r"bomb.yaml: its aliases \(\*name\) expand to more than"):
        load_config(PPOJobConfig, bomb)
    assert time.monotonic() - t0 < 2


def test_aliases_that_do_not_explode_still_load_and_loops_are_refused(tmp_path):
    from minihf.config import ConfigError, load_config, parse_value
    from minihf.trainer.ppo_job import PPOJobConfig
    from minihf.utils.yaml_load import YAMLInputError, load_yaml

    cfg = load_config(PPOJobConfig, "safe_rlhf")  # `cost_critic: *critic`
    assert cfg.cost_critic.model.path == cfg.critic.model.path
    with pytest.raises(YAMLInputError, match=r"x.yaml: an alias refers to the node that contains it"):
        load_yaml("a: &x [1, *x]\n", "x.yaml")
    merge = "a: &a {k0: 1, k1: 1, k2: 1, k3: 1, k4: 1, k5: 1, k6: 1}\n" + "".join(
        f"{n}: &{n} {{<<: [{', '.join([f'*{p}'] * 7)}]}}\n" for p, n in zip("abcde", "bcdef"))
    with pytest.raises(YAMLInputError, match="expand to more than"):  # merge keys (<<) count too
        load_yaml(merge, "merge.yaml")
    value = "[" + ", ".join(["&a [1, 1, 1, 1, 1, 1, 1, 1, 1]"] + [
        f"&{n} [{', '.join([f'*{p}'] * 9)}]" for p, n in zip("abcdef", "bcdefg")]) + "]"
    with pytest.raises(ConfigError, match=r"^value '\[&a \[1, 1, .*: its aliases \(\*name\) expand to more than"):
        parse_value(value)  # an override's value goes through the same loader
    bad = tmp_path / "bad.yaml"
    bad.write_text("trainer: [1,\n")
    with pytest.raises(ConfigError, match=r"^cannot parse recipe .*bad.yaml as YAML: .* at line \d+, column \d+$"):
        load_config(PPOJobConfig, bad)


def test_a_key_twice_in_one_mapping_is_refused_naming_both_lines(tmp_path):
    """PyYAML keeps the last of two equal keys: a second ``data:`` appended to a recipe threw
    the first away without a word. Now one line naming the key and both lines; a merge key's
    keys may still be overridden, and equal keys in different mappings are not duplicates."""
    from minihf.config import ConfigError, load_config, parse_value
    from minihf.trainer.ppo_job import PPOJobConfig
    from minihf.utils.yaml_load import load_yaml

    recipe = tmp_path / "twice.yaml"
    recipe.write_text("base: grpo\ndata:\n  train_batch_size: 8\ntrainer:\n  total_training_steps: 2\n"
                      "data:\n  max_response_length: 16\n")
    code, out, err = cli("config", "show", recipe)
    assert code != 0 and (f"recipe {recipe}: the key 'data' appears twice in one mapping (lines 2 and 6); YAML "
                          "would keep only the second, so merge the two") in out + err, out + err
    with pytest.raises(ConfigError, match=r"the key 'lr' appears twice in one mapping \(lines 1 and 1\)"):
        parse_value("{lr: 1, lr: 2}")
    assert load_yaml("a: &a {x: 1, y: 1}\nb:\n  <<: *a\n  x: 2\nc: [{k: 1}, {k: 2}]\n", "ok.yaml") == {
        "a": {"x": 1, "y": 1}, "b": {"x": 2, "y": 1}, "c": [{"k": 1}, {"k": 2}]}
    assert load_config(PPOJobConfig, "safe_rlhf").cost_critic is not None  # a shipped recipe with aliases


def test_a_number_with_underscores_is_text_unless_the_key_is_a_number():
    """YAML 1.1 reads 0.5_2 as the number 0.52: rollout correction's IcePop window
    'lower_upper' became a truncation cap below 1, accepted without a word. Read as YAML
    1.2 does (no digit separators): the text, which a number key still reads as a number."""
    from minihf.config import load_config
    from minihf.trainer.ppo_job import PPOJobConfig
    from minihf.utils.yaml_load import load_yaml

    assert load_yaml("a: 0.5_2\nb: 1_000\nc: 1e-6\nd: 0.52\ne: 7\n", "x") == {
        "a": "0.5_2", "b": "1_000", "c": 1e-6, "d": 0.52, "e": 7}
    cfg = load_config(PPOJobConfig, "grpo", [
        "trainer.total_training_steps=1_000", "actor_rollout_ref.actor.optim.lr=1_0.5e-3",
        "algorithm.rollout_correction.rollout_is=token", "algorithm.rollout_correction.rollout_is_threshold=0.5_2"])
    assert cfg.trainer.total_training_steps == 1000 and cfg.actor_rollout_ref.actor.optim.lr == 10.5e-3
    assert cfg.algorithm.rollout_correction.rollout_is_threshold == "0.5_2"  # lower 0.5, upper 2


# ---------------------------------------------------------------------------- launcher


def test_nproc_per_node_past_the_node_is_one_line_before_anything_loads():
    from minihf.launcher import check_launch, max_local_ranks

    most, why = max_local_ranks()
    with pytest.raises(ValueError, match=rf"--nproc-per-node 1000000 is more than this node can start: .*"
                                         rf"use --nproc-per-node {most} or fewer"):
        check_launch(1000000)
    assert "GB available" in why and "cores" in why  # the bound on CPU, and why ranks past the cores run
    check_launch(2)  # two CPU ranks on any machine: the tests run four on two cores
    # the launch options are checked before the config is loaded (a bad key here, so the
    # code before this check failed on the config instead of starting a million ranks)
    res = CliRunner().invoke(app, ["train", "--nproc-per-node", "1000000", "trainer.nope=1"])
    assert res.exit_code == 2 and "--nproc-per-node 1000000 is more than this node can start" in res.output, \
        res.output


def test_nproc_per_node_is_one_rank_per_gpu_on_cuda(monkeypatch):
    import torch

    from minihf.launcher import check_launch, max_local_ranks

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 8)
    assert max_local_ranks()[0] == 8 and "GB available" in max_local_ranks(cpu=True)[1]
    with pytest.raises(ValueError, match=r"--nproc-per-node 9 .*each rank drives one GPU .* this node has 8"):
        check_launch(9)
    check_launch(8)


@pytest.mark.parametrize("endpoint, message", [
    ("127.0.0.1:0", r"port 0 is not a TCP port 1..65535 \(0 asks the OS for any free port"),
    ("127.0.0.1:65536", r"port 65536 is not a TCP port 1..65535"),
    (":29500", r"give HOST:PORT"),
    ("127.0.0.1", r"give HOST:PORT"),
    ("127.0.0.1:http", r"give HOST:PORT"),
    ("no-such-host.invalid:29500", r"host 'no-such-host.invalid' does not resolve"),
])
def test_a_bad_rendezvous_endpoint_is_one_line(endpoint, message):
    from minihf.launcher import check_launch

    with pytest.raises(ValueError, match=rf"--rdzv-endpoint '{endpoint}': {message}"):
        check_launch(1, 2, 0, endpoint)
    if endpoint == "127.0.0.1:0":  # its ranks waited 10 minutes, then printed C++ stacks
        res = CliRunner().invoke(app, ["train", "--rdzv-endpoint", endpoint, "trainer.nope=1"])
        assert res.exit_code == 2 and "port 0 is not a TCP port" in res.output, res.output
    check_launch(1, 2, 1, "[::1]:29500")
    check_launch(1, 2, 1, "localhost:29500")


def test_a_node_whose_peer_never_comes_says_so_and_gives_up_in_one_line():
    """Node 0 alone, and node 1 alone, of --nnodes 2 (controller.timeout_s=8): each says
    whom it waits for, then which side did not come; no C++ stack, no traceback."""
    args = ["train", "--nnodes", "2", "--rdzv-endpoint"]
    env = {k: v for k, v in os.environ.items() if k != "OMP_NUM_THREADS"}
    procs = [subprocess.Popen([sys.executable, "-m", "minihf.cli", *args, f"127.0.0.1:{free_port()}",
                               "--node-rank", str(rank), "controller.timeout_s=8"], cwd=ROOT, env=env,
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for rank in (0, 1)]
    results = []
    try:
        for p in procs:
            results.append((p.communicate(timeout=45)[1], p.returncode))
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.communicate()
    (err0, code0), (err1, code1) = results
    assert code0 == 1 and "node 0 of --nnodes 2: waiting for the other node(s) to join at 127.0.0.1:" in err0, err0
    assert "the nodes did not meet: node 0 waited controller.timeout_s=8 s" in err0, err0
    assert code1 == 1 and "node 1 of --nnodes 2: waiting for node 0 at 127.0.0.1:" in err1, err1
    assert "the nodes did not meet: node 0 did not answer at 127.0.0.1:" in err1, err1
    for err in (err0, err1):
        assert "Traceback" not in err and "frame #" not in err and len(err.splitlines()) <= 4, err


# ---------------------------------------------------------------------------- planner


def test_plan_on_more_devices_than_it_can_enumerate_is_refused_at_once(model_dir):
    code, out, err = cli("plan", "ppo", "--devices", "1000000", "--profile", "H100", "--model", f"all={model_dir}")
    assert code == 2, out + err  # it ran CPU-bound without a line
    assert "--devices 1000000 --unit 1: 1e+06 placements of the 2 roles (actor, critic)" in err, err
    assert "over the planner's bound of 100,000" in err and "with 1000000 / U <=" in err, err


def test_a_long_search_reports_progress_and_the_suggested_unit_fits():
    from minihf.planner import DeviceProfile, search
    from minihf.planner.job import Role, Workload
    from minihf.planner.search import MAX_PLACEMENTS, check_size, placement_count

    class Shape:  # what the cost model reads of a model, round numbers
        params, layers, hidden, kv_dim, vocab, ffn, heads, kv_heads, largest_block, tied = (
            4000, 2, 20, 10, 50, 40, 4, 2, 1000, False)
        shapes = (("model.layers.0.mlp.gate_proj.weight", (80, 50)),)

        def kv_bytes_per_token(self, itemsize):
            return 2 * self.layers * self.kv_dim * itemsize

    roles = (Role("actor", Shape(), True, mini_batch=7), Role("critic", Shape(), True, mini_batch=7))
    w = Workload(7, 1, 10, 6, False, True, True, roles)
    profile = DeviceProfile("t", 1e11, 1e12, 1e11, 1e10, 1e9)
    calls = []
    result = search(w, 2500, profile, progress=lambda done, total: calls.append((done, total)))
    assert calls == [(1000, 2500), (2000, 2500)] and result.considered >= 2500
    with pytest.raises(ValueError, match=r"--devices 1000000 --unit 1: .* with 1000000 / U <= (\d+)") as exc:
        check_size(w, 1000000)
    most = int(exc.value.args[0].split("/ U <= ")[1].split()[0])
    assert placement_count(w, most) <= MAX_PLACEMENTS < placement_count(w, most + 1)


def test_measure_with_more_ranks_than_the_machine_holds_is_refused(monkeypatch):
    import minihf.planner

    def never(*a, **k):  # the code before the check started this many processes
        raise AssertionError("measure() started")
    monkeypatch.setattr(minihf.planner, "measure", never)
    res = CliRunner().invoke(app, ["plan", "--measure", "--devices", "1000000"])
    assert res.exit_code == 2 and "more than it can" in res.output and "--devices" in res.output, res.output


GOOD_PROFILE = ("name: t\nmemory_bytes: 8.0e+10\nflops: 1.0e+14\nmemory_bandwidth: 1.0e+12\n"
                "intra_node_bandwidth: 1.0e+11\ninter_node_bandwidth: 1.0e+10\n")


@pytest.mark.parametrize("text, message", [
    ("name: [t\nflops: 1\n", r"cannot parse profile .*p.yaml as YAML: .* at line 2, column \d+"),
    ("42\n", r"profile .*p.yaml must be a mapping of keys .* got int 42"),
    ("- 1\n- 2\n", r"profile .*p.yaml must be a mapping of keys .* got list"),
    ("", r"profile .*p.yaml must be a mapping of keys .* it is empty"),
    (GOOD_PROFILE.replace("flops: 1.0e+14", "flops: fast"), r"profile .*p.yaml: flops: expected float, got 'fast'"),
    (GOOD_PROFILE + "devices_per_node: 8.5\n", r"profile .*p.yaml: devices_per_node: expected int, got 8.5"),
    (GOOD_PROFILE + "devices_per_node: 0\n", r"profile .*p.yaml: profile 't': devices_per_node must be >= 1, got 0"),
    (GOOD_PROFILE + "bytes_per_param: 3\n", r"profile .*p.yaml: .*bytes_per_param must be 2 \(bf16\) or 4"),
    (GOOD_PROFILE + "comm_overlaps_compute: maybe\n", r"comm_overlaps_compute: expected bool, got 'maybe'"),
    (GOOD_PROFILE.replace("name: t", "name: 7"), None),  # a number for a name is fine: it is a label
    (GOOD_PROFILE + BOMB.replace("trainer:\n  project_name: *i\n", "source: *i\n"), r"p.yaml: its aliases"),
])
def test_a_broken_profile_file_is_one_line_naming_the_file_and_key(tmp_path, text, message):
    from minihf.planner import load_profile

    path = tmp_path / "p.yaml"
    path.write_text(text)
    if message is None:
        assert load_profile(str(path)).name == "7"
        return
    with pytest.raises(ValueError, match=message) as exc:
        load_profile(str(path))
    assert "\n" not in str(exc.value)


def test_a_broken_profile_through_minihf_plan_is_one_line(tmp_path, model_dir):
    (tmp_path / "p.yaml").write_text("42\n")
    res = CliRunner().invoke(app, ["plan", "ppo", "--devices", "2", "--profile", str(tmp_path / "p.yaml"),
                                   "--model", f"all={model_dir}"])
    assert res.exit_code == 2 and res.output.startswith("error: profile ") and len(res.output.splitlines()) == 1, \
        res.output


# ---------------------------------------------------------------------------- placement


class Echo(Worker):
    @register()
    def ping(self):
        return self.rank


def _placed_on_rank0(rank, world):
    from minihf.controller import Role, run
    from minihf.controller.config import ControllerConfig

    out = {}
    for name, placement in (("idle", {"echo": {"ranks": [0]}}), ("full", {"echo": {"ranks": [0, 1]}})):
        buf = io.StringIO()
        with contextlib.redirect_stderr(buf):
            run(lambda groups: groups["echo"].ping(), {"echo": Role(Echo)}, ControllerConfig(placement=placement))
        out[name] = buf.getvalue()
    return out


def test_a_placement_that_leaves_a_rank_without_a_role_warns_naming_it():
    from minihf.controller.config import idle_ranks
    from minihf.controller.layout import RoleLayout

    layouts = {"actor": RoleLayout("actor", (0, 1), 1), "critic": RoleLayout("critic", (2,), 1)}
    assert idle_ranks(layouts, 5) == [3, 4] and idle_ranks(layouts, 3) == []
    assert idle_ranks({"critic": RoleLayout("critic", (1,), 1)}, 2) == []  # rank 0 runs the driver
    rank0, rank1 = spawn_ranks(_placed_on_rank0, 2, timeout_s=120)
    assert "warning: controller.placement leaves rank(s) [1] of 2 with no role (echo [0])" in rank0["idle"], rank0
    assert rank0["full"] == "" and rank1 == {"idle": "", "full": ""}, (rank0, rank1)


# ---------------------------------------------------------------------------- config.json


@pytest.mark.parametrize("change, message", [
    ({"num_hidden_layers": 0}, r"num_hidden_layers=0 must be a whole number >= 1 \(decoder layers\)"),
    ({"hidden_size": 0}, r"hidden_size=0 must be a whole number >= 1"),
    ({"num_attention_heads": 0}, r"num_attention_heads=0 must be a whole number >= 1"),
    ({"vocab_size": 0}, r"vocab_size=0 must be a whole number >= 1"),
    ({"intermediate_size": -8}, r"intermediate_size=-8 must be a whole number >= 1"),
    ({"num_hidden_layers": "2"}, r"num_hidden_layers='2' must be a whole number >= 1 .*a string"),
    ({"max_position_embeddings": 0}, r"max_position_embeddings=0 must be a whole number >= 1"),
    ({"num_key_value_heads": 3}, r"num_attention_heads=4 is not a multiple of num_key_value_heads=3"),
    ({"head_dim": 7}, r"head_dim=7, which must be even"),
    ({"hidden_size": 2, "head_dim": None}, r"hidden_size=2 // num_attention_heads=4 gives head_dim=0"),
    ({"rms_norm_eps": -1e-6}, r"rms_norm_eps=-1e-06 must be a number > 0"),
    ({"num_hidden_layers": None}, r"has no num_hidden_layers \(decoder layers\)"),
])
def test_bad_config_json_values_are_one_line_naming_file_key_and_value(model_dir, tmp_path, change, message):
    from minihf.models import load_args
    from minihf.planner import model_shape

    bad = tmp_path / "bad"
    shutil.copytree(model_dir, bad)
    cfg = {**json.loads((model_dir / "config.json").read_text()), **change}
    (bad / "config.json").write_text(json.dumps({k: v for k, v in cfg.items() if v is not None}))
    pattern = rf"{bad / 'config.json'}.* {message}.*(fix that value in|add it to) config.json"
    with pytest.raises(ValueError, match=pattern):
        load_args(bad)
    with pytest.raises(ValueError, match=pattern):  # the planner reads shapes the same way
        model_shape(str(bad))


def test_a_bad_config_json_through_minihf_plan_is_one_line(model_dir, tmp_path):
    bad = tmp_path / "bad"
    shutil.copytree(model_dir, bad)
    cfg = json.loads((model_dir / "config.json").read_text())
    (bad / "config.json").write_text(json.dumps({**cfg, "num_hidden_layers": 0}))
    res = CliRunner().invoke(app, ["plan", "ppo", "--devices", "2", "--profile", "H100", "--model", f"all={bad}"])
    assert res.exit_code == 2 and len(res.output.splitlines()) == 1, res.output  # was "max() arg is an empty sequence"
    assert "config.json: num_hidden_layers=0 must be a whole number >= 1" in res.output, res.output


def test_sampling_params_refuse_a_temperature_that_is_not_a_finite_number():
    from minihf.rollout import SamplingParams

    for bad in (float("nan"), float("inf"), -0.5, "0.5", None, True):
        with pytest.raises(ValueError, match="temperature must be a finite number >= 0"):
            SamplingParams(temperature=bad)
    assert SamplingParams(temperature=0.0).temperature == 0.0

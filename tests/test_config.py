"""Tests for minihf.config: layering, type checks, error messages, placement resolution."""

import re
from dataclasses import dataclass, field
from typing import Literal, Optional

import pytest

from minihf.config import (ConfigError, apply_override, dump_yaml, find_recipe, from_dict,
                           load_config, parse_value, split_cli_args, to_dict)
from minihf.controller.config import ControllerConfig, RoleSpec, resolve_placement
from minihf.controller.layout import RoleLayout


# A small tree composed the way job configs are: sections declared separately, nested.
@dataclass
class OptimConfig:
    lr: float = 1e-5
    betas: tuple[float, float] = (0.9, 0.999)
    warmup_steps: int = 0

    def __post_init__(self):
        if not self.lr > 0:
            raise ValueError(f"lr must be > 0, got {self.lr}")


@dataclass
class ActorConfig:
    optim: OptimConfig = field(default_factory=OptimConfig)
    loss_agg: Literal["token-mean", "seq-mean"] = "token-mean"
    clip: Optional[float] = None
    use_kl: bool = False
    micro_batches: list[int] = field(default_factory=lambda: [1, 2])


@dataclass
class RootConfig:
    name: str = "run"
    ref: Optional[OptimConfig] = None
    actor: ActorConfig = field(default_factory=ActorConfig)
    # A non-default section default: partial overrides must start from it.
    critic_optim: OptimConfig = field(default_factory=lambda: OptimConfig(lr=3e-4, warmup_steps=7))
    controller: ControllerConfig = field(default_factory=ControllerConfig)
    extra: dict[str, int] = field(default_factory=lambda: {"a": 1})


@pytest.fixture
def recipes(tmp_path):
    d = tmp_path / "recipes" / "demo"
    d.mkdir(parents=True)
    (d / "config.yaml").write_text(
        "name: demo\n"
        "actor:\n  optim:\n    lr: 2e-6\n  use_kl: true\n"
        "critic_optim:\n  lr: 1.0e-3\n"
        "extra:\n  b: 2\n")
    return tmp_path / "recipes"


def test_defaults_recipe_overrides_precedence(recipes):
    cfg = load_config(RootConfig)
    assert cfg == RootConfig()
    cfg = load_config(RootConfig, "demo", recipes_dir=recipes)
    assert cfg.name == "demo" and cfg.actor.optim.lr == 2e-6 and cfg.actor.use_kl is True
    assert cfg.actor.optim.betas == (0.9, 0.999)  # untouched defaults survive
    # The section default (lr=3e-4, warmup 7) is the base, the recipe changes only lr.
    assert cfg.critic_optim == OptimConfig(lr=1e-3, warmup_steps=7)
    assert cfg.extra == {"a": 1, "b": 2}  # dicts merge key by key
    cfg = load_config(RootConfig, "demo", [
        "actor.optim.lr=1e-6", "actor.use_kl=false", "actor.clip=0.2", "actor.micro_batches=[4]",
        "actor.optim.betas=[0.8, 0.9]", "~extra.a", "extra.c=3", "controller.backend=gloo",
        "name=2024",
    ], recipes_dir=recipes)
    assert cfg.actor.optim.lr == 1e-6 and isinstance(cfg.actor.optim.lr, float)
    assert cfg.actor.use_kl is False and cfg.actor.clip == 0.2
    assert cfg.actor.micro_batches == [4] and cfg.actor.optim.betas == (0.8, 0.9)
    assert cfg.extra == {"b": 2, "c": 3} and cfg.controller.backend == "gloo"
    assert cfg.name == "2024"
    assert load_config(RootConfig, None, ["actor.clip=0.1", "actor.clip=null"]).actor.clip is None
    # Recipes can also be given as a directory or a file path.
    assert load_config(RootConfig, recipes / "demo").name == "demo"
    assert load_config(RootConfig, recipes / "demo" / "config.yaml").name == "demo"


def test_a_recipe_builds_on_a_base_and_says_where_each_value_came_from(recipes, tmp_path, monkeypatch):
    from minihf.config import load_config_sources, recipe_layers
    from minihf.cli.config_help import show

    (recipes / "child").mkdir()
    (recipes / "child" / "config.yaml").write_text("base: demo\nactor:\n  use_kl: false\n  clip: 0.1\n")
    (recipes / "grandchild").mkdir()
    (recipes / "grandchild" / "config.yaml").write_text("base: child\nextra:\n  c: 3\n")
    cfg, sources = load_config_sources(RootConfig, "grandchild", ["actor.optim.lr=5e-6"], recipes_dir=recipes)
    assert cfg.name == "demo" and cfg.critic_optim.lr == 1e-3            # from the base's base
    assert cfg.actor.use_kl is False and cfg.actor.clip == 0.1           # the child's changes win
    assert cfg.extra == {"a": 1, "b": 2, "c": 3}                         # dicts merge through the chain
    assert cfg.actor.optim.lr == 5e-6
    assert [label for label, _ in recipe_layers("grandchild", recipes)] == ["demo", "child", "grandchild"]
    assert sources["name"] == "demo" and sources["actor.clip"] == "child"
    assert sources["extra.c"] == "grandchild" and sources["actor.optim.lr"] == "command line"
    text = show(cfg, sources)
    assert "name: demo" in text and "(changed in demo)" in text.split("name: demo")[1].splitlines()[0]
    assert "(changed on the command line)" in text.split("lr: 5.0e-06")[1].splitlines()[0]
    assert "(set in child)" in text.split("use_kl: false")[1].splitlines()[0]  # equals the default
    # a base beside the recipe wins over ./recipes of the working directory
    monkeypatch.chdir(tmp_path)
    (tmp_path / "recipes" / "demo" / "config.yaml").write_text("name: local\n")  # recipes == ./recipes here
    assert load_config(RootConfig, "child", recipes_dir=recipes).name == "local"
    other = tmp_path / "elsewhere" / "x"
    other.mkdir(parents=True)
    (other / "config.yaml").write_text("base: ../../recipes/child\nname: x\n")   # a path to a base
    assert load_config(RootConfig, other).actor.clip == 0.1


@pytest.mark.parametrize("text, message", [
    ("base: nowhere\n", r"base 'nowhere': recipe 'nowhere' not found"),
    ("base: [demo]\n", r"base=\['demo'\] must name a recipe \(e.g. base: grpo\)"),
    ("base: loop\n", r"recipe bases loop: .*loop/config.yaml -> .*loop/config.yaml; one of them"),
])
def test_bad_recipe_bases_are_one_line(recipes, text, message):
    (recipes / "loop").mkdir()
    (recipes / "loop" / "config.yaml").write_text(text)
    with pytest.raises(ConfigError, match=message):
        load_config(RootConfig, "loop", recipes_dir=recipes)


def test_yaml_scalar_typing():
    assert parse_value("1e-6") == 1e-6 and isinstance(parse_value("3E5"), float)
    assert parse_value("true") is True and parse_value("null") is None
    assert parse_value("[1,2]") == [1, 2] and parse_value("7") == 7 and parse_value("abc") == "abc"
    assert parse_value("-2.5e+3") == -2500.0


def test_round_trip_dump(tmp_path, recipes):
    cfg = load_config(RootConfig, "demo", ["actor.clip=0.3"], recipes_dir=recipes)
    path = dump_yaml(cfg, tmp_path / "out" / "config.yaml")
    assert load_config(RootConfig, path) == cfg
    d = to_dict(cfg)
    assert d["actor"]["optim"]["betas"] == [0.9, 0.999] and d["controller"]["placement"] == {}


def test_type_errors():
    with pytest.raises(ConfigError, match=r"actor\.optim\.lr: expected float, got 'fast' \(str\)"):
        load_config(RootConfig, None, ["actor.optim.lr=fast"])
    with pytest.raises(ConfigError, match=r"actor\.use_kl: expected bool, got 1 \(int\)"):
        load_config(RootConfig, None, ["actor.use_kl=1"])
    with pytest.raises(ConfigError, match=r"actor\.optim\.warmup_steps: expected int, got True"):
        load_config(RootConfig, None, ["actor.optim.warmup_steps=true"])
    with pytest.raises(ConfigError, match=r"actor\.micro_batches\[1\]: expected int, got 'x'"):
        load_config(RootConfig, None, ["actor.micro_batches=[1, x]"])
    # a value where a list is expected: the example is that value in a list (it was always [1, 2])
    with pytest.raises(ConfigError, match=r"actor\.micro_batches: expected list\[int\] \(e.g. \[4\]\), got 4"):
        load_config(RootConfig, None, ["actor.micro_batches=4"])
    with pytest.raises(ConfigError, match=r"actor\.optim\.betas: expected 2 items"):
        load_config(RootConfig, None, ["actor.optim.betas=[0.9]"])
    with pytest.raises(ConfigError, match=r"actor\.clip: expected float or null, got 'big'"):
        load_config(RootConfig, None, ["actor.clip=big"])
    # Optional sections report the inner problem, not just "expected OptimConfig or null".
    with pytest.raises(ConfigError, match=r"unknown key 'ref\.lrr'; did you mean 'lr'"):
        load_config(RootConfig, None, ["ref.lrr=1"])
    assert load_config(RootConfig, None, ["ref.lr=0.5"]).ref == OptimConfig(lr=0.5)
    with pytest.raises(ConfigError, match=r"actor: expected a section \(ActorConfig"):
        load_config(RootConfig, None, ["actor=3"])
    with pytest.raises(ConfigError, match=r"'actor\.optim\.lr' is a value \(1e-05\), not a section"):
        load_config(RootConfig, None, ["actor.optim.lr.x=3"])
    with pytest.raises(ConfigError, match=r"extra\.k: expected int"):
        load_config(RootConfig, None, ["extra.k=v"])


def test_non_finite_floats_are_refused_naming_the_key():
    """NaN and infinity are never a float key's value (a NaN clip disables clipping, an
    infinite eps stops training, silently); "no limit" is null. A YAML .nan/.inf, or a
    literal past a float's range, in a key, an optional key, a list and a mapping."""
    says = "expected a finite number, got {} (a YAML .nan or .inf"
    for override, key, shown in (("actor.optim.lr=.nan", "actor.optim.lr", "nan"),
                                 ("actor.clip=.inf", "actor.clip", "inf"),
                                 ("actor.optim.betas=[0.9, -.inf]", "actor.optim.betas[1]", "-inf"),
                                 ("critic_optim.lr=1e400", "critic_optim.lr", "inf")):
        with pytest.raises(ConfigError, match=re.escape(f"{key}: {says.format(shown)}")):
            load_config(RootConfig, None, [override])
    assert load_config(RootConfig, None, ["actor.clip=1e300"]).actor.clip == 1e300


def test_literal_errors():
    with pytest.raises(ConfigError, match=r"actor\.loss_agg: 'tok-mean' is not one of "
                                          r"'token-mean', 'seq-mean'; did you mean 'token-mean'\?"):
        load_config(RootConfig, None, ["actor.loss_agg=tok-mean"])
    with pytest.raises(ConfigError, match=r"controller\.backend: 'mpi' is not one of 'auto', 'gloo', 'nccl'"):
        load_config(RootConfig, None, ["controller.backend=mpi"])


def test_unknown_keys_with_suggestions(tmp_path):
    with pytest.raises(ConfigError, match=r"unknown key 'actor\.optim\.lrr'; did you mean 'lr'\? "
                                          r"valid keys in actor\.optim: lr, betas, warmup_steps"):
        load_config(RootConfig, None, ["actor.optim.lrr=1"])
    with pytest.raises(ConfigError, match=r"unknown key 'actr'; did you mean 'actor'\?"):
        load_config(RootConfig, None, ["actr.use_kl=true"])
    bad = tmp_path / "bad.yaml"
    bad.write_text("actor:\n  zzz: 1\n")
    with pytest.raises(ConfigError, match=r"unknown key 'actor\.zzz'; valid keys in actor: optim, "):
        load_config(RootConfig, bad)
    with pytest.raises(ConfigError, match=r"recipe 'dmo' not found.*did you mean 'demo'"):
        find_recipe("dmo", _recipes(tmp_path))
    with pytest.raises(ConfigError, match="must look like key.sub=value"):
        apply_override({}, "actor.lr")
    with pytest.raises(ConfigError, match="nothing to delete"):
        apply_override({"a": {}}, "~a.b")
    bad.write_text("- 1\n")
    with pytest.raises(ConfigError, match="must be a mapping"):
        load_config(RootConfig, bad)


def _recipes(tmp_path):
    (tmp_path / "rr" / "demo").mkdir(parents=True)
    (tmp_path / "rr" / "demo" / "config.yaml").write_text("{}\n")
    return tmp_path / "rr"


def test_post_init_range_checks_carry_path():
    with pytest.raises(ConfigError, match=r"actor\.optim: lr must be > 0, got -1\.0"):
        load_config(RootConfig, None, ["actor.optim.lr=-1"])
    with pytest.raises(ConfigError, match=r"controller: timeout_s must be >= 1 .*, got 0"):
        load_config(RootConfig, None, ["controller.timeout_s=0"])
    # a tiny timeout failed as 117 lines of socket timeouts; now one line at load
    with pytest.raises(ConfigError, match=r"timeout_s must be >= 1 .*got 0.001: shorter, the ranks"):
        load_config(RootConfig, None, ["controller.timeout_s=0.001"])
    with pytest.raises(ValueError, match="backend must be"):
        ControllerConfig(backend="mpi")
    with pytest.raises(ConfigError, match=r"controller: idle_timeout_s must be > 0 or null"):
        load_config(RootConfig, None, ["controller.idle_timeout_s=-1"])
    assert load_config(RootConfig, None, []).controller.idle_timeout_s is None
    assert load_config(RootConfig, None, ["controller.idle_timeout_s=30"]
                       ).controller.idle_timeout_s == 30.0
    with pytest.raises(ConfigError, match=r"RootConfig: missing required keys \['x'\]"):
        @dataclass
        class Req:
            x: int
        from_dict(Req, {}, "RootConfig")


def test_split_cli_args():
    assert split_cli_args(["recipe=demo", "a.b=1"]) == ("demo", ["a.b=1"])
    assert split_cli_args(["a=1"]) == (None, ["a=1"])
    with pytest.raises(ConfigError, match="recipe given 2 times"):
        split_cli_args(["recipe=a", "recipe=b"])


def test_placement_resolution():
    cfg = load_config(ControllerConfig, None, [
        "placement={actor: {ranks: all, tp_size: 2}, critic: {ranks: [3, 1]}}"])
    assert cfg.placement["critic"] == RoleSpec(ranks=[3, 1], tp_size=1)
    out = resolve_placement(cfg.placement, 4)
    assert out == {"actor": RoleLayout("actor", (0, 1, 2, 3), 2),
                   "critic": RoleLayout("critic", (1, 3), 1)}
    assert out["actor"].dp_size == 2
    # Plain dicts work too; roles not named default to all ranks.
    out = resolve_placement({"critic": {"ranks": [1]}}, 2, roles=["actor", "critic"])
    assert out == {"actor": RoleLayout("actor", (0, 1)), "critic": RoleLayout("critic", (1,))}
    assert resolve_placement({}, 1, roles=["actor"]) == {"actor": RoleLayout("actor", (0,))}


def test_placement_errors():
    with pytest.raises(ConfigError, match=r"^controller\.placement\.critic\.ranks: \[2\] out of range for "
                                          r"world size 2 \(valid ranks 0\.\.1\)"):
        resolve_placement({"critic": {"ranks": [0, 2]}}, 2)
    with pytest.raises(ConfigError, match=r"placement\.actor: role 'actor', layout 'default': "
                                          r"tp_size=3 does not divide the role's 4 ranks "
                                          r"\[0, 1, 2, 3\]; use one of \[1, 2, 4\]"):
        resolve_placement({"actor": RoleSpec(tp_size=3)}, 4)
    with pytest.raises(ConfigError, match=r"placement\.critic: ranks is empty"):
        resolve_placement({"critic": {"ranks": []}}, 2)
    with pytest.raises(ConfigError, match=r"^controller\.placement\.critic: ranks \[1, 1\] "
                                          r"contain duplicates$"):
        load_config(RootConfig, None, ["controller.placement.critic.ranks=[1, 1]"])
    with pytest.raises(ConfigError, match=r"controller\.placement\.actor\.ranks: expected 'all' "
                                          r"or list\[int\], got 'al'"):
        load_config(RootConfig, None, ["controller.placement.actor.ranks=al"])
    with pytest.raises(ConfigError, match=r"unknown role 'critc'; did you mean 'critic'\?"):
        resolve_placement({"critc": {}}, 2, roles=["actor", "critic"])
    with pytest.raises(ConfigError, match="tp_size must be >= 1"):
        resolve_placement({"actor": {"tp_size": 0}}, 2)
    with pytest.raises(ConfigError, match="world_size must be >= 1"):
        resolve_placement({}, 0)

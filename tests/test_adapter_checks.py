"""PEFT adapter dirs given to minihf (``minihf.hub.peft``): a broken or unsupported one is
refused in one line naming the file and the key or tensor, by ``minihf generate`` and
``minihf eval`` (which merge it into its base) and when training starts from it
(``model.lora_adapter_path``), before any model runs: non-finite values or a product
``B A alpha / r`` that overflows float32, no tensors or fewer modules than the config
names, bad ``r`` / ``lora_alpha``, an unreadable file, embedding adapters, peft fields that
change the model; and training refuses an adapter whose base is another model dir, while
a legit adapter loads whatever the spelling of its base (relative, trailing slash,
symlink, a hub id)."""

import json
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file
from typer.testing import CliRunner

from minihf.cli import app
from minihf.config import ConfigError

from test_ppo import job_config

TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
LORA = {"actor_rollout_ref.model.lora_rank": 4, "actor_rollout_ref.model.lora_alpha": 8}
DROP = object()  # a config key to delete
NAN_KEY = "base_model.model.model.layers.1.self_attn.q_proj.lora_B.weight"


@pytest.fixture(scope="module")
def root(tmp_path_factory):
    """A tiny model, another of the same shapes, digits data, and a rank-4 adapter dir
    (``good``) on every projection of the first."""
    from minihf.data import make_task_data
    from minihf.hub import init_model
    from minihf.hub.peft import write_adapter_dir
    from minihf.models import build_model, load_args
    from minihf.models.lora import apply_lora, is_lora_param, module_names

    root = tmp_path_factory.mktemp("adapters")
    init_model(root / "model", size="tiny", task="digits")
    init_model(root / "other", size="tiny", task="digits", seed=1)
    make_task_data("digits", root / "data", 8, 4, seed=0)
    model = build_model(load_args(root / "model"), "lm", device="meta")
    apply_lora(model, 4, 8.0, module_names(model, "all-linear"))
    g = torch.Generator().manual_seed(0)
    adapters = {n: torch.randn(p.shape, generator=g) * 0.1 for n, p in model.named_parameters()
                if is_lora_param(n)}
    write_adapter_dir(root / "good", adapters, rank=4, alpha=8.0, target_modules=TARGETS,
                      base=str(root / "model"))
    return root


def variant(root, out, config=None, tensors=None, raw_config=None, raw_weights=None):
    """A copy of the good adapter dir at ``out``, its config keys set (DROP: deleted) and
    its tensors (the file's names) edited by ``tensors``."""
    shutil.copytree(root / "good", out)
    cfg_file, weights = out / "adapter_config.json", out / "adapter_model.safetensors"
    if config is not None:
        cfg = {**json.loads(cfg_file.read_text()), **config}
        cfg_file.write_text(json.dumps({k: v for k, v in cfg.items() if v is not DROP}))
    if raw_config is not None:
        cfg_file.write_text(raw_config)
    if tensors is not None:
        save_file(tensors(load_file(str(weights))), str(weights))
    if raw_weights is not None:
        weights.write_bytes(raw_weights)
    return out


def squeezed(text: str) -> str:
    """``text`` without whitespace or rich's box (it wraps a message anywhere)."""
    return "".join(text.replace("│", "").split())


def scaled(s):
    return lambda t: {k: v * s for k, v in t.items()}


def with_embedding(key_a, key_b):
    return lambda t: {**t, key_a: torch.zeros(4, 20), key_b: torch.zeros(64, 4)}


CONFIG = "adapter_config.json"
WEIGHTS = "adapter_model.safetensors"
CASES = {  # name: (variant's edits, what the line says after the dir)
    "nan": ({"tensors": lambda t: {**t, NAN_KEY: t[NAN_KEY] * float("nan")}},
            f"{WEIGHTS}: tensor '{NAN_KEY}' has 256 NaN"),
    "scaled_1e30": ({"tensors": scaled(1e30)}, f"{WEIGHTS}: model.layers.0.mlp.down_proj's lora_B x "
                    "lora_A x lora_alpha / r (8 / 4) reaches"),
    "no_tensors": ({"tensors": lambda t: {}}, f"{WEIGHTS} holds no tensors"),
    "no_v_proj": ({"tensors": lambda t: {k: v for k, v in t.items() if "v_proj" not in k}},
                  f"{WEIGHTS} has no tensors for 2 of the 14 modules its target_modules name "
                  "(['model.layers.0.self_attn.v_proj', 'model.layers.1.self_attn.v_proj'])"),
    "not_json": ({"raw_config": "{r: 4"}, f"{CONFIG} is not valid JSON"),
    "a_list": ({"raw_config": "[4, 8]"}, f"{CONFIG} holds a JSON list, not an object"),
    "r_missing": ({"config": {"r": DROP}}, f"{CONFIG}: r is missing but the tensors have rank 4"),
    "r_0": ({"config": {"r": 0}}, f"{CONFIG}: r=0 but the tensors have rank 4"),
    "r_huge": ({"config": {"r": 10**9}}, f"{CONFIG}: r=1000000000 but the tensors have rank 4"),
    "r_abc": ({"config": {"r": "abc"}}, f"{CONFIG}: r='abc' but the tensors have rank 4"),
    "alpha_missing": ({"config": {"lora_alpha": DROP}}, f"{CONFIG}: lora_alpha is missing; set it"),
    "alpha_0": ({"config": {"lora_alpha": 0}}, f"{CONFIG}: lora_alpha=0 is not a number > 0"),
    "alpha_abc": ({"config": {"lora_alpha": "abc"}}, f"{CONFIG}: lora_alpha='abc' is not a number > 0"),
    "alpha_huge": ({"config": {"lora_alpha": 1e300}}, "lora_alpha / r (1e+300 / 4) reaches"),
    "empty_file": ({"raw_weights": b""}, f"{WEIGHTS} is not a readable safetensors file"),
    "truncated": ({"raw_weights": "half"}, f"{WEIGHTS} is not a readable safetensors file"),
    "lora_embedding": ({"tensors": with_embedding("base_model.model.model.embed_tokens.lora_embedding_A",
                                                  "base_model.model.model.embed_tokens.lora_embedding_B")},
                       f"{WEIGHTS}: tensor 'base_model.model.model.embed_tokens.lora_embedding_A' adapts an "
                       "embedding, which is not supported: minihf's LoRA covers linear layers only"),
    "embedding_lora_A": ({"tensors": with_embedding("base_model.model.model.embed_tokens.lora_A.weight",
                                                    "base_model.model.model.embed_tokens.lora_B.weight")},
                         "adapts model.embed_tokens, which is not supported: minihf's LoRA covers linear "
                         "layers only"),
    "target_embedding": ({"config": {"target_modules": ["q_proj", "embed_tokens"]}},
                         f"{CONFIG}: target_modules names 'embed_tokens', which is not supported"),
    "layer_replication": ({"config": {"layer_replication": [[0, 2]]}},
                          f"{CONFIG}: layer_replication=[[0, 2]] is not supported"),
    "layers_to_transform": ({"config": {"layers_to_transform": [0]}},
                            f"{CONFIG}: layers_to_transform=[0] is not supported"),
    "layers_pattern": ({"config": {"layers_pattern": "layers"}},
                       f"{CONFIG}: layers_pattern='layers' is not supported"),
    "rank_pattern": ({"config": {"rank_pattern": {"q_proj": 8}}},
                     f"{CONFIG}: rank_pattern={{'q_proj': 8}} is not supported"),
    "alpha_pattern": ({"config": {"alpha_pattern": {"q_proj": 2}}},
                      f"{CONFIG}: alpha_pattern={{'q_proj': 2}} is not supported"),
    "rslora": ({"config": {"use_rslora": True}}, f"{CONFIG}: use_rslora=True is not supported"),
    "pissa": ({"config": {"init_lora_weights": "pissa"}}, f"{CONFIG}: init_lora_weights='pissa' is not "
              "supported"),
    "trainable_tokens": ({"config": {"trainable_token_indices": [3]}},
                         f"{CONFIG}: trainable_token_indices=[3] is not supported"),
}


def make_variant(root, out, name):
    edits = dict(CASES[name][0])
    if edits.get("raw_weights") == "half":
        good = (root / "good" / WEIGHTS).read_bytes()
        edits["raw_weights"] = good[: len(good) // 2]
    return variant(root, out, **edits)


def test_generate_and_eval_refuse_a_broken_adapter_in_one_line(root, tmp_path):
    runner = CliRunner()
    data = str(root / "data" / "test.parquet")
    res = runner.invoke(app, ["generate", str(root / "good"), "-p", "12", "--max-tokens", "2"])
    assert res.exit_code == 0 and res.output.startswith("'12' -> "), res.output
    for name, (_, says) in CASES.items():
        adapter = make_variant(root, tmp_path / name, name)
        res = runner.invoke(app, ["generate", str(adapter), "-p", "12", "--max-tokens", "2"])
        # exit 2: the command's one-line error (an exception escaping would be exit 1)
        assert res.exit_code == 2, (name, res.output, res.exception)
        assert squeezed(says) in squeezed(res.output), (name, res.output)
        assert str(adapter) in squeezed(res.output), (name, res.output)  # the file is named
    argv = ["--data", data, "-n", "1", "--max-tokens", "2", "--no-greedy"]
    res = runner.invoke(app, ["eval", str(root / "good"), *argv])
    assert res.exit_code == 0 and "minihf/digits/mean@1" in res.output, res.output
    for name in ("nan", "scaled_1e30", "no_tensors", "no_v_proj"):  # scored with exit 0 before
        res = runner.invoke(app, ["eval", str(tmp_path / name), *argv])
        assert res.exit_code == 2 and squeezed(CASES[name][1]) in squeezed(res.output), (name, res.output)


def test_training_refuses_a_broken_adapter_at_start(root, tmp_path):
    """At the checks before any worker starts (``check_paths``): the adapter file named,
    not a learning rate blamed after a step with NaN weights."""
    from minihf.trainer.ppo_job import check_paths

    data = root / "data"
    for name in ("nan", "scaled_1e30", "r_abc", "truncated", "embedding_lora_A", "layer_replication"):
        adapter = make_variant(root, tmp_path / name, name)
        cfg = job_config(root / "model", data, tmp_path / "out", "grpo", **LORA,
                         **{"actor_rollout_ref.model.lora_adapter_path": str(adapter)})
        with pytest.raises(ConfigError) as err:
            check_paths(cfg)
        assert squeezed(CASES[name][1]) in squeezed(str(err.value)) and str(adapter) in str(err.value)


def test_training_refuses_an_adapter_of_another_base(root, tmp_path, monkeypatch):
    from minihf.trainer.ppo_job import check_paths

    model, data = root / "model", root / "data"
    (tmp_path / "link").symlink_to(model, target_is_directory=True)
    monkeypatch.chdir(root)

    def check(base, model_path=model):
        adapter = variant(root, tmp_path / f"a{len(list(tmp_path.iterdir()))}",
                          config={"base_model_name_or_path": base})
        cfg = job_config(model_path, data, tmp_path / "out", "grpo", **LORA,
                         **{"actor_rollout_ref.model.lora_adapter_path": str(adapter)})
        check_paths(cfg)

    # the same dir however spelled, a hub id (nothing local to compare), no base at all
    for base in (str(model), "model", "./model/", str(model) + "/", str(tmp_path / "link"),
                 "HuggingFaceTB/SmolLM2-135M", None):
        check(base)
    check(str(model), model_path="model")
    check(str(model), model_path=tmp_path / "link")
    with pytest.raises(ConfigError) as err:  # same shapes, other weights: docs/training.md says an error
        check(str(root / "other"))
    said = str(err.value)
    assert f"base_model_name_or_path={str(root / 'other')!r}" in said, said
    assert f"is not actor_rollout_ref.model.path={str(model)!r}" in said, said
    assert "set actor_rollout_ref.model.path to its base" in said, said

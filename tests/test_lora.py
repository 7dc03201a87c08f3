"""LoRA (``minihf.models.lora``) against peft on transformers, and sharded against one
process.

* the same base weights and adapter values give peft's logits and adapter gradients;
* adapters off is the base model exactly (the LoRA actor's reference);
* a 2-rank FSDP LoRA update equals the one-process one; only the adapters move;
* target/exclude selection and the config keys fail with the key named.
"""

import pytest
import torch
import torch.distributed as dist

from minihf.config import ConfigError, from_dict
from minihf.models import load_hf, save_hf
from minihf.models.lora import (adapters_disabled, apply_lora, from_peft_state, is_lora_param,
                                merge_lora_state, module_names, to_peft_state)
from minihf.testing import spawn_ranks
from minihf.workers.config import FSDPConfig, TrainedModelConfig

from test_fsdp import full_params, make_batch, run_update, tiny_model
from test_rollout_engine import build_tiny


def peft_pair(path, rank=4, alpha=8.0, targets="all-linear", seed=0):
    """(peft model on transformers, minihf model) with the same base and adapter values;
    the adapters' B is random (peft starts it at 0, which would hide a wrong B)."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    pm = get_peft_model(hf, LoraConfig(r=rank, lora_alpha=alpha, target_modules=targets,
                                       lora_dropout=0.0))
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for n, p in pm.named_parameters():
            if "lora_" in n:
                p.copy_(torch.randn(p.shape, generator=g) * 0.2)
    ours = load_hf(path)
    apply_lora(ours, rank, alpha, module_names(ours, targets))
    adapters = from_peft_state({k: v for k, v in pm.state_dict().items() if "lora_" in k}, "peft")
    ours.load_state_dict({**ours.state_dict(), **adapters})
    return pm, ours


@pytest.fixture(scope="module")
def llama_dir(tmp_path_factory):
    root = tmp_path_factory.mktemp("lora")
    build_tiny("llama", root / "llama", heads=4, kv_heads=2)
    return str(root / "llama")


def test_logits_and_adapter_grads_match_peft(llama_dir):
    pm, ours = peft_pair(llama_dir)
    tokens = torch.randint(0, 128, (3, 9), generator=torch.Generator().manual_seed(1))
    w = torch.randn(3, 9, 128, generator=torch.Generator().manual_seed(2))
    theirs_logits = pm(input_ids=tokens).logits
    ours_logits = ours(tokens)
    # fp32, the same ops in the same order up to the matmul kernels: logits |z| < ~10 here,
    # so 1e-5 is ~10 ulp
    assert (ours_logits - theirs_logits).abs().max().item() < 1e-5
    (theirs_logits * w).sum().backward()
    (ours_logits * w).sum().backward()
    theirs = from_peft_state({n: p.grad for n, p in pm.named_parameters() if "lora_" in n}, "peft")
    grads = {n: p.grad for n, p in ours.named_parameters() if is_lora_param(n)}
    assert set(grads) == set(theirs) and len(grads) == 2 * 7 * 2  # A and B, 7 projections, 2 layers
    for n in grads:
        scale = theirs[n].abs().max().item()
        assert (grads[n] - theirs[n]).abs().max().item() < 1e-5 * max(1.0, scale), n
    # the base weights stay without gradient only if frozen: that is the worker's job (below)


def test_target_subset_and_merge_match_peft(llama_dir):
    pm, ours = peft_pair(llama_dir, rank=2, alpha=3.0, targets=["q_proj", "v_proj"])
    tokens = torch.randint(0, 128, (2, 7), generator=torch.Generator().manual_seed(3))
    assert (ours(tokens) - pm(input_ids=tokens).logits).abs().max().item() < 1e-5
    assert sorted({n.rpartition(".")[2] for n, m in ours.named_modules()
                   if getattr(m, "lora_A", None) is not None}) == ["q_proj", "v_proj"]
    # merged weights (W + B A * alpha/r, summed in float64): the plain model's logits
    merged = load_hf(llama_dir)
    merged.load_state_dict(merge_lora_state(ours.state_dict(), 3.0 / 2))
    assert (merged(tokens) - ours(tokens)).abs().max().item() < 1e-5
    # names round-trip through a PEFT file's
    state = {n: t for n, t in ours.state_dict().items() if is_lora_param(n)}
    assert from_peft_state(to_peft_state(state), "x").keys() == state.keys()


def test_adapters_off_is_the_base_model_exactly(llama_dir):
    _, ours = peft_pair(llama_dir)
    base = load_hf(llama_dir)
    tokens = torch.randint(0, 128, (2, 8), generator=torch.Generator().manual_seed(4))
    with adapters_disabled(ours):
        off = ours(tokens)
    # x W^T + b alone: the very kernels the base model runs, so bitwise equal
    assert torch.equal(off, base(tokens))
    assert not torch.equal(ours(tokens), off)  # back on after the block


def test_selection_errors_name_the_key(llama_dir):
    model = load_hf(llama_dir)
    with pytest.raises(ValueError, match="target_modules: 'lm_head' names no adaptable module"):
        module_names(model, ["q_proj", "lm_head"])
    with pytest.raises(ValueError, match="exclude_modules: 'qproj'"):
        module_names(model, "all-linear", ["qproj"])
    with pytest.raises(ValueError, match="leaves no module"):
        module_names(model, ["q_proj"], ["q_proj"])
    with pytest.raises(ValueError, match="use 'all-linear' or a list"):
        module_names(model, "all")
    assert module_names(model, ["layers.1.mlp.up_proj"]) == ["model.layers.1.mlp.up_proj"]
    assert len(module_names(model, "all-linear", ["o_proj", "layers.0.mlp.up_proj"])) == 14 - 3
    with pytest.raises(ValueError, match="exclude_modules: 'mlp'"):  # a suffix of a projection's name only
        module_names(model, "all-linear", ["mlp"])


def test_config_keys():
    with pytest.raises(ConfigError, match=r"model: target_modules set but lora_rank=0"):
        from_dict(TrainedModelConfig, {"target_modules": ["q_proj"]}, "model")
    with pytest.raises(ConfigError, match=r"lora_rank=-1 must be an int >= 0"):
        from_dict(TrainedModelConfig, {"lora_rank": -1}, "model")
    with pytest.raises(ConfigError, match=r"lora_alpha=0.0 must be > 0"):
        from_dict(TrainedModelConfig, {"lora_rank": 4, "lora_alpha": 0}, "model")
    cfg = from_dict(TrainedModelConfig, {"lora_rank": 8, "target_modules": ["q_proj", "v_proj"]})
    assert cfg.lora and cfg.target_modules == ["q_proj", "v_proj"]
    with pytest.warns(UserWarning, match=r"lora_alpha=32.0 is set but lora_rank=0"):  # recipe=grpo_lora lora_rank=0
        assert not from_dict(TrainedModelConfig, {"lora_alpha": 32}, "model").lora


def _fsdp_lora_update(rank, world, path):
    from minihf.workers.engine import build_fsdp_model

    cfg = TrainedModelConfig(path=path, lora_rank=4, lora_alpha=8.0)
    batch = make_batch(4, 6, 5)
    local = {k: v[rank * 2:rank * 2 + 2] for k, v in batch.items()}
    sharded = build_fsdp_model(cfg, FSDPConfig(), head="lm", group=dist.group.WORLD,
                               device=torch.device("cpu"))
    trainable = sorted(n for n, p in sharded.named_parameters() if p.requires_grad)
    before = full_params(sharded)
    stats = run_update(sharded, local, [[0, 1]], "token-mean", dist.group.WORLD, steps=3)
    one = build_fsdp_model(cfg, FSDPConfig(), head="lm", group=None, device=torch.device("cpu"))
    one_before = full_params(one)
    ref_stats = run_update(one, batch, [[0, 1, 2, 3]], "token-mean", None, steps=3)
    a, b = full_params(sharded), full_params(one)
    return {"trainable": trainable, "start_equal": all(torch.equal(before[n], one_before[n]) for n in b),
            "err": max((a[n] - b[n]).abs().max().item() for n in b),
            "base_moved": max((a[n] - before[n]).abs().max().item() for n in b if not is_lora_param(n)),
            "lora_moved": max((a[n] - before[n]).abs().max().item() for n in b if is_lora_param(n)),
            "stats": stats, "ref_stats": ref_stats}


def test_fsdp_lora_update_matches_one_process(tmp_path):
    save_hf(tiny_model(), tmp_path / "m")
    for r in spawn_ranks(_fsdp_lora_update, 2, str(tmp_path / "m")):
        assert r["trainable"] and all(is_lora_param(n) for n in r["trainable"])
        assert r["start_equal"]  # the same adapter init whatever the sharding
        assert r["base_moved"] == 0.0 and r["lora_moved"] > 1e-4
        # as test_fsdp's full-parameter check: AdamW steps, fp32 sums in another order
        assert r["err"] < 1e-5, r["err"]
        for s, s_ref in zip(r["stats"], r["ref_stats"]):
            assert s["grad_norm"] == pytest.approx(s_ref["grad_norm"], rel=1e-5)
            assert s["loss"] == pytest.approx(s_ref["loss"], rel=1e-5)


def test_start_from_a_peft_adapter_dir_and_merge_it(llama_dir, tmp_path):
    from minihf.hub import model_dir_of
    from minihf.workers.engine import build_fsdp_model

    pm, ours = peft_pair(llama_dir)
    pm.save_pretrained(tmp_path / "adapter")  # base_model_name_or_path: llama_dir
    tokens = torch.randint(0, 128, (2, 8), generator=torch.Generator().manual_seed(6))

    def build(**kw):
        cfg = TrainedModelConfig(path=llama_dir, **{"lora_rank": 4, "lora_alpha": 8.0,
                                                    "lora_adapter_path": str(tmp_path / "adapter"), **kw})
        return build_fsdp_model(cfg, FSDPConfig(), head="lm", group=None, device=torch.device("cpu"))
    assert torch.equal(build()(tokens), ours(tokens))  # the same values through the same ops
    with pytest.raises(ValueError, match="trained with lora_rank=4 but model.lora_rank=8; set model.lora_rank=4"):
        build(lora_rank=8)
    with pytest.raises(ValueError, match="adapts 14 modules .* select 4 .* set model.target_modules='all-linear'"):
        build(target_modules=["q_proj", "v_proj"])
    # `minihf eval` / `generate` given the adapter dir: merged into its base model
    merged = load_hf(model_dir_of(tmp_path / "adapter", tmp_path / "scratch"))
    want = ours(tokens)
    err = (merged(tokens) - want).abs().max().item()
    assert err < 1e-5 * max(1.0, want.abs().max().item()), err  # merging rounds once more (test_lora_actor)


def test_resuming_with_other_lora_settings_is_refused(tmp_path):
    import json

    from minihf.workers.train_state import TrainState

    saved = {"rank": 8, "alpha": 16, "modules": ["model.layers.0.self_attn.q_proj"]}
    (tmp_path / "meta.json").write_text(json.dumps({"world_size": 1, "head": "lm", "lora": saved}))
    state = TrainState.__new__(TrainState)  # the check alone: no model needed
    state.lora = dict(saved)
    state._check_lora(str(tmp_path))  # the same settings: no error
    state.lora = {"rank": 4, "alpha": 16, "modules": saved["modules"]}
    with pytest.raises(ValueError, match="trained with lora_rank=8, lora_alpha=16 on 1 modules, this run has "
                                         "lora_rank=4, lora_alpha=16 on 1 modules; set model.lora_rank"):
        state._check_lora(str(tmp_path))
    state.lora = {**saved, "alpha": 64}  # the scale alpha / rank jumped at the resume, accepted
    with pytest.raises(ValueError, match="lora_alpha=16 on 1 modules, this run has lora_rank=8, lora_alpha=64"):
        state._check_lora(str(tmp_path))
    state.lora = None
    with pytest.raises(ValueError, match=r"this run has full parameters \(lora_rank=0\)"):
        state._check_lora(str(tmp_path))

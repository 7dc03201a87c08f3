"""Multi-turn edges a model or an environment can reach: tool-call JSON nested past the
decoder's limit, lone surrogates in an observation, ``SystemExit`` from an environment, a
tool or a reward function, a turn cut in the middle of a tag, an episode ended for want of
room, long error observations, and rows an environment changes."""

import json

import pytest

from minihf.data.tokenizer import load_tokenizer
from minihf.hybrid.rollout_output import build_output, env_rows, episode_outputs
from minihf.multi_turn import ChatRenderer, ToolEnvironment, calculator, tool_schema
from minihf.multi_turn.loop import EnvironmentFailure
from minihf.multi_turn.tools import parse_tool_calls
from minihf.protocol import Batch
from test_multi_turn import Countdown, run_episodes, tiny  # noqa: F401 - tiny: the fixture


def test_tool_call_nested_too_deeply_is_an_observation():
    """json.loads raises RecursionError (not JSONDecodeError) at ~1000 nested brackets:
    it ended the run as an EnvironmentFailure; a malformed call is the model's observation."""
    calls, errors = parse_tool_calls("<tool_call>" + "[" * 5000 + "</tool_call>")
    assert calls == [] and errors == ["error: the tool call's JSON is nested too deeply"]
    deep_args = json.dumps({"name": "calculator", "arguments": "[" * 5000})
    calls, errors = parse_tool_calls(f"<tool_call>{deep_args}</tool_call>")
    assert calls == [] and "must be a JSON object" in errors[0]


class Surrogate(Countdown):
    def step(self, action):  # what a tool echoing a JSON-escaped argument ("\ud800") returns
        self.n += 1
        return "1\ud800", 0.0, self.n >= self.turns


class Quits(Countdown):
    def step(self, action):
        raise SystemExit(0)


class SixNines(Countdown):
    def step(self, action):
        self.n += 1
        return "9" * 6, 1.0, self.n >= self.turns


class LongError(Countdown):
    def step(self, action):
        self.n += 1
        return "error: " + "9" * 500, 0.0, self.n >= self.turns


def test_observations_with_lone_surrogates_render(tiny):
    """The tokenizer refused a str holding a lone surrogate (a bare TypeError naming no
    sample); the loop writes it as '?'."""
    runner, seqs, tok, _ = run_episodes(tiny, Surrogate, turns=2)
    users = [m["content"] for ep in runner.episodes for m in ep.messages if m["role"] == "user"]
    assert users and all(u == "1?" for u in users)


def test_system_exit_from_an_environment_names_the_sample(tiny):
    """SystemExit passed every ``except Exception``: generate raised SystemExit(0), and a
    script calling it exited 0 (under TP the other ranks waited for the leader)."""
    with pytest.raises(EnvironmentFailure, match=r"Quits.step on sample \d \(uid [ab]\) raised SystemExit: 0"):
        run_episodes(tiny, Quits)


def test_system_exit_from_a_tool_or_reward_function():
    from minihf.data.rewards import RewardError, compute_score

    def leaves(x: int) -> str:
        """Exit.

        Args:
            x: anything
        """
        raise SystemExit(3)

    env = ToolEnvironment({}, {"leaves": leaves})
    obs, _, _ = env.step('<tool_call>{"name": "leaves", "arguments": {"x": 1}}</tool_call>')
    assert obs[0]["content"] == "error: leaves raised SystemExit: 3"

    def reward(source, text, truth, info):
        raise SystemExit(0)

    with pytest.raises(RewardError, match="reward function 'reward' raised on sample 0 .*SystemExit: 0"):
        compute_score(reward, ["s"], ["x"], ["1"])


def test_long_error_observations_are_cut_too(tiny):
    runner, _, _, _ = run_episodes(tiny, LongError, turns=2, max_tokens=120, max_tool_response_length=20)
    users = [m["content"] for ep in runner.episodes for m in ep.messages if m["role"] == "user"]
    assert users and all(u == "error: " + "9" * 13 + "...(truncated)" for u in users)


def test_an_episode_ended_for_want_of_room_records_its_last_turn_once(tiny):
    """An observation with no room left ends the sequence at 'length' after its turn was
    recorded; the turn was then taken for one the cap cut, recorded again and counted twice."""
    import torch

    runner, seqs, _, _ = run_episodes(tiny, SixNines, turns=9, max_tokens=14)
    P = max(len(p) for p in runner.prompts)
    ids = torch.zeros(len(seqs), P, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for i, p in enumerate(runner.prompts):
        ids[i, P - len(p):], mask[i, P - len(p):] = torch.tensor(p), 1
    out = build_output(Batch({"input_ids": ids, "attention_mask": mask,
                              "position_ids": (mask.cumsum(-1) - 1).clamp(min=0)}), seqs, 14, 0)
    episode_outputs(out, runner, seqs, False)
    for i, (seq, ep) in enumerate(zip(seqs, runner.episodes)):
        roles = [m["role"] for m in ep.messages]
        assert roles.count("assistant") == out["multi_turn_turns"][i].item(), (seq.finish_reason, roles)
        assert all(a != b for a, b in zip(roles, roles[1:]))  # turns and observations alternate
    assert any(s.finish_reason == "length" for s in seqs)


def test_a_turn_cut_inside_a_tag_gets_the_whole_end_of_turn(smollm2_tokenizer_dir):
    """A turn cut by max_tokens_per_turn may end on any token: one whose text merely starts
    the template's end of turn ('<' of '<tool_call>', before '<|im_end|>') is not it, and
    the delta stripped that character, rendering '|im_end|>' as plain text."""
    smol = load_tokenizer(smollm2_tokenizer_dir)
    r = ChatRenderer(smol, [tool_schema(calculator)], "TOOLS")
    msgs = [{"role": "tool", "name": "calculator", "content": "42"}]
    closed = "<|im_end|>\n<|im_start|>tool\n42<|im_end|>\n<|im_start|>assistant\n"
    for token in ("<", "\n", "x"):
        assert r.delta_text(msgs, smol.convert_tokens_to_ids(token)) == closed
    assert r.delta_text(msgs, smol.convert_tokens_to_ids("<|im_end|>")) == closed[len("<|im_end|>"):]


def test_each_sample_gets_its_own_row(tmp_path):
    """The n samples of a prompt shared one extra_info dict, the dataset's own: an
    environment that spent its row's budget spent every sample's, in every later epoch."""
    from minihf.data import RLDataset
    from minihf.data.tokenizer import build_char_tokenizer

    row = {"data_source": "x", "prompt": [{"role": "user", "content": "12"}],
           "reward_model": {"ground_truth": "3"}, "extra_info": {"budget": 3}}
    (tmp_path / "t.jsonl").write_text(json.dumps(row) + "\n")
    ds = RLDataset(tmp_path / "t.jsonl", build_char_tokenizer("0123456789"), max_prompt_length=32)
    rows = env_rows(ds.collate([0]).repeat(4, interleave=True))
    rows[0]["extra_info"]["budget"] -= 1
    assert [r["extra_info"]["budget"] for r in rows] == [2, 3, 3, 3]
    batch = ds.collate([0])
    batch.non_tensors["extra_info"][0]["budget"] = 0  # a reward function writing to its row
    assert ds.records[0]["extra_info"] == {"budget": 3}


def test_the_sandbox_setting_reaches_a_users_own_run_python(tiny, monkeypatch):
    """multi_turn.sandbox was applied only with the built-in python tool listed: an
    environment (or tool) of the user's calling run_python ran in the default mode whatever
    the setting said."""
    from minihf.multi_turn import MultiTurn, sandbox
    from minihf.workers.config import MultiTurnConfig

    monkeypatch.setattr(sandbox, "_mode", "isolated")
    tok, _ = tiny
    cfg = MultiTurnConfig(enable=True, environment=f"{__file__}:SixNines", sandbox="process")
    MultiTurn(cfg, tok, (tok.eos_token_id,))
    assert sandbox._mode == "process"


def test_response_length_counts_observation_tokens():
    """A multi-turn response that fills max_response_length with observation tokens in it is
    clipped: response_length/* and clip_ratio count every response token (verl's, from the
    attention mask); from response_mask a filled row read 4 tokens, never clipped, and the
    watcher's 'responses hit max_response_length' warning never fired."""
    import torch

    from minihf.trainer.metrics import data_metrics

    R = 8
    attention = torch.cat([torch.ones(2, 3), torch.tensor([[1.0] * 8, [1.0] * 3 + [0.0] * 5])], 1).long()
    response_mask = torch.tensor([[1, 1, 0, 0, 0, 0, 1, 1], [1, 1, 1, 0, 0, 0, 0, 0]])
    zeros = torch.zeros(2, R)
    batch = Batch({"attention_mask": attention, "response_mask": response_mask, "token_level_scores": zeros,
                   "token_level_rewards": zeros, "advantages": zeros, "returns": zeros})
    m = data_metrics(batch)
    assert (m["response_length/max"], m["response_length/min"], m["response_length/clip_ratio"]) == (8, 3, 0.5)

"""Multi-turn pieces: tools (schemas, hermes parsing, the calculator, ToolEnvironment),
observation deltas through chat templates (char and SmolLM2's ChatML) and the append-only
check, and the environment loop with the engine: masks, rewards, prompts from reset(),
and environments that raise, hang or return the wrong thing."""

import json
import re
import sys
import time

import pytest

from minihf.data import load_tokenizer
from minihf.data.tokenizer import build_char_tokenizer
from minihf.multi_turn import (ChatRenderer, EnvironmentFailure, MultiTurn, TemplateMismatch,
                               ToolEnvironment, calculator, check_append_only, parse_tool_calls,
                               tool_schema)
from minihf.rollout import Engine, SamplingParams
from minihf.workers.config import MultiTurnConfig


def test_calculator_is_exact_and_safe():
    assert calculator("12*(3+4)") == "84"
    assert calculator("7/2") == "3.5" and calculator("8/2") == "4"
    assert calculator("123456789*987654321") == str(123456789 * 987654321)
    assert calculator("-3**2 % 5") == str(-3 ** 2 % 5)
    assert calculator("1/0") == "error: division by zero"
    assert calculator("2**1000").startswith("error: exponent too large")
    assert "unsupported syntax" in calculator("__import__('os').system('true')")
    assert "unsupported syntax" in calculator("x + 1")
    assert calculator("1 +").startswith("error:")
    assert calculator("9" * 60 + "*" + "9" * 60) == "error: result too large"


def test_tool_schema_and_parsing():
    schema = tool_schema(calculator)
    assert schema["function"]["name"] == "calculator"
    assert schema["function"]["parameters"]["required"] == ["expression"]

    def undocumented(x: int) -> int:
        return x

    with pytest.raises(ValueError, match="tool 'undocumented': cannot build its JSON schema"):
        tool_schema(undocumented)
    text = ('I will compute. <tool_call>{"name": "calculator", "arguments": {"expression": "2*3"}}</tool_call>'
            '<tool_call>{"name": "calculator", "arguments": "{\\"expression\\": \\"1+1\\"}"}</tool_call>')
    calls, errors = parse_tool_calls(text)
    assert calls == [("calculator", {"expression": "2*3"}), ("calculator", {"expression": "1+1"})]
    assert errors == []
    calls, errors = parse_tool_calls('<tool_call>{"name": calc</tool_call> <tool_call>[1]</tool_call> <tool_call>')
    assert calls == [] and len(errors) == 3
    assert "not valid JSON" in errors[0] and '{"name": <string>' in errors[1] and "unbalanced" in errors[2]
    assert parse_tool_calls("The answer is 6.") == ([], [])


def test_tool_environment_turns_errors_into_observations():
    def slow(seconds: float) -> str:
        """Sleep.

        Args:
            seconds: how long
        """
        time.sleep(seconds)
        return "woke"

    def broken(x: int) -> str:
        """Fail.

        Args:
            x: anything
        """
        raise KeyError("boom")

    env = ToolEnvironment({}, {"calculator": calculator, "slow": slow, "broken": broken},
                          max_parallel_calls=2, max_response_length=40, timeout_s=0.3)
    call = lambda name, args: f'<tool_call>{json.dumps({"name": name, "arguments": args})}</tool_call>'
    obs, reward, done = env.step(call("calculator", {"expression": "6*7"}))
    assert obs == [{"role": "tool", "name": "calculator", "content": "42"}] and not done and reward == 0
    obs, _, _ = env.step(call("nope", {}) + call("broken", {"x": 1}) + call("slow", {"seconds": 0}))
    assert "unknown tool 'nope'" in obs[0]["content"] and "raised KeyError" in obs[1]["content"]
    assert obs[2]["content"].startswith("error: 3 calls") and len(obs) == 3
    obs, _, _ = env.step(call("slow", {"seconds": 5}))
    assert obs[0]["content"] == "error: slow raised TimeoutError: did not...(truncated)"
    obs, _, _ = env.step(call("calculator", {"expression": "9" * 60}))
    assert obs[0]["content"] == "9" * 40 + "...(truncated)"
    obs, _, _ = env.step(call("calculator", {"wrong": 1}))
    assert obs[0]["content"].startswith("error: bad arguments for calculator")
    assert env.step("The answer is 42.") == (None, 0.0, True)
    assert env.tool_calls == 6 and env.tool_errors == 5


def test_deltas_and_append_only_check(smollm2_tokenizer_dir, caplog):
    char = build_char_tokenizer("0123456789")
    r = ChatRenderer(char)
    assert r.delta_text([{"role": "user", "content": "12"}], char.eos_token_id) == "<|user|>12<eos><|assistant|>"
    check_append_only(r, char.eos_token_id, "user", "strict")
    with pytest.raises(ValueError, match="unknown role tool"):
        check_append_only(r, char.eos_token_id, "tool", "strict")  # the char template has no tool role

    smol = load_tokenizer(smollm2_tokenizer_dir)
    end = smol.convert_tokens_to_ids("<|im_end|>")
    r = ChatRenderer(smol, [tool_schema(calculator)], "TOOLS")
    assert not r.native_tools and r.system_block == "TOOLS"
    delta = r.delta_text([{"role": "tool", "name": "calculator", "content": "42"}], end)
    assert delta == "\n<|im_start|>tool\n42<|im_end|>\n<|im_start|>assistant\n"
    assert "TOOLS" in r.text([{"role": "user", "content": "hi"}], True)
    check_append_only(r, end, "tool", "strict")

    # a template that rewrites earlier assistant turns (as Qwen3 drops old <think> blocks)
    rewrites = build_char_tokenizer("0123456789")
    rewrites.chat_template = (
        "{% for m in messages %}<|{{ m['role'] }}|>"
        "{% if m['role'] == 'assistant' and not loop.last %}0{% else %}{{ m['content'] }}{% endif %}"
        "{{ eos_token }}{% endfor %}{% if add_generation_prompt %}<|assistant|>{% endif %}")
    r = ChatRenderer(rewrites)
    with pytest.raises(TemplateMismatch, match=r"not append-only: rendered whole, token \d+ is"):
        check_append_only(r, rewrites.eos_token_id, "user", "strict")
    check_append_only(r, rewrites.eos_token_id, "user", "warn")
    assert "not append-only" in caplog.text
    check_append_only(r, rewrites.eos_token_id, "user", "off")


def test_config_errors_name_the_key():
    with pytest.raises(ValueError, match="needs rollout.multi_turn.tools"):
        MultiTurnConfig(enable=True)
    with pytest.raises(ValueError, match="not both"):
        MultiTurnConfig(tools=["calculator"], environment="env.py:Env")
    with pytest.raises(ValueError, match="max_assistant_turns=0"):
        MultiTurnConfig(max_assistant_turns=0)
    with pytest.raises(ValueError, match="only hermes"):
        MultiTurnConfig(format="json")



def test_tool_and_environment_references_are_checked_at_load(tmp_path):
    """A tool name that is neither built in nor a file reference, or a reference to a file or
    name that does not exist, failed on the rollout ranks after start-up, without naming the
    built-in tools; now the config refuses it (without running the file)."""
    (tmp_path / "tools.py").write_text("def add(a, b):\n    return a + b\n\nclass Env:\n    pass\n")
    for kw, says in ((dict(tools=["calc"]), "tools: 'calc' is neither a built-in tool (calculator, python) nor a "
                                            "file.py:function reference"),
                     (dict(tools=[f"{tmp_path}/nope.py:add"]), "tools: .*nope.py does not exist"),
                     (dict(tools=[f"{tmp_path}/tools.py:sub"]), "tools: .*tools.py has no tool function 'sub'"),
                     (dict(environment="Env"), "environment: 'Env' is not a file.py:Class reference"),
                     (dict(environment=f"{tmp_path}/tools.py:World"), "environment: .*has no environment class")):
        with pytest.raises(ValueError, match=says if ".*" in says else re.escape(says)):
            MultiTurnConfig(enable=True, **kw)
    MultiTurnConfig(enable=True, tools=["calculator", "python", f"{tmp_path}/tools.py:add"])
    for kw in (dict(tools=["calculator"]), dict(environment=f"{tmp_path}/tools.py:Env")):  # ran single-turn, silently
        with pytest.warns(UserWarning, match=r"rollout.multi_turn.(tools|environment) is set but rollout.multi_turn."
                                             r"enable=false: the rollout is single-turn"):
            MultiTurnConfig(**kw)
    MultiTurnConfig(enable=True, environment=f"{tmp_path}/tools.py:Env")
    doc = '    """Add.\n\n    Args:\n        a: a number\n        b: a number\n    """\n'
    (tmp_path / "tools.py").write_text(f"def add(a: int, b: int) -> int:\n{doc}    return a + b\n")
    (tmp_path / "more.py").write_text(f"def add(a: int, b: int) -> int:\n{doc}    return a - b\n\nplus = add\n")
    with pytest.raises(ValueError, match=r"names \['add'\] more than once"):  # one of them silently unreachable
        MultiTurnConfig(enable=True, tools=[f"{tmp_path}/tools.py:add", f"{tmp_path}/more.py:add"])
    from minihf.multi_turn.loop import load_tools  # an alias is the function's own name
    with pytest.raises(ValueError, match=r"'.*more.py:plus' is a tool named 'add', as is one listed before it"):
        load_tools([f"{tmp_path}/tools.py:add", f"{tmp_path}/more.py:plus"])


# -- the environment loop with the engine ---------------------------------------------------
class Countdown:
    """Answers each turn with the digits of its turn number, rewards 1 per turn, done after
    ``row['extra_info']['turns']`` turns; reset() adds a digit to the prompt."""

    def __init__(self, row):
        self.turns, self.n = row["extra_info"]["turns"], 0

    def reset(self):
        return "7"

    def step(self, action):
        self.n += 1
        return str(self.n) * 2, 1.0, self.n >= self.turns


class Raises(Countdown):
    def step(self, action):
        raise ValueError("bad state")


class Hangs(Countdown):
    def step(self, action):
        time.sleep(30)


class ReturnsInt(Countdown):
    def step(self, action):
        return 5


class RewardsNaN(Countdown):
    def step(self, action):
        return None, float("nan"), True


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    from minihf.hub import init_model
    from minihf.models import load_hf

    path = tmp_path_factory.mktemp("mt") / "model"
    init_model(path, size="tiny", task="digits")
    return load_tokenizer(path), load_hf(path)


def run_episodes(tiny, env_cls, turns=3, max_tokens=40, **cfg):
    tok, model = tiny
    where = sys.modules[env_cls.__module__].__file__  # the file defining the class, loaded by path
    cfg = MultiTurnConfig(enable=True, environment=f"{where}:{env_cls.__name__}", **cfg)
    mt = MultiTurn(cfg, tok, (tok.eos_token_id,))
    raw = [[{"role": "user", "content": "12"}], [{"role": "user", "content": "345"}]]
    rows = [{"raw_prompt": m, "extra_info": {"turns": turns}} for m in raw]
    prompts = [mt.renderer.prompt_ids(m) for m in raw]
    runner = mt.runner(rows, ["a", "b"], prompts, 16)
    stops = [tok.convert_tokens_to_ids(c) for c in "02468"]  # ends a turn often: several turns each
    engine = Engine(model, eos_token_ids=(tok.eos_token_id,))
    sp = SamplingParams(temperature=1.0, seed=0, max_tokens=max_tokens, stop_token_ids=stops + [tok.eos_token_id])
    return runner, [g[0] for g in engine.generate(runner.prompts, sp, turns=runner)], tok, stops


def test_episode_loop_masks_rewards_and_prompts(tiny):
    runner, seqs, tok, stops = run_episodes(tiny, Countdown, turns=3)
    assert tok.decode(runner.prompts[0]) == "<bos><|user|>127<eos><|assistant|>"  # reset()'s "7"
    for seq, ep in zip(seqs, runner.episodes):
        if seq.finish_reason == "done":
            assert ep.turns == 3 and len(seq.observations) == 2
        for k, (start, end) in enumerate(seq.observations, 1):
            # after a stop token that is not the template's end of turn, the delta closes the turn
            closed = "" if seq.tokens[start - 1] == tok.eos_token_id else "<eos>"
            assert tok.decode(seq.tokens[start:end]) == f"{closed}<|user|>{k}{k}<eos><|assistant|>"
            assert seq.tokens[start - 1] in stops + [tok.eos_token_id]
        assert [r for _, r in ep.rewards] == [1.0] * ep.turns
        assert all(seq.token_mask()[at] == 1 for at, _ in ep.rewards)
        user = [m["content"] for m in ep.messages if m["role"] == "user"]
        assert user == [f"{k}{k}" for k in range(1, len(seq.observations) + 1)]
    assert any(s.finish_reason == "done" for s in seqs)


def test_episode_loop_limits(tiny):
    runner, seqs, _, _ = run_episodes(tiny, Countdown, turns=9, max_assistant_turns=2)
    assert all(s.finish_reason in ("max_assistant_turns", "length") for s in seqs)
    assert all(len(s.observations) <= 1 for s in seqs)
    runner, seqs, _, _ = run_episodes(tiny, Countdown, turns=9, max_user_turns=1)
    assert all(len(s.observations) <= 1 for s in seqs)


@pytest.mark.parametrize("env_cls,message", [
    (Raises, r"Raises.step on sample \d \(uid [ab]\) raised ValueError: bad state"),
    (Hangs, r"Hangs.step on sample \d \(uid [ab]\) did not return within rollout.multi_turn.env_timeout_s=0.5"),
    (ReturnsInt, r"ReturnsInt.step on sample \d \(uid [ab]\) returned int; return \(observation"),
    (RewardsNaN, r"RewardsNaN.step on sample \d \(uid [ab]\) returned reward nan; return a finite float"),
])
def test_failing_environments_name_the_sample(tiny, env_cls, message):
    t0 = time.monotonic()
    with pytest.raises(EnvironmentFailure, match=message):
        run_episodes(tiny, env_cls, env_timeout_s=0.5)
    assert time.monotonic() - t0 < 20


def test_sft_on_tool_conversations_renders_the_tools(tmp_path):
    """SFT rows with tool calls (``messages``) rendered with the tools offered
    (``data.tools``), as the rollout renders its prompts: the prompt tokens match, the loss
    covers the assistant turns (the call and the answer) and not the tool's message."""
    from minihf.data import SFTDataset, make_task_data
    from minihf.data.tasks import tool_arith
    from minihf.multi_turn.loop import tool_renderer

    tok = build_char_tokenizer(tool_arith.ALPHABET, extra_roles=tool_arith.EXTRA_ROLES,
                               extra_special_tokens=tool_arith.EXTRA_SPECIAL_TOKENS)
    paths = make_task_data("tool_arith", tmp_path, 40, 0, seed=1)
    renderer = tool_renderer(tok, ["calculator"])
    ds = SFTDataset(paths["train"], tok, max_length=160, renderer=renderer)
    import pyarrow.parquet as pq
    rows = pq.read_table(paths["train"]).to_pylist()
    with_tool = [i for i, r in enumerate(rows) if r["extra_info"]["demo_tool"]]
    assert with_tool
    for i, row in enumerate(rows):
        ids, mask = ds[i]["input_ids"], ds[i]["loss_mask"]
        prompt = renderer.prompt_ids(row["prompt"])
        assert ids[:len(prompt)] == prompt and not any(mask[:len(prompt)])
        trained = tok.decode([t for t, m in zip(ids, mask) if m])
        answer = row["reward_model"]["ground_truth"]
        if i in with_tool:
            assert trained == f"{tool_arith.tool_call(row['prompt'][0]['content'])}<eos>{answer}<eos>"
        else:
            assert trained == f"{answer}<eos>"

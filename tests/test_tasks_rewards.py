"""GSM8K scorer, the data_source registry, user reward.py loading and compute_score errors."""

import math

import pytest

from minihf.data.rewards import (RewardError, compute_score, default_reward_fn, gsm8k_extract,
                                 gsm8k_score, load_reward_fn)


@pytest.mark.parametrize("text, strict, flexible", [
    ("She has 3 + 4 = 7 apples.\n#### 7", "7", "7"),
    ("Total: 1,234 dollars\n#### 1,234", "1234", "1234"),
    ("#### -5", "-5", "-5"),
    ("The answer is 42.", None, "42"),
    ("first 3 then 18, so 18.", None, "18"),
    ("no numbers here", None, None),
    ("#### 12\nwait, actually #### 13", "13", "13"),
])
def test_gsm8k_extract(text, strict, flexible):
    assert gsm8k_extract(text, "strict") == strict
    assert gsm8k_extract(text, "flexible") == flexible


def test_gsm8k_score():
    assert gsm8k_score("so #### 72", "72") == 1.0
    assert gsm8k_score("so #### 72.0", "72") == 1.0
    assert gsm8k_score("so #### 71", "72") == 0.0
    assert gsm8k_score("so #### 71", "72", format_score=0.1) == 0.1
    assert gsm8k_score("the answer is 72", "72") == 0.0  # strict needs ####
    assert gsm8k_score("the answer is 72", "72", method="flexible") == 1.0
    assert gsm8k_score("x" * 1000 + "#### 72", "72") == 1.0
    with pytest.raises(ValueError, match="strict"):
        gsm8k_extract("#### 1", "loose")


def test_default_registry_dispatch():
    assert default_reward_fn("minihf/arith", "579", "579", {}) == 1.0
    assert default_reward_fn("minihf/digits", "7,1", "7,1,5,9", {}) == 0.5
    assert default_reward_fn("minihf/countdown", "3*5", {"target": 22, "numbers": [3, 5, 7]}, {}) == 0.1
    assert default_reward_fn("openai/gsm8k", "#### 3", "3", None) == 1.0
    with pytest.raises(KeyError, match="reward.py"):
        default_reward_fn("my/data", "1", "1", {})


def test_compute_score_floats_and_dict_metrics():
    def fn(data_source, solution_str, ground_truth, extra_info):
        if data_source == "a":
            return {"score": float(solution_str == ground_truth), "length": len(solution_str)}
        return 0.5

    scores, extras = compute_score(fn, ["a", "b", "a"], ["x", "y", "zz"], ["x", "y", "x"])
    assert scores == [1.0, 0.5, 0.0]
    assert extras["length"][0] == 1 and math.isnan(extras["length"][1]) and extras["length"][2] == 2


def test_compute_score_names_failing_sample():
    def fn(data_source, solution_str, ground_truth, extra_info):
        return 1.0 / int(solution_str)

    with pytest.raises(RewardError, match=r"sample 2 \(data_source='src/two'\).*ZeroDivisionError") as info:
        compute_score(fn, ["s", "s", "src/two"], ["1", "2", "0"], [None] * 3, [{}] * 3)
    assert isinstance(info.value.__cause__, ZeroDivisionError)


@pytest.mark.parametrize("result, match", [
    ({"acc": 1.0}, "without 'score'"),
    ("1.0", "must be a number"),
    (None, "must be a number"),
])
def test_compute_score_rejects_bad_results(result, match):
    with pytest.raises(RewardError, match=match):
        compute_score(lambda *a: result, ["d"], ["s"], ["g"])


def test_compute_score_length_mismatch():
    with pytest.raises(ValueError, match="lengths differ"):
        compute_score(default_reward_fn, ["a"], ["x", "y"], ["x"])


def test_load_reward_fn(tmp_path):
    path = tmp_path / "reward.py"
    path.write_text(
        "THRESHOLD = 3\n"
        "def my_reward(data_source, solution_str, ground_truth, extra_info):\n"
        "    return {'score': float(len(solution_str) >= THRESHOLD), 'len': len(solution_str)}\n"
    )
    fn = load_reward_fn(path, "my_reward")
    assert compute_score(fn, ["x", "x"], ["ab", "abcd"], [None, None]) == ([0.0, 1.0], {"len": [2.0, 4.0]})
    with pytest.raises(AttributeError, match=r"no reward function 'compute_score'.*my_reward"):
        load_reward_fn(path)
    with pytest.raises(TypeError, match="not a reward function"):
        load_reward_fn(path, "THRESHOLD")
    with pytest.raises(FileNotFoundError, match="does not exist"):
        load_reward_fn(tmp_path / "missing.py", "my_reward")

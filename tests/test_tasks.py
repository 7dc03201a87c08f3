"""Synthetic task generators and rewards on hand-checked examples (correct, wrong, malformed)."""

import json
import random

import pyarrow.parquet as pq
import pytest

from minihf.data.tasks import TASKS, arith, countdown, digits, get_task, make_task_data, sort
from minihf.data.tasks.common import generate_rows


# --- digits -------------------------------------------------------------------------------

def test_digits_continuation_by_hand():
    assert digits.continuation(3, 4, 10, 4) == [7, 1, 5, 9]
    assert digits.continuation(12, 7, 14, 3) == [5, 12, 5]


@pytest.mark.parametrize("solution, expected", [
    ("7,1,5,9", 1.0),
    ("7,1,5,8", 0.75),          # one wrong term
    ("7,1", 0.5),               # too short
    ("7,1,5,9,3", 0.8),         # an extra term costs credit
    ("7,x,5,9", 0.75),          # a malformed term is wrong, the rest still count
    ("", 0.0),
    ("hello", 0.0),
    (" 7, 1 ,5,9 ", 1.0),
    ("7,\u00b2,5,9", 0.75),     # a non-ASCII digit is a wrong term, not a crash
])
def test_digits_reward(solution, expected):
    assert digits.compute_score(solution, "7,1,5,9") == pytest.approx(expected)  # float64 fractions


# --- sort ---------------------------------------------------------------------------------

def test_sort_examples_by_hand():
    import random

    prompt, truth, answer, params = sort.make_example(random.Random(3))
    items = [int(x) for x in prompt.split(",")]
    assert truth == answer == ",".join(str(x) for x in sorted(items))
    assert params == {"num_items": len(items)} and 2 <= len(items) <= 6


@pytest.mark.parametrize("solution, expected", [
    ("1,3,5,8", 1.0),
    ("1,3,8,5", 0.5),           # two items swapped
    ("1,3", 0.5),               # too short
    ("1,3,5,8,9", 0.8),         # an extra item costs credit
    ("8,5,3,1", 0.0),           # reversed
    ("", 0.0),
])
def test_sort_reward(solution, expected):
    assert sort.compute_score(solution, "1,3,5,8") == pytest.approx(expected)  # float64 fractions


# --- arith --------------------------------------------------------------------------------

@pytest.mark.parametrize("solution, truth, expected", [
    ("579", "579", 1.0),
    (" 579\n", "579", 1.0),
    ("123+456=579", "579", 1.0),  # the model repeats the equation
    ("-333", "-333", 1.0),
    ("578", "579", 0.0),
    ("333", "-333", 0.0),
    ("57 9", "579", 0.0),
    ("", "579", 0.0),
    ("five", "579", 0.0),
])
def test_arith_reward(solution, truth, expected):
    assert arith.compute_score(solution, truth) == expected


def test_answers_past_int_s_digit_limit_score_zero():
    """A model repeating a digit for thousands of tokens: int() refuses past 4300 digits,
    which stopped the run (a RewardError); the answer is wrong, as any malformed one."""
    from minihf.data.tasks import chat_arith

    long = "7" * 4400
    assert arith.compute_score(f"1+2={long}", "3") == 0.0
    assert chat_arith.compute_score(f"The answer is {long}", "3") == 0.0
    assert digits.compute_score(f"{long},3", "3,3") == 0.5  # the second term is right
    assert sort.compute_score(long, "1,2") == 0.0
    assert arith.compute_score("1+2=" + "0" * 999 + "3", "3") == 1.0  # 1000 digits still read


def test_arith_examples_are_right():
    rng = random.Random(3)
    for _ in range(200):
        prompt, truth, answer, p = arith.make_example(rng)
        assert prompt == f"{p['x']}{p['op']}{p['y']}="
        assert int(truth) == (p["x"] + p["y"] if p["op"] == "+" else p["x"] - p["y"])
        assert max(p["x"], p["y"]) < 10 ** arith.MAX_DIGITS


# --- countdown ----------------------------------------------------------------------------

GT = {"target": 22, "numbers": [3, 5, 7]}


@pytest.mark.parametrize("solution, expected", [
    ("3*5+7", 1.0),
    ("7+5*3", 1.0),
    ("3*5+7=22", 1.0),
    ("think...\n<answer> (3*5)+7 </answer>", 1.0),
    ("3*5", 0.1),              # well formed, wrong value
    ("3*5+7+7", 0.1),          # 7 used twice
    ("2*11", 0.1),             # numbers not given
    ("7/(5-5)", 0.1),          # well formed, division by zero
    ("3*5+", 0.0),             # syntax error
    ("3**5", 0.0),             # power is not allowed
    ("-3+25", 0.0),            # unary minus is not an allowed element
    ("import os", 0.0),
    ("", 0.0),
    ("3*5+7=23x", 0.0),
    ("1+" * 20000 + "1", 0.0),  # too deep for ast: malformed, not a RecursionError
    ("1" * 5000, 0.0),          # over Python's int digit limit
])
def test_countdown_reward(solution, expected):
    assert countdown.compute_score(solution, GT) == expected


def test_countdown_examples_are_solvable():
    rng = random.Random(5)
    for _ in range(300):
        prompt, gt, answer, _ = countdown.make_example(rng)
        nums, target = prompt.split(":")
        assert [int(x) for x in nums.split(",")] == gt["numbers"] and int(target) == gt["target"]
        assert countdown.compute_score(answer, gt) == 1.0, (prompt, answer)


# --- generators and files -----------------------------------------------------------------

@pytest.mark.parametrize("name", sorted(TASKS))
def test_generator_files_and_reference_answers(tmp_path, name):
    task = get_task(name)
    paths = make_task_data(name, tmp_path, num_train=40, num_test=10, seed=7)
    train = pq.read_table(paths["train"]).to_pylist()
    test = pq.read_table(paths["test"]).to_pylist()
    jsonl = [json.loads(line) for line in (tmp_path / "train.jsonl").read_text().splitlines()]
    assert len(train) == 40 and len(test) == 10
    assert jsonl == train  # both formats hold the same rows
    for row in train + test:
        assert row["data_source"] == task.DATA_SOURCE
        assert row["prompt"][0]["role"] == "user"
        assert set(row["prompt"][0]["content"]) <= set(task.ALPHABET)
        truth = row["reward_model"]["ground_truth"]
        assert task.compute_score(row["extra_info"]["answer"], truth, row["extra_info"]) == 1.0
    if not getattr(task, "HIDDEN_ANSWER", False):  # else the same prompt hides another answer
        assert not {r["prompt"][0]["content"] for r in train} & {r["prompt"][0]["content"] for r in test}
    assert [r["extra_info"]["index"] for r in test] == list(range(10))


def test_generator_is_deterministic_per_seed():
    a = generate_rows(digits, 20, 5, seed=1)
    assert a == generate_rows(digits, 20, 5, seed=1)
    assert a != generate_rows(digits, 20, 5, seed=2)


def test_unknown_task():
    with pytest.raises(ValueError, match="choose one of"):
        get_task("sudoku")


def test_guess_demonstrations_follow_the_feedback():
    from minihf.data.tasks import guess

    rows = generate_rows(guess, 300, 0, seed=3)["train"]
    turns = []
    for row in rows:
        lo, hi = row["extra_info"]["lo"], row["extra_info"]["hi"]
        secret = int(row["reward_model"]["ground_truth"])
        assert lo <= secret <= hi and row["prompt"][0]["content"] == f"{lo}-{hi}"
        msgs = row["messages"]
        assert msgs[0] == row["prompt"][0] and msgs[-1]["role"] == "assistant"
        low, high = lo, hi
        for a, u in zip(msgs[1::2], msgs[2::2] + [None]):
            g = int(a["content"])
            assert low <= g <= high  # consistent with every answer so far
            assert (u and u["content"]) == guess.feedback(g, secret) or (u is None)
            low, high = (g + 1, high) if secret > g else (low, g - 1)
        found = int(msgs[-1]["content"]) == secret
        assert found or len(msgs) == 1 + 2 * guess.MAX_TURNS - 1
        turns.append((len(msgs) - 1 + 1) // 2)
    assert 1 < sum(turns) / len(turns) < guess.MAX_TURNS

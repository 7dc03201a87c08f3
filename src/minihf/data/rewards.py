"""Rule-based rewards: the GSM8K scorer, a data_source registry, user ``reward.py`` loading.

A reward function is a plain callable
``fn(data_source, solution_str, ground_truth, extra_info) -> float | dict``; a dict must
hold ``"score"`` and its other numeric keys become extra metrics. ``default_reward_fn``
dispatches on ``data_source`` to the built-in scorers in ``REWARD_FNS``. ``compute_score``
runs any such function over a batch and turns an exception into a ``RewardError`` naming
the sample index and data source -- a crashing reward is a bug to see, not a silent 0.
"""

from __future__ import annotations

import math
import queue
import re
import threading
from pathlib import Path
from typing import Any, Callable, Sequence

from minihf.data.tasks import (arith, chat_arith, chat_code, chat_tool_arith, countdown, digits, guess,
                               safe_sort, sort, tool_arith)

RewardFn = Callable[[str, str, Any, dict], "float | dict"]

_GSM8K_STRICT = re.compile(r"#### (\-?[0-9\.\,]+)")
_NUMBER = re.compile(r"(\-?[0-9\.\,]+)")
_GSM8K_TAIL_CHARS = 300  # like verl: only the end of a long response is searched


class RewardError(RuntimeError):
    """A reward function failed or returned something unusable for one sample."""


def gsm8k_extract(solution_str: str, method: str = "strict") -> str | None:
    """The final answer: ``strict`` needs ``#### <number>``; ``flexible`` takes the last number."""
    text = solution_str[-_GSM8K_TAIL_CHARS:]
    if method == "strict":
        found = _GSM8K_STRICT.findall(text)
        return found[-1].replace(",", "") if found else None
    if method == "flexible":
        for candidate in reversed(_NUMBER.findall(text)):
            if candidate not in ("", ".", ",", "-"):
                return candidate.replace(",", "").rstrip(".")
        return None
    raise ValueError(f"gsm8k_extract: method={method!r}; use 'strict' or 'flexible'")


def gsm8k_score(solution_str: str, ground_truth: str, method: str = "strict", format_score: float = 0.0,
                score: float = 1.0) -> float:
    """``score`` if the extracted answer equals the ground truth, ``format_score`` if one was found, else 0."""
    answer = gsm8k_extract(solution_str, method)
    if answer is None:
        return 0.0
    truth = str(ground_truth).replace(",", "").strip()
    try:
        equal = float(answer) == float(truth)
    except ValueError:
        equal = answer == truth
    return score if equal else format_score


NO_GROUND_TRUTH = ("no ground truth: the row has no reward_model column, or its ground_truth is null; "
                   "add reward_model.ground_truth to the data, or score with a reward function of "
                   "your own")


def _task_fn(module) -> RewardFn:
    def fn(data_source, solution_str, ground_truth, extra_info=None):
        if ground_truth is None:  # str(None) reached the task's int() parse: "invalid literal"
            raise ValueError(NO_GROUND_TRUTH)
        return module.compute_score(solution_str, ground_truth, extra_info)
    return fn


def _gsm8k_fn(data_source, solution_str, ground_truth, extra_info=None):
    if ground_truth is None:
        raise ValueError(NO_GROUND_TRUTH)
    return gsm8k_score(solution_str, ground_truth)


REWARD_FNS: dict[str, RewardFn] = {
    digits.DATA_SOURCE: _task_fn(digits),
    sort.DATA_SOURCE: _task_fn(sort),
    arith.DATA_SOURCE: _task_fn(arith),
    countdown.DATA_SOURCE: _task_fn(countdown),
    chat_arith.DATA_SOURCE: _task_fn(chat_arith),
    safe_sort.DATA_SOURCE: _task_fn(safe_sort),
    guess.DATA_SOURCE: _task_fn(guess),
    tool_arith.DATA_SOURCE: _task_fn(tool_arith),
    chat_tool_arith.DATA_SOURCE: _task_fn(chat_tool_arith),
    chat_code.DATA_SOURCE: _task_fn(chat_code),
    "openai/gsm8k": _gsm8k_fn,
    "gsm8k": _gsm8k_fn,
}


def default_reward_fn(data_source: str, solution_str: str, ground_truth: Any, extra_info: dict | None = None):
    """Score with the built-in function registered for ``data_source``."""
    if data_source not in REWARD_FNS:
        raise KeyError(
            f"no built-in reward function for data_source {data_source!r}; known: {sorted(REWARD_FNS)}. "
            "Write your own fn(data_source, solution_str, ground_truth, extra_info) in a reward.py and name it in the recipe"
        )
    return REWARD_FNS[data_source](data_source, solution_str, ground_truth, extra_info)


def _task_cost_fn(module) -> RewardFn:
    def fn(data_source, solution_str, ground_truth, extra_info=None):
        return module.compute_cost(solution_str, ground_truth, extra_info)
    return fn


COST_FNS: dict[str, RewardFn] = {safe_sort.DATA_SOURCE: _task_cost_fn(safe_sort)}


def default_cost_fn(data_source: str, solution_str: str, ground_truth: Any, extra_info: dict | None = None):
    """The built-in cost (Safe-RLHF) registered for ``data_source``; same signature as a reward."""
    if data_source not in COST_FNS:
        raise KeyError(
            f"no built-in cost function for data_source {data_source!r}; known: {sorted(COST_FNS)}. "
            "Write fn(data_source, solution_str, ground_truth, extra_info) in a .py file and name it in "
            "custom_cost_function.path/name, or enable a cost model (cost_model.enable)"
        )
    return COST_FNS[data_source](data_source, solution_str, ground_truth, extra_info)


def load_reward_fn(path: str | Path, name: str = "compute_score") -> RewardFn:
    """Import ``name`` from the Python file at ``path`` (a recipe's ``reward.py``), once per
    process (``minihf.utils.imports``)."""
    from minihf.utils.imports import load_object

    return load_object(path, name, "reward function")


TIMED_OUT = "timed_out"  # the extras key counting samples scored 0 after a timeout


class _Watched:
    """Calls of ``fn`` in a daemon thread, each waited for at most ``timeout_s``: a call
    that never returns is abandoned (a daemon thread cannot keep the process alive) and
    later calls go to a fresh thread. Python cannot stop the abandoned call itself."""

    def __init__(self, fn):
        self.fn = fn
        self._start()

    def _start(self) -> None:
        self.inbox, self.outbox = queue.Queue(), queue.Queue()
        threading.Thread(target=self._loop, args=(self.fn, self.inbox, self.outbox),
                         name="minihf-reward", daemon=True).start()

    @staticmethod
    def _loop(fn, inbox, outbox) -> None:
        while (args := inbox.get()) is not None:
            try:
                outbox.put((True, fn(*args)))
            except BaseException as exc:  # noqa: BLE001 - re-raised in the caller's thread
                outbox.put((False, exc))

    def __call__(self, args: tuple, timeout_s: float):
        self.inbox.put(args)
        try:
            ok, value = self.outbox.get(timeout=timeout_s)
        except queue.Empty:
            self._start()
            raise TimeoutError from None
        if not ok:
            raise value
        return value

    def close(self) -> None:
        self.inbox.put(None)


def compute_score(fn: RewardFn, data_sources: Sequence[str], solutions: Sequence[str], ground_truths: Sequence[Any],
                  extra_infos: Sequence[dict | None] | None = None, timeout_s: float | None = None,
                  on_timeout: str = "error") -> tuple[list[float], dict[str, list[float]]]:
    """Run ``fn`` on every sample: ``(scores, extra metrics by name)``.

    Extra metrics come from dict results (all keys but ``"score"``); samples that did not
    report a key get NaN for it so every list has one entry per sample. With ``timeout_s``,
    a call that has not returned by then raises :class:`RewardError` naming the sample
    (``on_timeout="error"``), or scores 0 and counts as 1 in ``extras["timed_out"]``
    (``"zero"``).
    """
    if on_timeout not in ("error", "zero"):
        raise ValueError(f"on_timeout={on_timeout!r}; choose error or zero")
    watched = _Watched(fn) if timeout_s is not None else None
    try:
        return _score_all(fn, watched, timeout_s, on_timeout, data_sources, solutions,
                          ground_truths, extra_infos)
    finally:
        if watched is not None:
            watched.close()


def _score_all(fn, watched, timeout_s, on_timeout, data_sources, solutions, ground_truths, extra_infos):
    n = len(solutions)
    if not (len(data_sources) == len(ground_truths) == n) or (extra_infos is not None and len(extra_infos) != n):
        raise ValueError(
            f"compute_score: lengths differ: data_sources={len(data_sources)}, solutions={n}, "
            f"ground_truths={len(ground_truths)}, extra_infos={None if extra_infos is None else len(extra_infos)}"
        )
    scores: list[float] = []
    extras: dict[str, list[float]] = {}
    for i in range(n):
        source, info = data_sources[i], (extra_infos[i] if extra_infos is not None else None)
        try:
            args = (source, solutions[i], ground_truths[i], info)
            result = fn(*args) if watched is None else watched(args, timeout_s)
        except TimeoutError:
            if on_timeout == "error":
                raise RewardError(
                    f"reward function {getattr(fn, '__name__', fn)!r} did not return within "
                    f"timeout_s={timeout_s} on sample {i} (data_source={source!r}); make it faster, "
                    "raise custom_reward_function.timeout_s, or set on_timeout=zero to score such "
                    "samples 0") from None
            extras.setdefault(TIMED_OUT, [0.0] * n)[i] = 1.0
            scores.append(0.0)
            continue
        except (Exception, SystemExit) as exc:
            raise RewardError(
                f"reward function {getattr(fn, '__name__', fn)!r} raised on sample {i} (data_source={source!r}): "
                f"{type(exc).__name__}: {exc}"
            ) from exc
        if isinstance(result, dict):
            if "score" not in result:
                raise RewardError(
                    f"reward function returned a dict without 'score' for sample {i} (data_source={source!r}): "
                    f"keys {sorted(result)}; return a float or a dict with a 'score' key"
                )
            for key, value in result.items():
                if key != "score":
                    extras.setdefault(key, [math.nan] * n)[i] = _as_float(value, i, source, key)
            result = result["score"]
        scores.append(_as_float(result, i, source, "score"))
    return scores, extras


def _as_float(value: Any, index: int, source: str, key: str) -> float:
    try:
        if isinstance(value, (str, bytes)):
            raise TypeError
        number = float(value)
    except (TypeError, ValueError, OverflowError):  # OverflowError: an int past float's range
        raise RewardError(
            f"reward function returned {key}={value!r} ({type(value).__name__}) for sample {index} "
            f"(data_source={source!r}); it must be a number"
        ) from None
    if not math.isfinite(number) and key == "score":
        raise RewardError(
            f"reward function returned score={number} for sample {index} (data_source={source!r}); "
            "it must be a finite number (a NaN or infinite score would poison the advantages)"
        )
    return number

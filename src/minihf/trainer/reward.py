"""Rule rewards on the driver: decode each response, score it, place it on its last token.

The function is verl's ``compute_score(data_source, solution_str, ground_truth,
extra_info) -> float | dict`` (a dict has ``score`` plus extra per-sample values, logged as
``reward_extra/<key>/mean``): the built-ins (``minihf.data.default_reward_fn``) or the one
``custom_reward_function.path/name`` names, imported from its file on the driver (a
recipe's ``reward.py`` is found in the recipe folder, see ``minihf.config``). One that
raises stops the run naming the sample (``RewardError``), and so does one that does not
return within ``custom_reward_function.timeout_s`` (or it scores 0 with ``on_timeout=zero``).
"""

from __future__ import annotations

import math
import torch

from minihf.algorithms import last_index
from minihf.data import compute_score, default_reward_fn, load_reward_fn
from minihf.protocol import Batch


def load_reward(path: str | None, name: str):
    """The reward function a config names (``None`` path: the built-ins)."""
    return default_reward_fn if not path else load_reward_fn(path, name)


def at_last_token(scores: torch.Tensor, response_mask: torch.Tensor) -> torch.Tensor:
    """Sequence ``scores`` [B] as token-level scores [B, R] on each response's last token
    (its last assistant token in a multi-turn trajectory; a response of length 0 has no
    token to hold it: it scores 0)."""
    token_scores = torch.zeros(response_mask.shape, dtype=torch.float32)
    last = last_index(response_mask)                                             # [B]
    rows = torch.nonzero(last >= 0).squeeze(-1)
    token_scores[rows, last[rows]] = scores.float()[rows]
    return token_scores


def overlong_penalty(lengths: torch.Tensor, max_length: int, buffer: int, factor: float) -> torch.Tensor:
    """DAPO's overlong shaping (Yu et al., 2025), per response ``[B]``: 0 up to
    ``max_length - buffer`` tokens, then falling linearly to ``-factor`` at ``max_length``:
    ``min(0, -(L - (max_length - buffer)) / buffer * factor)``."""
    excess = lengths.float() - (max_length - buffer)
    return torch.clamp(-excess / buffer * factor, max=0.0)


class RuleReward:
    """A rule function over decoded responses. Each response is decoded from its generated
    tokens only (``response_mask``: no padding, even where pad = eos), with special tokens
    (the final ``<|im_end|>``) removed unless ``skip_special_tokens=False``."""

    def __init__(self, fn, tokenizer, skip_special_tokens: bool = True,
                 timeout_s: float | None = None, on_timeout: str = "error"):
        self.fn, self.tokenizer, self.skip_special_tokens = fn, tokenizer, skip_special_tokens
        self.timeout_s, self.on_timeout = timeout_s, on_timeout

    def decode(self, batch: Batch) -> list[str]:
        return [self.tokenizer.decode(r[m.bool()].tolist(), skip_special_tokens=self.skip_special_tokens)
                for r, m in zip(batch["responses"], batch["response_mask"])]

    def __call__(self, batch: Batch) -> tuple[torch.Tensor, dict[str, float], list[float]]:
        """``(token_level_scores [B, R], metrics, scores)``: each sample's score at its last
        response token (``at_last_token``)."""
        texts = self.decode(batch)
        nt = batch.non_tensors
        extra = nt["extra_info"] if "extra_info" in nt else None
        scores, extras = compute_score(self.fn, list(nt["data_source"]), texts,
                                       list(nt["ground_truth"]), extra, self.timeout_s,
                                       self.on_timeout)
        token_scores = at_last_token(torch.tensor(scores), batch["response_mask"])
        metrics = {}
        for key, values in extras.items():
            finite = [v for v in values if not math.isnan(v)]
            if finite:
                metrics[f"reward_extra/{key}/mean"] = sum(finite) / len(finite)
        return token_scores, metrics, scores

"""RL prompt datasets in verl's row format, batched into left-padded ``Batch`` objects.

Rows (parquet or jsonl) carry ``prompt`` (a list of chat messages ``{"role", "content"}``
or plain text), ``data_source`` (which reward function scores it), optionally
``reward_model: {"ground_truth": ...}`` and ``extra_info`` (any dict). Prompts are rendered
with the tokenizer's chat template and tokenised once, up front, so that length problems
surface when the dataset is built, not mid-run. Batches are left padded (generation appends
on the right) with attention masks and position ids counting real tokens only.
"""

from __future__ import annotations

import copy

import logging
from pathlib import Path
from typing import Iterator, Sequence

import numpy as np
import torch

from minihf.data.files import DataFileError, describe, read_many, require_columns
from minihf.data.sampler import ResumableSampler
from minihf.protocol import Batch

logger = logging.getLogger(__name__)

TRUNCATION_MODES = ("error", "left", "right", "filter")


def check_truncation(mode: str) -> None:
    if mode not in TRUNCATION_MODES:
        raise ValueError(f"truncation={mode!r} is not one of {TRUNCATION_MODES}")


def check_text(text: str, where: str) -> str:
    """``text`` if it is valid Unicode; a lone surrogate (what undecodable bytes become) is
    an error naming the row, not a tokenizer's TypeError."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as exc:
        raise DataFileError(f"{where}: text with invalid Unicode ({text[max(0, exc.start - 10):exc.end + 10]!r}, "
                            "from bytes that are not UTF-8?); re-encode the file as UTF-8") from None
    return text


def to_messages(prompt, where: str, column: str = "prompt", allow_text: bool = True) -> list[dict]:
    """A prompt cell as chat messages: plain text becomes one user message (if allowed)."""
    if isinstance(prompt, str) and allow_text:
        return [{"role": "user", "content": check_text(prompt, f"{where}, column {column!r}")}]
    if isinstance(prompt, np.ndarray):
        prompt = prompt.tolist()
    if isinstance(prompt, list) and prompt and all(
        isinstance(m, dict) and isinstance(m.get("role"), str) and isinstance(m.get("content"), str) for m in prompt
    ):
        where = f"{where}, column {column!r}"
        return [_message(m, where) for m in prompt]
    raise DataFileError(
        f"{where}, column {column!r}: expected {'a string or ' if allow_text else ''}a non-empty list of "
        "{'role': str, 'content': str} "
        f"messages, got {describe(prompt)}"
    )


EXTRA_MESSAGE_KEYS = ("tool_calls", "name", "tool_call_id")  # OpenAI's, passed to the chat template


def _message(m: dict, where: str) -> dict:
    """``role`` and ``content``, and the tool keys a chat template may render (an assistant's
    ``tool_calls``, a tool message's ``name`` / ``tool_call_id``); other keys are dropped."""
    out = {"role": check_text(m["role"], where), "content": check_text(m["content"], where)}
    for key in EXTRA_MESSAGE_KEYS:
        if m.get(key) is not None:
            out[key] = m[key].tolist() if isinstance(m[key], np.ndarray) else m[key]
    return out


def render_prompts(tokenizer, messages: Sequence[list[dict]], apply_chat_template: bool,
                   wheres: Sequence[str] | None = None, renderer=None) -> list[list[int]]:
    """Token ids of each prompt (chat template with generation prompt, or plain text;
    ``renderer``: a ``minihf.multi_turn.ChatRenderer`` that adds the tools)."""
    if renderer is not None:
        out = []
        for i, m in enumerate(messages):
            try:
                out.append(renderer.prompt_ids(m))
            except ValueError as exc:
                raise ValueError(f"{wheres[i] if wheres else f'prompt {i}'}: {exc}") from exc
        return out
    if apply_chat_template:
        if tokenizer.chat_template is None:
            raise ValueError("the tokenizer has no chat_template; set apply_chat_template=False for plain-text prompts")
        texts = []
        for i, m in enumerate(messages):
            try:
                texts.append(tokenizer.apply_chat_template(m, tokenize=False, add_generation_prompt=True))
            except Exception as exc:  # jinja raises its own types; say which row
                where = wheres[i] if wheres else f"prompt {i}"
                raise ValueError(f"{where}: the chat template failed on this prompt: {exc}") from exc
        return tokenizer(texts, add_special_tokens=False)["input_ids"]
    texts = ["\n".join(msg["content"] for msg in m) for m in messages]
    return tokenizer(texts)["input_ids"]


def fit_length(ids: list[int], max_length: int, truncation: str, where: str, limit_name: str) -> list[int] | None:
    """Apply the truncation mode to one sequence; ``None`` means filter it out."""
    if len(ids) <= max_length:
        return ids
    if truncation == "left":
        return ids[-max_length:]
    if truncation == "right":
        return ids[:max_length]
    if truncation == "filter":
        return None
    raise ValueError(
        f"{where}: {len(ids)} tokens, longer than {limit_name}={max_length}; raise the "
        "limit, or set truncation to 'left' (keep the end), 'right' (keep the start) or 'filter' (drop such rows)"
    )


def left_pad(seqs: Sequence[Sequence[int]], pad_id: int) -> dict[str, torch.Tensor]:
    """``input_ids``, ``attention_mask`` and ``position_ids`` [B, T] for left-padded sequences."""
    width = max(len(s) for s in seqs)
    input_ids = torch.full((len(seqs), width), pad_id, dtype=torch.long)
    attention_mask = torch.zeros((len(seqs), width), dtype=torch.long)
    for i, s in enumerate(seqs):
        if len(s):
            input_ids[i, width - len(s):] = torch.as_tensor(s, dtype=torch.long)
            attention_mask[i, width - len(s):] = 1
    position_ids = (attention_mask.cumsum(-1) - 1).clamp(min=0)  # [B, T], 0 at the first real token
    return {"input_ids": input_ids, "attention_mask": attention_mask, "position_ids": position_ids}


def refuse_unknown_chars(tok, texts, what: str) -> None:
    """A data file's characters that would all become the unknown token are an error naming
    the row (:func:`minihf.data.tokenizer.unknown_chars_error`), not silently trained on."""
    from minihf.data.tokenizer import unknown_chars_error

    message = unknown_chars_error(tok, texts, what, "remove them, use a model whose tokenizer has them, or let them through "
                                  "(data.allow_unk=true in training)")
    if message:
        raise DataFileError(message)


class RLDataset:
    """Prompts of one or more verl-format files, tokenised and length-checked at build time.

    ``truncation``: ``error`` (raise naming the row), ``left``/``right`` (keep the last/first
    ``max_prompt_length`` tokens) or ``filter`` (drop long rows; ``num_filtered`` says how
    many, and it is logged). ``allow_unk``: keep prompts with characters the tokenizer can
    only encode as its unknown token (refused by default, naming the row).
    """

    def __init__(self, files: str | Path | Sequence[str | Path], tokenizer, max_prompt_length: int = 512,
                 truncation: str = "error", apply_chat_template: bool = True, prompt_key: str = "prompt",
                 renderer=None, allow_unk: bool = False):
        check_truncation(truncation)
        self.tokenizer, self.max_prompt_length, self.truncation = tokenizer, max_prompt_length, truncation
        self.pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
        entries = read_many(files)
        by_file: dict[Path, list[dict]] = {}
        for path, _, row in entries:
            by_file.setdefault(path, []).append(row)
        for path, rows in by_file.items():
            require_columns(path, rows, [prompt_key, "data_source"])
        messages, records = [], []
        for path, i, row in entries:
            where = f"data file {path}, row {i}"
            messages.append(to_messages(row[prompt_key], where))
            records.append(self._record(row, where))
        wheres = [f"data file {path}, row {i}" for path, i, _ in entries]
        if not allow_unk:
            refuse_unknown_chars(tokenizer, [(w, m["content"]) for w, msgs in zip(wheres, messages) for m in msgs],
                                 "prompt")
        all_ids = render_prompts(tokenizer, messages, apply_chat_template, wheres, renderer)
        self.input_ids: list[list[int]] = []
        self.records: list[dict] = []
        for where, msgs, rec, ids in zip(wheres, messages, records, all_ids):
            if not len(ids):  # the engine needs a token to start from
                raise DataFileError(f"{where}: the prompt is empty once tokenised (generation needs a "
                                    "token to start from); give the row a prompt, or drop it")
            ids = fit_length(list(ids), max_prompt_length, truncation, where, "max_prompt_length")
            if ids is None:
                continue
            rec["raw_prompt"] = msgs
            self.input_ids.append(ids)
            self.records.append(rec)
        self.num_filtered = len(entries) - len(self.records)
        if self.num_filtered:
            logger.warning("RLDataset: filtered out %d of %d prompts longer than max_prompt_length=%d",
                           self.num_filtered, len(entries), max_prompt_length)
        if not self.records:
            raise ValueError(
                f"RLDataset: all {len(entries)} prompts are longer than max_prompt_length={max_prompt_length}; "
                "raise max_prompt_length or use truncation='left'/'right'"
            )

    @staticmethod
    def _record(row: dict, where: str) -> dict:
        source = row["data_source"]
        if not isinstance(source, str) or not source:
            raise DataFileError(f"{where}, column 'data_source': expected a non-empty string, got {describe(source)}")
        reward_model = row.get("reward_model")
        if reward_model is None:
            ground_truth = None
        elif isinstance(reward_model, dict) and "ground_truth" in reward_model:
            ground_truth = reward_model["ground_truth"]
        else:
            raise DataFileError(
                f"{where}, column 'reward_model': expected a dict with a 'ground_truth' key "
                f"(verl format), got {describe(reward_model)}"
            )
        extra_info = row.get("extra_info") or {}
        if not isinstance(extra_info, dict):
            raise DataFileError(f"{where}, column 'extra_info': expected a dict, got {describe(extra_info)}")
        return {"data_source": source, "ground_truth": ground_truth, "extra_info": extra_info}

    def __len__(self) -> int:
        return len(self.records)

    def __getitem__(self, index: int) -> dict:
        return {"input_ids": self.input_ids[index], "index": index, **self.records[index]}

    def collate(self, indices: Sequence[int]) -> Batch:
        """A left-padded Batch of the given rows (padded to the longest prompt among them)."""
        if len(indices) == 0:
            raise ValueError("RLDataset.collate: no indices given")
        tensors = left_pad([self.input_ids[i] for i in indices], self.pad_id)
        # copies: a reward function or environment that changes a row's extra_info (or
        # prompt) must not change the dataset's row for later epochs
        non_tensors = {key: [copy.deepcopy(self.records[i][key]) for i in indices]
                       for key in ("data_source", "ground_truth", "extra_info", "raw_prompt")}
        non_tensors["index"] = list(indices)
        return Batch.from_dict(tensors=tensors, non_tensors=non_tensors)


class PromptLoader:
    """Batches of an ``RLDataset`` in a deterministic, resumable order (see ``ResumableSampler``)."""

    def __init__(self, dataset: RLDataset, batch_size: int, *, shuffle: bool = True, seed: int = 0,
                 drop_last: bool = True):
        self.dataset = dataset
        self.sampler = ResumableSampler(len(dataset), batch_size, shuffle=shuffle, seed=seed, drop_last=drop_last)

    def __len__(self) -> int:
        return len(self.sampler)

    def __iter__(self) -> Iterator[Batch]:
        for indices in self.sampler:
            yield self.dataset.collate(indices)

    def next_batch(self) -> Batch:
        return self.dataset.collate(self.sampler.next_batch())

    @property
    def epoch(self) -> int:
        return self.sampler.epoch

    def state_dict(self) -> dict:
        return self.sampler.state_dict()

    def load_state_dict(self, state: dict) -> None:
        self.sampler.load_state_dict(state)

"""SFT datasets: prompt/response pairs or chat transcripts, with loss on responses only.

Rows are either ``prompt`` (text or chat messages) + ``response`` (text; assistant turns
inside the prompt are context), or ``messages`` (a chat transcript; every assistant turn is
a response). Each sequence is the chat-template rendering of the whole conversation;
``loss_mask`` is 1 exactly on the tokens of the trained assistant turns (content and their
end-of-turn text), found by rendering growing prefixes of the conversation
(:func:`tokenize_conversation`). Batches are right padded (training only; generation uses
the left-padded ``RLDataset``).
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Sequence

import torch

from minihf.data.files import DataFileError, describe, read_many
from minihf.data.rl_dataset import check_truncation, fit_length, refuse_unknown_chars, to_messages
from minihf.protocol import Batch

logger = logging.getLogger(__name__)


NOT_PREFIXES = ("the chat template does not render conversations prefix by prefix, so the assistant turns "
                "cannot be located; use a template whose turns append")


def _text(tokenizer, messages: list[dict], add_generation_prompt: bool, renderer=None) -> str:
    if not messages:
        return ""
    if renderer is not None:  # a minihf.multi_turn.ChatRenderer: the prompts offer tools
        return renderer.text(messages, add_generation_prompt)
    return tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=add_generation_prompt)


def _encode(tokenizer, text: str) -> list[int]:
    return tokenizer(text, add_special_tokens=False)["input_ids"] if text else []


def _pieces(tokenizer, messages: list[dict], trained, where: str, renderer=None) -> list[tuple[str, int]]:
    """The rendered conversation cut at each assistant turn's start and end: ``(text, 1 if
    the turn is trained else 0)``, the prompt before each turn rendered as the rollout
    renders it (with the generation prompt). A template that renders earlier turns
    differently once later ones follow is refused."""
    pieces, done = [], ""
    for k in trained:
        before = _text(tokenizer, messages[:k], True, renderer)
        after = _text(tokenizer, messages[:k + 1], False, renderer)
        if not (before.startswith(done) and after.startswith(before)):
            raise ValueError(f"{where}: {NOT_PREFIXES}")
        pieces += [(before[len(done):], 0), (after[len(before):], 1)]
        done = after
    full = _text(tokenizer, messages, False, renderer)
    if not full.startswith(done):
        raise ValueError(f"{where}: the chat template changes earlier turns when later ones are added")
    return pieces + [(full[len(done):], 0)]


def check_tool_calls_render(tokenizer, messages: list[dict], where: str, renderer=None) -> None:
    """A message's OpenAI ``tool_calls`` go to the chat template; one that ignores them
    would train on an empty assistant turn (the calls lost): refused, naming the row."""
    if not any(m.get("tool_calls") for m in messages):
        return
    plain = [{k: v for k, v in m.items() if k != "tool_calls"} for m in messages]
    if _text(tokenizer, messages, False, renderer) == _text(tokenizer, plain, False, renderer):
        raise DataFileError(f"{where}: a message's tool_calls are not rendered by this chat template, so they "
                            "would be lost; write each call in the assistant's content (hermes: "
                            "<tool_call>{\"name\": ..., \"arguments\": {...}}</tool_call>), or use a template "
                            "that renders tool_calls")


def tokenize_conversation(tokenizer, messages: list[dict], where: str, renderer=None,
                          last_only: bool = False) -> tuple[list[int], list[int]]:
    """``(input_ids, loss_mask)`` for a chat with loss on every assistant turn (``last_only``:
    on the last one; the assistant turns of a prompt are context). Rendered by ``renderer``
    when given (a multi-turn ``ChatRenderer`` offering tools).

    Each piece (the text before a trained turn, the turn: its content and end-of-turn text)
    is tokenised on its own, as the rollout tokenises a prompt and samples the response after
    it: a byte-level BPE would merge the generation prompt's newline with a response's leading
    spaces if the whole text were tokenised at once (a row answering "    return x" was
    refused). Where a piece does not read back as its text alone (a SentencePiece tokenizer
    adding a word-start space), the whole text is tokenised and must hold the pieces as
    token prefixes."""
    turns = [k for k, m in enumerate(messages) if m["role"] == "assistant"]
    if turns[:1] == [0]:
        raise DataFileError(f"{where}: the conversation starts with an assistant message, which has no prompt "
                            "to follow (a template cannot render the empty conversation before it); start it "
                            "with a system or user message")
    trained = turns[-1:] if last_only else turns
    if not trained:
        raise DataFileError(f"{where}: no assistant message to learn from; add a message with role 'assistant'")
    pieces = _pieces(tokenizer, messages, trained, where, renderer)
    encoded = [_encode(tokenizer, text) for text, _ in pieces]
    if all(tokenizer.decode(ids, skip_special_tokens=False, clean_up_tokenization_spaces=False) == text
           for ids, (text, _) in zip(encoded, pieces)):
        return ([t for ids in encoded for t in ids],
                [m for ids, (_, m) in zip(encoded, pieces) for _ in ids])
    ids, mask, text = [], [], ""
    for piece, m in pieces:  # token prefixes of the whole text, piece by piece
        text += piece
        grown = _encode(tokenizer, text)
        if grown[:len(ids)] != ids:
            raise ValueError(f"{where}: {NOT_PREFIXES}")
        mask += [m] * (len(grown) - len(ids))
        ids = grown
    return ids, mask


class SFTDataset:
    """Tokenised SFT rows with a response-only loss mask.

    ``truncation``: ``error``, ``right`` (drop the end), ``left`` (drop the start) or
    ``filter`` (drop the row; counted in ``num_filtered``). Rows whose truncated form has no
    response token left are an error in every mode. ``response_key`` may be a dotted path
    into a dict column: ``"extra_info.answer"`` trains on the reference answers that
    ``minihf make-data`` writes, straight from the RL files. ``allow_unk``: keep rows with
    characters the tokenizer can only encode as its unknown token (refused by default).
    """

    def __init__(self, files: str | Path | Sequence[str | Path], tokenizer, max_length: int = 1024,
                 truncation: str = "error", response_key: str = "response", renderer=None,
                 allow_unk: bool = False):
        check_truncation(truncation)
        self.response_key = response_key
        if tokenizer.chat_template is None:
            raise ValueError("SFTDataset needs a tokenizer with a chat_template (see minihf.data.tokenizer)")
        self.pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
        self.input_ids: list[list[int]] = []
        self.loss_mask: list[list[int]] = []
        entries = read_many(files)
        wheres = [f"data file {path}, row {i}" for path, i, _ in entries]
        chats = [(where, self._messages(row, where)) for where, (_, _, row) in zip(wheres, entries)]
        # a prompt/response row trains on its response alone (assistant turns in its prompt,
        # few-shot examples, are context); a messages row on every assistant turn
        transcript = [row.get("messages") is None for _, _, row in entries]
        if not allow_unk:
            refuse_unknown_chars(tokenizer, [(where, m["content"]) for where, msgs in chats for m in msgs], "example")
        for (where, messages), last_only in zip(chats, transcript):
            check_tool_calls_render(tokenizer, messages, where, renderer)
            ids, mask = tokenize_conversation(tokenizer, messages, where, renderer, last_only=last_only)
            kept = fit_length(list(zip(ids, mask)), max_length, truncation, where, "max_length")
            if kept is None:
                continue
            if not any(m for _, m in kept):
                raise ValueError(f"{where}: truncation to max_length={max_length} removed every response token; "
                                 "raise max_length or use truncation='left'")
            self.input_ids.append([t for t, _ in kept])
            self.loss_mask.append([m for _, m in kept])
        self.num_filtered = len(entries) - len(self.input_ids)
        if self.num_filtered:
            logger.warning("SFTDataset: filtered out %d of %d rows longer than max_length=%d",
                           self.num_filtered, len(entries), max_length)
        if not self.input_ids:
            raise ValueError(f"SFTDataset: every row is longer than max_length={max_length}; raise it or truncate")

    def _messages(self, row: dict, where: str) -> list[dict]:
        if row.get("messages") is not None:
            return to_messages(row["messages"], where, column="messages", allow_text=False)
        response = row
        for part in self.response_key.split("."):
            response = response.get(part) if isinstance(response, dict) else None
        if "prompt" not in row or response is None:
            empty = sorted(k for k in ("prompt", self.response_key) if k in row and row[k] is None)
            found = f"{empty} are null" if empty else f"found {sorted(row)}"
            raise DataFileError(f"{where}: SFT rows need 'prompt' and {self.response_key!r} columns, or 'messages'; "
                                f"{found}")
        if not isinstance(response, str):
            raise DataFileError(f"{where}, column {self.response_key!r}: expected a string, got {describe(response)}")
        return to_messages(row["prompt"], where) + [{"role": "assistant", "content": response}]

    def __len__(self) -> int:
        return len(self.input_ids)

    def __getitem__(self, index: int) -> dict:
        return {"input_ids": self.input_ids[index], "loss_mask": self.loss_mask[index]}

    def collate(self, indices: Sequence[int]) -> Batch:
        """Right-padded ``input_ids``, ``attention_mask``, ``position_ids``, ``loss_mask`` [B, T]."""
        width = max(len(self.input_ids[i]) for i in indices)
        out = {k: torch.zeros((len(indices), width), dtype=torch.long)
               for k in ("input_ids", "attention_mask", "position_ids", "loss_mask")}
        out["input_ids"].fill_(self.pad_id)
        for row, i in enumerate(indices):
            n = len(self.input_ids[i])
            out["input_ids"][row, :n] = torch.as_tensor(self.input_ids[i])
            out["attention_mask"][row, :n] = 1
            out["position_ids"][row, :n] = torch.arange(n)
            out["loss_mask"][row, :n] = torch.as_tensor(self.loss_mask[i])
        return Batch.from_dict(tensors=out, non_tensors={"index": list(indices)})


def scored_end(ids: list[int], mask: list[int], eos_id: int | None) -> int:
    """Where a pair's side ends: just after its response's last end-of-sequence token, the
    token a rollout stops on and the reward model reads the score at (ChatML renders a
    newline after ``<|im_end|>``: the score head was trained on the newline and used on
    ``<|im_end|>``); the whole sequence when the response holds none."""
    ends = [i for i, (t, m) in enumerate(zip(ids, mask)) if m and t == eos_id]
    return ends[-1] + 1 if ends else len(ids)


class PairDataset:
    """Preference pairs for reward-model training: rows with ``prompt`` (text or chat
    messages), ``chosen`` and ``rejected`` (response texts). Each side is the chat-template
    rendering of prompt + response (as ``SFTDataset`` renders it), cut after the response's
    end-of-sequence token, where the score is read, as on a rollout's response. ``truncation`` applies to each side; a pair
    with a side filtered out is dropped (``num_filtered``). Optional ``chosen_sign`` and
    ``rejected_sign`` columns (+1, -1, or 0 for unlabeled) give the sign each side's score
    should have: Safe-RLHF's safety labels for a cost model (+1 unsafe)."""

    SIDES = ("chosen", "rejected")

    def __init__(self, files: str | Path | Sequence[str | Path], tokenizer, max_length: int = 1024,
                 truncation: str = "error", allow_unk: bool = False):
        check_truncation(truncation)
        if tokenizer.chat_template is None:
            raise ValueError("PairDataset needs a tokenizer with a chat_template (see minihf.data.tokenizer)")
        self.pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
        self.ids: dict[str, list[list[int]]] = {side: [] for side in self.SIDES}
        self.signs: dict[str, list[int]] = {side: [] for side in self.SIDES}
        entries = read_many(files)
        texts: list[tuple[str, str]] = []  # checked for unknown characters once, at the end
        for path, i, row in entries:
            where = f"data file {path}, row {i}"
            missing = [c for c in ("prompt",) + self.SIDES if c not in row]
            if missing:
                raise DataFileError(f"{where}: preference rows need 'prompt', 'chosen' and 'rejected' columns; "
                                    f"missing {missing} (found {sorted(row)}); write pairs with "
                                    "`minihf make-data TASK DIR --pairs`")
            prompt = to_messages(row["prompt"], where)
            sides = {}
            for side in self.SIDES:
                if not isinstance(row[side], str):
                    raise DataFileError(f"{where}, column {side!r}: expected a string, got {describe(row[side])}")
            texts += [(where, m["content"]) for m in prompt] + [(f"{where} ({s})", row[s]) for s in self.SIDES]
            for side in self.SIDES:
                ids, mask = tokenize_conversation(tokenizer, prompt + [{"role": "assistant", "content": row[side]}],
                                                  where, last_only=True)
                ids = ids[:scored_end(ids, mask, tokenizer.eos_token_id)]
                sides[side] = fit_length(ids, max_length, truncation, f"{where} ({side})", "max_length")
            signs = self._signs(row, where)
            if any(v is None for v in sides.values()):
                continue
            for side in self.SIDES:
                self.ids[side].append(sides[side])
                self.signs[side].append(signs[side])
        if not allow_unk:
            refuse_unknown_chars(tokenizer, texts, "pair")
        self.num_filtered = len(entries) - len(self.ids["chosen"])
        if self.num_filtered:
            logger.warning("PairDataset: filtered out %d of %d pairs longer than max_length=%d",
                           self.num_filtered, len(entries), max_length)
        if not self.ids["chosen"]:
            raise ValueError(f"PairDataset: every pair is longer than max_length={max_length}; raise it or truncate")

    def _signs(self, row: dict, where: str) -> dict[str, int]:
        cols = [f"{side}_sign" for side in self.SIDES]
        present = [c for c in cols if row.get(c) is not None]
        if not present:
            return {side: 0 for side in self.SIDES}
        if len(present) == 1:
            raise DataFileError(f"{where}: {present[0]!r} without {(set(cols) - set(present)).pop()!r}; "
                                "give both sign columns or neither")
        out = {}
        for side, col in zip(self.SIDES, cols):
            value = row[col]
            if isinstance(value, bool) or value not in (-1, 0, 1):
                raise DataFileError(f"{where}, column {col!r}: expected -1, 0 or 1, got {describe(value)}")
            out[side] = int(value)
        return out

    def __len__(self) -> int:
        return len(self.ids["chosen"])

    @property
    def has_signs(self) -> bool:
        return any(any(v) for v in self.signs.values())

    def collate(self, indices: Sequence[int]) -> Batch:
        """Per side, right-padded ``<side>_input_ids``, ``<side>_attention_mask``,
        ``<side>_position_ids`` [B, T_side] (one row per pair, so pairs never split),
        ``<side>_sign`` [B] (0 where unlabeled) and ``weight`` [B] (ones)."""
        out = {}
        for side in self.SIDES:
            seqs = [self.ids[side][i] for i in indices]
            width = max(len(s) for s in seqs)
            ids = torch.full((len(seqs), width), self.pad_id, dtype=torch.long)
            mask = torch.zeros((len(seqs), width), dtype=torch.long)
            for row, s in enumerate(seqs):
                ids[row, :len(s)] = torch.as_tensor(s)
                mask[row, :len(s)] = 1
            out[f"{side}_input_ids"], out[f"{side}_attention_mask"] = ids, mask
            out[f"{side}_position_ids"] = (mask.cumsum(-1) - 1).clamp(min=0)
            out[f"{side}_sign"] = torch.tensor([self.signs[side][i] for i in indices], dtype=torch.float32)
        out["weight"] = torch.ones(len(indices))  # 0 marks fill rows (see minihf.trainer.rm)
        return Batch.from_dict(tensors=out, non_tensors={"index": list(indices)})

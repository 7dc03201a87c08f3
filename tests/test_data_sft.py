"""SFTDataset: loss mask exactly on response tokens, multi-turn chats, truncation, right padding."""

import pyarrow.parquet as pq
import pytest

from minihf.data.files import DataFileError, write_rows
from minihf.data.sft_dataset import SFTDataset
from minihf.data.tasks import make_task_data
from minihf.data.tokenizer import build_char_tokenizer, encode_chat

TOK = build_char_tokenizer("0123456789+-=,:")


def _ids(text):
    return TOK(text, add_special_tokens=False)["input_ids"]


def test_prompt_response_mask_is_response_plus_eos(tmp_path):
    path = write_rows([{"prompt": "12+3=", "response": "15"},
                       {"prompt": [{"role": "user", "content": "1-1="}], "response": "0"}], tmp_path / "s.jsonl")
    ds = SFTDataset(path, TOK)
    prompt_ids = encode_chat(TOK, [{"role": "user", "content": "12+3="}])
    expected = prompt_ids + _ids("15") + [TOK.eos_token_id]
    assert ds[0]["input_ids"] == expected
    assert ds[0]["loss_mask"] == [0] * len(prompt_ids) + [1, 1, 1]
    batch = ds.collate([1, 0])
    n1, n0 = len(ds[1]["input_ids"]), len(expected)
    assert batch["input_ids"].shape == (2, n0)
    assert batch["input_ids"][0, n1:].eq(TOK.pad_token_id).all()  # right padded
    assert batch["attention_mask"][0].tolist() == [1] * n1 + [0] * (n0 - n1)
    assert batch["loss_mask"][1].tolist() == ds[0]["loss_mask"]
    assert batch["position_ids"][1].tolist() == list(range(n0))


def test_multi_turn_messages_mask_every_assistant_turn(tmp_path):
    messages = [{"role": "system", "content": "0"}, {"role": "user", "content": "1+1="},
                {"role": "assistant", "content": "2"}, {"role": "user", "content": "2+2="},
                {"role": "assistant", "content": "4"}]
    ds = SFTDataset(write_rows([{"messages": messages}], tmp_path / "m.jsonl"), TOK)
    ids, mask = ds[0]["input_ids"], ds[0]["loss_mask"]
    assert ids == encode_chat(TOK, messages, add_generation_prompt=False)
    learned = [t for t, m in zip(ids, mask) if m]
    assert learned == _ids("2") + [TOK.eos_token_id] + _ids("4") + [TOK.eos_token_id]


def test_truncation_modes(tmp_path):
    path = write_rows([{"prompt": "1+1=", "response": "2"}, {"prompt": "1234567+1=", "response": "1234568"}],
                      tmp_path / "t.jsonl")
    long_ids = SFTDataset(path, TOK)[1]["input_ids"]
    limit = len(long_ids) - 3
    with pytest.raises(ValueError, match=rf"row 1: {len(long_ids)} tokens, longer than max_length={limit}"):
        SFTDataset(path, TOK, max_length=limit)
    right = SFTDataset(path, TOK, max_length=limit, truncation="right")
    assert right[1]["input_ids"] == long_ids[:limit] and sum(right[1]["loss_mask"]) == 8 - 3
    left = SFTDataset(path, TOK, max_length=limit, truncation="left")
    assert left[1]["input_ids"] == long_ids[-limit:] and sum(left[1]["loss_mask"]) == 8
    filtered = SFTDataset(path, TOK, max_length=limit, truncation="filter")
    assert len(filtered) == 1 and filtered.num_filtered == 1
    with pytest.raises(ValueError, match="removed every response token"):
        SFTDataset(path, TOK, max_length=4, truncation="right")


@pytest.mark.parametrize("row, match", [
    ({"prompt": "1"}, "need 'prompt' and 'response'"),
    ({"prompt": "1", "response": None}, r"need 'prompt' and 'response' columns, or 'messages'; \['response'\] are null"),
    ({"prompt": "1", "response": 2}, "column 'response'"),
    ({"messages": [{"role": "user", "content": "1"}]}, "no assistant message"),
    ({"messages": "1+1"}, "column 'messages'"),
])
def test_bad_rows(tmp_path, row, match):
    path = tmp_path / "bad.jsonl"
    write_rows([row], path)
    with pytest.raises(DataFileError, match=match):
        SFTDataset(path, TOK)


def test_task_files_train_on_reference_answers(tmp_path):
    paths = make_task_data("arith", tmp_path, num_train=6, num_test=0, seed=0)
    ds = SFTDataset(paths["train"], TOK, response_key="extra_info.answer")
    rows = pq.read_table(paths["train"]).to_pylist()
    for i, r in enumerate(rows):
        learned = [t for t, m in zip(ds[i]["input_ids"], ds[i]["loss_mask"]) if m]
        assert learned == _ids(r["extra_info"]["answer"]) + [TOK.eos_token_id]


def test_characters_outside_the_vocabulary_are_refused_naming_the_row(tmp_path):
    """A character tokenizer encodes an unknown character as ``<unk>``: RL prompts, SFT
    examples and RM pairs holding one were trained on silently (an SFT response of four
    ``<unk>``); now the row is named, and ``allow_unk`` lets it through."""
    from minihf.data.rl_dataset import RLDataset
    from minihf.data.sft_dataset import PairDataset

    rl = write_rows([{"data_source": "d", "prompt": "1+2="}, {"data_source": "d", "prompt": "What is 1+2?"}],
                    tmp_path / "rl.jsonl")
    with pytest.raises(DataFileError, match=rf"{rl}, row 1: the prompt has characters outside the model's vocabulary: "
                                            r"\[' ', '\?', 'W', 'a', 'h', 'i', 's', 't'\] \(they would all become '<unk>'\)"):
        RLDataset(rl, TOK)
    assert len(RLDataset(rl, TOK, allow_unk=True)) == 2
    sft = write_rows([{"prompt": "1+2=", "response": "3"}, {"prompt": "1+2=", "response": "three"}],
                     tmp_path / "sft.jsonl")
    with pytest.raises(DataFileError, match=rf"{sft}, row 1: the example has characters outside .*\['e', 'h', 'r', 't'\]"):
        SFTDataset(sft, TOK)
    assert TOK.unk_token_id in SFTDataset(sft, TOK, allow_unk=True).input_ids[1]
    pairs = write_rows([{"prompt": "1+2=", "chosen": "3", "rejected": "4"},
                        {"prompt": "1+2=", "chosen": "3", "rejected": "4?"}], tmp_path / "pairs.jsonl")
    with pytest.raises(DataFileError, match=rf"{pairs}, row 1 \(rejected\): the pair has characters outside .*\['\?'\]"):
        PairDataset(pairs, TOK)
    assert len(PairDataset(pairs, TOK, allow_unk=True)) == 2
    spelled = write_rows([{"prompt": "1+<unk>=", "response": "3"}], tmp_path / "spelled.jsonl")
    assert len(SFTDataset(spelled, TOK)) == 1  # the text asks for the unknown token itself
    added = write_rows([{"prompt": "1+2=", "response": "3<eos>"}], tmp_path / "added.jsonl")
    assert len(SFTDataset(added, TOK)) == 1  # an added token is one token, not '<', 'e', ...


def test_smollm2_rows_with_leading_whitespace_and_few_shot_prompts(tmp_path, smollm2_tokenizer_dir):
    """A byte-level BPE merges the generation prompt's newline with a response's leading
    spaces when the whole text is tokenised: "    return x" was refused as a template that
    does not render prefix by prefix. Each piece is tokenised as the rollout does (the
    prompt with its generation prompt, then the response), and assistant turns inside a
    prompt (few-shot examples) are context, not trained on."""
    from minihf.data import load_tokenizer

    tok = load_tokenizer(smollm2_tokenizer_dir, padding_side="right")
    shots = [{"role": "user", "content": "2+2?"}, {"role": "assistant", "content": "EXAMPLE4"},
             {"role": "user", "content": "3+3?"}]
    rows = [{"prompt": "Write f.", "response": "    return x + 1"}, {"prompt": shots, "response": "6"},
            {"prompt": "Say hi.", "response": "\n\nhello"}]
    ds = SFTDataset(write_rows(rows, tmp_path / "s.jsonl"), tok)
    for i, (row, response) in enumerate([(rows[0], "    return x + 1"), (rows[1], "6"), (rows[2], "\n\nhello")]):
        ids, mask = ds[i]["input_ids"], ds[i]["loss_mask"]
        prompt = row["prompt"] if isinstance(row["prompt"], list) else [{"role": "user", "content": row["prompt"]}]
        rollout_prompt = tok(tok.apply_chat_template(prompt, tokenize=False, add_generation_prompt=True),
                             add_special_tokens=False)["input_ids"]
        assert ids[:len(rollout_prompt)] == rollout_prompt and not any(mask[:len(rollout_prompt)])
        trained = tok.decode([t for t, m in zip(ids, mask) if m])
        assert trained == response + "<|im_end|>\n", (i, trained)


def test_a_reward_models_pair_ends_where_a_rollout_stops(tmp_path, smollm2_tokenizer_dir):
    """ChatML renders a newline after <|im_end|>: each side ended on it, so the score head
    was trained on the newline and read on <|im_end|>, where a rollout stops. Each side
    now ends on its response's end-of-sequence token."""
    from minihf.data import load_tokenizer
    from minihf.data.sft_dataset import PairDataset

    tok = load_tokenizer(smollm2_tokenizer_dir, padding_side="right")
    path = write_rows([{"prompt": "Sort 3,1.", "chosen": "1,3", "rejected": "3,1"}], tmp_path / "p.jsonl")
    ds = PairDataset(path, tok)
    for side in ("chosen", "rejected"):
        ids = ds.ids[side][0]
        assert ids[-1] == tok.eos_token_id == tok.convert_tokens_to_ids("<|im_end|>")
        assert tok.decode(ids).endswith(f"assistant\n{'1,3' if side == 'chosen' else '3,1'}<|im_end|>")
    char = PairDataset(write_rows([{"prompt": "1+2=", "chosen": "3", "rejected": "4"}], tmp_path / "c.jsonl"), TOK)
    assert char.ids["chosen"][0][-1] == TOK.eos_token_id  # a template ending on eos: unchanged


def test_tool_calls_an_assistant_first_chat_and_mixed_formats(tmp_path, smollm2_tokenizer_dir):
    """OpenAI tool_calls were dropped (an empty assistant turn trained on, the call lost):
    they reach the template, and a template that does not render them is refused naming
    the row. An assistant-first chat failed inside transformers naming nothing; a parquet
    file mixing prompt/response and messages rows (messages=None) was refused."""
    from minihf.data import load_tokenizer

    call = {"role": "assistant", "content": "", "tool_calls": [{"type": "function", "function": {"name": "calc"}}]}
    chat = [{"role": "user", "content": "1+1="}, call, {"role": "user", "content": "2"},
            {"role": "assistant", "content": "2"}]
    smol = load_tokenizer(smollm2_tokenizer_dir, padding_side="right")
    with pytest.raises(DataFileError, match=r"row 0: a message's tool_calls are not rendered by this chat template"):
        SFTDataset(write_rows([{"messages": chat}], tmp_path / "tc.jsonl"), smol)
    renders = build_char_tokenizer("0123456789+-=,:")
    renders.chat_template = ("{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}{% if m.get('tool_calls') %}"
                             "99{% endif %}{{ eos_token }}{% endfor %}{% if add_generation_prompt %}<|assistant|>{% endif %}")
    ds = SFTDataset(write_rows([{"messages": chat}], tmp_path / "tc.jsonl"), renders)
    trained = renders.decode([t for t, m in zip(ds[0]["input_ids"], ds[0]["loss_mask"]) if m])
    assert trained.replace(" ", "") == "99<eos>2<eos>"
    with pytest.raises(DataFileError, match="row 0: the conversation starts with an assistant message"):
        SFTDataset(write_rows([{"messages": chat[1:]}], tmp_path / "af.jsonl"), renders)
    mixed = write_rows([{"prompt": "1+1=", "response": "2"}, {"messages": chat[2:]}], tmp_path / "mixed.parquet")
    assert len(SFTDataset(mixed, TOK)) == 2

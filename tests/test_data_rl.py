"""RLDataset: chat rendering, truncation modes, left padding, bad files; sampler resume."""

import json
import logging

import pytest
import torch

from minihf.data.files import DataFileError, write_rows
from minihf.data.rl_dataset import PromptLoader, RLDataset
from minihf.data.sampler import ResumableSampler
from minihf.data.tokenizer import build_char_tokenizer, encode_chat

TOK = build_char_tokenizer("0123456789+-=,:")
OVERHEAD = len(encode_chat(TOK, [{"role": "user", "content": ""}]))  # bos, role markers, eos


def row(content, source="minihf/arith", truth="1", extra=None):
    return {"data_source": source, "prompt": [{"role": "user", "content": content}],
            "reward_model": {"style": "rule", "ground_truth": truth}, "extra_info": extra or {"i": 0}}


ROWS = [row("1+2="), row("12345+6789="), row("9-9=", truth="0")]


@pytest.fixture(params=["parquet", "jsonl"])
def data_file(tmp_path, request):
    return write_rows(ROWS, tmp_path / f"d.{request.param}")


def test_rows_render_and_left_pad(data_file):
    ds = RLDataset(data_file, TOK, max_prompt_length=64)
    assert len(ds) == 3 and ds.num_filtered == 0
    for i, r in enumerate(ROWS):
        assert ds[i]["input_ids"] == encode_chat(TOK, r["prompt"])
    batch = ds.collate([0, 1])
    ids, mask, pos = batch["input_ids"], batch["attention_mask"], batch["position_ids"]
    n0, n1 = len(ds[0]["input_ids"]), len(ds[1]["input_ids"])
    assert ids.shape == (2, n1) and n0 < n1
    assert ids[0, : n1 - n0].eq(TOK.pad_token_id).all() and mask[0, : n1 - n0].eq(0).all()
    assert ids[0, n1 - n0:].tolist() == ds[0]["input_ids"] and mask[1].eq(1).all()
    assert pos[0, n1 - n0:].tolist() == list(range(n0)) and pos[1].tolist() == list(range(n1))
    assert list(batch.non_tensors["ground_truth"]) == ["1", "1"]
    assert list(batch.non_tensors["data_source"]) == ["minihf/arith"] * 2
    assert batch.non_tensors["raw_prompt"][1] == ROWS[1]["prompt"]
    assert list(batch.non_tensors["index"]) == [0, 1]


def test_plain_text_prompt_is_a_user_message(tmp_path):
    path = write_rows([{"data_source": "d", "prompt": "1+2="}], tmp_path / "p.jsonl")
    ds = RLDataset(path, TOK)
    assert ds[0]["input_ids"] == encode_chat(TOK, [{"role": "user", "content": "1+2="}])
    assert ds[0]["ground_truth"] is None and ds[0]["extra_info"] == {}
    raw = RLDataset(path, TOK, apply_chat_template=False)
    assert raw[0]["input_ids"] == TOK("1+2=")["input_ids"]


def test_truncation_modes(data_file, caplog):
    full = encode_chat(TOK, ROWS[1]["prompt"])
    limit = OVERHEAD + 6  # rows 0 and 2 fit, row 1 (11 chars) does not
    with pytest.raises(ValueError, match=rf"row 1: {len(full)} tokens, longer than max_prompt_length={limit}.*'filter'"):
        RLDataset(data_file, TOK, max_prompt_length=limit)
    assert RLDataset(data_file, TOK, max_prompt_length=limit, truncation="left")[1]["input_ids"] == full[-limit:]
    assert RLDataset(data_file, TOK, max_prompt_length=limit, truncation="right")[1]["input_ids"] == full[:limit]
    with caplog.at_level(logging.WARNING):
        ds = RLDataset(data_file, TOK, max_prompt_length=limit, truncation="filter")
    assert ds.num_filtered == 1 and len(ds) == 2 and "filtered out 1 of 3" in caplog.text
    assert [ds[i]["ground_truth"] for i in range(2)] == ["1", "0"]
    with pytest.raises(ValueError, match="all 3 prompts"):
        RLDataset(data_file, TOK, max_prompt_length=2, truncation="filter")
    with pytest.raises(ValueError, match="not one of"):
        RLDataset(data_file, TOK, truncation="middle")


@pytest.mark.parametrize("content, match", [
    ("", "has no rows"),
    ('{"data_source": "d", "prompt": "1"}\n{"data_source": ', "line 2: invalid JSON"),
    ('{"prompt": "1"}\n', r"row 0: missing column\(s\) \['data_source'\]"),
    ('{"data_source": "d", "prompt": "1"}\n{"data_source": "d", "prompt": 5}\n', "row 1, column 'prompt'"),
    ('{"data_source": "d", "prompt": [{"role": "user"}]}\n', "row 0, column 'prompt'"),
    ('{"data_source": 3, "prompt": "1"}\n', "row 0, column 'data_source'"),
    ('{"data_source": "d", "prompt": "1", "reward_model": {"truth": 1}}\n', "row 0, column 'reward_model'"),
    ('{"data_source": "d", "prompt": "1", "extra_info": [1]}\n', "row 0, column 'extra_info'"),
])
def test_bad_files_name_file_row_column(tmp_path, content, match):
    path = tmp_path / "bad.jsonl"
    path.write_text(content)
    with pytest.raises(DataFileError, match=match) as info:
        RLDataset(path, TOK)
    assert str(path) in str(info.value)


def test_chat_template_failure_names_row(tmp_path):
    path = write_rows([row("1"), {**row("2"), "prompt": [{"role": "tool", "content": "2"}]}], tmp_path / "r.jsonl")
    with pytest.raises(ValueError, match="row 1: the chat template failed.*unknown role tool"):
        RLDataset(path, TOK)


def test_missing_and_unsupported_files(tmp_path):
    with pytest.raises(DataFileError, match="does not exist"):
        RLDataset(tmp_path / "none.parquet", TOK)
    (tmp_path / "x.csv").write_text("a,b\n")
    with pytest.raises(DataFileError, match="unsupported suffix"):
        RLDataset(tmp_path / "x.csv", TOK)
    (tmp_path / "x.parquet").write_text("not parquet")
    with pytest.raises(DataFileError, match="not a readable parquet"):
        RLDataset(tmp_path / "x.parquet", TOK)


def test_text_that_is_not_utf8_and_empty_prompts_name_the_file(tmp_path):
    """A file that is not UTF-8 names the file and the line (the decoder's own offset is into
    a chunk of the file); a byte-order mark is fine. A prompt empty once tokenised is refused
    naming the row (the engine refused it later, at the first generation, without the row)."""
    good = b'{"data_source": "d", "prompt": "1"}\n'
    for suffix in ("jsonl", "json"):
        path = tmp_path / f"latin.{suffix}"
        path.write_bytes(good * 3000 + b'{"data_source": "d", "prompt": "1\xff"}\n')
        with pytest.raises(DataFileError, match=rf"data file {path} is not UTF-8 text \(line 3001, byte 34: "
                                                r"invalid start byte\); save it as UTF-8"):
            RLDataset(path, TOK)
        path.write_bytes(b"\xef\xbb\xbf" + good * 2)
        assert len(RLDataset(path, TOK)) == 2
    path = write_rows([row("1"), {**row(""), "prompt": ""}], tmp_path / "empty.jsonl")
    assert RLDataset(path, TOK).input_ids[1]  # the chat template's tokens
    with pytest.raises(DataFileError, match=rf"data file {path}, row 1: the prompt is empty once tokenised"):
        RLDataset(path, TOK, apply_chat_template=False)


def test_several_files_concatenate(tmp_path):
    a = write_rows(ROWS[:2], tmp_path / "a.parquet")
    b = write_rows([row("5+5=", source="other")], tmp_path / "b.jsonl")
    ds = RLDataset([a, b], TOK)
    assert len(ds) == 3 and ds[2]["data_source"] == "other"


def _take(sampler, n):
    return [sampler.next_batch() for _ in range(n)]


def test_sampler_epochs_are_permutations_and_seeded():
    s = ResumableSampler(10, 3, seed=4)
    epoch0 = list(s)
    assert len(epoch0) == 3 and len({i for b in epoch0 for i in b}) == 9  # drop_last
    epoch1 = list(s)
    assert s.epoch == 1 and epoch1 != epoch0
    assert list(ResumableSampler(10, 3, seed=4)) == epoch0
    assert list(ResumableSampler(10, 3, seed=5)) != epoch0
    keep = ResumableSampler(10, 3, shuffle=False, drop_last=False)
    assert list(keep) == [[0, 1, 2], [3, 4, 5], [6, 7, 8], [9]]


@pytest.mark.parametrize("stop", [0, 2, 3, 4, 7])
def test_sampler_resume_yields_exactly_the_rest(stop):
    reference = _take(ResumableSampler(10, 3, seed=1), 9)
    first = ResumableSampler(10, 3, seed=1)
    head = _take(first, stop)
    state = json.loads(json.dumps(first.state_dict()))  # survives a checkpoint file
    resumed = ResumableSampler(10, 3, seed=1)
    resumed.load_state_dict(state)
    assert head + _take(resumed, 9 - stop) == reference


def test_sampler_resume_mid_epoch_via_iteration():
    s = ResumableSampler(12, 4, seed=0)
    it = iter(s)
    seen = [next(it)]
    r = ResumableSampler(12, 4, seed=0)
    r.load_state_dict(s.state_dict())
    assert seen + list(r) == list(ResumableSampler(12, 4, seed=0))
    with pytest.raises(ValueError, match="batch_size"):
        ResumableSampler(12, 3, seed=0).load_state_dict(s.state_dict())


def test_prompt_loader_resume(data_file):
    ds = RLDataset(data_file, TOK)
    loader = PromptLoader(ds, batch_size=2, seed=3, drop_last=False)
    first = loader.next_batch()
    clone = PromptLoader(ds, batch_size=2, seed=3, drop_last=False)
    clone.load_state_dict(loader.state_dict())
    a, b = loader.next_batch(), clone.next_batch()
    assert torch.equal(a["input_ids"], b["input_ids"])
    assert list(a.non_tensors["index"]) == list(b.non_tensors["index"])
    assert sorted(list(first.non_tensors["index"]) + list(a.non_tensors["index"])) == [0, 1, 2]


def test_rl_refuses_a_tokenizer_past_the_models_vocabulary(tmp_path):
    """The RL trainer, as SFT and RM (test_sft.py): another model's tokenizer files make ids
    past the embedding; the first is refused before any step, naming both files (it was an
    IndexError inside ``F.embedding`` at the first generation, a device assert on CUDA)."""
    import re
    import shutil

    from minihf.hub import init_model
    from minihf.trainer.ppo import PPOTrainer
    from test_ppo import ScriptedActor, job_config

    model = init_model(tmp_path / "m", size="tiny", task="digits")
    other = init_model(tmp_path / "other", size="tiny", task="chat_arith")
    for f in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "chat_template.jinja"):
        if (other / f).exists():
            shutil.copy(other / f, model / f)
    rows = [row("What is 1+2?") for _ in range(4)]
    write_rows(rows, tmp_path / "train.parquet")
    write_rows(rows, tmp_path / "test.parquet")
    cfg = job_config(str(model), str(tmp_path), tmp_path / "run", "grpo")
    says = (r"data .*train.parquet.*: token id \d+ \('.*'\) is past the model's vocabulary of \d+ \(vocab_size in "
            rf"{re.escape(str(model))}/config.json\); the tokenizer \(\d+ tokens\) is not this model's")
    with pytest.raises(ValueError, match=says):
        PPOTrainer(cfg, {"actor": ScriptedActor()}, log=lambda *a: None)


def test_parquet_keeps_a_column_the_first_row_lacks(tmp_path):
    """pyarrow's from_pylist takes the columns from the first row: a later row's extra
    column was dropped from the .parquet file while the .jsonl copy kept it."""
    from minihf.data.files import read_rows

    rows = [{"a": 1}, {"a": 2, "b": "x"}]
    assert read_rows(write_rows(rows, tmp_path / "r.parquet")) == [{"a": 1, "b": None}, {"a": 2, "b": "x"}]

"""A real BPE tokenizer and chat template through minihf, on tiny random models (CPU).

* ``minihf convert-gguf`` on a tiny llama GGUF (Q8_0 weights, SmolLM2's BPE tokenizer and
  ChatML template in its header): the HF dir it writes has no quantization settings; minihf
  and transformers give equal logits on a padded chat batch, also equal to transformers
  reading the GGUF itself; its tokenizer gives the fixture's ids; bad inputs are one clear
  error each.
* The RL data path with that tokenizer: chat prompts rendered and measured in tokens,
  generation's EOS is ``<|im_end|>`` from the generation config, the reward sees the
  decoded response without ``<|im_end|>`` or padding (pad = eos here), and a GRPO step runs
  on 2 processes with a reward that checks what it is given.
* Rollout TP must split 9 query / 3 KV heads: TP 2 is a config error saying so.
The same on the converted SmolLM2 itself: ``test_smollm2.py`` (slow).
"""

import json
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from minihf.config import ConfigError

CHAT = [[{"role": "user", "content": "What is 47 + 8? Answer with just the number."}],
        [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Héllo — 1,234 + 5?\n\tok"}],
        [{"role": "user", "content": "hi"}]]


def write_tiny_gguf(path: Path, tokenizer_dir: Path, arch: str = "llama", seed: int = 0) -> None:
    """A llama.cpp-style GGUF: hidden 64, 2 layers, 4 query / 2 KV heads, tied embeddings,
    2-D weights quantized to Q8_0, the tokenizer of ``tokenizer_dir`` in the header."""
    import gguf

    tok = json.loads((tokenizer_dir / "tokenizer.json").read_text())
    vocab = tok["model"]["vocab"]
    tokens = [None] * len(vocab)
    for t, i in vocab.items():
        tokens[i] = t
    special = {a["id"] for a in tok["added_tokens"] if a["special"]}
    types = [gguf.TokenType.CONTROL if i in special else gguf.TokenType.NORMAL for i in range(len(tokens))]
    merges = [m if isinstance(m, str) else " ".join(m) for m in tok["model"]["merges"]]
    config = json.loads((tokenizer_dir / "tokenizer_config.json").read_text())

    h, layers, heads, kv, ffn, v = 64, 2, 4, 2, 128, len(tokens)
    w = gguf.GGUFWriter(str(path), arch)
    w.add_block_count(layers)
    w.add_context_length(512)
    w.add_embedding_length(h)
    w.add_feed_forward_length(ffn)
    w.add_head_count(heads)
    w.add_head_count_kv(kv)
    w.add_rope_freq_base(10000.0)
    w.add_layer_norm_rms_eps(1e-5)
    w.add_vocab_size(v)
    w.add_rope_dimension_count(h // heads)
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("smollm")
    w.add_token_list(tokens)
    w.add_token_types(types)
    w.add_token_merges(merges)
    w.add_bos_token_id(vocab[config["bos_token"]])
    w.add_eos_token_id(vocab[config["eos_token"]])
    w.add_unk_token_id(vocab[config["unk_token"]])
    w.add_pad_token_id(vocab[config["pad_token"]])
    w.add_add_bos_token(False)
    w.add_chat_template(config["chat_template"])
    rng = np.random.default_rng(seed)

    def add(name, shape, norm=False):
        if norm:
            w.add_tensor(name, (1.0 + 0.1 * rng.standard_normal(shape)).astype(np.float32))
        else:
            data = (0.05 * rng.standard_normal(shape)).astype(np.float32)
            q = gguf.quants.quantize(data, gguf.GGMLQuantizationType.Q8_0)
            w.add_tensor(name, q, raw_dtype=gguf.GGMLQuantizationType.Q8_0)
    add("token_embd.weight", (v, h))
    add("output_norm.weight", (h,), norm=True)
    d = h // heads
    for i in range(layers):
        add(f"blk.{i}.attn_norm.weight", (h,), norm=True)
        add(f"blk.{i}.ffn_norm.weight", (h,), norm=True)
        add(f"blk.{i}.attn_q.weight", (heads * d, h))
        add(f"blk.{i}.attn_k.weight", (kv * d, h))
        add(f"blk.{i}.attn_v.weight", (kv * d, h))
        add(f"blk.{i}.attn_output.weight", (h, heads * d))
        add(f"blk.{i}.ffn_gate.weight", (ffn, h))
        add(f"blk.{i}.ffn_up.weight", (ffn, h))
        add(f"blk.{i}.ffn_down.weight", (h, ffn))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def padded_chat_batch(tokenizer, messages):
    from minihf.data.rl_dataset import left_pad, render_prompts

    ids = render_prompts(tokenizer, messages, apply_chat_template=True)
    return ids, left_pad(ids, tokenizer.pad_token_id)


def minihf_logits(model, ids):
    """Each prompt alone through minihf's forward: [len, V] per prompt."""
    with torch.no_grad():
        return [model(torch.tensor([s]), torch.arange(len(s))[None])[0] for s in ids]


@pytest.fixture(scope="module")
def converted(tmp_path_factory, smollm2_tokenizer_dir):
    pytest.importorskip("gguf")
    from minihf.hub.gguf import convert_gguf

    root = tmp_path_factory.mktemp("gguf")
    write_tiny_gguf(root / "tiny.gguf", smollm2_tokenizer_dir)
    convert_gguf(root / "tiny.gguf", root / "hf")
    return root


def test_convert_gguf_loads_the_same_in_minihf_and_transformers(converted, smollm2_tokenizer_dir):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from minihf.data.tokenizer import load_tokenizer
    from minihf.models import load_hf

    out = converted / "hf"
    config = json.loads((out / "config.json").read_text())
    assert "quantization_config" not in config and config["architectures"] == ["LlamaForCausalLM"]
    assert config["num_attention_heads"] == 4 and config["tie_word_embeddings"] is True
    assert json.loads((out / "generation_config.json").read_text())["eos_token_id"] == 2
    tok, fixture = load_tokenizer(out), load_tokenizer(smollm2_tokenizer_dir)
    assert tok.eos_token == "<|im_end|>" and tok.chat_template == fixture.chat_template
    ids, batch = padded_chat_batch(tok, CHAT)
    assert ids == padded_chat_batch(fixture, CHAT)[0]
    assert ids == padded_chat_batch(AutoTokenizer.from_pretrained(str(out)), CHAT)[0]

    refs = {"hf dir": AutoModelForCausalLM.from_pretrained(str(out), dtype=torch.float32),
            "gguf": AutoModelForCausalLM.from_pretrained(str(converted), gguf_file="tiny.gguf",
                                                         dtype=torch.float32)}
    ours = minihf_logits(load_hf(out).eval(), ids)
    width = batch["input_ids"].shape[1]
    for name, ref in refs.items():
        with torch.no_grad():
            logits = ref.eval()(**batch).logits                                 # padded batch
        for i, s in enumerate(ids):
            # other kernels, padded batch; fp32 logits |z| < ~2 (ulp 2.4e-7): 2e-5 is 80+ ulp
            torch.testing.assert_close(ours[i], logits[i, width - len(s):], atol=2e-5, rtol=1e-5,
                                       msg=f"{name}, prompt {i}")


def test_convert_gguf_errors(converted, tmp_path):
    from minihf.hub.gguf import convert_gguf, gguf_architecture, resolve_gguf

    with pytest.raises(FileExistsError, match="--overwrite"):
        convert_gguf(converted / "tiny.gguf", converted / "hf")
    with pytest.raises(FileNotFoundError, match="not a file"):
        convert_gguf(tmp_path / "missing.gguf", tmp_path / "out")
    with pytest.raises(FileNotFoundError, match="no_such_pkg.*not installed"):
        resolve_gguf("no_such_pkg:model.gguf")
    with pytest.raises(FileNotFoundError, match="has no file 'nope.gguf'"):
        resolve_gguf("minihf:nope.gguf")
    with pytest.raises(ValueError, match="dtype"):
        convert_gguf(converted / "tiny.gguf", tmp_path / "out", dtype="int8")
    (tmp_path / "junk.gguf").write_bytes(b"not a gguf file at all")
    with pytest.raises(ValueError, match="not a readable GGUF"):
        gguf_architecture(tmp_path / "junk.gguf")
    import gguf
    w = gguf.GGUFWriter(str(tmp_path / "gpt2.gguf"), "gpt2")   # an architecture minihf does not run
    w.add_tensor("token_embd.weight", np.zeros((4, 4), np.float32))
    w.write_header_to_file(); w.write_kv_data_to_file(); w.write_tensors_to_file(); w.close()
    with pytest.raises(ValueError, match="'gpt2' is not one minihf runs"):
        convert_gguf(tmp_path / "gpt2.gguf", tmp_path / "out")
    assert not (tmp_path / "out").exists()
    from typer.testing import CliRunner

    from minihf.cli import app
    res = CliRunner().invoke(app, ["convert-gguf", str(tmp_path / "gpt2.gguf"), str(tmp_path / "out")])
    assert res.exit_code == 2 and "not one minihf runs" in res.output


def gguf_header(kvs, order="<") -> bytes:
    """A GGUF v3 header (no tensors) with ``kvs``: (key, type id, payload bytes) each."""
    import struct

    out = b"GGUF" + struct.pack(order + "IQQ", 3, 0, len(kvs))
    for key, kind, payload in kvs:
        out += struct.pack(order + "Q", len(key)) + key + struct.pack(order + "I", kind) + payload
    return out


@pytest.mark.parametrize("order", ["<", ">"])
def test_gguf_architecture_reads_the_header_up_to_its_key(tmp_path, order):
    import struct

    from minihf.hub.gguf import gguf_architecture

    def s(b):
        return struct.pack(order + "Q", len(b)) + b
    strings = struct.pack(order + "IQ", 8, 3) + s(b"a") + s(b"bc") + s(b"")      # array of 3 strings
    ints = struct.pack(order + "IQ", 4, 2) + struct.pack(order + "II", 7, 8)  # array of 2 uint32
    before = [(b"tokenizer.ggml.tokens", 9, strings), (b"x.ints", 9, ints),
              (b"x.f64", 12, struct.pack(order + "d", 1.5)), (b"x.bool", 7, b"\x01"),
              (b"x.name", 8, s(b"not this"))]
    path = tmp_path / "h.gguf"
    path.write_bytes(gguf_header(before + [(b"general.architecture", 8, s(b"qwen2"))], order))
    assert gguf_architecture(path) == "qwen2"
    path.write_bytes(gguf_header(before, order))
    with pytest.raises(ValueError, match="has no general.architecture"):
        gguf_architecture(path)
    path.write_bytes(gguf_header(before, order)[:40])
    with pytest.raises(ValueError, match="not a readable GGUF file .the header ends early"):
        gguf_architecture(path)
    path.write_bytes(gguf_header([(b"x", 42, b"")], order))
    with pytest.raises(ValueError, match="unknown value type 42"):
        gguf_architecture(path)


@pytest.fixture(scope="module")
def bpe_job(tmp_path_factory, smollm2_tokenizer_dir):
    from minihf.data import make_task_data
    from minihf.hub import init_model

    root = tmp_path_factory.mktemp("bpe")
    init_model(root / "model", arch="llama", size="tiny", tokenizer=smollm2_tokenizer_dir)
    make_task_data("chat_arith", root / "data", 16, 4, seed=0)
    return root


def test_prompts_eos_and_reward_text_with_bpe(bpe_job):
    from minihf.data import RLDataset, load_tokenizer
    from minihf.data.tasks import chat_arith
    from minihf.hybrid.rollout_output import build_output
    from minihf.protocol import Batch
    from minihf.rollout.llm import eos_ids_from_dir
    from minihf.trainer.reward import RuleReward

    model, data = bpe_job / "model", bpe_job / "data"
    tok = load_tokenizer(model)
    im_end = tok.convert_tokens_to_ids("<|im_end|>")
    assert (im_end, tok.pad_token_id) == (2, 2)  # pad is the eos: masks must come from lengths
    hf = json.loads((model / "config.json").read_text())
    assert eos_ids_from_dir(model, hf) == (im_end,)          # the engine stops at <|im_end|>
    ds = RLDataset(data / "train.parquet", tok, max_prompt_length=64)
    row = ds[0]
    expected = tok.apply_chat_template(row["raw_prompt"], tokenize=False, add_generation_prompt=True)
    assert tok.decode(row["input_ids"]) == expected and expected.endswith("<|im_start|>assistant\n")
    assert len(row["input_ids"]) < len(expected) / 2          # BPE: far fewer tokens than characters
    with pytest.raises(ValueError, match=rf"{len(row['input_ids'])} tokens, longer than max_prompt_length=20"):
        RLDataset(data / "train.parquet", tok, max_prompt_length=20)

    # responses as the engine returns them: text + <|im_end|>, right-padded with pad (= eos)
    truth = row["ground_truth"]
    answers = [f"{truth}", f"The sum is {truth}.", " 1,00", ""]
    prompts = ds.collate([0, 0, 0, 0])
    tokens = [tok(a, add_special_tokens=False)["input_ids"] + [im_end] for a in answers]
    seqs = [SimpleNamespace(tokens=t, logprobs=[0.0] * len(t)) for t in tokens]
    out = Batch(build_output(prompts, seqs, 12, tok.pad_token_id).tensors, prompts.non_tensors)
    assert out["response_mask"].sum(-1).tolist() == [len(t) for t in tokens]

    def fn(data_source, solution_str, ground_truth, extra_info):
        return chat_arith.compute_score(solution_str, ground_truth)
    reward = RuleReward(fn, tok)
    assert reward.decode(out) == answers                      # no <|im_end|>, no padding
    scores, _, raw = reward(out)
    assert raw == [1.0, 1.0, 0.0, 0.0]
    kept = RuleReward(fn, tok, skip_special_tokens=False).decode(out)
    assert kept == [a + "<|im_end|>" for a in answers]          # still no padding
    last = out["response_mask"].sum(-1) - 1
    assert scores[0, last[0]] == 1.0 and scores.sum() == 2.0


REWARD = '''
import json, os
from minihf.data.tasks.chat_arith import compute_score as score

def check(data_source, solution_str, ground_truth, extra_info):
    bad = [t for t in ("<|im_end|>", "<|im_start|>", "<|endoftext|>") if t in solution_str]
    with open(os.environ["BPE_LOG"], "a") as f:
        f.write(json.dumps({"text": solution_str, "bad": bad}) + "\\n")
    return score(solution_str, ground_truth)
'''


def _grpo_step(rank, world, model, data, tmp):
    from minihf.config import load_config
    from minihf.controller import run
    from minihf.trainer.ppo_job import PPOJobConfig, ppo_driver, ppo_roles

    cfg = load_config(PPOJobConfig, "grpo_smollm2_arith", [
        f"actor_rollout_ref.model.path={model}", f"data.train_files={data}/train.parquet",
        f"data.val_files={data}/test.parquet", "data.train_batch_size=2", "data.max_response_length=6",
        "actor_rollout_ref.rollout.n=2", "actor_rollout_ref.actor.ppo_mini_batch_size=4",
        "actor_rollout_ref.rollout.val_kwargs.n=1", "trainer.total_training_steps=1",
        "trainer.test_freq=1", f"trainer.default_local_dir={tmp}/run", "trainer.log_samples_freq=1",
        "prepare.gguf_file=null", "prepare.task=null", "controller.timeout_s=120",
        f"custom_reward_function.path={tmp}/reward.py", "custom_reward_function.name=check"])
    return run(ppo_driver(cfg), ppo_roles(cfg), cfg.controller)


def test_grpo_step_with_bpe_on_two_processes(bpe_job, tmp_path, monkeypatch):
    from minihf.testing import spawn_ranks

    (tmp_path / "reward.py").write_text(REWARD)
    monkeypatch.setenv("BPE_LOG", str(tmp_path / "texts.jsonl"))
    hist = spawn_ranks(_grpo_step, 2, str(bpe_job / "model"), str(bpe_job / "data"), str(tmp_path),
                       timeout_s=300)[0]
    assert [h["step"] for h in hist] == [0, 1] and "actor/pg_loss" in hist[-1]
    seen = [json.loads(x) for x in (tmp_path / "texts.jsonl").read_text().splitlines()]
    assert len(seen) == 4 + 4 + 4 and not any(s["bad"] for s in seen)  # val 0, train, val 1
    samples = [json.loads(x) for x in (tmp_path / "run" / "samples.jsonl").read_text().splitlines()]
    assert all(s["prompt"].startswith("<|im_start|>system\n") and
               s["prompt"].endswith("<|im_start|>assistant\n") and "<|im_end|>" not in s["response"]
               for s in samples)


def test_rollout_tp_must_split_the_heads(bpe_job, tmp_path):
    from minihf.config import load_config
    from minihf.trainer.ppo_job import PPOJobConfig, check_paths

    model = tmp_path / "model"
    model.mkdir()
    config = json.loads((bpe_job / "model" / "config.json").read_text())
    config.update(num_attention_heads=9, num_key_value_heads=3, hidden_size=576, head_dim=64)
    (model / "config.json").write_text(json.dumps(config))   # SmolLM2's head counts
    data = bpe_job / "data"

    def cfg(tp):
        return load_config(PPOJobConfig, "grpo_smollm2_arith", [
            f"actor_rollout_ref.model.path={model}", f"data.train_files={data}/train.parquet",
            f"data.val_files={data}/test.parquet",
            f"actor_rollout_ref.rollout.tensor_model_parallel_size={tp}"])
    check_paths(cfg(3))
    with pytest.raises(ConfigError, match=r"tensor_model_parallel_size=2: the model at .* num_heads=9 and "
                                          r"num_kv_heads=3 must both divide by the TP size 2.*\[1, 3\]"):
        check_paths(cfg(2))


def test_eval_scores_sampled_and_greedy_answers(bpe_job, tmp_path):
    from typer.testing import CliRunner

    from minihf.cli import app
    from minihf.trainer.evaluate import EvalConfig, evaluate

    model, test = bpe_job / "model", bpe_job / "data" / "test.parquet"
    (tmp_path / "r.py").write_text(
        "def length(data_source, solution_str, ground_truth, extra_info):\n"
        "    assert '<|im_end|>' not in solution_str\n"
        "    return float(len(solution_str) > 0)\n"
        "def broken(data_source, solution_str, ground_truth, extra_info):\n"
        "    raise KeyError('oops')\n")
    cfg = EvalConfig(n=3, temperature=1.0, max_tokens=5, reward=f"{tmp_path}/r.py:length", seed=1)
    m = evaluate(model, test, cfg)
    assert m["prompts"] == 4 and set(m) >= {"minihf/chat_arith/mean@3", "minihf/chat_arith/greedy",
                                            "mean@3/response_length/mean", "greedy/truncated"}
    assert 0 < m["minihf/chat_arith/mean@3"] <= 1 and m["mean@3/response_length/mean"] <= 5
    assert evaluate(model, test, cfg) == m                      # seeded
    built_in = evaluate(model, test, EvalConfig(n=0, max_tokens=4))
    assert list(built_in) == ["prompts", "minihf/chat_arith/greedy", "greedy/response_length/mean",
                              "greedy/truncated"]
    with pytest.raises(ValueError, match="nothing to evaluate"):
        EvalConfig(n=0, greedy=False)
    with pytest.raises(ValueError, match=r"n=-1 must be >= 0"):  # was "nothing to evaluate; use ... or greedy"
        EvalConfig(n=-1)
    runner = CliRunner()
    res = runner.invoke(app, ["eval", str(model), str(test), "--n", "1", "--max-tokens", "3",
                              "--reward", f"{tmp_path}/r.py:broken", "--no-greedy"])
    assert res.exit_code == 2 and "raised on sample 0" in res.output and "oops" in res.output
    res = runner.invoke(app, ["eval", str(model), str(test), "--n", "1", "--max-tokens", "3",
                              "--json", str(tmp_path / "m.json")])
    assert res.exit_code == 0, res.output
    assert json.loads((tmp_path / "m.json").read_text())["prompts"] == 4


def test_gguf_special_tokens_follow_the_header(smollm2_tokenizer_dir):
    # transformers 5.17 built SmolLM2's tokenizer from a GGUF file with <|im_start|> as EOS
    # while the header's eos id is <|im_end|>'s; the converter trusts the header's ids
    from transformers import AutoTokenizer

    from minihf.hub.gguf import align_special_tokens

    tok = AutoTokenizer.from_pretrained(str(smollm2_tokenizer_dir))
    im_start, im_end = tok.convert_tokens_to_ids(["<|im_start|>", "<|im_end|>"])
    pad = tok.pad_token
    tok.eos_token = "<|im_start|>"
    align_special_tokens(tok, None, [im_end], None)  # a list of eos ids: its first
    assert tok.eos_token == "<|im_end|>" and tok.eos_token_id == im_end
    assert tok.pad_token == pad  # ids the header does not give stay as they were
    align_special_tokens(tok, im_start, im_end, im_start)
    assert tok.bos_token == tok.pad_token == "<|im_start|>"
    with pytest.raises(ValueError, match="eos_token id 1000000 is outside its vocabulary"):
        align_special_tokens(tok, None, 1_000_000, None)

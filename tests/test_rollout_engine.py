"""Rollout engine vs references: transformers greedy generate, the training forward's
log-probs, each request run alone (continuous batching), fixed seeds."""

import re

import pytest
import torch

from logprob_reference import float64_log_probs, rounding_ratio
from minihf.models import load_hf, save_hf
from minihf.rollout import LLM, SamplingParams

ARCHS = ("llama", "qwen2", "qwen3", "mistral")
PROMPTS = [[1, 2, 3, 4, 5], [7, 8], [9, 10, 11, 12, 13, 14, 15, 16, 17, 18, 19], [3], [5, 6, 7], [20, 21, 22, 23]]


def build_tiny(arch: str, path, heads: int = 4, kv_heads: int = 2, **extra):
    """A tiny random transformers model of ``arch`` saved at ``path``; returns the HF model."""
    from transformers import (AutoModelForCausalLM, LlamaConfig, MistralConfig, MixtralConfig, Qwen2Config,
                              Qwen3Config, Qwen3MoeConfig)

    cls = dict(llama=LlamaConfig, qwen2=Qwen2Config, qwen3=Qwen3Config, mistral=MistralConfig,
               qwen3_moe=Qwen3MoeConfig, mixtral=MixtralConfig)[arch]
    # a large init std makes logits peaky, so greedy comparisons are not decided by fp32 ties
    extra.setdefault("tie_word_embeddings", arch == "qwen2")
    extra = {"vocab_size": 128, "intermediate_size": 128, "max_position_embeddings": 256, **extra}
    cfg = cls(hidden_size=64, num_hidden_layers=2, num_attention_heads=heads, num_key_value_heads=kv_heads,
              initializer_range=0.2, eos_token_id=None, bos_token_id=None, pad_token_id=None, **extra)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32).eval()
    model.save_pretrained(path)
    return model


def hf_greedy(hf, prompt, max_new_tokens):
    out = hf.generate(torch.tensor([prompt]), max_new_tokens=max_new_tokens, do_sample=False,
                      eos_token_id=None, pad_token_id=0, attention_mask=torch.ones(1, len(prompt), dtype=torch.long))
    return out[0, len(prompt):].tolist()


@pytest.fixture(scope="module")
def tiny_dirs(tmp_path_factory):
    root = tmp_path_factory.mktemp("tiny")
    return {arch: (root / arch, build_tiny(arch, root / arch)) for arch in ARCHS}


@pytest.mark.parametrize("arch", ARCHS)
def test_greedy_matches_transformers(tiny_dirs, arch):
    path, hf = tiny_dirs[arch]
    llm = LLM(str(path), max_num_seqs=4)  # 6 prompts over 4 slots: refill is exercised
    outs = llm.generate(PROMPTS, SamplingParams(temperature=0, max_tokens=10))
    for prompt, out in zip(PROMPTS, outs):
        (c,) = out.outputs
        assert c.token_ids == hf_greedy(hf, prompt, 10), f"{arch} prompt {prompt}"
        assert c.finish_reason == "length" and len(c.logprobs) == 10


def training_logprobs(model, prompt, response, temperature):
    """The trainer's recomputation: full forward over prompt+response, log_softmax(logits/T)."""
    ids = torch.tensor([prompt + response])
    with torch.no_grad():
        logits = model(ids, torch.arange(ids.shape[1])[None]).float()
    logp = torch.log_softmax(logits[0, len(prompt) - 1:-1] / temperature, dim=-1)
    return logp.gather(1, torch.tensor(response)[:, None]).squeeze(1)


def one_row(prompt, response):
    """A one-row batch in the trainer's layout (no padding) for ``float64_log_probs``."""
    ids = torch.tensor([prompt + response])
    return {"input_ids": ids, "attention_mask": torch.ones_like(ids),
            "position_ids": torch.arange(ids.shape[1])[None], "responses": torch.tensor([response])}


def test_logprobs_match_training_forward(tiny_dirs):
    """The engine's log-probs (column-major weights, decode) and the training forward's are
    each within ``logprob_rounding_bound`` of a float64 forward (so within twice it of each
    other), at T = 0.7, 1.3 with top-k/top-p, and greedy."""
    path, _ = tiny_dirs["qwen3"]
    model = load_hf(path)  # the trainer's copy (row-major); the engine gets its own, re-laid-out one
    llm = LLM(load_hf(path), max_num_seqs=3, cpu_column_major=True)
    worst, gap = {"engine": 0.0, "trainer": 0.0, "pair": 0.0}, 0.0
    for sp in (SamplingParams(temperature=0.7, max_tokens=12, seed=1, n=2),
               SamplingParams(temperature=1.3, top_k=20, top_p=0.9, max_tokens=12, seed=2),
               SamplingParams(temperature=0, max_tokens=12)):
        outs = llm.generate(PROMPTS, sp)
        for prompt, out in zip(PROMPTS, outs):
            for c in out.outputs:
                t = sp.temperature or 1.0
                trainer = training_logprobs(model, prompt, c.token_ids, t)[None]
                engine = torch.tensor(c.logprobs)[None]
                exact, scale = float64_log_probs(model, one_row(prompt, c.token_ids), t)
                mask = torch.ones_like(engine)
                for k, (x, y) in {"engine": (engine, exact), "trainer": (trainer, exact),
                                  "pair": (engine, trainer)}.items():
                    worst[k] = max(worst[k], rounding_ratio(x, y, scale, mask, pairwise=k == "pair"))
                gap = max(gap, (engine - trainer).abs().max().item())
    print(f"max |engine logprob - training logprob| = {gap:.2e}; worst token in units of the "
          f"rounding bound: {worst}")
    assert max(worst.values()) <= 1, worst


@pytest.mark.parametrize("sp", [SamplingParams(temperature=0, max_tokens=10),
                                SamplingParams(temperature=1.0, max_tokens=10, seed=3)],
                         ids=["greedy", "sampled"])
def test_batch_invariance(tiny_dirs, sp):
    """A request's tokens and log-probs do not depend on what shares its decode batch: alone
    vs among 1, 7 and 64 other requests (other prompts, lengths, seeds, top-k), the tokens are
    identical and the log-probs within the rounding bound of each other (the batch changes
    the GEMM shapes, so the summation order, not the result beyond rounding)."""
    path, _ = tiny_dirs["llama"]
    model = load_hf(path)
    llm = LLM(load_hf(path))
    prompt = PROMPTS[0]
    alone = llm.generate([prompt], sp)[0].outputs[0]
    _, scale = float64_log_probs(model, one_row(prompt, alone.token_ids), sp.temperature or 1.0)
    g = torch.Generator().manual_seed(0)
    worst = 0.0
    for others in (1, 7, 64):
        lens = torch.randint(1, 20, (others,), generator=g).tolist()
        batch = [torch.randint(1, 100, (n,), generator=g).tolist() for n in lens]
        params = [SamplingParams(temperature=1.0, max_tokens=int(m), seed=100 + i, top_k=20 if i % 2 else -1)
                  for i, m in enumerate(torch.randint(1, 16, (others,), generator=g))]  # some truncate
        at = others // 2
        outs = llm.generate(batch[:at] + [prompt] + batch[at:], params[:at] + [sp] + params[at:])
        got = outs[at].outputs[0]
        assert got.token_ids == alone.token_ids, others
        worst = max(worst, rounding_ratio(torch.tensor([got.logprobs]), torch.tensor([alone.logprobs]),
                                          scale, torch.ones(1, len(alone.logprobs)), pairwise=True))
    print(f"batch invariance ({'greedy' if sp.temperature == 0 else 'sampled'}): worst token "
          f"{worst:.3f} of the rounding bound")
    assert worst <= 1


def test_continuous_batching_equals_alone(tiny_dirs):
    path, _ = tiny_dirs["llama"]
    llm = LLM(str(path), max_num_seqs=2)
    lengths, seeds = [3, 17, 6, 12, 1, 9], range(6)
    # the stop id is a token request 1 is known to sample (its 5th token, unstopped run), so at
    # least one request certainly finishes with "stop" and the stop path is exercised
    free = llm.generate([PROMPTS[1]], SamplingParams(temperature=1.0, max_tokens=17, seed=1))[0].outputs[0]
    stop = free.token_ids[4]
    params = [SamplingParams(temperature=1.0, max_tokens=m, seed=s, stop_token_ids=[stop])
              for m, s in zip(lengths, seeds)]
    together = llm.generate(PROMPTS, params)
    for prompt, sp, out in zip(PROMPTS, params, together):
        alone = llm.generate([prompt], sp)[0].outputs[0]
        assert out.outputs[0].token_ids == alone.token_ids
        assert out.outputs[0].finish_reason == alone.finish_reason
        # batched vs alone: other GEMM shapes; fp32 |z| < ~6 (ulp 4.8e-7), so 1e-5 is ~20 ulp
        torch.testing.assert_close(torch.tensor(out.outputs[0].logprobs), torch.tensor(alone.logprobs), atol=1e-5, rtol=0)
    # vLLM semantics: output ends at the first stop token, which is kept in token_ids
    got = together[1].outputs[0]
    cut = free.token_ids.index(stop) + 1
    assert got.token_ids == free.token_ids[:cut] and got.finish_reason == "stop"
    for out, m in zip(together, lengths):
        c = out.outputs[0]
        if c.finish_reason == "stop":
            assert c.token_ids[-1] == stop and stop not in c.token_ids[:-1] and len(c.token_ids) <= m
        else:
            assert c.finish_reason == "length" and len(c.token_ids) == m and stop not in c.token_ids
    assert {o.outputs[0].finish_reason for o in together} == {"stop", "length"}


def test_eos_ids_from_config_dicts_and_dirs(tmp_path):
    import json

    from minihf.rollout.llm import eos_ids, eos_ids_from_dir

    assert eos_ids({}) == () and eos_ids({"eos_token_id": None}) == ()
    assert eos_ids({"eos_token_id": 2}) == (2,)
    assert eos_ids({"eos_token_id": 2}, {"eos_token_id": [2, 7]}) == (2, 7)  # generation config wins
    assert eos_ids({"eos_token_id": 2}, {"do_sample": True}) == (2,)  # ... only when it sets one
    assert eos_ids_from_dir(tmp_path, {"eos_token_id": 3}) == (3,)  # no generation_config.json
    (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": [4, 5]}))
    assert eos_ids_from_dir(tmp_path, {"eos_token_id": 3}) == (4, 5)
    with pytest.raises(FileNotFoundError, match="has no config.json"):  # LLM defers to load_args
        LLM(str(tmp_path))


def test_seeds_and_n_samples(tiny_dirs):
    path, _ = tiny_dirs["mistral"]
    llm = LLM(str(path), max_num_seqs=8)
    sp = SamplingParams(n=4, temperature=1.0, max_tokens=16, seed=123)
    a = llm.generate(PROMPTS[:2], sp)
    b = llm.generate(PROMPTS[:2][::-1], sp)[::-1]  # other order, other batch slots
    assert [[c.token_ids for c in o.outputs] for o in a] == [[c.token_ids for c in o.outputs] for o in b]
    samples = [tuple(c.token_ids) for c in a[0].outputs]
    assert len(set(samples)) == 4  # the n samples of one request differ
    # sample 0 of n (prefilled once, cache copied to the other samples) equals an n=1 request
    one = llm.generate(PROMPTS[:1], SamplingParams(n=1, temperature=1.0, max_tokens=16, seed=123))[0].outputs[0]
    assert one.token_ids == a[0].outputs[0].token_ids
    c = llm.generate(PROMPTS[:2], SamplingParams(n=4, temperature=1.0, max_tokens=16, seed=124))
    assert [x.token_ids for x in c[0].outputs] != [x.token_ids for x in a[0].outputs]
    # unseeded requests: consecutive calls draw different samples
    u1 = llm.generate(PROMPTS[:1], SamplingParams(temperature=1.0, max_tokens=16))[0].outputs[0].token_ids
    u2 = llm.generate(PROMPTS[:1], SamplingParams(temperature=1.0, max_tokens=16))[0].outputs[0].token_ids
    assert u1 != u2


def test_eos_stop_and_ignore_eos(tiny_dirs):
    path, hf = tiny_dirs["qwen2"]
    ref = hf_greedy(hf, PROMPTS[0], 10)
    eos = ref[3]
    first = ref.index(eos)
    llm = LLM(str(path), eos_token_ids=[eos])
    out = llm.generate([PROMPTS[0]], SamplingParams(temperature=0, max_tokens=10))[0].outputs[0]
    assert out.token_ids == ref[: first + 1] and out.finish_reason == "stop"
    out = llm.generate([PROMPTS[0]], SamplingParams(temperature=0, max_tokens=10, ignore_eos=True))[0].outputs[0]
    assert out.token_ids == ref and out.finish_reason == "length"
    # the call's timers: the first token comes from the prefill, the other 9 from decode steps
    stats = llm.engine.last_stats
    assert stats["decode_steps"] == 9 and stats["prefill_s"] > 0 and stats["decode_s"] > 0
    out = llm.generate([PROMPTS[0]], SamplingParams(temperature=0, max_tokens=10, ignore_eos=True, stop_token_ids=[ref[1]]))[0].outputs[0]
    assert out.token_ids == ref[: ref.index(ref[1]) + 1] and out.finish_reason == "stop"
    short = LLM(str(path), max_model_len=8)
    out = short.generate([PROMPTS[0]], SamplingParams(temperature=0, max_tokens=10))[0].outputs[0]
    assert out.token_ids == ref[:3] and out.finish_reason == "length"  # 5 prompt + 3 = max_model_len


def test_out_of_vocab_prompt_is_rejected(tiny_dirs):
    llm = LLM(str(tiny_dirs["llama"][0]))
    with pytest.raises(ValueError, match="vocab"):
        llm.generate([[1, 2, 128]], SamplingParams(max_tokens=2))
    # text, or transformers 5's apply_chat_template dict, instead of token ids: named, with the fix
    for prompt, kind in (("What is 2 + 2?", "str"), ({"input_ids": [1, 2], "attention_mask": [1, 1]}, "str")):
        with pytest.raises(ValueError, match=rf"prompt 0 is not a list of token ids .*'{kind}'\]; tokenize it"):
            llm.generate([prompt], SamplingParams(max_tokens=2))
    out = llm.generate([torch.tensor([1, 2, 3])], SamplingParams(max_tokens=2))  # a tensor still works
    assert len(out[0].outputs[0].token_ids) == 2


def test_bad_engine_sizes_and_a_dtype_that_would_be_ignored_are_refused(tiny_dirs):
    """``LLM``'s sizes are ints >= 1 (or None where a default exists): a 0 was read as unset,
    a negative ``max_num_batched_tokens`` with chunked prefill hung, a negative
    ``max_num_seqs`` failed inside torch; a ``max_model_len`` past the model's context ran on
    positions without trained rotary angles. A ``dtype`` other than an in-memory model's was
    ignored; now it is refused."""
    path = str(tiny_dirs["llama"][0])
    for kw, says in ((dict(max_num_batched_tokens=-1, enable_chunked_prefill=True), "max_num_batched_tokens=-1 must"),
                     (dict(max_num_batched_tokens=0), "max_num_batched_tokens=0 must be an int >= 1, or None"),
                     (dict(max_model_len=0), "max_model_len=0 must be an int >= 1, or None for the default"),
                     (dict(max_num_seqs=-1), "max_num_seqs=-1 must be an int >= 1"),
                     (dict(max_model_len=10**6), "max_model_len=1000000 exceeds the model's context, "
                                                 "max_position_embeddings=")):
        with pytest.raises(ValueError, match=re.escape(says)):
            LLM(path, **kw)
    model = load_hf(path)
    with pytest.raises(ValueError, match=r"dtype=torch.bfloat16 but the model passed in is torch.float32; convert"):
        LLM(model, dtype=torch.bfloat16)
    assert LLM(model, dtype=torch.float32).generate([[1, 2]], SamplingParams(max_tokens=2))


def test_dtype_by_name_as_vllm_takes_it(tiny_dirs):
    """``dtype`` also takes vLLM's names ("float32", "bfloat16", "auto", ...); a string torch
    does not know was passed to ``model.to`` and failed there as an invalid device string."""
    path = str(tiny_dirs["llama"][0])
    for name, want in (("float32", torch.float32), ("float", torch.float32), ("bfloat16", torch.bfloat16),
                       ("half", torch.float16), ("auto", torch.float32)):
        llm = LLM(path, dtype=name, max_num_seqs=2)
        assert next(llm.engine.model.parameters()).dtype == want, name
    assert LLM(path, dtype="float32").generate([[1, 2]], SamplingParams(temperature=0, max_tokens=3)) \
        [0].outputs[0].token_ids == LLM(path, dtype=torch.float32).generate(
            [[1, 2]], SamplingParams(temperature=0, max_tokens=3))[0].outputs[0].token_ids
    for bad in ("fp33", "int8", torch.int64, 32):
        with pytest.raises(ValueError, match=re.escape(f"dtype={bad!r} is neither a floating-point torch dtype nor the name of one; pass one of")):
            LLM(path, dtype=bad)
    with pytest.raises(ValueError, match=r"dtype=torch.bfloat16 but the model passed in is torch.float32"):
        LLM(load_hf(path), dtype="bfloat16")


def test_prompts_params_and_settings_of_the_wrong_kind_are_refused_by_name(tiny_dirs):
    """What failed deep inside (a 2-D tensor of prompts: "Boolean value of Tensor ... is
    ambiguous"; a tokenizer's dict: KeyError 0; a None among the params: no attribute 'n'; a
    seed of None: at the first generate, in the sampler) or passed silently (float token ids,
    truncated; an eos id past the vocabulary, never matched)."""
    import numpy as np

    path = str(tiny_dirs["llama"][0])
    llm = LLM(path, max_num_seqs=2)
    sp = SamplingParams(max_tokens=2)
    for prompts, says in ((torch.ones(2, 3, dtype=torch.long), "prompts is a 2-D Tensor: pass a list of token-id "
                                                                "lists; one list per prompt, without padding"),
                          (np.ones((2, 3), dtype=np.int64), "prompts is a 2-D ndarray"),
                          (torch.ones(3, dtype=torch.long), "prompts is a 1-D Tensor: pass a list of token-id lists; "
                                                             "wrap one prompt as [ids]"),
                          ({"input_ids": [[1, 2]]}, "prompts is a dict (a tokenizer's output?): pass its input_ids"),
                          ((p for p in [[1, 2]]), "prompts must be a list of token-id lists, got generator"),
                          ([[1.5, 2.7]], "prompt 0 is not a list of token ids (ints): it holds ['float']"),
                          ([[1, 2], [True]], "prompt 1 is not a list of token ids (ints): it holds ['bool']")):
        with pytest.raises((TypeError, ValueError), match=re.escape(says)):
            llm.generate(prompts, sp)
    for params in ([None], [dict(max_tokens=2)]):
        with pytest.raises(TypeError, match="sampling params 0 is a .*: pass SamplingParams"):
            llm.generate([[1, 2]], params)
    assert len(llm.generate([torch.tensor([1, 2, 3]), np.array([4, 5]), (6,)], sp)) == 3  # one per prompt
    greedy = SamplingParams(temperature=0, max_tokens=3)
    assert llm.generate([list(np.array([1, 2, 3]))], greedy)[0].outputs[0].token_ids == \
        llm.generate([[1, 2, 3]], greedy)[0].outputs[0].token_ids  # numpy's ints are token ids too
    assert LLM(path, eos_token_ids=np.array([2]), max_num_seqs=2).engine.eos_token_ids == {2}
    assert LLM(path, eos_token_ids=(t for t in [2, 3]), seed=np.int64(1), max_num_seqs=2).engine.eos_token_ids == {2, 3}
    for kw, says in ((dict(seed=None), "seed=None must be an int"),
                     (dict(eos_token_ids=2), "eos_token_ids=2 must be a list of token ids in [0, 128)"),
                     (dict(eos_token_ids=[128]), "eos_token_ids=[128] must be a list of token ids in [0, 128)"),
                     (dict(kv_cache_memory="1GB"), "kv_cache_memory='1GB' must be a number of bytes"),
                     (dict(gpu_memory_utilization=5), "gpu_memory_utilization=5 must be a fraction of the free "
                                                      "memory in (0, 1]")):
        with pytest.raises(ValueError, match=re.escape(says)):
            LLM(path, **kw)
    for model in (None, torch.nn.Linear(2, 2)):
        with pytest.raises(TypeError, match="LLM takes a checkpoint dir or a minihf model"):
            LLM(model)
    with pytest.raises(TypeError, match="save_hf writes a minihf model"):
        save_hf(torch.nn.Linear(2, 2), tiny_dirs["llama"][0].parent / "nope")
    with pytest.raises(ValueError, match="dtype='bf16' is neither a floating-point torch dtype nor the name of one"):
        load_hf(path, dtype="bf16")
    assert next(load_hf(path, dtype="bfloat16").parameters()).dtype == torch.bfloat16


def test_memory_budget_and_free(tiny_dirs):
    path, hf = tiny_dirs["llama"]
    llm = LLM(str(path), max_num_seqs=64)
    per_slot = 2 * 2 * 2 * 15 * 16 * 4  # k+v, layers, kv heads, positions (5+10), head_dim, fp32
    llm.engine.kv_cache_memory = 2 * per_slot  # room for two sequences only
    outs = llm.generate(PROMPTS[:1] * 4, SamplingParams(temperature=0, max_tokens=10))
    assert llm.engine.cache.num_slots == 2
    assert all(o.outputs[0].token_ids == hf_greedy(hf, PROMPTS[0], 10) for o in outs)
    llm.engine.kv_cache_memory = per_slot // 2
    llm.engine.cache = None
    with pytest.raises(ValueError, match="holds no sequence"):
        llm.generate(PROMPTS[:1], SamplingParams(max_tokens=10))
    llm.engine.kv_cache_memory = None
    out = llm.generate(PROMPTS[:1], SamplingParams(temperature=0, max_tokens=10))[0].outputs[0]
    llm.free(weights=False)  # cache only: generation still works and reallocates it
    assert llm.engine.cache is None
    again = llm.generate(PROMPTS[:1], SamplingParams(temperature=0, max_tokens=10))[0].outputs[0]
    assert again.token_ids == out.token_ids and llm.engine.cache is not None
    llm.free()
    assert llm.engine.cache is None and llm.engine.model is None
    with pytest.raises(RuntimeError, match="freed"):
        llm.generate(PROMPTS[:1], SamplingParams(max_tokens=2))


def test_the_cuda_budget_counts_the_blocks_torch_caches_but_does_not_use(tiny_dirs, monkeypatch):
    """``gpu_memory_utilization`` of the free CUDA memory: the driver's free bytes plus the
    segments torch caches with nothing in them (freed activations, moments moved to the
    host), not the gaps between live blocks; the CUDA calls faked."""
    path, _ = tiny_dirs["llama"]
    runner = LLM(str(path)).engine.runner
    runner.device, runner.gpu_memory_utilization = torch.device("cuda"), 0.5
    per_slot = 2 * 2 * 2 * 15 * 16 * 4
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device: (6 * per_slot, 100 * per_slot))
    monkeypatch.setattr(torch.cuda, "memory_reserved", lambda device: 9 * per_slot)
    monkeypatch.setattr(torch.cuda, "memory_allocated", lambda device: 5 * per_slot)
    monkeypatch.setattr(torch.cuda, "memory_stats", lambda device: {"inactive_split_bytes.all.current": 2 * per_slot})
    assert runner._slot_budget(15, torch.float32) == 4  # (6 + 9 - 5 - 2) / 2: free gaps between live blocks not counted


def test_length_buckets_bound_padding():
    import random

    from minihf.rollout.model_runner import length_buckets

    rng = random.Random(0)
    lens = [rng.randint(1, 200) for _ in range(300)]
    groups = length_buckets(lens)
    assert sorted(i for g in groups for i in g) == list(range(300))
    for g in groups:
        real = sum(lens[i] for i in g)
        assert max(lens[i] for i in g) * len(g) <= 1.25 * real
    assert len(groups) < 40
    assert length_buckets([32] * 64) == [list(range(64))]  # equal lengths: one forward

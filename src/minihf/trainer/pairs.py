"""Preference pairs from a model's own samples, ranked by a rule: reward-model data the RLHF
way (a labeler ranks the policy's answers), with the task's reward or cost as the labeler.

Pairs built only from reference answers and their edits teach a score model what a right
answer looks like, but not how to grade the answers a policy actually writes; a policy
trained on such a model finds what it never saw (longer lists, well-formed wrong ones) and
games it. ``add_sampled_pairs`` samples ``n`` answers per prompt from a model (the SFT
policy the RL run starts from), and for each prompt whose samples score differently adds
the best over the worst (by ``cost``: the costliest over the cheapest, with sign labels) to
the pair files. ``minihf make-data --pairs --sample-model DIR`` and the RL recipes'
``prepare.pair_samples`` use it.
"""

from __future__ import annotations

from pathlib import Path


def sampled_pairs(model_dir: str | Path, files, n: int = 4, by: str = "reward", temperature: float = 1.0,
                  max_tokens: int = 32, seed: int = 0) -> list[dict]:
    """Pair rows from ``n`` samples of each prompt in ``files`` (verl-format rows, e.g. pair
    files, whose other columns are ignored), ranked by the built-in reward or cost."""
    from minihf.data import RLDataset, compute_score, default_cost_fn, default_reward_fn, load_tokenizer
    from minihf.data.files import read_many
    from minihf.rollout import LLM, SamplingParams
    from minihf.rollout.sampling import request_seed
    from minihf.rollout.llm import eos_ids_from_dir
    from minihf.trainer.evaluate import generate_batch
    from minihf.utils.files import read_json
    from minihf.trainer.reward import RuleReward

    if by not in ("reward", "cost"):
        raise ValueError(f"pairs by {by!r}; choose 'reward' or 'cost'")
    if n < 2:
        raise ValueError(f"n={n}: sampled pairs need at least 2 samples per prompt")
    tok = load_tokenizer(model_dir)
    entries = read_many(files)
    ds = RLDataset(files, tok, max_prompt_length=4096)
    eos = set(eos_ids_from_dir(model_dir, read_json(Path(model_dir) / "config.json", "re-export the model dir")))
    llm = LLM(model_dir, max_model_len=max(map(len, ds.input_ids)) + max_tokens,
              eos_token_ids=tuple(sorted(eos | {tok.eos_token_id})), seed=seed)
    # a seed per prompt (as minihf eval's): one seed for all made sample j of every prompt
    # draw with the same noise, and duplicate prompts get the same samples
    params = [SamplingParams(n=n, temperature=temperature, max_tokens=max_tokens, seed=request_seed(seed, i))
              for i in range(len(ds))]
    rows, batch = generate_batch(llm, ds, params, tok.pad_token_id)
    llm.free()
    texts = RuleReward(None, tok).decode(batch)
    nt = batch.non_tensors
    fn = default_reward_fn if by == "reward" else default_cost_fn
    scores, _ = compute_score(fn, list(nt["data_source"]), texts, list(nt["ground_truth"]), list(nt["extra_info"]))
    key = "score" if by == "reward" else "cost"  # the names pair_rows gives them
    by_prompt: dict[int, list[tuple[float, str]]] = {}
    for (i, _), text, score in zip(rows, texts, scores):
        by_prompt.setdefault(i, []).append((score, text))
    out = []
    for i, samples in sorted(by_prompt.items()):
        (low, worst), (high, best) = min(samples), max(samples)
        if high == low:
            continue
        row = entries[i][2]
        pair = {"data_source": row["data_source"], "prompt": row["prompt"], "chosen": best, "rejected": worst,
                "reward_model": row["reward_model"],
                "extra_info": {**{k: v for k, v in (row.get("extra_info") or {}).items()
                                  if not k.startswith(("chosen_", "rejected_"))},
                               f"chosen_{key}": high, f"rejected_{key}": low, "sampled": True}}
        if by == "cost":
            pair.update(chosen_sign=1 if high > 0 else -1, rejected_sign=1 if low > 0 else -1)
        out.append(pair)
    return out


def add_sampled_pairs(out_dir: str | Path, model_dir: str | Path, n: int, by: str = "reward",
                      seed: int = 0, max_tokens: int = 32) -> dict[str, int]:
    """Append sampled pairs (``sampled_pairs`` on each split's own prompts) to the
    ``train``/``test`` .parquet and .jsonl pair files in ``out_dir``; returns the pairs added."""
    from minihf.data.files import read_many, write_rows

    added = {}
    for split in ("train", "test"):
        path = Path(out_dir) / f"{split}.parquet"
        if not path.is_file():
            continue
        rows = [row for _, _, row in read_many(path)]
        new = sampled_pairs(model_dir, path, n=n, by=by, seed=seed + (split == "test"), max_tokens=max_tokens)
        for suffix in (".parquet", ".jsonl"):
            write_rows(rows + new, path.with_suffix(suffix))
        added[split] = len(new)
    return added

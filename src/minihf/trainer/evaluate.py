"""Score a model dir on prompt files, offline: ``minihf eval`` (one process).

The prompts go through the training path -- ``RLDataset`` renders the chat template and
counts ``max_prompt_length`` in tokens, generation stops at the generation config's EOS ids
(and the tokenizer's eos), each response is decoded with special tokens skipped and scored
by the same reward function as training (``RuleReward``). Reports, per data source, the mean
score of ``n`` sampled answers per prompt (``mean@n``) and of the greedy answer, so a
trained checkpoint (after ``minihf export``) compares with its base model on equal terms.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Sequence

import torch

from minihf.protocol import Batch


@dataclass
class EvalConfig:
    n: int = 4                      # sampled answers per prompt (mean@n); 0: none
    temperature: float = 1.0        # sampling temperature of the n answers
    top_p: float = 1.0              # nucleus of the n answers
    top_k: int = -1                 # top-k of the n answers; -1: off
    greedy: bool = True             # also score one greedy answer per prompt
    max_tokens: int = 256           # response tokens at most
    max_prompt_length: int = 1024   # prompt tokens at most (longer: an error naming the row)
    apply_chat_template: bool = True
    reward: str | None = None       # file.py:function; None: the built-in scorer per data_source
    seed: int = 0

    def __post_init__(self):
        if self.n < 0 or (self.n == 0 and not self.greedy):
            raise ValueError(f"n={self.n} with greedy={self.greedy}: nothing to evaluate; use n >= 1 or greedy")


def evaluate(model_dir: str | Path, files: str | Path | Sequence[str | Path], cfg: EvalConfig | None = None) -> dict:
    """Metrics ``{"<source>/mean@n", "<source>/greedy", "response_length/...", ...}`` over all
    prompts of ``files`` (verl-format parquet/jsonl)."""
    from minihf.data import RLDataset, load_tokenizer
    from minihf.rollout import LLM, SamplingParams
    from minihf.rollout.llm import eos_ids_from_dir
    from minihf.trainer.reward import RuleReward, load_reward
    from minihf.utils.files import MODEL_FIX, read_json
    from minihf.utils.imports import split_ref

    cfg = cfg or EvalConfig()
    model_dir = Path(model_dir)
    tok = load_tokenizer(model_dir)
    ds = RLDataset(files, tok, max_prompt_length=cfg.max_prompt_length,
                   apply_chat_template=cfg.apply_chat_template)
    fn = load_reward(*split_ref(cfg.reward)) if cfg.reward else load_reward(None, "")
    reward = RuleReward(fn, tok)
    hf = read_json(model_dir / "config.json", MODEL_FIX)
    eos = set(eos_ids_from_dir(model_dir, hf)) | ({tok.eos_token_id} if tok.eos_token_id is not None else set())
    llm = LLM(model_dir, max_model_len=max(map(len, ds.input_ids)) + cfg.max_tokens,
              eos_token_ids=tuple(sorted(eos)), seed=cfg.seed)
    runs = []
    if cfg.n:
        runs.append((f"mean@{cfg.n}", SamplingParams(n=cfg.n, temperature=cfg.temperature, top_p=cfg.top_p,
                                                     top_k=cfg.top_k, max_tokens=cfg.max_tokens, seed=cfg.seed)))
    if cfg.greedy:
        runs.append(("greedy", SamplingParams(n=1, temperature=0.0, max_tokens=cfg.max_tokens)))
    metrics: dict = {"prompts": len(ds)}
    for name, params in runs:
        rows, batch = generate_batch(llm, ds, params, tok.pad_token_id)
        mask = batch["response_mask"]
        _, _, scores = reward(batch)
        sources = list(batch.non_tensors["data_source"])
        for src in sorted(set(sources)):
            vals = [s for s, d in zip(scores, sources) if d == src]
            metrics[f"{src}/{name}"] = sum(vals) / len(vals)
        metrics[f"{name}/response_length/mean"] = mask.sum(-1).float().mean().item()
        metrics[f"{name}/truncated"] = sum(c.finish_reason == "length" for _, c in rows) / len(rows)
    llm.free()
    return metrics


def generate_batch(llm, ds, params, pad_id: int) -> tuple[list, Batch]:
    """Every prompt of ``ds`` through ``llm``: ``(rows, batch)``, ``rows`` the ``(prompt
    index, CompletionOutput)`` of each sample and ``batch`` their prompt columns with
    ``responses`` / ``response_mask`` (right-padded), ready for a ``RuleReward``."""
    outs = llm.generate([ds[i]["input_ids"] for i in range(len(ds))], params)
    rows = [(i, c) for i, o in enumerate(outs) for c in o.outputs]
    batch = ds.collate([i for i, _ in rows])
    width = max(len(c.token_ids) for _, c in rows) or 1
    responses = torch.full((len(rows), width), pad_id, dtype=torch.long)
    mask = torch.zeros(len(rows), width, dtype=torch.long)
    for r, (_, c) in enumerate(rows):
        responses[r, :len(c.token_ids)] = torch.tensor(c.token_ids, dtype=torch.long)
        mask[r, :len(c.token_ids)] = 1
    return rows, Batch({"responses": responses, "response_mask": mask}, batch.non_tensors)

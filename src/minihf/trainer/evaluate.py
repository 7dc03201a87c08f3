"""Score a model on prompt files, offline: ``minihf eval``, on one process or under torchrun.

The prompts go through the training path -- ``RLDataset`` renders the chat template and
counts ``max_prompt_length`` in tokens, generation stops at the generation config's EOS ids
(and the tokenizer's eos), each response is decoded with special tokens skipped and scored
by the same reward function as training, through the scoring path RL validation takes
(``minihf.trainer.scoring``). Reports, per data source, the mean
score of ``n`` sampled answers per prompt (``mean@n``), ``pass@k`` for k = 1, 2, 4, ..., n
(the unbiased estimate of Chen et al. 2021 that at least one of k samples passes, i.e. scores
at least ``pass_threshold``) and the greedy answer's score, so a trained checkpoint compares
with its base model on equal terms.

Before any model loads, each prompt is checked as ``minihf generate`` checks its own: a
character outside the vocabulary (it would be scored as the unknown token) is refused
unless ``allow_unk``, and so is a row without the ground truth the built-in rewards score
against, and a ``max_tokens`` that, after the longest prompt, runs past the model's
context (training refuses the same at start-up); each error names the data file and row.

The model is an HF dir or a training checkpoint (``.../global_step_N`` or its ``actor``),
exported to a temporary dir first. Under torchrun each rank generates for every
``world``-th prompt and the scores are gathered; sample j of prompt i draws from a stream
seeded by (``seed``, i, j) alone, so the metrics do not depend on the number of ranks.
"""

from __future__ import annotations

import math
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Sequence

import torch
import torch.distributed as dist

from minihf.protocol import Batch
from minihf.hub import model_dir_of
from minihf.trainer.scoring import mean_by_source, score_responses


@dataclass
class EvalConfig:
    n: int = 4                      # sampled answers per prompt (mean@n, pass@k); 0: none
    temperature: float = 1.0        # sampling temperature of the n answers
    top_p: float = 1.0              # nucleus of the n answers
    top_k: int = -1                 # top-k of the n answers; -1: off
    greedy: bool = True             # also score one greedy answer per prompt
    max_tokens: int = 256           # response tokens at most
    max_prompt_length: int = 1024   # prompt tokens at most (longer: an error naming the row)
    apply_chat_template: bool = True
    reward: str | None = None       # file.py:function; None: the built-in scorer per data_source
    pass_threshold: float = 1.0     # a sample passes (for pass@k) when it scores at least this
    seed: int = 0
    allow_unk: bool = False         # score prompts with characters outside the vocabulary

    def __post_init__(self):
        for key in ("temperature", "top_p", "pass_threshold"):
            value = getattr(self, key)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
                raise ValueError(f"{key}={value!r} must be a finite number")
        if self.n < 0:
            raise ValueError(f"n={self.n} must be >= 0 (sampled answers per prompt; 0 with greedy: greedy only)")
        if self.n == 0 and not self.greedy:
            raise ValueError(f"n={self.n} with greedy={self.greedy}: nothing to evaluate; use n >= 1 or greedy")
        if self.max_tokens < 1 or self.max_prompt_length < 1:
            raise ValueError(f"max_tokens={self.max_tokens}, max_prompt_length={self.max_prompt_length}: "
                             "both must be >= 1")


def pass_at_k(n: int, c: int, k: int) -> float:
    """The probability that at least one of k samples drawn without replacement from n, of
    which c pass, passes: ``1 - C(n-c, k) / C(n, k)`` (unbiased for the model's pass@k)."""
    if n - c < k:
        return 1.0
    return 1.0 - math.comb(n - c, k) / math.comb(n, k)


def ks_for(n: int) -> list[int]:
    """1, 2, 4, ... up to n, and n."""
    return sorted({2 ** i for i in range(n.bit_length()) if 2 ** i <= n} | {n})


def _rank_world() -> tuple[int, int]:
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


def evaluate(model: str | Path, files: str | Path | Sequence[str | Path], cfg: EvalConfig | None = None) -> dict:
    """Metrics ``{"<source>/mean@n", "<source>/pass@k", "<source>/greedy", ...}`` over all
    prompts of ``files`` (verl-format parquet/jsonl); the same on every rank."""
    cfg = cfg or EvalConfig()
    with tempfile.TemporaryDirectory(prefix="minihf-eval-") as scratch:
        return _evaluate(model_dir_of(model, Path(scratch)), files, cfg, str(model))


def _evaluate(model_dir: Path, files, cfg: EvalConfig, model_name: str | None = None) -> dict:
    """``evaluate`` of an HF model dir; ``model_name``: the model as the user gave it (for
    messages: a checkpoint is exported to a scratch dir first)."""
    from minihf.data import RLDataset, load_tokenizer
    from minihf.data.files import read_many
    from minihf.rollout.llm import eos_ids_from_dir
    from minihf.trainer.reward import RuleReward, load_reward
    from minihf.utils.files import MODEL_FIX, read_json
    from minihf.utils.imports import split_ref

    model_name = model_name or str(model_dir)
    rank, world = _rank_world()
    try:  # before the data and the model: a wrong name is one line naming what the file has
        fn = load_reward(*split_ref(cfg.reward)) if cfg.reward else load_reward(None, "")
    except (AttributeError, TypeError, ImportError) as exc:
        raise ValueError(f"reward {cfg.reward}: {exc}") from None
    tok = load_tokenizer(model_dir)
    try:
        ds = RLDataset(files, tok, max_prompt_length=cfg.max_prompt_length,
                       apply_chat_template=cfg.apply_chat_template, allow_unk=True)  # check_prompts: eval's wording
    except ValueError as exc:
        raise _template_error(exc, model_dir, model_name) from None
    wheres = [f"data file {path}, row {i}" for path, i, _ in read_many(files)]  # eval filters no row
    check_prompts(ds, wheres, tok, cfg)
    check_context(ds, wheres, model_dir, model_name, cfg)
    reward = RuleReward(fn, tok)
    hf = read_json(model_dir / "config.json", MODEL_FIX)
    eos = set(eos_ids_from_dir(model_dir, hf)) | ({tok.eos_token_id} if tok.eos_token_id is not None else set())
    mine = list(range(rank, len(ds), world))
    try:
        results, error = _score_prompts(model_dir, ds, mine, reward, eos, tok.pad_token_id, cfg), None
    except Exception as e:  # noqa: BLE001 - reported on every rank below, not left to hang the others
        if world == 1:
            raise
        results, error = None, f"rank {rank}: {type(e).__name__}: {e}"
    if world > 1:
        gathered = [None] * world
        dist.all_gather_object(gathered, (results, error))
        errors = [err for _, err in gathered if err]
        if errors:
            raise ValueError("; ".join(errors))
        results = {name: [r for part, _ in gathered for r in part[name]] for name in results}
    return summarize({name: sorted(rows) for name, rows in results.items()}, len(ds), cfg)


def _template_error(exc: ValueError, model_dir: Path, name: str) -> ValueError:
    """``exc`` with the chat template's file named when the template failed (a jinja error)."""
    import jinja2

    if "longer than max_prompt_length" in str(exc):  # the dataset's wording names its own options
        return ValueError(str(exc).split("; raise the limit")[0] + "; raise --max-prompt-length (eval keeps "
                          "every prompt whole)")
    if not isinstance(exc.__cause__, jinja2.TemplateError):
        return exc
    where = ("chat_template.jinja" if (model_dir / "chat_template.jinja").is_file()
             else "tokenizer_config.json's chat_template")
    return ValueError(f"{exc} (the chat template is the {where} of {name}); fix the template")


def check_prompts(ds, wheres: Sequence[str], tok, cfg: EvalConfig) -> None:
    """Refuse, naming the data file and row, a prompt with characters outside the
    vocabulary (they would all be scored as the unknown token; ``minihf generate`` refuses
    them too; ``allow_unk`` lets them through) and, scored by the built-in rewards, a row
    with no ground truth (no ``reward_model`` column, or ``ground_truth: null``)."""
    from minihf.data.tokenizer import unknown_chars_error

    message = None if cfg.allow_unk else unknown_chars_error(
        tok, [(where, "".join(m["content"] for m in rec["raw_prompt"])) for where, rec in zip(wheres, ds.records)],
        "prompt", "remove them, or pass --allow-unk")
    if message:
        raise ValueError(message)
    for where, rec in zip(wheres, ds.records):
        if cfg.reward is None and rec["ground_truth"] is None:
            from minihf.data.files import DataFileError

            raise DataFileError(
                f"{where}: no ground truth (column 'reward_model' missing, or its ground_truth is "
                f"null); the built-in reward for data_source {rec['data_source']!r} scores against "
                "it: add reward_model.ground_truth, or pass --reward file.py:function")


def check_context(ds, wheres: Sequence[str], model_dir: Path, name: str, cfg: EvalConfig) -> None:
    """The longest prompt + ``max_tokens`` must fit the model's context (training's start-up
    check, ``minihf.models.config_checks.context_error``): past it, a KV cache of that length is
    allocated and a model that never says EOS is decoded for minutes."""
    from minihf.models import load_args
    from minihf.models.config_checks import context_error

    limit = load_args(model_dir).max_position_embeddings
    i = max(range(len(ds)), key=lambda j: len(ds.input_ids[j]))
    prompt = len(ds.input_ids[i])
    fix = (f"lower --max-tokens to at most {limit - prompt}" if prompt < limit
           else "shorten that prompt")
    message = context_error(f"the longest prompt ({wheres[i]}) + max_tokens = {prompt} + {cfg.max_tokens}",
                            prompt + cfg.max_tokens, limit, f"model {name}", fix)
    if message:
        raise ValueError(message)


def _score_prompts(model_dir: Path, ds, mine: list[int], reward, eos: set, pad_id: int,
                   cfg: EvalConfig) -> dict:
    """``(prompt, sample, data source, score, length, truncated)`` of every sample of the prompts
    ``mine``, per run (``mean@n``, ``greedy``)."""
    from minihf.rollout import LLM, SamplingParams
    from minihf.rollout.sampling import request_seed

    runs = []
    if cfg.n:
        runs.append((f"mean@{cfg.n}", [SamplingParams(
            n=cfg.n, temperature=cfg.temperature, top_p=cfg.top_p, top_k=cfg.top_k, max_tokens=cfg.max_tokens,
            seed=request_seed(cfg.seed, i)) for i in mine]))
    if cfg.greedy:
        runs.append(("greedy", [SamplingParams(n=1, temperature=0.0, max_tokens=cfg.max_tokens)] * len(mine)))
    results: dict = {name: [] for name, _ in runs}
    if not mine:  # more ranks than prompts
        return results
    llm = LLM(model_dir, max_model_len=max(map(len, ds.input_ids)) + cfg.max_tokens,
              eos_token_ids=tuple(sorted(eos)), seed=cfg.seed)
    for name, params in runs:
        rows, batch = generate_batch(llm, ds, params, pad_id, mine)
        results[name] = [(i, c.index, r.source, r.score, r.length, c.finish_reason == "length")
                         for (i, c), r in zip(rows, score_responses(reward, batch))]
    llm.free()
    return results


def summarize(results: dict, prompts: int, cfg: EvalConfig) -> dict:
    """The metrics of the ``(prompt, sample, source, score, length, truncated)`` rows of
    each run, in (prompt, sample) order."""
    metrics: dict = {"prompts": prompts}
    for name, rows in results.items():
        for src, mean in mean_by_source([r[3] for r in rows], [r[2] for r in rows]).items():
            metrics[f"{src}/{name}"] = mean
            if name.startswith("mean@"):
                passed: dict[int, int] = {}
                for i, _, _, score, *_ in (r for r in rows if r[2] == src):
                    passed[i] = passed.get(i, 0) + (score >= cfg.pass_threshold)
                for k in ks_for(cfg.n):
                    metrics[f"{src}/pass@{k}"] = sum(pass_at_k(cfg.n, c, k) for c in passed.values()) / len(passed)
        metrics[f"{name}/response_length/mean"] = sum(r[4] for r in rows) / len(rows)
        metrics[f"{name}/truncated"] = sum(r[5] for r in rows) / len(rows)
    return metrics


def generate_batch(llm, ds, params, pad_id: int, indices: Sequence[int] | None = None) -> tuple[list, Batch]:
    """The prompts ``indices`` of ``ds`` (default: all) through ``llm`` with ``params`` (one,
    or one per prompt): ``(rows, batch)``, ``rows`` the ``(prompt index, CompletionOutput)``
    of each sample and ``batch`` their prompt columns with ``responses`` / ``response_mask``
    (right-padded), ready for a ``RuleReward``."""
    indices = list(range(len(ds))) if indices is None else list(indices)
    outs = llm.generate([ds[i]["input_ids"] for i in indices], params)
    rows = [(i, c) for i, o in zip(indices, outs) for c in o.outputs]
    batch = ds.collate([i for i, _ in rows])
    width = max(len(c.token_ids) for _, c in rows) or 1
    responses = torch.full((len(rows), width), pad_id, dtype=torch.long)
    mask = torch.zeros(len(rows), width, dtype=torch.long)
    for r, (_, c) in enumerate(rows):
        responses[r, :len(c.token_ids)] = torch.tensor(c.token_ids, dtype=torch.long)
        mask[r, :len(c.token_ids)] = 1
    return rows, Batch({"responses": responses, "response_mask": mask}, batch.non_tensors)

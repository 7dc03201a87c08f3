"""The rollout's output batch: generated sequences to verl's columns (``build_output``), the
recorded expert routes (``routes_tensor``), multi-turn rows in and episode columns out, and
the collection of every replica's rows (``collect_rollout``); split from ``engine.py``, whose
``HybridEngine`` produces what these assemble."""

from __future__ import annotations

import copy

import numpy as np
import torch

from minihf.multi_turn.loop import ENV_ROW_KEYS
from minihf.protocol import Batch


def build_output(batch: Batch, seqs, response_length: int, pad_token_id: int) -> Batch:
    """verl's rollout tensors: ``prompts`` [B, P] (as given, left-padded), ``responses``
    [B, R] right-padded with ``pad_token_id``, ``input_ids`` = prompts ++ responses,
    ``attention_mask`` and ``position_ids`` [B, P + R] (response positions continue after
    each prompt's last), ``response_mask`` [B, R] (1 on generated tokens, EOS included;
    0 on a multi-turn trajectory's observation tokens, which the attention mask keeps),
    ``rollout_log_probs`` [B, R] (0 on padding and observations); when the engine recorded
    them, ``routed_experts`` [B, P + R, MoE layers, k]: each token's expert ids, -1 where
    none was recorded (padding; the last token, never fed through the model)."""
    prompts = batch.tensors["input_ids"]
    B, R = len(seqs), response_length
    responses = torch.full((B, R), pad_token_id, dtype=prompts.dtype)
    logps = torch.zeros(B, R, dtype=torch.float32)
    lengths = torch.tensor([len(s.tokens) for s in seqs], dtype=torch.long)
    mask_dtype = batch.tensors["attention_mask"].dtype
    response_attn = (torch.arange(R)[None, :] < lengths[:, None]).to(mask_dtype)
    response_mask = response_attn.clone()
    for i, s in enumerate(seqs):
        responses[i, :len(s.tokens)] = torch.tensor(s.tokens, dtype=prompts.dtype)
        logps[i, :len(s.logprobs)] = torch.tensor(s.logprobs, dtype=torch.float32)
        for start, end in getattr(s, "observations", ()):  # multi-turn sequences only
            response_mask[i, start:end] = 0
    last = batch.tensors["position_ids"][:, -1:]                                 # [B, 1]
    positions = torch.cat([batch.tensors["position_ids"], last + torch.arange(1, R + 1)[None, :]], 1)
    out = Batch({
        "prompts": prompts, "responses": responses,
        "input_ids": torch.cat([prompts, responses], dim=1),
        "attention_mask": torch.cat([batch.tensors["attention_mask"], response_attn], dim=1),
        "position_ids": positions, "response_mask": response_mask,
        "rollout_log_probs": logps,
    })
    if seqs and getattr(seqs[0], "routes", None) is not None:
        out.tensors["routed_experts"] = routes_tensor(seqs, prompts.shape[1], R)
    return out


def routes_tensor(seqs, prompt_width: int, response_length: int) -> torch.Tensor:
    """Each sequence's recorded routes [n, L, k] placed as its tokens are in ``input_ids``
    (the prompt ends at column ``prompt_width``, the response follows): [B, P + R, L, k]."""
    first = seqs[0].routes
    routes = torch.full((len(seqs), prompt_width + response_length, *first.shape[1:]), -1, dtype=first.dtype)
    for i, s in enumerate(seqs):
        start = prompt_width - len(s.prompt)
        routes[i, start:start + len(s.routes)] = s.routes.cpu()
    return routes


def env_rows(batch: Batch) -> list[dict]:
    """Each sample's dataset row as an environment receives it: ``prompt`` (messages),
    ``data_source``, ``reward_model: {ground_truth}``, ``extra_info``, ``index``."""
    nt = batch.non_tensors
    rows = []
    for i in range(len(batch)):
        # its own copy: an environment that changes its row's extra_info changes no other
        # sample of the prompt, nor the dataset's row in a later epoch
        row = copy.deepcopy({k: nt[k][i] for k in ENV_ROW_KEYS if k in nt})
        row["prompt"] = row.get("raw_prompt")
        row["reward_model"] = {"ground_truth": row.pop("ground_truth", None)}
        rows.append(row)
    return rows


def with_prompts(batch: Batch, prompts: list[list[int]], width: int, pad_token_id: int) -> Batch:
    """``batch`` with its prompt tensors rebuilt from ``prompts``, left-padded to ``width``
    (the rollout's prompt length, the same on every replica)."""
    ids = torch.full((len(prompts), width), pad_token_id, dtype=batch.tensors["input_ids"].dtype)
    mask = torch.zeros((len(prompts), width), dtype=batch.tensors["attention_mask"].dtype)
    for i, p in enumerate(prompts):
        ids[i, width - len(p):] = torch.tensor(p, dtype=ids.dtype)
        mask[i, width - len(p):] = 1
    positions = (mask.long().cumsum(-1) - 1).clamp(min=0)
    return Batch({**batch.tensors, "input_ids": ids, "attention_mask": mask, "position_ids": positions},
                 batch.non_tensors, batch.meta)


def episode_outputs(out: Batch, runner, seqs, turn_rewards: bool) -> None:
    """Add a multi-turn generation's per-sample results to ``out``: ``env_rewards`` [B, R]
    (each step's reward on its turn's last token with ``turn_rewards``, else their sum on
    the last assistant token), ``multi_turn_{turns,tool_calls,tool_errors}`` [B] and the
    non-tensors ``multi_turn_finish`` and ``multi_turn_messages`` (the conversation)."""
    R = out.tensors["responses"].shape[1]
    env_rewards = torch.zeros(len(seqs), R, dtype=torch.float32)
    stats = {k: torch.zeros(len(seqs), dtype=torch.float32) for k in ("turns", "tool_calls", "tool_errors")}
    finish, messages = [], []
    episodes = runner.episodes or [None] * len(seqs)  # a TP follower's output is not collected
    for i, (seq, ep) in enumerate(zip(seqs, episodes)):
        if ep is None:
            finish.append(seq.finish_reason)
            messages.append([])
            continue
        partial = seq.finish_reason == "length" and len(seq.tokens) > ep.turn_start
        if partial:  # the turn the length cap cut off
            ep.messages.append({"role": "assistant", "content": runner.mt.turn_text(seq.tokens[ep.turn_start:])})
        if turn_rewards:
            for at, r in ep.rewards:
                env_rewards[i, at] += r
        elif ep.rewards:  # on the last assistant token (the response's last is an observation's only when cut)
            last = max(j for j, m in enumerate(seq.token_mask()) if m)
            env_rewards[i, last] = sum(r for _, r in ep.rewards)
        stats["turns"][i] = ep.turns + partial
        stats["tool_calls"][i] = getattr(ep.env, "tool_calls", 0)
        stats["tool_errors"][i] = getattr(ep.env, "tool_errors", 0)
        finish.append(seq.finish_reason)
        messages.append(ep.messages)
    out.tensors["env_rewards"] = env_rewards
    for k, v in stats.items():
        out.tensors[f"multi_turn_{k}"] = v
    out.non_tensors["multi_turn_finish"] = np.array(finish, dtype=object)
    msgs = np.empty(len(messages), dtype=object)
    msgs[:] = messages
    out.non_tensors["multi_turn_messages"] = msgs


# replicas run at once: the slowest counts (and the most bytes one rank received)
MAX_META = ("timing_s/reshard", "timing_s/gen", "perf/reshard_bytes", "timing_s/gen_prefill",
            "timing_s/gen_decode", "timing_s/gen_capture", "timing_s/gen_pack", "timing_s/gen_extend", "timing_s/env",
            "multi_turn/evictions")


def collect_rollout(layout, outputs: list, ctx) -> Batch:
    """DP_COMPUTE's collect for ``generate_sequences``: concatenate in DP order, drop the
    rows generated for DP padding (``n`` per padded prompt when the call repeats prompts
    itself) and merge the replicas' timings (their max)."""
    metas = [o.meta for o in outputs]
    n = metas[0].get("rollout/n", 1)
    keep = ("rollout/n",) + MAX_META
    out = Batch.concat([Batch(o.tensors, o.non_tensors,
                              {k: v for k, v in o.meta.items() if k not in keep}) for o in outputs])
    pad = getattr(ctx, "pad", ctx or 0)
    out = out.unpad(pad * n)
    out.meta.update({k: max(m[k] for m in metas) for k in MAX_META if k in metas[0]})
    return out

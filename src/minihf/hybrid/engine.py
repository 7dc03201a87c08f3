"""``HybridEngine``: the actor's FSDP model + a long-lived TP rollout engine + the reshard plan.

One generation call (``generate_sequences``): wake the engine up and fill its weights from
the current FSDP shards (``reshard.reshard_into``, no rank ever holds more than its TP
slice), generate with the KV-cache engine, then (``free_cache_engine``) put the engine to
sleep, freeing its weights and KV cache before training resumes. The engine's model is
built once, on the meta device, and rewritten for TP (``tp_rewrite``); it never holds
weights it was not given.

A LoRA actor (``minihf.models.lora``): the engine's model carries the same adapters,
unmerged, sliced for TP like the layers they adapt (``placement``), and adds their term to
each product as the trainer does; merging them into a kept copy of the base weights was
the alternative, but it would hold a second copy of every adapted weight, cost a merge of
every adapted matrix per step, and round differently from the trainer's forward. The
base weights never change, so the engine keeps them while asleep (only the KV cache is
freed) and each later sync moves the adapters alone (``adapter_buckets``): per-step
traffic is the adapter bytes. ``rollout.free_base_weights`` frees them too; the next
sync then gathers everything again.

Randomness comes from the caller: sample j of the prompt with uid u at global step s draws
from ``request_seed(rollout.seed, s, u, j)``, whatever its row, replica or call. So DP
replicas never share streams, the n samples of a prompt differ wherever they land, and a
resumed run draws what the uninterrupted run would have.
"""

from __future__ import annotations

import time

import torch
import torch.distributed as dist

from minihf.models import build_model
from minihf.models.hf_io import resolve_dtype
from minihf.models.lora import apply_lora, is_lora_param, lora_modules
from minihf.parallel.fsdp import reshard as fsdp_reshard
from minihf.parallel.tp import tp_rewrite
from minihf.protocol import Batch
from minihf.rollout import Engine, SamplingParams
from minihf.rollout.sampling import request_seed
from minihf.hybrid.plan import plan_reshard
from minihf.hybrid.reshard import reshard_into
from minihf.hybrid.rollout_output import build_output, env_rows, episode_outputs, with_prompts

PROMPT_KEYS = ("input_ids", "attention_mask", "position_ids")
SAMPLING_META = ("do_sample", "temperature", "top_k", "top_p", "n", "response_length",
                 "validate")


def rollout_dtype(name: str, device: torch.device) -> torch.dtype:
    return resolve_dtype(name, device)  # the config allows "auto", "float32" and "bfloat16"


def _size(group) -> int:
    return dist.get_world_size(group) if group is not None else 1


def lora_spec(adapted: dict) -> tuple[int, float, list[str]] | None:
    """``(rank, alpha, module names)`` of a model's LoRA modules (``lora_modules``), or None."""
    if not adapted:
        return None
    first = next(iter(adapted.values()))
    rank = first.lora_A.shape[0]
    return rank, first.scaling * rank, list(adapted)


def build_engine(args, cfg, dtype: torch.dtype, tp_group, device: torch.device,
                 eos_token_ids: tuple[int, ...], lora: tuple[int, float, list[str]] | None = None,
                 record_routes: bool = False) -> Engine:
    """The KV-cache engine over a meta-device model of ``args`` rewritten for TP (its
    weights are loaded by a sync); ``lora``: the trained model's adapters, ``(rank, alpha,
    module names)``; ``record_routes``: keep a MoE model's expert choices (R3)."""
    model = build_model(args, "lm", device="meta", dtype=dtype)
    if lora:
        apply_lora(model, *lora)
    tp_rewrite(model, tp_group if _size(tp_group) > 1 else None)
    return Engine(model, device=device, max_num_seqs=cfg.max_num_seqs,
                  max_model_len=cfg.prompt_length + cfg.response_length,
                  max_num_batched_tokens=cfg.max_num_batched_tokens,
                  gpu_memory_utilization=cfg.gpu_memory_utilization if device.type == "cuda" else None,
                  eos_token_ids=eos_token_ids, enforce_eager=cfg.enforce_eager,
                  cudagraph_capture_sizes=cfg.cudagraph_capture_sizes,
                  enable_chunked_prefill=cfg.enable_chunked_prefill, record_routes=record_routes)


class HybridEngine:
    """Generation from an FSDP-sharded causal LM through a TP engine (see module docstring).

    ``all_group``: the actor's N ranks (the FSDP group); ``gather_group``/``tp_group``/
    ``tp_rank``: this rank's place in the strided rollout layout.
    """

    def __init__(self, fsdp_model: torch.nn.Module, cfg, *, all_group, gather_group, tp_group,
                 tp_rank: int, device: torch.device, eos_token_ids: tuple[int, ...],
                 pad_token_id: int, multi_turn=None, record_routes: bool = False):
        self.fsdp_model, self.cfg, self.device = fsdp_model, cfg, device
        self.multi_turn = multi_turn  # minihf.multi_turn.MultiTurn, or None: single-turn
        self.all_group, self.gather_group, self.tp_rank = all_group, gather_group, tp_rank
        self.tp = _size(tp_group)
        self.dtype = rollout_dtype(cfg.dtype, device)
        self.pad_token_id = pad_token_id
        if cfg.prompt_length is None or cfg.response_length is None:
            raise ValueError("rollout.prompt_length and rollout.response_length must be set (the "
                             "PPO trainer takes them from data.max_prompt_length/max_response_length)")
        args = fsdp_model.args
        shapes = {n: tuple(p.shape) for n, p in fsdp_model.named_parameters()}  # global shapes
        itemsize = torch.empty((), dtype=self.dtype).element_size()

        def plan(names) -> list:
            return plan_reshard({n: shapes[n] for n in names}, _size(all_group), self.tp,
                                mode=cfg.reshard, tied_lm_head=bool(args.tie_word_embeddings),
                                itemsize=itemsize, bucket_bytes=cfg.reshard_bucket_mb << 20)

        self.buckets = plan(shapes)  # every weight: the first sync, and every sync without LoRA
        adapted = lora_modules(fsdp_model)
        self.adapter_buckets = plan([n for n in shapes if is_lora_param(n)]) if adapted else None
        self.base_loaded = False  # whether the engine holds the (frozen) base weights now
        self.engine = build_engine(args, cfg, self.dtype, tp_group, device, eos_token_ids, lora_spec(adapted),
                                   record_routes)
        self.last_reshard: dict[str, int] = {}  # what the last sync moved (reshard_into)

    # -- weights --------------------------------------------------------------------------
    def sync_weights(self) -> None:
        """Wake the engine up and load the FSDP model's current weights into it (a LoRA
        model's adapters alone while the engine still holds its base weights)."""
        fsdp_reshard(self.fsdp_model)  # every parameter a DTensor shard again
        self.engine.wake_up()
        buckets = self.adapter_buckets if self.base_loaded else self.buckets
        dest = dict(self.engine.model.named_parameters())
        self.last_reshard = reshard_into(
            self.fsdp_model, buckets, dest, gather_group=self.gather_group,
            all_group=self.all_group, tp_rank=self.tp_rank, tp=self.tp, dtype=self.dtype)
        self.base_loaded = self.adapter_buckets is not None

    def sleep(self) -> None:
        """Free the KV cache and the weights (a LoRA engine keeps its base weights, unless
        ``rollout.free_base_weights``)."""
        if self.adapter_buckets is not None and not self.cfg.free_base_weights:
            self.engine.free(weights=False)
            return
        self.engine.sleep()
        self.base_loaded = False

    def engine_weight_bytes(self) -> int:
        """Bytes of weights the engine holds now (0 asleep)."""
        if not self.engine.awake:
            return 0
        return sum(p.numel() * p.element_size() for p in self.engine.model.parameters())

    # -- generation -----------------------------------------------------------------------
    def sampling(self, meta: dict) -> dict:
        """The call's sampling settings: rollout config, then ``val_kwargs`` when
        ``meta["validate"]``, then the keys ``meta`` sets."""
        c = self.cfg
        s = dict(n=1, do_sample=c.do_sample, temperature=c.temperature, top_k=c.top_k,
                 top_p=c.top_p, response_length=c.response_length, ignore_eos=c.ignore_eos)
        if meta.get("validate", False):
            v = c.val_kwargs
            s.update(n=v.n, do_sample=v.do_sample, temperature=v.temperature, top_k=v.top_k,
                     top_p=v.top_p)
        s.update({k: meta[k] for k in SAMPLING_META if k in meta and k != "validate"})
        if s["response_length"] > c.response_length or s["response_length"] < 1:
            raise ValueError(f"meta response_length={s['response_length']} must be in 1.."
                             f"{c.response_length} (rollout.response_length sizes the engine)")
        return s

    def generate_sequences(self, batch: Batch, global_step: int) -> Batch:
        """Left-padded prompts (``input_ids``/``attention_mask``/``position_ids`` [B, P],
        non-tensor ``uid``) -> verl's rollout outputs (see ``build_output``)."""
        missing = [k for k in PROMPT_KEYS if k not in batch.tensors]
        if missing or "uid" not in batch.non_tensors:
            raise KeyError(f"generate_sequences needs tensors {list(PROMPT_KEYS)} and the "
                           f"non-tensor 'uid' (one id per prompt); missing "
                           f"{missing + ([] if 'uid' in batch.non_tensors else ['uid'])}")
        s = self.sampling(batch.meta)
        n = int(s["n"])
        if n > 1:  # this call's own repeat (e.g. validation with val_kwargs.n)
            batch = batch.repeat(n, interleave=True)
            index = torch.arange(n).repeat(len(batch) // n)
        elif "sample_index" in batch.tensors:
            index = batch.tensors["sample_index"]
        else:
            index = torch.zeros(len(batch), dtype=torch.long)
        ids, mask = batch.tensors["input_ids"], batch.tensors["attention_mask"]
        if ids.shape[1] > self.cfg.prompt_length:
            raise ValueError(f"prompts are {ids.shape[1]} tokens wide but rollout.prompt_length="
                             f"{self.cfg.prompt_length}; raise it to data.max_prompt_length")
        prompts = [row[m.bool()].tolist() for row, m in zip(ids, mask)]
        temperature = float(s["temperature"]) if s["do_sample"] else 0.0
        uids = batch.non_tensors["uid"]
        params = [SamplingParams(n=1, temperature=temperature, top_k=int(s["top_k"]),
                                 top_p=float(s["top_p"]), max_tokens=int(s["response_length"]),
                                 ignore_eos=bool(s["ignore_eos"]),
                                 seed=request_seed(self.cfg.seed, global_step, str(u), int(j)),
                                 max_turn_tokens=self.cfg.multi_turn.max_tokens_per_turn,
                                 stop_token_ids=list(self.multi_turn.stop_ids) if self.multi_turn else [])
                  for u, j in zip(uids, index.tolist())]
        runner = None
        if self.multi_turn is not None:
            runner = self.multi_turn.runner(env_rows(batch), list(uids), prompts, self.cfg.prompt_length)
            if runner.prompts != prompts:  # an environment's reset() added to a prompt
                prompts = runner.prompts
                batch = with_prompts(batch, prompts, self.cfg.prompt_length, self.pad_token_id)
        t0 = time.perf_counter()
        self.sync_weights()
        t1 = time.perf_counter()
        groups = self.engine.generate(prompts, params, turns=runner)
        t2 = time.perf_counter()
        if self.cfg.free_cache_engine:
            self.sleep()
        seqs = [g[0] for g in groups]
        out = build_output(batch, seqs, int(s["response_length"]), self.pad_token_id)
        if runner is not None:
            episode_outputs(out, runner, seqs, self.cfg.multi_turn.turn_rewards)
        if n > 1:
            out.non_tensors.update(batch.non_tensors)
            out.tensors["sample_index"] = index
        out.meta.update({"timing_s/reshard": t1 - t0, "timing_s/gen": t2 - t1, "rollout/n": n,
                         "perf/reshard_bytes": self.last_reshard.get("bytes_received", 0),
                         "timing_s/gen_prefill": self.engine.last_stats.get("prefill_s", 0.0),
                         "timing_s/gen_decode": self.engine.last_stats.get("decode_s", 0.0),
                         **({"timing_s/gen_capture": self.engine.last_stats["capture_s"]}
                            if self.engine.runner.decode_mode != "eager" else {}),
                         **({"timing_s/gen_pack": self.engine.last_stats["pack_s"]}
                            if self.engine.runner.packed is not None and self.engine.runner.packed.table else {}),
                         **({"timing_s/env": runner.env_seconds,
                             "timing_s/gen_extend": self.engine.last_stats["extend_s"],
                             "multi_turn/evictions": self.engine.last_stats["evictions"]}
                            if runner is not None else {}),
                         "temperature": temperature if temperature > 0 else 1.0})
        return out


class StandaloneEngine(HybridEngine):
    """The rollout engine alone, on ranks that do not train (standalone placement,
    ``minihf.workers.RolloutWorker``, docs/async.md): its weights arrive from the actor's
    ranks (``receive``, ``minihf.hybrid.transfer``) and stay between calls (a LoRA actor's
    base weights arrive once, its adapters at every sync); a call frees only its KV cache.
    Generation is the hybrid engine's, so the same weights give the same samples."""

    def __init__(self, args, cfg, *, tp_group, tp_rank: int, device: torch.device,
                 eos_token_ids: tuple[int, ...], pad_token_id: int, multi_turn=None,
                 lora: tuple[int, float, list[str]] | None = None, record_routes: bool = False):
        self.cfg, self.device, self.multi_turn = cfg, device, multi_turn
        self.tp, self.tp_rank = _size(tp_group), tp_rank
        self.dtype = rollout_dtype(cfg.dtype, device)
        self.pad_token_id = pad_token_id
        if cfg.prompt_length is None or cfg.response_length is None:
            raise ValueError("rollout.prompt_length and rollout.response_length must be set (the "
                             "PPO trainer takes them from data.max_prompt_length/max_response_length)")
        self.engine = build_engine(args, cfg, self.dtype, tp_group, device, eos_token_ids, lora, record_routes)
        self.loaded = False
        self.last_reshard: dict[str, int] = {}

    def receive(self, rounds, group) -> int:
        """This rank's TP slice of every weight from the actor's ranks; the bytes received."""
        from minihf.hybrid.transfer import receive_weights

        self.engine.wake_up()
        received = receive_weights(dict(self.engine.model.named_parameters()), rounds,
                                   dist.get_rank(), group)
        self.loaded = True
        return received

    def sync_weights(self) -> None:
        if not self.loaded:
            raise RuntimeError("the standalone rollout has no weights yet: the driver sends them "
                               "(actor.send_weights with rollout.receive_weights) before it generates")

    def sleep(self) -> None:
        self.engine.free(weights=False)  # the weights stay until the next sync overwrites them

"""CUDA-only checks (marker ``gpu``), run by ``scripts/gpu_check.sh`` on a GPU machine
(``pytest -m gpu``) and skipped elsewhere; the default run deselects them.

* the engine's and the trainer's log-probs, fp32 and bf16, at TP 1: each within its dtype's
  rounding bound of a float64 forward of the same (dtype-rounded) weights;
* the logits over the temperature, the same correctly rounded bits in the sampler's two
  paths and the trainer's two (``minihf.models.temperature``);
* SDPA's flash backend against its math backend, bare and through the model: the flash
  result's error against fp32 is within twice the bf16 math backend's (+ a bf16 ulp);
* the packed training forward (flash-attn's varlen kernel when installed, else right-padded
  SDPA buckets) against the padded one, in bf16;
* FSDP2 at world size 1 on NCCL: one AdamW step equals the plain model's;
* the hybrid engine's in-place all-gather (the reshard's path for a whole-tensor TP slice)
  into CUDA memory, over two ranks sharing the GPU (gloo: NCCL refuses two ranks on one GPU);
* optimizer offload during generation: the AdamW moments sit on the host while the engine
  generates and come back, and the next update equals the one without offload;
* the grouped MoE path's gradient, the same bits in three backward passes at k = 4;
* the decode step captured as CUDA graphs for a MoE model and for unmerged LoRA adapters:
  the eager step's tokens, log-probs within rounding, replayed on the next generate.
"""

import pytest
import torch

from logprob_reference import float64_log_probs, rounding_ratio
from minihf.models import load_hf
from minihf.rollout import LLM, SamplingParams

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]

PROMPTS = [[1, 2, 3, 4, 5], [7, 8], [9, 10, 11, 12, 13, 14, 15, 16, 17, 18, 19], [3], [5, 6, 7]]


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    from test_rollout_engine import build_tiny

    path = tmp_path_factory.mktemp("gpu") / "qwen2"
    build_tiny("qwen2", path)
    return str(path)


def padded_batch(pairs, device):
    """Left-padded prompts + right-padded responses, the trainer's layout."""
    P, R = max(len(p) for p, _ in pairs), max(len(r) for _, r in pairs)
    ids = torch.zeros(len(pairs), P + R, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for i, (p, r) in enumerate(pairs):
        ids[i, P - len(p):P + len(r)] = torch.tensor(p + r)
        mask[i, P - len(p):P + len(r)] = 1
    mb = {"input_ids": ids, "attention_mask": mask, "position_ids": (mask.cumsum(-1) - 1).clamp(min=0),
          "responses": ids[:, P:]}
    return {k: v.to(device) for k, v in mb.items()}, mask[:, P:]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_engine_and_trainer_log_probs_within_rounding(tiny, dtype):
    from minihf.workers.forward import forward_log_probs

    model = load_hf(tiny, dtype=dtype, device="cuda").eval()
    llm = LLM(load_hf(tiny, dtype=dtype, device="cuda"), dtype=dtype, device="cuda")
    outs = llm.generate(PROMPTS, SamplingParams(n=2, temperature=0.7, max_tokens=12, seed=1))
    pairs = [(p, c.token_ids) for p, o in zip(PROMPTS, outs) for c in o.outputs]
    mb, mask = padded_batch(pairs, "cuda")
    engine = torch.zeros(mask.shape)
    for i, (_, c) in enumerate((p, c) for p, o in zip(PROMPTS, outs) for c in o.outputs):
        engine[i, :len(c.logprobs)] = torch.tensor(c.logprobs)
    with torch.no_grad():
        trainer = forward_log_probs(model, mb, temperature=0.7)["log_probs"].cpu()
    # the exact reference: float64 of the weights as this dtype holds them
    exact, scale = float64_log_probs(load_hf(tiny, dtype=dtype).float(),
                                     {k: v.cpu() for k, v in mb.items()}, 0.7)
    ratio = {"engine": rounding_ratio(engine, exact, scale, mask, dtype=dtype),
             "trainer": rounding_ratio(trainer, exact, scale, mask, dtype=dtype),
             "pair": rounding_ratio(engine, trainer, scale, mask, pairwise=True, dtype=dtype)}
    gap = (engine - trainer)[mask.bool()].abs()
    print(f"{dtype}: engine vs trainer max {gap.max():.3e} mean {gap.mean():.3e}; worst token in "
          f"units of the rounding bound: {ratio}")
    assert max(ratio.values()) <= 1, ratio


def _attention_errors(backend):
    """(|flash - fp32 math|, |bf16 math - fp32 math|) maxima for causal SDPA."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    g = torch.Generator(device="cuda").manual_seed(0)
    q, k, v = (torch.randn(2, 8, 256, 64, device="cuda", generator=g) for _ in range(3))
    with sdpa_kernel(SDPBackend.MATH):
        ref = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
        low = torch.nn.functional.scaled_dot_product_attention(q.bfloat16(), k.bfloat16(), v.bfloat16(),
                                                               is_causal=True)
    with sdpa_kernel(backend):
        fast = torch.nn.functional.scaled_dot_product_attention(q.bfloat16(), k.bfloat16(), v.bfloat16(),
                                                                is_causal=True)
    return (fast.float() - ref).abs().max().item(), (low.float() - ref).abs().max().item()


def test_temperature_division_is_exact_on_cuda():
    """CUDA multiplies a tensor by a Python float divisor's reciprocal: the captured decode
    step, the eager sampler and the trainer divide by a device tensor, to the same bits."""
    from test_rollout_sampling import check_temperature_division_is_exact

    check_temperature_division_is_exact("cuda")


def test_sdpa_flash_backend_against_math():
    from torch.nn.attention import SDPBackend

    flash, math_bf16 = _attention_errors(SDPBackend.FLASH_ATTENTION)
    print(f"SDPA flash vs fp32 math: {flash:.3e}; bf16 math vs fp32 math: {math_bf16:.3e}")
    # both round q, k, v and the output to bf16 (ulp 2^-8 relative, |out| < ~4): flash's error
    # may differ from math's by its own summation order, not by more than that
    assert flash <= 2 * math_bf16 + 4 * 2.0**-8


def test_model_forward_flash_vs_math_and_packed_vs_padded(tiny):
    from torch.nn.attention import SDPBackend, sdpa_kernel

    from minihf.workers.forward import forward_log_probs

    model = load_hf(tiny, dtype=torch.bfloat16, device="cuda").eval()
    ref = load_hf(tiny, dtype=torch.float32, device="cuda").eval()
    ids = torch.randint(1, 100, (3, 40), device="cuda", generator=torch.Generator(device="cuda").manual_seed(1))
    with torch.no_grad():
        with sdpa_kernel(SDPBackend.MATH):
            exact = ref(ids).float()
            math_bf16 = (model(ids).float() - exact).abs().max().item()
        with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
            flash = (model(ids).float() - exact).abs().max().item()
    print(f"model logits vs fp32: flash bf16 {flash:.3e}, math bf16 {math_bf16:.3e}")
    assert flash <= 2 * math_bf16 + 1e-2   # both round to bf16; 1e-2 only matters if both are ~0
    pairs = [(p, list(range(20, 20 + n))) for p, n in zip(PROMPTS, (5, 9, 3, 12, 7))]
    mb, mask = padded_batch(pairs, "cuda")
    with torch.no_grad():
        packed = forward_log_probs(model, mb, use_remove_padding=True)["log_probs"]
        padded = forward_log_probs(model, mb, use_remove_padding=False)["log_probs"]
        exact = forward_log_probs(ref, mb, use_remove_padding=False)["log_probs"]
    m = mask.bool().to(packed.device)
    packed_err, padded_err = ((x - exact)[m].abs().max().item() for x in (packed, padded))
    print(f"bf16 log-probs vs fp32: packed {packed_err:.3e}, padded {padded_err:.3e}")
    assert packed_err <= 2 * padded_err + 2e-2   # as above: only matters if both are ~0


def _fsdp_rank(rank, world, path):
    import torch.distributed as dist

    from minihf.parallel.fsdp import apply_fsdp, fsdp_mesh

    torch.cuda.set_device(0)
    plain = load_hf(path, device="cuda")
    sharded = apply_fsdp(load_hf(path, device="cuda"), fsdp_mesh(dist.group.WORLD, "cuda"),
                         mixed_precision="none")
    ids = torch.randint(1, 100, (4, 16), device="cuda", generator=torch.Generator(device="cuda").manual_seed(0))
    for m in (plain, sharded):
        opt = torch.optim.AdamW(m.parameters(), lr=1e-3)
        m(ids).float().logsumexp(-1).mean().backward()
        opt.step()
    full = {k: (v.full_tensor() if hasattr(v, "full_tensor") else v).detach().cpu()
            for k, v in sharded.state_dict().items()}
    return max((full[k] - v.detach().cpu()).abs().max().item() for k, v in plain.state_dict().items())


def test_fsdp2_world_size_one_on_nccl(tiny):
    from minihf.testing import spawn_ranks

    err = spawn_ranks(_fsdp_rank, 1, tiny, backend="nccl", timeout_s=300)[0]
    print(f"FSDP2 (1 rank, NCCL) vs plain after one AdamW step: max param diff {err:.3e}")
    assert err < 1e-5   # fp32 weights |w| < 1 moved by lr 1e-3: rounding only (~1e-7)


def _gather_rank(rank, world):
    import torch.distributed as dist

    from minihf.hybrid.reshard import _all_gather

    shard = torch.arange(6, dtype=torch.bfloat16, device="cuda") + 10 * rank
    target = torch.zeros(3, 4, dtype=torch.bfloat16, device="cuda")      # the engine's weight
    _all_gather(target.view(-1), shard, group=dist.group.WORLD)         # in place, as reshard_into
    return target.cpu().tolist()


def test_in_place_reshard_gather_into_cuda_memory():
    from minihf.testing import spawn_ranks

    got = spawn_ranks(_gather_rank, 2, backend="gloo", timeout_s=300)
    want = torch.cat([torch.arange(6.0), torch.arange(6.0) + 10]).view(3, 4).tolist()
    assert got == [want, want]


def _offload_rank(rank, world, path):
    from minihf.controller import Dispatch, Role, register, run
    from minihf.controller.config import ControllerConfig
    from minihf.protocol import Batch
    from test_hybrid_actor import Actor, config, prompts, train_batch

    class Watched(Actor):
        @register(dispatch=Dispatch.ONE_TO_ALL, collect=Dispatch.RANK_ZERO)
        def moments_device_during_generation(self, batch: Batch) -> str:
            seen = []
            inner = self.rollout.generate_sequences

            def generate(b, step):
                seen.append(str(next(iter(self.state.optimizer.state.values()))["exp_avg"].device))
                return inner(b, step)
            self.rollout.generate_sequences = generate
            try:
                self.generate_sequences(batch)
            finally:
                self.rollout.generate_sequences = inner
            after = str(next(iter(self.state.optimizer.state.values()))["exp_avg"].device)
            return f"{seen[0]} -> {after}"

    where, states = {}, {}
    for offload in (True, False):
        def drive(g):
            actor = g["actor"]
            actor.init_model()
            batch = prompts()
            for step in range(2):   # the first update creates the AdamW moments
                meta = {"global_step": step}
                if step == 1:
                    where[offload] = actor.moments_device_during_generation(
                        Batch(batch.tensors, batch.non_tensors, meta))
                gen = actor.generate_sequences(Batch(batch.tensors, batch.non_tensors, meta))
                actor.update_actor(train_batch(gen, step) | actor.compute_log_prob(gen))
            states[offload] = actor.full_state()
        cfg = config(path, 1, 6)
        cfg.actor.fsdp.optimizer_offload = offload
        run(drive, {"actor": Role(Watched, (cfg,))}, ControllerConfig(timeout_s=300))
    diff = max((states[True][k].float() - v.float()).abs().max().item() for k, v in states[False].items())
    return where, diff


def test_optimizer_offload_during_generation(tiny):
    from minihf.testing import spawn_ranks

    where, diff = spawn_ranks(_offload_rank, 1, tiny, backend="nccl", timeout_s=600)[0]
    print(f"AdamW moments during generation -> after: offload {where[True]}, none {where[False]}; "
          f"parameters after two updates, offload vs none: max diff {diff:.3e}")
    assert where[True].startswith("cpu -> cuda") and where[False].startswith("cuda")
    assert diff <= 1e-6   # the moments' round trip is lossless; 1e-6 allows kernel nondeterminism


def test_moe_grouped_gradient_is_reproducible_on_cuda():
    """The grouped MoE path's forward and its backward into x add each token's k terms one by
    one in expert order (no index_add_ over repeated indices, whose CUDA atomics added them in
    any order): two backward passes give the same bits at k = 4."""
    from minihf.models.moe import SparseMoE
    from test_moe import _args

    torch.manual_seed(0)
    moe = SparseMoE(_args(num_experts=8, num_experts_per_tok=4), layer_idx=0).cuda()
    x = torch.randn(4096, 32, device="cuda", requires_grad=True)
    g = torch.randn(4096, 32, device="cuda")
    grads = []
    for _ in range(3):
        x.grad = None
        (moe(x) * g).sum().backward()
        grads.append(x.grad.clone())
    assert all(torch.equal(grads[0], other) for other in grads[1:])


@pytest.mark.parametrize("case", ["moe", "lora"])
def test_captured_decode_of_moe_and_lora_equals_eager(tmp_path, case):
    """The decode step captured as CUDA graphs, for what the dense model's engine test does
    not reach: a MoE model (its dense experts while capturing, the grouped path in the eager
    step) and unmerged LoRA adapters. fp32, greedy and sampled: the same tokens as the eager
    step (the tiny model's logits are peaky: a flip needs a near-tie at fp32's rounding) and
    log-probs within their rounding bound of each other against a float64 forward; a third
    generate replays the graphs (nothing captured: a bucket is captured at its second use)."""
    import copy

    from minihf.models.lora import apply_lora, module_names
    from test_decode_step import SAMPLERS, _worst
    from test_rollout_engine import build_tiny

    path = tmp_path / case
    if case == "moe":
        build_tiny("qwen3_moe", path, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32)
    else:
        build_tiny("qwen2", path)
    model = load_hf(path)
    if case == "lora":
        apply_lora(model, 4, 8.0, module_names(model, "all-linear"))
        torch.manual_seed(0)
        with torch.no_grad():
            for name, p in model.named_parameters():
                if "lora_B" in name:  # zero at init: give the adapters something to add
                    p.normal_(std=0.05)
    for name in ("greedy", "sampled"):
        sp = SAMPLERS[name]
        runs = {}
        for decode in ("eager", "graph"):
            llm = LLM(copy.deepcopy(model).cuda(), dtype=torch.float32, device="cuda", max_num_seqs=4, decode=decode)
            runs[decode] = llm.generate(PROMPTS, sp)
            if decode == "graph":
                assert llm.engine.last_stats["captures"] >= 1  # the buckets used more than once
                llm.generate(PROMPTS, sp)  # captures the buckets used once before
                again = llm.generate(PROMPTS, sp)
                assert llm.engine.last_stats["captures"] == 0
                assert [o.outputs[0].token_ids for o in again] == [o.outputs[0].token_ids for o in runs["graph"]]
        worst = _worst(model, PROMPTS, runs["graph"], runs["eager"], sp.temperature)
        print(f"captured vs eager decode, {case}, {name}: worst log-prob gap in units of the rounding bound {worst:.3f}")
        assert worst <= 1

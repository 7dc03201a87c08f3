"""The mixture-of-experts block: its two expert paths, the load-balancing loss (value and
gradient against transformers' formula), config checks and parameter counts.

Parity of whole MoE models with transformers (logits, the KV cache, saving) is in
test_models_parity.py beside the dense families.
"""

import pytest
import torch
from transformers.models.qwen3_moe.modeling_qwen3_moe import load_balancing_loss_func

from minihf.models import ModelArgs, build_model, init_weights
from minihf.models.config_checks import check_config, implied_parameters
from minihf.models.moe import MoEStep, RouterStats, SparseMoE
from minihf.parallel.fsdp import enable_activation_checkpointing


def _args(**kw):
    base = dict(arch="qwen3_moe", vocab_size=64, hidden_size=32, num_hidden_layers=3, num_attention_heads=4,
                num_key_value_heads=2, head_dim=8, intermediate_size=48, qk_norm=True, num_experts=6,
                num_experts_per_tok=2, moe_intermediate_size=16, norm_topk_prob=True, mlp_only_layers=(1,),
                initializer_range=0.2)
    base.update(kw)
    return ModelArgs(**base)


def _model(seed=0, **kw):
    return init_weights(build_model(_args(**kw), dtype=torch.float64), seed)


def test_dense_path_equals_grouped_path():
    """The capture-safe path (every expert over every row, zero weight off the chosen ones)
    sums the same terms in the same expert order as the grouped one: in float64 they agree
    to a few units of rounding of the output's size (2^-52 ~ 2e-16 relative)."""
    moe = SparseMoE(_args(), layer_idx=0).double()
    with torch.no_grad():
        for p in moe.parameters():
            p.normal_(0, 0.3)
    x = torch.randn(37, 32, dtype=torch.float64)
    probs, weights, ids = moe.route(x)
    assert ids.shape == (37, 2) and torch.allclose(weights.sum(-1), torch.ones(37, dtype=torch.float64))
    grouped, dense = moe.grouped(x, weights, ids), moe.dense(x, weights, ids)
    assert (grouped - dense).abs().max() <= 1e-13 * grouped.abs().max()
    with torch.no_grad():  # without gradients empty experts are skipped: the same values
        assert torch.equal(moe.grouped(x, weights, ids), grouped.detach())


@pytest.mark.parametrize("k", [1, 2, 3, 4])
def test_the_row_gathers_gradient_adds_each_tokens_rows_in_expert_order(k):
    """The grouped path's backward into x adds each token's k row gradients one by one in
    expert order (no atomics on CUDA, whose index_add_ was not reproducible for k >= 3). On
    CPU index_select's own backward adds them in that order too: the same bits."""
    moe = SparseMoE(_args(num_experts=6, num_experts_per_tok=k), layer_idx=0)
    with torch.no_grad():
        for p in moe.parameters():
            p.normal_(0, 0.3)
    x = torch.randn(29, 32, requires_grad=True)
    probs, weights, ids = moe.route(x)
    weights = weights.detach()
    g = torch.randn(29, 32)
    (gx,) = torch.autograd.grad((moe.grouped(x, weights, ids) * g).sum(), x)
    flat = ids.reshape(-1)
    order = torch.argsort(flat, stable=True)
    rows = x.index_select(0, order // k)  # what the grouped path gathered before
    outs, start = [], 0
    for expert, count in zip(moe.experts, torch.bincount(flat, minlength=6).tolist()):
        outs.append(expert(rows[start:start + count]))
        start += count
    y = torch.cat(outs) * weights.reshape(-1).index_select(0, order)[:, None]
    out = torch.zeros_like(x).index_add(0, order // k, y)
    (want,) = torch.autograd.grad((out * g).sum(), x)
    assert torch.equal(gx, want)


def test_unchosen_experts_still_get_zero_gradients():
    """With gradients on every expert is in the graph (FSDP reduces the same parameters
    on every rank): an expert no row chose gets a zero gradient, not None."""
    moe = SparseMoE(_args(num_experts=8), layer_idx=0)
    x = torch.randn(1, 32)  # one row, 2 of 8 experts chosen
    moe(x).sum().backward()
    grads = [e.down_proj.weight.grad for e in moe.experts]
    assert all(g is not None for g in grads)
    assert sum(bool(g.abs().sum() > 0) for g in grads) == 2


def _router_logits(model):
    """Each sparse layer's router logits, captured (with their graph) during a forward."""
    logits, handles = [], []
    for block in model.model.layers:
        if isinstance(block.ffn, SparseMoE):
            handles.append(block.ffn.gate.register_forward_hook(lambda m, i, o: logits.append(o)))
    return logits, handles


@pytest.mark.parametrize("checkpointing", [False, True])
def test_load_balancing_loss_value_and_gradient_match_transformers(checkpointing):
    """RouterStats' value equals transformers' ``load_balancing_loss_func`` over the same
    router logits, and its gradient (entered at each layer's output, after the forward)
    equals autograd's of ``main + coef * aux``, with and without activation checkpointing.
    The model runs in float64; transformers sums the loss's terms in float32 (its
    accumulators are float32) over 2 layers x 18 rows, so the value agrees within
    36 x 2^-24 ~ 2e-6 relative (1e-5 taken), and its gradient (through the float32 cast)
    within 2^-20 of the gradient's scale, three orders below the aux term's own effect."""
    coef = 0.37
    tokens = torch.randint(0, 64, (2, 9), generator=torch.Generator().manual_seed(1))

    ref = _model()
    logits, _ = _router_logits(ref)
    out = ref(tokens)
    aux_ref = load_balancing_loss_func(tuple(logits), 6, 2)
    (out.square().mean() + coef * aux_ref).backward()

    model = _model()
    if checkpointing:
        enable_activation_checkpointing(model)
    stats = RouterStats(6)
    out2 = model(tokens, moe=MoEStep(stats))
    stats.weight = coef
    assert len(stats.counts) == 2  # layers 0 and 2 (layer 1 is in mlp_only_layers)
    assert abs(stats.loss() - aux_ref.double()) <= 1e-5 * aux_ref.abs()
    out2.square().mean().backward()
    for (name, p), p2 in zip(ref.named_parameters(), model.parameters()):
        assert (p.grad - p2.grad).abs().max() <= 2**-20 * (1 + p.grad.abs().max()), name
    router = model.model.layers[0].mlp.gate.weight
    plain = _model()
    plain(tokens).square().mean().backward()
    effect = (plain.model.layers[0].mlp.gate.weight.grad - router.grad).abs().max()
    assert effect > 1000 * 2**-20 * (1 + router.grad.abs().max())  # the aux term moved it


def test_the_aux_loss_counts_each_real_token_once_on_every_path():
    """transformers' loss with the attention mask (padding left out) on an RL batch: 2
    prompts x 2 responses, left-padded prompts, right-padded responses. The padded path
    counted the padding; the packed path with shared prompts counted a prompt's tokens once
    for its 2 responses. Each routed row now weighs the tokens it stands for: the value
    matches on all three paths (transformers sums in float32 over 2 layers x 26 real rows:
    52 x 2^-24 ~ 3e-6 relative, 1e-5 taken, as above), and the router's gradient is the same
    on all three."""
    from minihf.workers.forward import forward_log_probs

    g = torch.Generator().manual_seed(0)
    P, R = 5, 4
    rows = [0, 0, 1, 1]
    prompt_mask = torch.tensor([[0, 0, 1, 1, 1], [1, 1, 1, 1, 1]])[rows]
    mask = torch.cat([prompt_mask, torch.tensor([[1, 1, 0, 0], [1, 1, 1, 1], [1, 0, 0, 0], [1, 1, 1, 0]])], 1)
    ids = torch.cat([torch.randint(1, 64, (2, P), generator=g)[rows], torch.randint(1, 64, (4, R), generator=g)], 1)
    ids = ids * mask
    mb = dict(input_ids=ids, attention_mask=mask, position_ids=(mask.cumsum(1) - 1).clamp(min=0), responses=ids[:, P:])

    ref = _model()
    logits, _ = _router_logits(ref)
    with torch.no_grad():
        ref(ids, mb["position_ids"], attention_mask=mask)
    want = load_balancing_loss_func(tuple(logits), 6, 2, mask).double()
    grads = []
    for kw in (dict(use_remove_padding=False), dict(share_prompt=False), dict(share_prompt=True)):
        model, stats = _model(), RouterStats(6)
        forward_log_probs(model, mb, moe=MoEStep(stats), **kw)["log_probs"].sum().mul(0).backward()
        assert abs(stats.loss() - want) <= 1e-5 * want, kw
        model.zero_grad()
        stats = RouterStats(6)
        stats.weight = 1.0
        forward_log_probs(model, mb, moe=MoEStep(stats), **kw)["log_probs"].sum().mul(0).backward()
        grads.append(model.model.layers[0].mlp.gate.weight.grad.clone())
    # float64 throughout: the paths add the same terms in other orders (a shared prompt's
    # gradient summed before its norm's backward, not after), each sum of at most ~100 terms
    # off by <= 100 * 2^-53 ~ 1e-14 of its scale; 1e-10 leaves four orders for the chain
    scale = grads[0].abs().max()
    assert scale > 0
    for other in grads[1:]:
        assert (other - grads[0]).abs().max() <= 1e-10 * scale


def test_no_stats_means_no_aux_gradient():
    model, plain = _model(), _model()
    tokens = torch.randint(0, 64, (2, 5), generator=torch.Generator().manual_seed(2))
    stats = RouterStats(6)  # weight 0: the statistics are recorded, the gradient is unchanged
    model(tokens, moe=MoEStep(stats)).sum().backward()
    plain(tokens).sum().backward()
    assert stats.loss() > 0
    for p, q in zip(model.parameters(), plain.parameters()):
        assert torch.equal(p.grad, q.grad)


def _cfg(**kw):
    cfg = dict(architectures=["Qwen3MoeForCausalLM"], vocab_size=64, hidden_size=32, num_hidden_layers=4,
               num_attention_heads=4, num_key_value_heads=2, head_dim=8, intermediate_size=48, num_experts=8,
               num_experts_per_tok=2, moe_intermediate_size=16, decoder_sparse_step=2, mlp_only_layers=[3])
    cfg.update(kw)
    return cfg


@pytest.mark.parametrize("change, match", [
    (dict(num_experts_per_tok=9), "num_experts_per_tok=9 is more than the 8 experts"),
    (dict(num_experts=None), "num_local_experts is missing"),
    (dict(num_experts=0), "num_experts=0 must be a whole number >= 1"),
    (dict(moe_intermediate_size="16"), "moe_intermediate_size='16'.*without quotes"),
    (dict(mlp_only_layers=[4]), r"mlp_only_layers=\[4\] must be a list of layer indices from 0 to 3"),
    (dict(router_aux_loss_coef=-1), "router_aux_loss_coef=-1 must be a finite number >= 0"),
    (dict(norm_topk_prob="true"), "norm_topk_prob='true' must be true or false"),
    (dict(architectures=["OlmoeForCausalLM"]), "unsupported architecture 'OlmoeForCausalLM'.*Qwen3MoeForCausalLM"),
])
def test_bad_moe_configs_fail_in_one_line(change, match):
    with pytest.raises(ValueError, match=match) as e:
        check_config(_cfg(**change), "config.json")
    assert "\n" not in str(e.value)


def test_mixtral_reads_num_local_experts_and_renormalises():
    cfg = dict(architectures=["MixtralForCausalLM"], vocab_size=64, hidden_size=32, num_hidden_layers=2,
               num_attention_heads=4, num_key_value_heads=2, intermediate_size=24, num_local_experts=4,
               num_experts_per_tok=2)
    args = ModelArgs.from_hf(cfg)
    assert (args.num_experts, args.moe_intermediate_size, args.norm_topk_prob) == (4, 24, True)
    # a config without router_aux_loss_coef: transformers' default, 0.001 (it was 0: untrained)
    assert args.router_aux_loss_coef == 0.001 and ModelArgs.from_hf({**cfg, "router_aux_loss_coef": 0}).router_aux_loss_coef == 0
    with pytest.raises(ValueError, match="num_experts_per_tok=5 is more than the 4 experts"):
        ModelArgs.from_hf({**cfg, "num_experts_per_tok": 5})


@pytest.mark.parametrize("family", ["mixtral", "qwen"])
def test_bf16_expert_sum_rounds_as_transformers(family):
    """transformers' expert loop in bf16: Mixtral keeps the routing weights fp32 (each
    expert's output times its weight in fp32, cast, then added); Qwen3-MoE casts them to
    bf16 first. minihf cast both, which moved a bf16 Mixtral's logits by 0.03 from
    transformers'. The grouped and the capture-safe dense paths equal that loop exactly
    (the same operations in the same order, on CPU)."""
    moe = SparseMoE(_args(norm_topk_prob=True), layer_idx=0, expert_names=family).bfloat16()
    with torch.no_grad():
        for p in moe.parameters():
            p.normal_(0, 0.3)
    x = torch.randn(29, 32, generator=torch.Generator().manual_seed(3)).bfloat16()
    probs, weights, ids = moe.route(x)
    assert weights.dtype == (torch.float32 if family == "mixtral" else torch.bfloat16)
    want = torch.zeros_like(x)
    with torch.no_grad():
        for e, expert in enumerate(moe.experts):  # transformers' order: expert by expert
            token, pos = (ids == e).nonzero(as_tuple=True)
            if len(token):
                want.index_add_(0, token, (expert(x[token]) * weights[token, pos, None]).to(x.dtype))
        assert torch.equal(moe.grouped(x, weights, ids), want)
        assert torch.equal(moe.dense(x, weights, ids), want)


def test_implied_parameters_total_and_active():
    """The config-only count equals the built model's (less the q/k norms it leaves out);
    the active count swaps each sparse layer's 8 experts for the 2 a token uses."""
    cfg = _cfg()
    model = build_model(ModelArgs.from_hf(cfg), device="meta")
    built = sum(p.numel() for p in model.parameters())
    norms = 4 * 2 * 8  # q_norm and k_norm per layer
    assert implied_parameters(cfg) == built - norms
    sparse = 1  # layers 1 and 3 are the step's; 3 is in mlp_only_layers
    assert implied_parameters(cfg) - implied_parameters(cfg, active=True) == sparse * 6 * 3 * 32 * 16


def test_lora_all_linear_adapts_experts_not_the_router():
    from minihf.models.lora import apply_lora, module_names

    model = _model()
    names = module_names(model, "all-linear")
    assert "model.layers.0.mlp.experts.5.down_proj" in names and "model.layers.1.mlp.up_proj" in names
    assert not any(n.endswith(".gate") for n in names)  # the routers
    mixtral = build_model(ModelArgs.from_hf(dict(
        architectures=["MixtralForCausalLM"], vocab_size=64, hidden_size=32, num_hidden_layers=1,
        num_attention_heads=4, num_key_value_heads=2, intermediate_size=16, num_local_experts=4,
        num_experts_per_tok=2)))
    assert {n.rpartition(".")[2] for n in module_names(mixtral, "all-linear")} == {
        "q_proj", "k_proj", "v_proj", "o_proj", "w1", "w2", "w3"}
    apply_lora(model, 4, 8.0, names)
    tokens = torch.randint(0, 64, (2, 5), generator=torch.Generator().manual_seed(4))
    model(tokens).sum().backward()  # every adapter gets a gradient, unchosen experts' zero
    assert all(m.lora_B.grad is not None for m in map(model.get_submodule, names))

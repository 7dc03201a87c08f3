"""Routing replay for mixture-of-experts models (``actor.router_replay``, R2/R3):

* the engine records each token's experts beside its KV cache (prefill, decode, the static
  step, refilled slots, multi-turn extends) and they equal the experts a full forward over
  the same tokens chooses, wherever that choice is not a near-tie;
* the rollout's batch carries them as ``routed_experts`` [B, T, L, k], placed as the tokens;
* the trainer's forward records its own choices and, replaying them, computes the very same
  log-probs; replaying other choices forces them (log-probs change, the disagreement
  counts are exact) while the routing weights keep the live router's gradient.
"""

import pytest
import torch

from minihf.models import ModelArgs, build_model, init_weights
from minihf.models.moe import MoEStep, SparseMoE
from minihf.rollout import SamplingParams
from minihf.rollout.engine import Engine
from minihf.workers.forward import forward_log_probs

ARGS = dict(arch="qwen3_moe", vocab_size=40, hidden_size=32, num_hidden_layers=3, num_attention_heads=4,
            num_key_value_heads=2, head_dim=8, intermediate_size=48, qk_norm=True, num_experts=8,
            num_experts_per_tok=2, moe_intermediate_size=16, norm_topk_prob=True, mlp_only_layers=(1,),
            initializer_range=0.3, max_position_embeddings=64)
PROMPTS = [[1, 2, 3, 4, 5], [7, 8], [9, 10, 11, 12, 13, 14, 15], [3], [5, 6, 7]]


def _model(seed=0, **kw):
    return init_weights(build_model(ModelArgs(**{**ARGS, **kw})), seed).eval()


def _full_forward_routes(model, tokens):
    """Each MoE layer's chosen experts [T, L, k] and the gap between the k-th and the
    (k+1)-th router probability [T, L] over ``tokens`` in one plain forward."""
    chosen, gaps = {}, {}
    hooks = []
    for block in model.model.layers:
        moe = block.ffn
        if isinstance(moe, SparseMoE):
            def hook(m, inputs, out, j=moe.moe_index):
                top = torch.softmax(out.float(), -1).topk(m_k + 1, -1).values
                gaps[j] = top[:, m_k - 1] - top[:, m_k]
            m_k = moe.top_k
            hooks.append(moe.gate.register_forward_hook(hook))
    with torch.no_grad():
        model(torch.tensor([tokens]), moe=MoEStep(record=chosen.__setitem__))
    for h in hooks:
        h.remove()
    return torch.stack([chosen[j] for j in sorted(chosen)], 1), torch.stack([gaps[j] for j in sorted(gaps)], 1)


# A route differs between the engine's forwards (cached keys, other row counts) and one
# full forward only by fp32 rounding of the router's inputs, ~1e-6 relative: a choice can
# flip only where the k-th and (k+1)-th probabilities are that close. 1e-4 leaves 100x.
NEAR_TIE = 1e-4


@pytest.mark.parametrize("decode", ["eager", "static"])
def test_engine_records_the_routes_of_a_full_forward(decode):
    """Every sequence's recorded routes, including those that finish on their first token
    (their slot is a hole in the same step's decode, which writes there: the routes are
    copied out first) and those admitted into refilled slots."""
    model = _model()
    engine = Engine(model, max_num_seqs=3, decode=decode, record_routes=True)  # 5 prompts, 3 slots
    params = [SamplingParams(temperature=1.0, max_tokens=1 if i % 2 else 9, seed=3 + i, n=2)
              for i in range(len(PROMPTS))]
    groups = engine.generate(PROMPTS, params)
    checked = 0
    for prompt, group in zip(PROMPTS, groups):
        for seq in group:
            tokens = prompt + seq.tokens
            assert seq.routes.shape == (len(tokens) - 1, 2, 2)  # every fed token; the last is never fed
            want, gap = _full_forward_routes(model, tokens[:-1])
            sure = gap > NEAR_TIE                                             # [T, L]
            got = seq.routes.long().sort(-1).values
            assert torch.equal(got[sure], want.sort(-1).values[sure])
            checked += int(sure.sum())
    assert checked > 100


@pytest.mark.parametrize("slots", [8, 2], ids=["roomy", "evicting"])
def test_multi_turn_routes_cover_observations(slots):
    """Multi-turn: observation tokens are fed by extend forwards (or, after an eviction, a
    whole-context prefill) and their routes are recorded too."""
    from test_multi_turn_engine import STOP, FixedObservations

    model = _model(vocab_size=128)
    engine = Engine(model, max_num_seqs=slots, record_routes=True)
    sp = SamplingParams(temperature=0, max_tokens=40, stop_token_ids=list(STOP))
    groups = engine.generate(PROMPTS, sp, turns=FixedObservations(turns=3, lag=3 if slots == 2 else 0))
    assert (engine.last_stats["evictions"] > 0) == (slots == 2)
    observed = 0
    for prompt, (seq,) in zip(PROMPTS, groups):
        tokens = prompt + seq.tokens
        assert seq.routes.shape[0] == len(tokens) - 1
        want, gap = _full_forward_routes(model, tokens[:-1])
        sure = gap > NEAR_TIE
        assert torch.equal(seq.routes.long().sort(-1).values[sure], want.sort(-1).values[sure])
        observed += sum(e - s for s, e in seq.observations)
    assert observed > 10


def test_rollout_batch_places_routes_as_the_tokens():
    from minihf.hybrid.rollout_output import routes_tensor
    from minihf.rollout.scheduler import Sequence

    a = Sequence(seq_id=0, prompt=[1, 2], max_tokens=4, tokens=[5, 6, 7])
    b = Sequence(seq_id=1, prompt=[3, 4, 5], max_tokens=4, tokens=[8])
    a.routes = torch.arange(4 * 2 * 2, dtype=torch.int16).view(4, 2, 2)  # 2 + 3 tokens, 4 fed
    b.routes = torch.full((3, 2, 2), 9, dtype=torch.int16)              # 3 + 1 tokens, 3 fed
    out = routes_tensor([a, b], prompt_width=4, response_length=4)
    assert out.shape == (2, 8, 2, 2) and out.dtype == torch.int16
    assert torch.equal(out[0, 2:6], a.routes) and (out[0, :2] == -1).all() and (out[0, 6:] == -1).all()
    assert torch.equal(out[1, 1:4], b.routes) and (out[1, :1] == -1).all() and (out[1, 4:] == -1).all()


def _batch(seed=0):
    """Two left-padded prompts + right-padded responses, verl's layout."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(1, 40, (3, 10), generator=g)
    mask = torch.ones(3, 10, dtype=torch.long)
    mask[0, :2] = 0
    mask[1, 8:] = 0
    mask[2, :1] = 0
    positions = (mask.cumsum(-1) - 1).clamp(min=0)
    return {"input_ids": ids * mask, "attention_mask": mask, "position_ids": positions,
            "responses": (ids * mask)[:, 6:]}


@pytest.mark.parametrize("packed", [True, False])
def test_replaying_own_routes_is_exact_and_others_are_forced(packed):
    model, mb = _model(), _batch()
    with torch.no_grad():
        rec = forward_log_probs(model, mb, use_remove_padding=packed, routes="record")
        routes = rec["routed_experts"]
        assert routes.shape == (3, 10, 2, 2) and (routes[mb["attention_mask"] == 0] == -1).all()
        again = forward_log_probs(model, {**mb, "routed_experts": routes}, use_remove_padding=packed,
                                  routes="replay")
    assert torch.equal(again["log_probs"], rec["log_probs"])  # the same ops on the same values
    assert (again["router_disagree"] == 0).all()
    assert torch.equal(again["router_replayed"], mb["attention_mask"].sum(-1, keepdim=True).float().expand(3, 2))

    forced = routes.clone()
    real = forced >= 0
    forced[real] = (forced[real] + 3) % 8  # other experts, still two distinct ones per token
    forced[0, 5] = -1                      # one token routes live
    with torch.no_grad():
        moved = forward_log_probs(model, {**mb, "routed_experts": forced}, use_remove_padding=packed,
                                  routes="replay")
    assert (moved["log_probs"] - rec["log_probs"]).abs().max() > 1e-3
    replayed = mb["attention_mask"].sum(-1).float()
    replayed[0] -= 1
    assert torch.equal(moved["router_replayed"][:, 0], replayed)
    # (e + 3) % 8 of a pair never equals the pair as a set unless {a, b} = {a+3, b+3}: impossible mod 8
    assert torch.equal(moved["router_disagree"], moved["router_replayed"])


def test_replay_keeps_the_router_gradient():
    """Forced ids, weights from the live router: the router's weight still gets a gradient,
    equal to autograd's through ``softmax(x W^T)`` gathered at the forced ids."""
    moe = SparseMoE(ModelArgs(**ARGS), layer_idx=0).double()
    x = torch.randn(6, 32, dtype=torch.float64, generator=torch.Generator().manual_seed(1))
    forced = torch.tensor([[0, 1], [2, 3], [4, 5], [6, 7], [1, 6], [3, 0]])
    moe(x, MoEStep(replay=forced[:, None])).sum().backward()
    got = moe.gate.weight.grad.clone()
    moe.zero_grad()
    probs = torch.softmax(moe.gate(x), -1)
    w = probs.gather(-1, forced)
    w = w / w.sum(-1, keepdim=True)
    ref = sum(w[:, j:j + 1] * torch.stack([moe.experts[int(e)](x[i]) for i, e in enumerate(forced[:, j])])
              for j in range(2))
    ref.sum().backward()
    assert got.abs().max() > 1e-3
    assert (got - moe.gate.weight.grad).abs().max() <= 1e-12


def test_replay_under_activation_checkpointing_gives_the_same_gradients():
    """The recomputed forward routes by the same replayed ids (they are an argument of the
    checkpointed block), so the gradients equal those without checkpointing: the same ops
    on the same values, bitwise."""
    from minihf.parallel.fsdp import enable_activation_checkpointing

    mb = _batch(1)
    with torch.no_grad():
        routes = forward_log_probs(_model(), mb, routes="record")["routed_experts"]
    routes[routes >= 0] = (routes[routes >= 0] + 1) % 8  # forced: other than the live choice
    grads = []
    for checkpointing in (False, True):
        model = _model()
        if checkpointing:
            enable_activation_checkpointing(model)
        out = forward_log_probs(model, {**mb, "routed_experts": routes}, routes="replay")
        out["log_probs"].sum().backward()
        grads.append([p.grad.clone() for p in model.parameters()])
    assert all(torch.equal(a, b) for a, b in zip(*grads))
    assert grads[0][next(i for i, (n, _) in enumerate(_model().named_parameters()) if n.endswith("mlp.gate.weight"))].abs().max() > 0

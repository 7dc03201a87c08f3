"""``actor.use_torch_compile``: each block's norms and MLP compiled (dynamic shapes), names
unchanged; the compiled update's log-probs and gradients against the eager ones."""

import pytest
import torch

from minihf.workers.config import ActorConfig, FSDPConfig, ModelConfig
from minihf.workers.engine import build_fsdp_model

from test_rollout_engine import build_tiny


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    path = tmp_path_factory.mktemp("compile") / "qwen3"
    build_tiny("qwen3", path)
    return path


def _build(tiny, compile):
    return build_fsdp_model(ModelConfig(path=str(tiny)), FSDPConfig(), head="lm", group=None,
                            device=torch.device("cpu"), compile=compile)


def test_the_key_compiles_norms_and_mlps_only(tiny):
    """Which modules: each block's two norms and MLP, not attention; the state dict (what
    checkpoints and the reshard read) keeps its keys and values."""
    eager, compiled = _build(tiny, False), _build(tiny, True)
    for block in compiled.model.layers:
        for part in (block.input_layernorm, block.post_attention_layernorm, block.mlp):
            assert part._compiled_call_impl is not None
        assert block.self_attn._compiled_call_impl is None
    a, b = eager.state_dict(), compiled.state_dict()
    assert list(a) == list(b) and all(torch.equal(a[k], b[k]) for k in a)
    assert ActorConfig(use_torch_compile=True).use_torch_compile and not ActorConfig().use_torch_compile


@pytest.mark.slow
def test_compiled_update_matches_eager(tiny):
    """Packed micro-batches of two lengths (one graph, dynamic shapes): log-probs of both
    models within the fp32 rounding bound of a float64 forward (derived in
    ``logprob_rounding_bound``). Gradients: each entry is a sum of at most n = 2^12 fp32
    products, off the exact sum by at most n * u * (the sum of their magnitudes) in either
    program (u = 2^-24: 2.4e-4 relative); the bound takes that sum of magnitudes as the
    tensor's largest entry, which holds unless one entry's terms cancel to far below it
    (they do not at this random init; a failure says to check that first)."""
    from logprob_reference import float64_log_probs, rounding_ratio
    from minihf.workers.forward import forward_log_probs

    eager, compiled = _build(tiny, False), _build(tiny, True)
    eager.train()
    compiled.train()
    g = torch.Generator().manual_seed(0)
    for p_len, r_len in ((5, 9), (7, 13)):
        ids = torch.randint(1, 120, (3, p_len + r_len), generator=g)
        mb = {"input_ids": ids, "attention_mask": torch.ones_like(ids),
              "position_ids": torch.arange(ids.shape[1]).expand(3, -1), "responses": ids[:, p_len:]}
        exact, scale = float64_log_probs(eager, mb, 1.0)
        grads = []
        for model in (eager, compiled):
            model.zero_grad()
            lp = forward_log_probs(model, mb)["log_probs"]
            assert rounding_ratio(lp, exact, scale, torch.ones_like(lp)) <= 1
            lp.sum().backward()
            grads.append({n: p.grad.clone() for n, p in model.named_parameters()})
        for n, want in grads[0].items():
            torch.testing.assert_close(grads[1][n], want, rtol=0, atol=2.4e-4 * want.abs().max().item())

"""Dispatch/collect arithmetic, the @register table and the transport's packing: no processes."""

import numpy as np
import pytest
import torch

from minihf.controller import (
    DISPATCH_MODES, ControllerError, Dispatch, Plan, RoleLayout, Worker, get_dispatch_mode,
    register, register_dispatch_mode,
)
from minihf.config import ConfigError
from minihf.controller.dispatch import collect_dp_compute, dispatch_dp_compute
from minihf.controller.driver import _reply_into
from minihf.controller.messages import Reply
from minihf.controller.transport import (
    BIG_TENSOR_BYTES, pack, receive_buffers, roundtrip, unpack, unpack_control,
)
from minihf.protocol import Batch


def _batch(n):
    return Batch({"x": torch.arange(n * 3, dtype=torch.float32).view(n, 3),
                  "ids": torch.arange(n)},
                 {"uid": [f"u{i}" for i in range(n)]}, {"step": 7})


def _ids(b):
    return b.tensors["ids"].tolist()


@pytest.mark.parametrize("n,ranks,tp", [(8, 4, 1), (5, 2, 1), (7, 4, 2), (1, 4, 1), (3, 6, 2)])
def test_dp_compute_chunks_pads_and_strips(n, ranks, tp):
    layout = RoleLayout("r", tuple(range(10, 10 + ranks)), tp)
    batch = _batch(n)
    plan = dispatch_dp_compute(layout, (batch, 3), {"scale": 2.0})
    dp = ranks // tp
    pad = plan.ctx.pad
    assert pad == -n % dp  # pad count
    assert plan.collect_from == list(range(0, ranks, tp))  # tp_rank 0 of each DP group
    chunk_ids = []
    for i, (args, kwargs) in enumerate(plan.calls):
        chunk, three = args
        assert three == 3 and kwargs == {"scale": 2.0}
        assert len(chunk) == (n + pad) // dp
        if i % tp == 0:
            chunk_ids.append(_ids(chunk))
        else:  # TP peers get the very same chunk object
            assert plan.calls[i] is plan.calls[i - 1]
    flat = sum(chunk_ids, [])
    assert flat[:n] == list(range(n)) and len(flat) == n + pad
    # collect: concatenation in DP order with the padding removed equals the input
    outputs = [plan.calls[i][0][0] for i in plan.collect_from]
    out = collect_dp_compute(layout, outputs, plan.ctx)
    assert _ids(out) == list(range(n))
    assert torch.equal(out.tensors["x"], batch.tensors["x"])
    assert list(out.non_tensors["uid"]) == list(batch.non_tensors["uid"])
    assert out.meta == {"step": 7}


def test_dp_compute_non_batch_results_and_errors():
    layout = RoleLayout("r", (0, 1), 1)
    assert collect_dp_compute(layout, [{"loss": 1.0}, {"loss": 2.0}], 0) == [{"loss": 1.0},
                                                                            {"loss": 2.0}]
    with pytest.raises(ControllerError, match="needs at least one Batch"):
        dispatch_dp_compute(layout, (1,), {})
    with pytest.raises(ControllerError, match=r"different lengths \[2, 3\]"):
        dispatch_dp_compute(layout, (_batch(2), _batch(3)), {})


def test_other_builtin_modes():
    layout = RoleLayout("r", (3, 5, 7), 1)
    one = get_dispatch_mode(Dispatch.ONE_TO_ALL).dispatch_fn(layout, (1,), {"k": 2})
    assert one.calls == [((1,), {"k": 2})] * 3 and one.collect_from == [0, 1, 2]
    zero = get_dispatch_mode(Dispatch.RANK_ZERO).dispatch_fn(layout, (1,), {})
    assert zero.calls == [((1,), {}), None, None] and zero.collect_from == [0]
    assert get_dispatch_mode(Dispatch.RANK_ZERO).collect_fn(layout, ["a"], None) == "a"
    a2a = get_dispatch_mode(Dispatch.ALL_TO_ALL).dispatch_fn(layout, ([1, 2, 3],), {"k": ["a", "b", "c"]})
    assert a2a.calls == [((1,), {"k": "a"}), ((2,), {"k": "b"}), ((3,), {"k": "c"})]
    with pytest.raises(ControllerError, match="one entry per rank"):
        get_dispatch_mode(Dispatch.ALL_TO_ALL).dispatch_fn(layout, ([1, 2],), {})


def test_layout_validation_and_ranks():
    layout = RoleLayout("r", (4, 5, 6, 7), 2)
    assert (layout.dp_size, layout.dp_rank(3), layout.tp_rank(3)) == (2, 1, 1)
    with pytest.raises(ConfigError, match="tp_size=3 does not divide"):
        RoleLayout("r", (0, 1), 3)


def test_register_builds_explicit_table_and_user_modes():
    def dispatch_last(layout, args, kwargs):
        return Plan([None] * (layout.size - 1) + [(args, kwargs)], [layout.size - 1])

    register_dispatch_mode("test_last_only", dispatch_last, lambda lay, outs, ctx: outs[0],
                           replace=True)
    try:
        class Base(Worker):
            @register(dispatch=Dispatch.DP_COMPUTE)
            def compute(self, batch):
                return batch

            def helper(self):  # not registered: not callable from the driver
                return 1

        class Child(Base):
            @register(dispatch="test_last_only", blocking=False)
            def last(self):
                return "last"

        every_role = ["start_profile", "stop_profile"]  # the base's own (trainer.profile_steps)
        assert sorted(Worker.remote_methods) == every_role
        assert sorted(Base.remote_methods) == ["compute"] + every_role
        assert sorted(Child.remote_methods) == ["compute", "last"] + every_role
        spec = Child.remote_methods["last"]
        assert spec.dispatch == "test_last_only" and spec.blocking is False
        assert Child.remote_methods["compute"].collect_fn() is collect_dp_compute
        assert Child.last(Child.__new__(Child)) == "last"  # still a plain method locally
        with pytest.raises(ControllerError, match="constructed directly"):
            _ = Child().rank
        with pytest.raises(ControllerError, match="unknown dispatch mode 'nope'"):
            register(dispatch="nope")
        with pytest.raises(ControllerError, match="already exists"):
            register_dispatch_mode("test_last_only", dispatch_last, lambda *a: None)
    finally:
        DISPATCH_MODES.pop("test_last_only")


def test_pack_groups_small_tensors_by_dtype_and_keeps_big_ones_whole():
    big = torch.randn(BIG_TENSOR_BYTES // 4 + 5)
    obj = {"batch": _batch(4), "big": big, "f": [torch.ones(2), torch.zeros(3, 1)],
           "b": torch.tensor([True, False]), "empty": torch.empty(0, 4), "s": torch.tensor(2.5),
           "view": torch.arange(12).view(3, 4).t(), "arr": np.arange(3), "txt": "hi"}
    packed = pack(obj, None)
    # float32 small: x, ones, zeros, s -> 1 buffer; int64: ids, view -> 1; bool -> 1; big -> 1
    assert sorted(str(b.dtype) for b in packed.buffers) == sorted(
        ["torch.float32", "torch.float32", "torch.int64", "torch.bool"])
    assert any(b.data_ptr() == big.data_ptr() for b in packed.buffers)  # no copy of big
    back = roundtrip(obj)
    assert torch.equal(back["big"], big) and torch.equal(back["view"], obj["view"])
    assert torch.equal(back["batch"].tensors["x"], obj["batch"].tensors["x"])
    assert list(back["batch"].non_tensors["uid"]) == ["u0", "u1", "u2", "u3"]
    assert back["batch"].meta == {"step": 7}
    assert back["empty"].shape == (0, 4) and back["s"].item() == 2.5 and back["s"].dim() == 0
    assert back["b"].tolist() == [True, False] and back["f"][1].shape == (3, 1)
    assert back["arr"].tolist() == [0, 1, 2] and back["txt"] == "hi"
    with pytest.raises(TypeError, match="to_dense"):
        pack(torch.eye(3).to_sparse(), None)


def test_worker_group_lists_registered_methods_on_typos():
    from minihf.controller import WorkerGroup

    class Critic(Worker):
        @register(dispatch=Dispatch.DP_COMPUTE)
        def compute_values(self, batch):
            return batch

    group = WorkerGroup(RoleLayout("critic", (0, 1)), Critic, driver=None)
    assert group.compute_values.spec.dispatch == Dispatch.DP_COMPUTE
    assert "compute_values" in dir(group)
    with pytest.raises(AttributeError, match=r"no remote method 'compute_value'.*\['compute_values', 'start_profile'"):
        group.compute_value


def _received(obj, into):
    """What a peer rebuilds from ``obj`` when receiving with destinations ``into``."""
    packed = pack(obj, None)
    payload, table, specs = unpack_control(packed.control)
    buffers = receive_buffers(payload, table, specs, None, into)
    for b, src in zip(buffers, packed.buffers):
        b.copy_(src)
    return unpack(payload, table, buffers, None)


def test_dp_compute_receives_remote_results_into_the_concatenated_output():
    layout = RoleLayout("r", (0, 1, 2), 1)
    n = 7  # padded to 9: 3 rows per rank
    batch = Batch({"big": torch.randn(n, 1 << 17), "ids": torch.arange(n),
                   "a": torch.ones(n, 2), "b": torch.zeros(n, 3)},
                  {"uid": [f"u{i}" for i in range(n)]}, {"step": 1})
    plan = dispatch_dp_compute(layout, (batch,), {})
    chunks = [plan.calls[i][0][0] for i in plan.collect_from]
    # ranks 1 and 2 reply over the wire; rank 2's "a" has another shape (plain path for "a")
    odd = Batch(dict(chunks[2].tensors, a=torch.ones(3, 5)), chunks[2].non_tensors,
                chunks[2].meta)
    parts = [chunks[0]] + [
        _received(Reply(c), lambda r, k=k: _reply_into(plan.receive_into, k, r)).value
        for k, c in ((1, chunks[1]), (2, odd))]
    out_big = plan.ctx.out["big"]
    assert out_big.shape == (9, 1 << 17)  # allocated from the first reply's stubs
    assert parts[1].tensors["big"].data_ptr() == out_big[3:6].data_ptr()  # in place
    assert parts[2].tensors["big"].data_ptr() == out_big[6:9].data_ptr()
    assert parts[1].tensors["ids"].data_ptr() == plan.ctx.out["ids"][3:6].data_ptr()
    parts_ok = parts[:2] + [Batch(dict(parts[2].tensors, a=torch.ones(3, 2)),
                                  parts[2].non_tensors, parts[2].meta)]
    local = plan.place_local(0, parts_ok[0])  # rank 0's own part, copied in right away
    assert local.tensors["big"].data_ptr() == out_big.data_ptr()
    assert torch.equal(local.tensors["big"], chunks[0].tensors["big"])
    parts_ok[0] = local
    out = collect_dp_compute(layout, parts_ok, plan.ctx)
    ref = Batch.concat(chunks).unpad(2)
    assert list(out.tensors) == list(ref.tensors)
    for k, t in ref.tensors.items():
        assert torch.equal(out.tensors[k], t), k
    assert out.tensors["big"].data_ptr() == out_big.data_ptr()  # no extra full copy
    assert list(out.non_tensors["uid"]) == list(batch.non_tensors["uid"])
    assert out.meta == {"step": 1}
    # a part whose shape does not fit falls back to Batch.concat and its error
    with pytest.raises(RuntimeError, match="Sizes of tensors must match"):
        collect_dp_compute(layout, parts, plan.ctx)
    # a non-Batch reply or an error reply gets no destinations
    assert _reply_into(plan.receive_into, 1, Reply({"x": 1})) == {}
    assert plan.receive_into(1, [1, 2]) == {}
    # one DP rank: its result is the output as it is, nothing to receive into
    single = dispatch_dp_compute(RoleLayout("r", (0, 1), 2), (batch,), {})
    assert single.receive_into is None and single.place_local is None
    assert plan.place_local(0, [1]) == [1]


def test_dp_compute_exact_refuses_padding():
    layout = RoleLayout("actor", (0, 1, 2, 3), 2)  # dp_size 2
    plan = get_dispatch_mode(Dispatch.DP_COMPUTE_EXACT).dispatch_fn(layout, (_batch(4),), {})
    assert plan.ctx.pad == 0 and [_ids(c[0][0]) for c in plan.calls] == [[0, 1]] * 2 + [[2, 3]] * 2
    assert get_dispatch_mode(Dispatch.DP_COMPUTE_EXACT).collect_fn is collect_dp_compute
    with pytest.raises(ControllerError, match=r"len\(batch\)=5 .* 2 DP ranks.* multiple of 2, "
                                              r"e\.g\. ppo_mini_batch_size"):
        get_dispatch_mode(Dispatch.DP_COMPUTE_EXACT).dispatch_fn(layout, (_batch(5),), {})


def test_collect_mode_decides_who_replies():
    """A DP_COMPUTE method collected with RANK_ZERO asks only the first DP head for data (the
    driver sends the others reply=False); its own collect keeps every DP head."""
    from minihf.controller.dispatch import dispatch_dp_compute

    class W(Worker):
        @register(dispatch=Dispatch.DP_COMPUTE, collect=Dispatch.RANK_ZERO)
        def metrics(self, batch):
            return {}

        @register(dispatch=Dispatch.DP_COMPUTE, layout="rollout")
        def rows(self, batch):
            return batch

    layout = RoleLayout("r", (0, 1, 2, 3), 2, tp_strided=True, name="rollout")
    plan = dispatch_dp_compute(layout, (Batch({"x": torch.arange(4)}),), {})
    assert plan.collect_from == [0, 1]  # strided: role ranks 0, 1 are TP rank 0 of each replica
    assert W.remote_methods["metrics"].replies(plan.collect_from) == [0]
    assert W.remote_methods["rows"].replies(plan.collect_from) == [0, 1]
    assert W.remote_methods["rows"].layout == "rollout"
    assert W.remote_methods["metrics"].layout == "default"


def test_role_layouts_from_declarations():
    from minihf.controller import Role
    from minihf.controller.setup import role_layouts

    class Gen(Worker):
        def __init__(self, tp):
            super().__init__()

        @classmethod
        def declare_layouts(cls, tp):
            return {"rollout": tp}

        @register(dispatch=Dispatch.DP_COMPUTE, layout="rollout")
        def generate(self, batch):
            return batch

    class Undeclared(Worker):
        @register(dispatch=Dispatch.DP_COMPUTE, layout="rollout")
        def generate(self, batch):
            return batch

    default = RoleLayout("g", (0, 1, 2, 3))
    out = role_layouts({"g": Role(Gen, (2,))}, {"g": default})["g"]
    assert out["default"] is default
    assert out["rollout"] == RoleLayout("g", (0, 1, 2, 3), 2, tp_strided=True, name="rollout")
    with pytest.raises(ControllerError, match=r"Undeclared.generate uses layout 'rollout', which "
                                              r"the role does not declare"):
        role_layouts({"g": Role(Undeclared)}, {"g": default})
    with pytest.raises(ConfigError, match=r"layout 'rollout': tp_size=3 does not divide"):
        role_layouts({"g": Role(Gen, (3,))}, {"g": default})

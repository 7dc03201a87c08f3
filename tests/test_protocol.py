"""Tests for minihf.protocol.Batch, each checked against a hand-built expectation."""

import numpy as np
import pytest
import torch

from minihf.protocol import Batch


def make(n=4, meta=None):
    return Batch(
        {"x": torch.arange(n * 2).view(n, 2), "m": torch.arange(n).float()},
        {"uid": [f"u{i}" for i in range(n)]},
        meta or {"step": 3},
    )


def rows(b):
    """Row ids recovered from the x tensor, used to compare orders."""
    return (b["x"][:, 0] // 2).tolist()


def test_construction_and_introspection():
    b = make()
    assert len(b) == 4
    assert b.keys() == ["x", "m", "uid"]
    assert "x" in b and "uid" in b and "nope" not in b
    assert isinstance(b["uid"], np.ndarray) and b["uid"].dtype == object
    assert b["uid"].tolist() == ["u0", "u1", "u2", "u3"]
    assert [k for k, _ in b.tensor_items()] == ["m", "x"]
    assert len(Batch()) == 0
    # Equal-length lists per row stay one object per row.
    nb = Batch(non_tensors={"ids": [[1, 2], [3, 4]]})
    assert nb["ids"].shape == (2,) and nb["ids"][1] == [3, 4]
    assert "x: (4, 2) int64" in repr(b)


def test_from_dict_sorts_by_type():
    b = Batch.from_dict({"a": torch.zeros(2), "s": ["p", "q"]}, meta={"k": 1})
    assert list(b.tensors) == ["a"] and list(b.non_tensors) == ["s"] and b.meta == {"k": 1}
    b2 = Batch.from_dict(tensors={"a": torch.zeros(2)}, non_tensors={"s": np.array(["p", "q"])})
    assert b2["s"].dtype == object


def test_validation_errors():
    with pytest.raises(ValueError, match=r"inconsistent batch sizes.*a=3, b=2"):
        Batch({"a": torch.zeros(3), "b": torch.zeros(2)})
    with pytest.raises(ValueError, match=r"a=3, s=2"):
        Batch({"a": torch.zeros(3)}, {"s": ["x", "y"]})
    with pytest.raises(ValueError, match="0-d"):
        Batch({"a": torch.tensor(1.0)})
    with pytest.raises(TypeError, match="not a torch.Tensor"):
        Batch({"a": [1, 2]})
    with pytest.raises(TypeError, match="put it in `tensors`"):
        Batch(non_tensors={"a": torch.zeros(2)})
    with pytest.raises(ValueError, match="both tensors and non-tensors"):
        Batch({"a": torch.zeros(2)}, {"a": [1, 2]})
    b = make()
    with pytest.raises(ValueError, match="inconsistent"):
        b["y"] = torch.zeros(5)
    with pytest.raises(KeyError, match=r"\['nope'\] not in Batch; available"):
        b["nope"]


def test_setitem():
    b = make()
    b["y"] = torch.ones(4)
    b["x"] = ["a", "b", "c", "d"]  # replaces the tensor with a non-tensor
    assert "x" not in b.tensors and b["x"].tolist() == ["a", "b", "c", "d"]


def test_indexing():
    b = make()
    one = b[1]
    assert isinstance(one, Batch) and len(one) == 1 and rows(one) == [1]
    assert one["uid"].tolist() == ["u1"] and one.meta == {"step": 3}
    assert rows(b[-1]) == [3]
    assert rows(b[1:3]) == [1, 2]
    assert rows(b[::2]) == [0, 2]
    assert rows(b[torch.tensor([3, 0, 3])]) == [3, 0, 3]
    assert b[torch.tensor([3, 0])]["uid"].tolist() == ["u3", "u0"]
    assert rows(b[[2, -4]]) == [2, 0]
    assert rows(b[np.array([1])]) == [1]
    mask = torch.tensor([True, False, False, True])
    assert rows(b[mask]) == [0, 3] and b[mask]["uid"].tolist() == ["u0", "u3"]
    assert rows(b[[False, True, True, False]]) == [1, 2]
    assert len(b[[]]) == 0
    with pytest.raises(IndexError, match="index 4 out of range for Batch of length 4"):
        b[4]
    with pytest.raises(IndexError, match=r"indices \[7\] out of range"):
        b[[0, 7]]
    with pytest.raises(IndexError, match="bool mask has length 3, Batch has 4"):
        b[torch.tensor([True, False, True])]
    with pytest.raises(IndexError, match="dtype float"):
        b[torch.tensor([0.5])]


def test_select_and_pop():
    b = make()
    s = b.select("x", "uid")
    assert s.keys() == ["x", "uid"] and s.meta == {"step": 3} and "m" in b
    with pytest.raises(KeyError, match=r"\['zz'\] not in Batch"):
        b.select("x", "zz")
    p = b.pop("m", "uid")
    assert p.keys() == ["m", "uid"] and b.keys() == ["x"]
    assert torch.equal(p["m"], torch.arange(4).float())
    with pytest.raises(KeyError):
        b.pop("m")


def test_union():
    b = make()
    extra = Batch({"y": torch.ones(4)}, {"tag": list("abcd")}, {"temp": 1.0})
    u = b | extra
    assert u.keys() == ["x", "m", "y", "uid", "tag"] and u.meta == {"step": 3, "temp": 1.0}
    assert "y" not in b  # | builds a new Batch
    # Equal overlapping keys are fine.
    assert (b | b.select("x", "uid")).keys() == b.keys()
    b |= extra
    assert "y" in b and b.meta["temp"] == 1.0
    # Empty side unions with anything.
    assert len(Batch(meta={"a": 1}) | make()) == 4


def test_union_conflicts():
    b = make()
    with pytest.raises(ValueError, match="key 'x' is in both Batches with different values"):
        b.union(Batch({"x": torch.zeros(4, 2, dtype=torch.long)}))
    with pytest.raises(ValueError, match="key 'x' is in both"):  # same values, other dtype
        b.union(Batch({"x": b["x"].float()}))
    with pytest.raises(ValueError, match="key 'uid' is in both"):
        b.union(Batch(non_tensors={"uid": ["u0", "u1", "u2", "zz"]}))
    with pytest.raises(ValueError, match="key 'm' is a tensor on one side"):
        b.union(Batch(non_tensors={"m": [0, 1, 2, 3]}))
    with pytest.raises(ValueError, match="meta key 'step' conflicts: 3 vs 4"):
        b.union(Batch({"y": torch.ones(4)}, meta={"step": 4}))
    with pytest.raises(ValueError, match="lengths 4 and 2"):
        b.union(Batch({"y": torch.ones(2)}))
    with pytest.raises(TypeError, match="got dict"):
        b.union({"y": torch.ones(4)})
    nan = Batch({"v": torch.tensor([float("nan"), 1.0])})
    nan |= nan.select("v")  # the same tensor object counts as equal even with NaNs
    # Non-tensor rows holding arrays are compared row by row.
    arr = Batch(non_tensors={"a": [np.arange(2), np.arange(3)]})
    assert arr.union(Batch(non_tensors={"a": [np.arange(2), np.arange(3)]})).keys() == ["a"]
    with pytest.raises(ValueError, match="key 'a'"):
        arr.union(Batch(non_tensors={"a": [np.arange(2), np.arange(3) + 1]}))


def test_chunk_split_concat():
    b = make(6)
    parts = b.chunk(3)
    assert [rows(p) for p in parts] == [[0, 1], [2, 3], [4, 5]]
    assert [p["uid"].tolist() for p in parts][2] == ["u4", "u5"]
    with pytest.raises(ValueError, match=r"length 6 cannot be split into 4 equal chunks.*"
                                         r"pad_to_multiple\(4\)"):
        b.chunk(4)
    with pytest.raises(ValueError, match="positive int"):
        b.chunk(0)
    assert [rows(p) for p in b.split(4)] == [[0, 1, 2, 3], [4, 5]]
    assert [len(p) for p in Batch().chunk(2)] == [0, 0]
    back = Batch.concat(parts)
    assert torch.equal(back["x"], b["x"]) and back["uid"].tolist() == b["uid"].tolist()
    assert back.meta == {"step": 3}
    with pytest.raises(ValueError, match="batch 1 has keys"):
        Batch.concat([b, b.select("x")])
    with pytest.raises(ValueError, match="meta key 'step' conflicts"):
        Batch.concat([make(2), make(2, meta={"step": 9})])
    with pytest.raises(ValueError, match="at least one"):
        Batch.concat([])


def test_repeat():
    b = make(3)
    inter = b.repeat(2)
    assert rows(inter) == [0, 0, 1, 1, 2, 2]
    assert inter["uid"].tolist() == ["u0", "u0", "u1", "u1", "u2", "u2"]
    assert torch.equal(inter["x"], torch.tensor([[0, 1], [0, 1], [2, 3], [2, 3], [4, 5], [4, 5]]))
    tiled = b.repeat(2, interleave=False)
    assert rows(tiled) == [0, 1, 2, 0, 1, 2]
    assert tiled["uid"].tolist() == ["u0", "u1", "u2", "u0", "u1", "u2"]
    assert torch.equal(tiled["m"], torch.tensor([0.0, 1, 2, 0, 1, 2]))
    with pytest.raises(ValueError, match="positive int"):
        b.repeat(0)


def test_pad_unpad_round_trip():
    b = make(5)
    padded, pad = b.pad_to_multiple(4)
    assert pad == 3 and len(padded) == 8
    assert rows(padded) == [0, 1, 2, 3, 4, 0, 1, 2]  # rows repeated from the start
    assert padded["uid"].tolist()[5:] == ["u0", "u1", "u2"]
    back = padded.unpad(pad)
    assert torch.equal(back["x"], b["x"]) and back["uid"].tolist() == b["uid"].tolist()
    # Padding longer than the batch wraps around.
    small, pad2 = make(2).pad_to_multiple(7)
    assert pad2 == 5 and rows(small) == [0, 1, 0, 1, 0, 1, 0]
    same, zero = b.pad_to_multiple(5)
    assert zero == 0 and same.unpad(0) is same
    with pytest.raises(ValueError, match="pad_count 6 out of range"):
        b.unpad(6)
    # Padded batches chunk evenly; collecting and unpadding restores the order.
    chunks = padded.chunk(4)
    assert torch.equal(Batch.concat(chunks).unpad(pad)["m"], b["m"])


def test_to_device():
    b = make()
    moved = b.to("cpu")
    assert moved["x"].device.type == "cpu" and moved["uid"] is b["uid"]
    assert moved.meta == b.meta and moved.meta is not b.meta

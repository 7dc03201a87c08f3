"""The oneDNN linear path against F.linear: values and gradients, shapes, fallbacks, choice."""

import pytest
import torch
import torch.nn.functional as F

from minihf.models import linear as lin

needs_onednn = pytest.mark.skipif(not torch.backends.mkldnn.is_available(),
                                  reason="torch built without oneDNN")


def _grads(fn, x, w, b, g):
    for t in (x, w, b):
        if t is not None:
            t.grad = None
    y = fn(x, w, b)
    y.backward(g)
    return y.detach(), [None if t is None else t.grad.clone() for t in (x, w, b)]


@needs_onednn
@pytest.mark.parametrize("shape", [(5, 16), (2, 3, 16), (0, 16)])
@pytest.mark.parametrize("bias", [True, False])
@pytest.mark.parametrize("column_major", [False, True])
def test_onednn_linear_matches_f_linear(monkeypatch, shape, bias, column_major):
    monkeypatch.setattr(lin, "use_onednn", lambda: True)
    monkeypatch.setattr(lin, "MIN_MACS_PER_THREAD", 0)  # small shapes, the oneDNN path
    torch.manual_seed(0)
    x = torch.randn(*shape, requires_grad=True)
    w = torch.randn(8, 16)
    w = (w.t().contiguous().t() if column_major else w).requires_grad_()  # the engine's layout
    b = torch.randn(8, requires_grad=True) if bias else None
    g = torch.randn(*shape[:-1], 8)
    y, grads = _grads(lin.linear, x, w, b, g)
    y_ref, grads_ref = _grads(F.linear, x, w, b, g)
    assert y.shape == y_ref.shape and y._base is None  # FSDP2 warns on a view output
    # oneDNN and MKL sum 16 products in other orders: a few ulp of partial sums |s| < ~10
    # (ulp 9.5e-7); atol + rtol |y| is >= 10 such ulp
    torch.testing.assert_close(y, y_ref, rtol=1e-5, atol=1e-5)
    for got, want in zip(grads, grads_ref):
        if want is not None:
            torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    with torch.no_grad():  # the inference path skips autograd
        torch.testing.assert_close(lin.linear(x, w, b), y_ref, rtol=1e-5, atol=1e-5)
    # and it really is oneDNN's op, not F.linear
    calls = []
    monkeypatch.setattr(lin, "_onednn_mm_t", lambda *a: calls.append(a) or F.linear(*a))
    lin.linear(x, w, b).sum().backward()
    assert len(calls) == 2  # forward and the input gradient


@needs_onednn
def test_onednn_linear_frozen_input_and_weight(monkeypatch):
    """Only the gradients asked for are computed (a frozen weight, an input without grad)."""
    monkeypatch.setattr(lin, "use_onednn", lambda: True)
    monkeypatch.setattr(lin, "MIN_MACS_PER_THREAD", 0)
    x, w = torch.randn(4, 6), torch.randn(3, 6, requires_grad=True)
    lin.linear(x, w).sum().backward()
    # both checks: 3- or 4-term sums of |x| < ~4 in another order: ~1 ulp (4.8e-7) << atol 1e-5
    torch.testing.assert_close(w.grad, torch.ones(4, 3).t() @ x)
    x.requires_grad_()
    w2 = torch.randn(3, 6)
    lin.linear(x, w2).sum().backward()
    torch.testing.assert_close(x.grad, torch.ones(4, 3) @ w2)


@needs_onednn
@pytest.mark.parametrize("threads", [1, 2])
def test_small_matmuls_stay_on_mkl(monkeypatch, threads):
    """oneDNN only from MIN_MACS_PER_THREAD multiply-adds per thread: below, its per-call
    cost outweighs its kernel (a decode step of a small model)."""
    monkeypatch.setattr(lin, "use_onednn", lambda: True)
    monkeypatch.setattr(torch, "get_num_threads", lambda: threads)
    calls = []
    real = lin._onednn_mm_t
    monkeypatch.setattr(lin, "_onednn_mm_t", lambda *a: calls.append(a[0].shape) or real(*a))
    w = torch.randn(128, 128)
    rows = lin.MIN_MACS_PER_THREAD * threads // (128 * 128)  # exactly at the threshold
    for n, want in [(rows - 1, 0), (rows, 1)]:
        for x in (torch.randn(n, 128), torch.randn(1, n, 128)):  # leading dims count as rows
            calls.clear()
            # any summation order of a K-term fp32 dot product is within gamma_K |x|.|w| of the
            # exact value, gamma_K = K u / (1 - K u) (Higham, ch. 3): each path against float64
            y, ref = lin.linear(x, w), F.linear(x, w)
            exact = F.linear(x.double(), w.double())
            k, u = 128, 2.0**-24
            bound = k * u / (1 - k * u) * F.linear(x.double().abs(), w.double().abs())
            assert ((y.double() - exact).abs() <= bound).all() and ((ref.double() - exact).abs() <= bound).all()
            assert len(calls) == want, (x.shape, threads)


def test_other_dtypes_and_tensor_types_fall_back(monkeypatch):
    monkeypatch.setattr(lin, "use_onednn", lambda: True)
    monkeypatch.setattr(lin, "_onednn_mm_t", lambda *a: pytest.fail("oneDNN path taken"))
    x, w = torch.randn(3, 4, dtype=torch.float64), torch.randn(2, 4, dtype=torch.float64)
    # the fallback is F.linear itself: bitwise, the default tolerances are never used
    torch.testing.assert_close(lin.linear(x, w), F.linear(x, w))
    xb, wb = x.to(torch.bfloat16), w.to(torch.bfloat16)
    torch.testing.assert_close(lin.linear(xb, wb), F.linear(xb, wb))


def test_linear_module_is_nn_linear():
    m = lin.Linear(4, 3)
    assert isinstance(m, torch.nn.Linear) and set(dict(m.named_parameters())) == {"weight", "bias"}
    x = torch.randn(2, 4)
    # 24 MACs stay below MIN_MACS_PER_THREAD: the same F.linear, bitwise; the tolerances are slack
    torch.testing.assert_close(m(x), F.linear(x, m.weight, m.bias), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("vendor, flags, machine, onednn, want", [
    ("AuthenticAMD", {"avx2", "avx512f"}, "x86_64", True, True),
    ("AuthenticAMD", {"avx2"}, "x86_64", True, False),  # no AVX-512: nothing to gain
    ("GenuineIntel", {"avx2", "avx512f"}, "x86_64", True, False),  # MKL's own AVX-512 path
    ("AuthenticAMD", {"avx512f"}, "x86_64", False, False),  # torch without oneDNN
    ("", set(), "aarch64", True, False),
])
def test_onednn_preferred(vendor, flags, machine, onednn, want):
    assert lin.onednn_preferred(vendor, flags, machine, onednn) is want


def test_cpu_fields_reads_the_first_processor():
    info = ("processor\t: 0\nvendor_id\t: AuthenticAMD\ncpu family\t: 26\n"
            "flags\t\t: fpu avx2 avx512f\n\nprocessor\t: 1\nvendor_id\t: Other\n")
    cpu = lin.cpu_fields(info)
    assert cpu["vendor_id"] == "AuthenticAMD" and cpu["cpu family"] == "26"
    assert set(cpu["flags"].split()) == {"fpu", "avx2", "avx512f"}
    assert lin.cpu_fields("") == {}

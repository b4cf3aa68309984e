"""kernels.threads: compute_alone (a background thread's tensor work runs on that thread only) and
serial_torch (the step thread's torch ops serial, its kernels as wide as asked); no other thread is
affected."""

import threading

import torch

from kernels import packed_linear
from kernels.packed_linear import PackedLinear
from kernels.threads import compute_alone, kernel_threads, on_a_step_thread, serial_torch


def _on_thread(fn):
    out = {}
    t = threading.Thread(target=lambda: out.setdefault("r", fn()))
    t.start()
    t.join()
    return out["r"]


def test_only_the_calling_thread_computes_alone():
    torch.set_num_threads(2)

    def background():
        compute_alone()
        return torch.get_num_threads()

    assert _on_thread(background) == 1
    assert torch.get_num_threads() == 2  # this thread, and any other, keep their width
    assert _on_thread(torch.get_num_threads) == 2


def test_results_are_the_same_computed_alone():
    g = torch.Generator().manual_seed(0)
    w, x = torch.randn(300, 96, generator=g), torch.randn(5, 96, generator=g)
    a, b = torch.randn(200, 300, generator=g), torch.randn(300, 100, generator=g)
    packed = PackedLinear.pack(w) if packed_linear.available() else None

    def work():
        return (packed(x) if packed is not None else None), a @ b

    expected = work()

    def background():
        compute_alone()
        return work()

    got = _on_thread(background)
    if packed is not None:  # each output is one FMA chain whatever the split: exact
        assert torch.equal(got[0], expected[0])
    torch.testing.assert_close(got[1], expected[1])


def test_serial_torch_keeps_the_kernels_width_and_their_results():
    torch.set_num_threads(2)
    g = torch.Generator().manual_seed(1)
    w, x = torch.randn(300, 96, generator=g), torch.randn(12, 96, generator=g)
    packed = PackedLinear.pack(w) if packed_linear.available() else None

    def step_thread():
        serial_torch(2)
        y = packed(x) if packed is not None else None
        return torch.get_num_threads(), kernel_threads(), y

    torch_width, width, y = _on_thread(step_thread)
    assert (torch_width, width) == (1, 2)
    assert kernel_threads() == 2 and _on_thread(kernel_threads) == 2  # others: torch's width
    if packed is not None:
        assert torch.equal(y, packed(x))
    assert _on_thread(lambda: (compute_alone(), kernel_threads())[1]) == 1


def test_on_a_step_thread_returns_and_raises_as_the_step_thread_would():
    torch.set_num_threads(2)
    assert on_a_step_thread(lambda: (torch.get_num_threads(), kernel_threads())) == (1, 2)
    try:
        on_a_step_thread(lambda: 1 / 0)
    except ZeroDivisionError:
        pass
    else:
        raise AssertionError("the exception was lost")
    assert torch.get_num_threads() == 2

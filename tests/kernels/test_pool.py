"""The kernels' worker threads (kernels/native/pool.c): right results from any thread, from
several threads at once, at any thread count, and in a forked child."""

import multiprocessing
import threading

import pytest
import torch
import torch.nn.functional as F

from kernels import decode_attention, packed_linear
from kernels.packed_linear import PackedLinear
from kernels.thin_linear import thin_linear

needs_native = pytest.mark.skipif(not packed_linear.available(), reason="no native kernels here")


def _case(seed: int):
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(200, 96, generator=g)
    x = torch.randn(5, 96, generator=g)
    return w, x


@needs_native
@pytest.mark.parametrize("threads", [1, 2, 3, 5])
def test_any_thread_count_gives_the_same_result(threads, monkeypatch):
    """Each output is one FMA chain whatever the split, so every thread count agrees exactly."""
    w, x = _case(0)
    packed = PackedLinear.pack(w)
    expected = packed(x)
    monkeypatch.setattr(torch, "get_num_threads", lambda: threads)
    assert torch.equal(packed(x), expected)
    assert torch.equal(packed.normed(x, torch.ones(96), 1e-5), packed(F.rms_norm(x, (96,), torch.ones(96), 1e-5)))


@needs_native
def test_calls_from_many_threads_at_once():
    """Only one call has the workers at a time; the others run alone on their caller, and every
    result is right."""
    cases = [_case(seed) for seed in range(6)]
    packed = [PackedLinear.pack(w) for w, _ in cases]
    expected = [F.linear(x, w) for w, x in cases]
    errors: list[str] = []

    def work(i: int) -> None:
        for _ in range(50):
            got = packed[i](cases[i][1])
            if not torch.allclose(got, expected[i], rtol=1e-5, atol=1e-4):
                errors.append(f"packed {i}")
            if not torch.allclose(thin_linear(cases[i][1], cases[i][0]), expected[i], rtol=1e-5, atol=1e-4):
                errors.append(f"thin {i}")

    threads = [threading.Thread(target=work, args=(i,)) for i in range(6)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
    assert not any(t.is_alive() for t in threads)
    assert errors == []


def _child(queue, expected) -> None:
    # no torch matmul here: torch's own intra-op pool can hang in a forked child once the parent
    # has used it (seen on a 2-core AMD EPYC); the reference is computed before the fork
    w, x = _case(3)
    queue.put(torch.equal(PackedLinear.pack(w)(x), PackedLinear.pack(w)(x))
              and torch.allclose(PackedLinear.pack(w)(x), expected, rtol=1e-5, atol=1e-4))


@needs_native
def test_a_forked_child_gets_workers_of_its_own():
    """The parent's workers do not exist in a forked child; its first call starts new ones
    (without the atfork handler it would wait for them forever)."""
    w, x = _case(3)
    PackedLinear.pack(w)(x)  # the parent's workers are running
    ctx = multiprocessing.get_context("fork")
    queue = ctx.Queue()
    w3, x3 = _case(3)
    child = ctx.Process(target=_child, args=(queue, F.linear(x3, w3)))
    child.start()
    child.join(timeout=60)
    if child.is_alive():
        child.kill()
    assert child.exitcode == 0
    assert queue.get(timeout=5) is True


@needs_native
def test_attention_barrier_between_cache_write_and_reads():
    """decode_attention's two phases meet at the pool's barrier: with 2 threads, keys written by
    one thread are read by the other (tokens attend to each other's new keys)."""
    assert decode_attention.available()
    g = torch.Generator().manual_seed(1)
    b, t, hq, hkv, d, cap = 2, 6, 4, 2, 64, 16
    qkv = torch.randn(b, t, (hq + 2 * hkv) * d, generator=g)
    cos, sin = torch.ones(b, t, d), torch.zeros(b, t, d)  # rotary off: the check is the cache
    keys, values = torch.zeros(b, hkv, cap, d), torch.zeros(b, hkv, cap, d)
    cols = torch.arange(t).expand(b, t).contiguous()
    mask = (torch.arange(t)[None, :] <= torch.arange(t)[:, None]).expand(b, t, t).contiguous()
    got = decode_attention.decode_attention(qkv, cos, sin, keys, values, cols, mask, hq, hkv, d**-0.5)
    q = qkv[..., : hq * d].view(b, t, hq, d).transpose(1, 2)
    k = qkv[..., hq * d : (hq + hkv) * d].view(b, t, hkv, d).transpose(1, 2)
    v = qkv[..., (hq + hkv) * d :].view(b, t, hkv, d).transpose(1, 2)
    ref = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=d**-0.5, enable_gqa=True)
    torch.testing.assert_close(got, ref.transpose(1, 2).reshape(b, t, hq * d), rtol=1e-5, atol=1e-5)

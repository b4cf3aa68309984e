"""Where a native kernel cannot be built, its caller gets the torch reference, not an error."""

import torch
import torch.nn.functional as F

from kernels import native_build
from kernels.thin_linear import thin_linear
from kernels.topk_logprobs import topk_logprobs, topk_logprobs_reference


def test_a_failed_build_falls_back_to_torch(tmp_path, monkeypatch):
    monkeypatch.setenv("CC", "false")  # a "compiler" that fails every build
    monkeypatch.setenv("SPECLOOP_KERNEL_CACHE", str(tmp_path))
    monkeypatch.setattr(native_build, "_loaded", {})  # as in a new process
    x, w = torch.randn(3, 16), torch.randn(5, 16)
    torch.testing.assert_close(thin_linear(x, w), F.linear(x, w))
    logits = torch.randn(2, 40)
    assert torch.equal(topk_logprobs(logits, 4)[0], topk_logprobs_reference(logits, 4)[0])
    assert native_build._loaded == {"pool": None, "thin_linear": None, "topk_logprobs": None}
    assert not list(tmp_path.glob("*.so"))


def test_the_switch_turns_native_kernels_off(monkeypatch):
    monkeypatch.setenv("SPECLOOP_NATIVE_KERNELS", "0")
    monkeypatch.setattr(native_build, "_loaded", {})
    x, w = torch.randn(2, 8), torch.randn(4, 8)
    torch.testing.assert_close(thin_linear(x, w), F.linear(x, w))
    assert native_build._loaded == {"thin_linear": None}

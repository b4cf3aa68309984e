"""LlamaForward computes what the Hugging Face Llama forward computes, over the engine's cache."""

import pytest
import torch

from kernels import packed_linear
from kernels.packed_linear import PackedLinear
from serving.engine.batch_cache import RaggedKVCache
from serving.engine.llama_forward import LlamaForward
from serving.target import tiny_target


def _prefilled(model, lengths, seed=0):
    """A ragged cache whose rows hold ``lengths`` random tokens (written by the HF forward)."""
    g = torch.Generator().manual_seed(seed)
    cache = RaggedKVCache.for_model(model, batch_size=0)
    vocab = model.config.vocab_size
    for n in lengths:
        one = RaggedKVCache.for_model(model, batch_size=1)
        ids = torch.randint(0, vocab, (1, n), generator=g)
        pos, mask = one.prepare(n)
        model(input_ids=ids, position_ids=pos, attention_mask=mask, past_key_values=one,
              use_cache=True, logits_to_keep=1)
        one.commit([n])
        cache.append(one)
    return cache


def _twin(cache):
    twin = RaggedKVCache.for_model_like(cache) if hasattr(RaggedKVCache, "for_model_like") else None
    if twin is None:
        twin = RaggedKVCache(cache.num_layers, cache.num_kv_heads, cache.head_dim, cache.dtype,
                             cache.device, 0)
        twin.keys = [k.clone() for k in cache.keys]
        twin.values = [v.clone() for v in cache.values]
        twin.lengths = list(cache.lengths)
        twin.capacity = cache.capacity
    return twin


@pytest.mark.parametrize("native", [True, False], ids=["native", "blas"])
@pytest.mark.parametrize("q", [1, 2, 4, 5, 9, 40])
@torch.inference_mode()
def test_logits_and_features_match_hf_on_ragged_rows(q, native):
    """Both projection paths: the native packed kernel (where it builds) and BLAS alone."""
    if native and not packed_linear.available():
        pytest.skip("native kernel not built here")
    model = tiny_target(vocab_size=97, num_layers=3).model
    fast = LlamaForward(model, thin_max=4, native=native)
    assert fast.native == native
    cache = _prefilled(model, [5, 11, 2])
    twin = _twin(cache)
    ids = torch.randint(0, 97, (3, q), generator=torch.Generator().manual_seed(q))
    pos, mask = cache.prepare(q)
    ref = model(input_ids=ids, position_ids=pos, attention_mask=mask, past_key_values=cache,
                use_cache=True, output_hidden_states=True)
    pos2, mask2 = twin.prepare(q)
    layers = (0, 1, 2, 3, -1)
    got = fast(ids, pos2, mask2, twin, hidden_layers=layers)
    torch.testing.assert_close(got.logits, ref.logits, rtol=1e-4, atol=1e-4)
    for i in layers:
        torch.testing.assert_close(got.hidden_states[i], ref.hidden_states[i], rtol=1e-4, atol=1e-4)
    pos3, mask3 = twin.prepare(q)  # -1 alone still means the final normed state
    last = fast(ids, pos3, mask3, twin, hidden_layers=(-1,)).hidden_states
    torch.testing.assert_close(last[-1], ref.hidden_states[-1], rtol=1e-4, atol=1e-4)
    for a, b in zip(cache.keys + cache.values, twin.keys + twin.values):  # same KV written
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("tree", [False, True])
@torch.inference_mode()
def test_padding_is_skipped_and_real_inputs_come_out_the_same(tree):
    """A ragged verify (rows of 1, 3 and 5 real inputs padded to 5): the projections run on the 9
    real inputs only, and each real input's logits are exactly those of the padded forward (a
    token's projection does not depend on what else shares the call); padded logits are zeros."""
    if not packed_linear.available():
        pytest.skip("native kernel not built here")
    model = tiny_target(vocab_size=97, num_layers=3).model
    fast = LlamaForward(model, native=True)
    cache = _prefilled(model, [5, 11, 2])
    twin = _twin(cache)
    ids = torch.randint(0, 97, (3, 5), generator=torch.Generator().manual_seed(7))
    real_tokens = torch.tensor([1, 3, 5])
    if tree:  # node 2 branches off the root beside node 1, node 3 follows node 1
        ancestors = torch.tensor([[1, 0, 0, 0, 0], [1, 1, 0, 0, 0], [1, 0, 1, 0, 0], [1, 1, 0, 1, 0],
                                  [1, 1, 0, 1, 1]], dtype=torch.bool).expand(3, 5, 5)
        depth = torch.tensor([0, 1, 1, 2, 3]).expand(3, 5)
        cache.set_tree(depth, ancestors)
        twin.set_tree(depth, ancestors)
    pos, mask = cache.prepare(5)
    full = fast(ids, pos, mask, cache).logits  # [3, 5, V]
    pos2, mask2 = twin.prepare(5)
    packed = fast(ids, pos2, mask2, twin, row_tokens=real_tokens).logits
    real = torch.arange(5)[None, :] < real_tokens[:, None]  # [3, 5]
    assert torch.equal(packed[real], full[real])
    assert torch.count_nonzero(packed[~real]) == 0
    for b, n in enumerate(real_tokens.tolist()):  # the real inputs' keys and values, the same
        start = cache.lengths[b]
        for a, c in zip(cache.keys + cache.values, twin.keys + twin.values):
            assert torch.equal(a[b, :, start:start + n], c[b, :, start:start + n])


@torch.inference_mode()
def test_tree_shaped_mask_matches_hf():
    """An arbitrary mask (here: two branches that must not see each other) is honoured exactly."""
    model = tiny_target(vocab_size=61, num_layers=2).model
    fast = LlamaForward(model)
    cache = _prefilled(model, [6])
    twin = _twin(cache)
    ids = torch.tensor([[3, 7, 9, 11]])
    pos, mask = cache.prepare(4)
    pos = torch.tensor([[6, 7, 7, 8]])  # root, two siblings at depth 1, a child of the first
    tree = torch.tensor([[1, 0, 0, 0], [1, 1, 0, 0], [1, 0, 1, 0], [1, 1, 0, 1]], dtype=torch.bool)
    mask = mask.clone()
    mask[0, 0, :, 6:10] = tree
    ref = model(input_ids=ids, position_ids=pos, attention_mask=mask, past_key_values=cache,
                use_cache=True)
    twin.prepare(4)
    got = fast(ids, pos, mask, twin)
    torch.testing.assert_close(got.logits, ref.logits, rtol=1e-4, atol=1e-4)


@torch.inference_mode()
def test_logits_to_keep_and_unsupported_models():
    model = tiny_target(vocab_size=50, num_layers=2).model
    fast = LlamaForward(model)
    cache = _prefilled(model, [4])
    pos, mask = cache.prepare(3)
    out = fast(torch.tensor([[1, 2, 3]]), pos, mask, cache, logits_to_keep=1)
    assert out.logits.shape == (1, 1, 50) and out.hidden_states is None
    assert fast.weight_bytes() > 0
    model.config.model_type = "gpt2"
    assert not LlamaForward.supports(model)
    with pytest.raises(ValueError):
        LlamaForward(model)


@pytest.mark.real_model
@torch.inference_mode()
def test_real_model_greedy_outputs_equal_hf_reference():
    """SmolLM2: the engine's fast forward (bf16 panels) decodes exactly what the Hugging Face
    forward decodes."""
    from benchmarks.bench_engine import _greedy
    from serving.engine.config import EngineConfig
    from serving.engine.torch_engine import TorchEngine
    from serving.target import load_target

    target = load_target(None)
    fast = TorchEngine(target, config=EngineConfig(k=0))
    ref = TorchEngine(target, config=EngineConfig(k=0, forward="hf"))
    assert fast.runner.fast is not None and ref.runner.fast is None
    if fast.runner.fast.native:  # the default target's weights are exactly bf16: half the bytes
        assert fast.runner.fast.lm_head_served.panels.dtype == torch.bfloat16
    tok = target.tokenizer
    for text in ("def fibonacci(n):", "The capital of France is", "Write a haiku about rain."):
        ids = tok.encode(text)
        assert _greedy(fast, ids, 16) == _greedy(ref, ids, 16)


def test_engines_on_one_model_share_its_forward_until_a_weight_changes():
    """One packed copy of the weights per model, however many engines run on it; a weight
    modified in place (or replaced) after that gets a fresh forward that computes with it."""
    from serving.engine.model_runner import ModelRunner

    model = tiny_target(vocab_size=50, num_layers=2, seed=3).model
    cpu = torch.device("cpu")
    first, second = ModelRunner(model, cpu), ModelRunner(model, cpu)
    assert first.fast is second.fast
    assert ModelRunner(model, cpu, native_kernels=False).fast is not first.fast
    other = tiny_target(vocab_size=50, num_layers=2, seed=3).model
    assert ModelRunner(other, cpu).fast is not first.fast

    with torch.no_grad():
        model.model.layers[0].mlp.down_proj.weight.mul_(2.0)
        third = ModelRunner(model, cpu)
        assert third.fast is not first.fast
        cache = _prefilled(model, [5])
        ids = torch.tensor([[7, 9]])

        def logits(forward):
            c = _twin(cache)
            pos, mask = c.prepare(2)
            if forward is None:
                return model(input_ids=ids, position_ids=pos, attention_mask=mask,
                             past_key_values=c, use_cache=True).logits
            return forward(ids, pos, mask, c).logits

        ref = logits(None)
        torch.testing.assert_close(logits(third.fast), ref, rtol=1e-4, atol=1e-4)
        assert not torch.allclose(logits(first.fast), ref, atol=1e-3)  # the old copy: the old model


@torch.inference_mode()
def test_a_bf16_valued_target_streams_bf16_panels_with_the_same_logits():
    """The default target's weights are all exactly bf16 (a bf16 cache, served in fp32): its
    projections are packed as bf16 panels, half the bytes a step reads, and the forward's logits
    and cache are bit for bit those of fp32 panels."""
    if not packed_linear.available():
        pytest.skip("native kernel not built here")
    model = tiny_target(vocab_size=97, num_layers=3).model
    model.to(torch.bfloat16).to(torch.float32)  # every weight now exactly a bf16 value
    half = LlamaForward(model, native=True, amx=False)  # the FMA kernel over bf16 panels
    full = LlamaForward(model, native=True, bf16_panels=False)

    def panels(fwd):
        return [w for lay in fwd.layers for w in lay if isinstance(w, PackedLinear)] + [fwd.lm_head_served]

    assert len(panels(half)) == 3 * 4 + 1
    assert all(w.panels.dtype == torch.bfloat16 for w in panels(half))
    assert sum(w.nbytes for w in panels(half)) * 2 == sum(w.nbytes for w in panels(full))
    cache = _prefilled(model, [5, 11, 2])
    twin = _twin(cache)
    for q in (1, 4, 19):
        ids = torch.randint(0, 97, (3, q), generator=torch.Generator().manual_seed(q))
        pos, mask = cache.prepare(q)
        pos2, mask2 = twin.prepare(q)
        assert torch.equal(half(ids, pos, mask, cache).logits, full(ids, pos2, mask2, twin).logits)
        cache.commit([q] * 3)
        twin.commit([q] * 3)
    for a, b in zip(cache.keys + cache.values, twin.keys + twin.values):
        assert torch.equal(a, b)


@pytest.mark.parametrize("bf16", [True, False], ids=["bf16-panels", "fp32-panels"])
@torch.inference_mode()
def test_the_native_layer_stack_gives_the_per_call_numbers_bit_for_bit(bf16):
    """All the layers in one native call (kernels/llama_layers.py) against the per-call loop: the
    same logits, hidden states and cache, bit for bit, at decode, verify and prefill widths, with
    padding skipped and with a token tree."""
    if not packed_linear.available():
        pytest.skip("native kernel not built here")
    model = tiny_target(vocab_size=97, num_layers=3).model
    if bf16:
        model.to(torch.bfloat16).to(torch.float32)
    fast = LlamaForward(model, native=True)
    assert fast.stack is not None
    per_call = LlamaForward(model, native=True)
    per_call.stack = None
    cache = _prefilled(model, [5, 11, 2])
    twin = _twin(cache)
    ancestors = torch.tensor([[1, 0, 0], [1, 1, 0], [1, 0, 1]], dtype=torch.bool).expand(3, 3, 3)
    for q, row_tokens, tree in ((1, None, False), (4, None, False), (3, torch.tensor([1, 3, 2]), True),
                                (5, torch.tensor([2, 5, 1]), False), (19, None, False)):
        ids = torch.randint(0, 97, (3, q), generator=torch.Generator().manual_seed(q))
        if tree:
            for c in (cache, twin):
                c.set_tree(torch.tensor([0, 1, 1]).expand(3, 3), ancestors)
        pos, mask = cache.prepare(q)
        pos2, mask2 = twin.prepare(q)
        hidden = () if row_tokens is not None else (0, 1, 2, -1)
        a = fast(ids, pos, mask, cache, hidden_layers=hidden, row_tokens=row_tokens)
        b = per_call(ids, pos2, mask2, twin, hidden_layers=hidden, row_tokens=row_tokens)
        assert torch.equal(a.logits, b.logits)
        for i in hidden:
            assert torch.equal(a.hidden_states[i], b.hidden_states[i])
        if not tree:
            cache.commit([q] * 3)
            twin.commit([q] * 3)
    for x, y in zip(cache.keys + cache.values, twin.keys + twin.values):
        assert torch.equal(x, y)


@torch.inference_mode()
def test_amx_tiles_serve_a_bf16_valued_target_and_verify_agrees_with_decode():
    """Where the CPU has AMX-BF16, a bf16-valued target's projections run on tiles: logits close
    to the FMA panels' (fp32 precision, another order of additions), and a token's logits in a
    verify of q tokens those of decoding it alone after the same prefix, to float rounding (the
    projections agree bit for bit: tests/kernels/test_packed_linear.py)."""
    if not packed_linear.amx_available():
        pytest.skip("no AMX-BF16 here")
    model = tiny_target(vocab_size=97, num_layers=3).model
    model.to(torch.bfloat16).to(torch.float32)
    amx = LlamaForward(model, native=True)
    fma = LlamaForward(model, native=True, amx=False)
    layouts = {w.layout for lay in amx.layers for w in lay if isinstance(w, PackedLinear)}
    assert layouts == {"amx"} and amx.lm_head_served.layout == "amx" and amx.stack is not None
    ids = torch.randint(0, 97, (3, 9), generator=torch.Generator().manual_seed(3))
    wide = _prefilled(model, [5, 11, 2])
    twin, stepwise = _twin(wide), _twin(wide)
    pos, mask = wide.prepare(9)
    verify = amx(ids, pos, mask, wide).logits  # [3, 9, V]
    pos2, mask2 = twin.prepare(9)
    torch.testing.assert_close(verify, fma(ids, pos2, mask2, twin).logits, rtol=1e-4, atol=1e-4)
    for t in range(9):
        pos3, mask3 = stepwise.prepare(1)
        one = amx(ids[:, t : t + 1], pos3, mask3, stepwise).logits  # [3, 1, V]
        stepwise.commit([1] * 3)
        torch.testing.assert_close(one[:, 0], verify[:, t], rtol=1e-5, atol=1e-5)

import json

import pytest
import torch
from safetensors import safe_open
from transformers import DynamicCache

from feedback.drafters.eagle_head import (
    EagleHead,
    EagleHeadConfig,
    default_feature_layers,
    eagle_from_target,
    gather_features,
)
from feedback.drafters.standalone_lm import standalone_from_target
from feedback.drafters.vocab import day0_draft_vocab
from feedback.registry.eagle3_export import export_eagle3
from serving.target import tiny_target

V, H, L = 256, 64, 4


@pytest.fixture(scope="module")
def target():
    return tiny_target(vocab_size=V, hidden_size=H, num_layers=L)


def test_default_feature_layers_follow_eagle3_and_stay_distinct_on_shallow_targets():
    assert default_feature_layers(30) == (2, 15, 27)
    assert default_feature_layers(4) == (1, 2, 3)
    with pytest.raises(ValueError):
        default_feature_layers(2)


def test_day0_vocab_is_lowest_ids_plus_specials_or_most_frequent():
    ids = day0_draft_vocab(100, 10, special_ids=[99, 50])
    assert ids.tolist() == [0, 1, 2, 3, 4, 5, 6, 7, 50, 99]
    freq = torch.zeros(100)
    freq[[70, 80, 90]] = torch.tensor([3.0, 5.0, 4.0])
    ids = day0_draft_vocab(100, 4, special_ids=[2], frequencies=freq)
    assert ids.tolist() == [2, 70, 80, 90]


def test_vocab_maps_follow_sglang_convention(target):
    head = eagle_from_target(target.model, draft_vocab=torch.tensor([0, 5, 7, 200]), init="random")
    assert (torch.arange(4) + head.d2t).tolist() == [0, 5, 7, 200]
    assert head.t2d.dtype == torch.bool and head.t2d.nonzero().flatten().tolist() == [0, 5, 7, 200]
    assert head.target_to_draft[7] == 2 and head.target_to_draft[6] == -1
    full = head.to_target_vocab(torch.tensor([[0.1, 0.2, 0.3, 0.4]]))  # [1, V]
    assert (
        full.shape == (1, V)
        and full[0, 200] == pytest.approx(0.4)
        and full.sum() == pytest.approx(1.0)
    )


def test_eagle_day0_starts_from_the_target(target):
    draft_vocab = day0_draft_vocab(V, 64, special_ids=[V - 1])
    head = eagle_from_target(target.model, draft_vocab=draft_vocab)
    last = target.model.model.layers[-1]
    assert torch.equal(head.lm_head.weight, target.model.lm_head.weight[draft_vocab])
    assert torch.equal(head.midlayer.mlp.down_proj.weight, last.mlp.down_proj.weight)
    assert torch.equal(head.midlayer.self_attn.q_proj.weight[:, H:], last.self_attn.q_proj.weight)
    assert head.embed_weight.data_ptr() == target.model.get_input_embeddings().weight.data_ptr()
    assert "embed_weight" not in head.state_dict()


def test_eagle_incremental_decoding_matches_one_causal_pass(target):
    torch.manual_seed(0)
    head = eagle_from_target(target.model, draft_vocab_size=64, init="random")
    ids = torch.randint(0, V, (2, 9))
    feats = torch.randn(2, 9, head.config.feature_size)
    with torch.no_grad():
        full = head(ids, features=feats)  # [2, 9, H]
        cache = DynamicCache()
        first = head(ids[:, :5], features=feats[:, :5], cache=cache)
        rest = [
            head(ids[:, i : i + 1], features=feats[:, i : i + 1], cache=cache) for i in range(5, 9)
        ]
    inc = torch.cat([first, *rest], dim=1)
    assert torch.allclose(full, inc, atol=1e-5)
    assert head.compute_logits(full).shape == (2, 9, 64)


def test_standalone_with_every_target_layer_is_the_target(target):
    copy = standalone_from_target(target.model, num_layers=L)
    ids = torch.randint(0, V, (1, 12))
    with torch.no_grad():
        assert torch.allclose(copy(ids).logits, target.model(ids).logits, atol=1e-5)
    two = standalone_from_target(target.model, num_layers=2)
    assert two.config.num_hidden_layers == 2
    assert torch.equal(
        two.model.layers[1].mlp.up_proj.weight, target.model.model.layers[1].mlp.up_proj.weight
    )
    rand = standalone_from_target(target.model, num_layers=2, init="random", seed=3)
    assert not torch.equal(
        rand.model.layers[0].mlp.up_proj.weight, target.model.model.layers[0].mlp.up_proj.weight
    )


def test_gather_features_concatenates_hf_hidden_states(target):
    ids = torch.randint(0, V, (1, 6))
    with torch.no_grad():
        hs = target.model(ids, output_hidden_states=True).hidden_states
    f = gather_features(hs, (1, 2, 3))
    assert f.shape == (1, 6, 3 * H) and torch.equal(f[..., H : 2 * H], hs[2])


# SGLang's LlamaForCausalLMEagle3 checkpoint names (python/sglang/srt/models/llama_eagle3.py) for a
# head of width H, intermediate I, heads nh x hd, kv heads kvh, target width Ht, vocab V, draft Vd.
def _sglang_eagle3_shapes(H, I, nh, kvh, hd, Ht, V, Vd):
    return {
        "fc.weight": (H, 3 * Ht),
        "midlayer.input_layernorm.weight": (H,),
        "midlayer.hidden_norm.weight": (H,),
        "midlayer.self_attn.q_proj.weight": (nh * hd, 2 * H),
        "midlayer.self_attn.k_proj.weight": (kvh * hd, 2 * H),
        "midlayer.self_attn.v_proj.weight": (kvh * hd, 2 * H),
        "midlayer.self_attn.o_proj.weight": (H, nh * hd),
        "midlayer.post_attention_layernorm.weight": (H,),
        "midlayer.mlp.gate_proj.weight": (I, H),
        "midlayer.mlp.up_proj.weight": (I, H),
        "midlayer.mlp.down_proj.weight": (H, I),
        "norm.weight": (H,),
        "lm_head.weight": (Vd, H),
        "d2t": (Vd,),
        "t2d": (V,),
    }


def test_eagle3_export_has_sglang_names_shapes_and_config(target, tmp_path):
    head = eagle_from_target(target.model, draft_vocab_size=64, feature_layers=(1, 2, 3))
    out = export_eagle3(head, tmp_path / "eagle3", dtype=torch.bfloat16)
    cfg = json.loads((out / "config.json").read_text())
    assert cfg["architectures"] == ["LlamaForCausalLMEagle3"]
    assert cfg["draft_vocab_size"] == 64 and cfg["vocab_size"] == V
    assert cfg["target_hidden_size"] == H and cfg["num_hidden_layers"] == 1
    assert cfg["eagle_config"]["eagle_aux_hidden_state_layer_ids"] == [0, 1, 2]
    assert cfg["tie_word_embeddings"] is False
    tc = target.model.config
    expected = _sglang_eagle3_shapes(
        H,
        tc.intermediate_size,
        tc.num_attention_heads,
        tc.num_key_value_heads,
        tc.head_dim,
        H,
        V,
        64,
    )
    with safe_open(str(out / "model.safetensors"), framework="pt") as f:
        shapes = {n: tuple(f.get_slice(n).get_shape()) for n in f.keys()}  # noqa: SIM118
        d2t, t2d = f.get_tensor("d2t"), f.get_tensor("t2d")
        lm = f.get_tensor("lm_head.weight")
    assert shapes == expected
    assert d2t.dtype == torch.int64 and t2d.dtype == torch.bool and lm.dtype == torch.bfloat16
    assert torch.equal(torch.arange(64) + d2t, head.draft_vocab())
    assert int(t2d.sum()) == 64


def test_eagle3_export_refuses_heads_sglang_cannot_run(target, tmp_path):
    head = EagleHead(
        EagleHeadConfig.for_target(target.model.config, feature_layers=(3,), draft_vocab_size=32)
    )
    with pytest.raises(ValueError, match="3 target layers"):
        export_eagle3(head, tmp_path / "x")


def test_bf16_draft_weights_serve_drafts_and_training_keeps_the_real_weights():
    """``draft_in_bf16``: drafting reads a bf16 copy (half the bytes; logits within bf16 rounding),
    while a forward that trains still reads, and updates, the fp32 weight."""
    import pytest
    import torch

    from feedback.drafters.ops import draft_in_bf16, linear
    from kernels.thin_linear import available

    if not available():
        pytest.skip("no native kernel: bf16 draft weights are not used")
    layer = torch.nn.Linear(64, 32, bias=False)
    x = torch.randn(2, 64)
    assert draft_in_bf16(torch.nn.Sequential(layer)) == 1
    assert layer.draft_weight.dtype == torch.bfloat16
    with torch.no_grad():
        y = linear(layer, x)
        torch.testing.assert_close(y, x @ layer.draft_weight.float().T, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(y, layer(x), rtol=2e-2, atol=5e-2)
    linear(layer, x).sum().backward()  # gradients enabled: the real weight
    assert layer.weight.grad is not None and layer.weight.grad.abs().sum() > 0


def test_a_long_extend_with_bf16_draft_weights_stays_within_bf16_rounding(monkeypatch):
    """Many tokens (a request's history at a hot swap) take the bf16 gemm where the CPU has one,
    else the fp32 weight: either way the draft model's result, within bf16 rounding."""
    import pytest
    import torch

    from feedback.drafters import ops
    from kernels.thin_linear import MAX_TOKENS, available

    if not available():
        pytest.skip("no native kernel: bf16 draft weights are not used")
    layer = torch.nn.Linear(64, 48, bias=False)
    ops.draft_in_bf16(torch.nn.Sequential(layer))
    x = torch.randn(1, MAX_TOKENS + 9, 64)
    with torch.no_grad():
        exact = x @ layer.weight.T
        y = ops.linear(layer, x)
        assert y.dtype == torch.float32 and y.shape == exact.shape
        torch.testing.assert_close(y, exact, rtol=3e-2, atol=8e-2)
        ops._bf16_gemm.cache_clear()
        monkeypatch.setattr(torch.ops.mkldnn, "_is_mkldnn_bf16_supported", lambda: False)
        torch.testing.assert_close(ops.linear(layer, x), exact, rtol=1e-5, atol=1e-5)
    ops._bf16_gemm.cache_clear()


def test_standalone_net_drafts_alike_in_bf16():
    import torch

    from feedback.drafters.standalone_lm import standalone_from_target
    from serving.drafters.standalone import StandaloneNet
    from serving.target import tiny_target

    target = tiny_target(vocab_size=300, hidden_size=64, num_layers=3)
    ids = torch.randint(0, 300, (1, 12))
    pos = torch.arange(12)[None]
    out = {}
    for bf16 in (False, True):
        from transformers import DynamicCache

        net = StandaloneNet(standalone_from_target(target.model, num_layers=2), draft_vocab=torch.arange(200), bf16=bf16)
        with torch.no_grad():
            out[bf16] = net.logits(net.extend(ids, None, pos, DynamicCache(), None)[:, -1])  # [1, 200]
    torch.testing.assert_close(out[True], out[False], rtol=5e-2, atol=5e-2)


def test_gemm_row_buckets_are_few_and_waste_at_most_a_quarter():
    from feedback.drafters.ops import gemm_rows_bucket

    sizes = {gemm_rows_bucket(n) for n in range(33, 1025)}
    assert all(n <= gemm_rows_bucket(n) <= 1.25 * n for n in range(1, 5000))
    assert len(sizes) <= 24  # 4 per power of two, where every length gave its own shape


def test_bucketed_bf16_projection_equals_the_plain_one():
    from feedback.drafters.ops import _bf16_gemm_bucketed

    g = torch.Generator().manual_seed(0)
    w = torch.randn(96, 64, generator=g).bfloat16()
    x = torch.randn(2, 37, 64, generator=g)  # 74 rows -> 80
    out = _bf16_gemm_bucketed(x, w)
    assert out.shape == (2, 37, 96) and out.dtype == torch.float32
    ref = torch.nn.functional.linear(x.bfloat16(), w).float()
    torch.testing.assert_close(out, ref, rtol=1e-2, atol=1e-2)

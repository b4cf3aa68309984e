"""RopeTable gives the rotary module's own cos/sin, bit for bit, in any batch shape."""

import torch
from transformers import LlamaConfig
from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

from serving.engine.rope_table import RopeTable


def _rotary(**rope):
    cfg = LlamaConfig(hidden_size=576, num_attention_heads=9, max_position_embeddings=2048,
                      rope_parameters={"rope_type": "default", "rope_theta": 100000.0, **rope})
    return LlamaRotaryEmbedding(cfg)


def test_table_rows_are_the_modules_numbers_bit_for_bit():
    rotary = _rotary()
    table = RopeTable(rotary, 2048)
    assert table.tabled
    for positions in (torch.tensor([[0]]), torch.tensor([[2047]]), torch.tensor([[5, 6, 7, 8], [100, 101, 102, 90]]),
                      torch.arange(300)[None]):
        x = torch.zeros(*positions.shape, 576)
        got, want = table(x, positions), rotary(x, positions)
        assert all(torch.equal(g, w) for g, w in zip(got, want))


def test_past_the_table_and_length_dependent_ropes_use_the_module():
    rotary = _rotary()
    table = RopeTable(rotary, 64)
    x, far = torch.zeros(1, 2, 576), torch.tensor([[63, 64]])
    assert all(torch.equal(g, w) for g, w in zip(table(x, far), rotary(x, far)))  # 64 is past it
    dynamic = _rotary(rope_type="dynamic", factor=2.0)
    assert not RopeTable(dynamic, 2048).tabled

"""CPUCoreAttention against an independent reference, and the spec helpers."""

from __future__ import annotations

import dataclasses

import pytest
import torch
import torch.nn.functional as F
from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
from megatron.core.models.T5.t5_spec import decoder_model_with_local_spec
from megatron.core.packed_seq_params import PackedSeqParams
from megatron.core.transformer.dot_product_attention import DotProductAttention
from megatron.core.transformer.enums import AttnMaskType
from megatron.core.transformer.transformer_block import TransformerBlockSubmodules
from megatron.core.transformer.transformer_layer import TransformerLayer

from megatron_ssd.errors import ConfigError
from megatron_ssd.megatron.attention import (
    CPUCoreAttention,
    cpu_block_spec,
    cpu_layer_spec,
    replace_core_attention,
)
from megatron_ssd.workloads.models import tiny_transformer_config
from megatron_ssd.workloads.parallel import destroy_parallel, init_parallel

SQ, B, HEADS, HN = 16, 2, 4, 16


@pytest.fixture(scope="module")
def world():
    init_parallel()
    yield
    destroy_parallel()


def _qkv(groups: int):
    g = torch.Generator().manual_seed(0)
    q = torch.randn(SQ, B, HEADS, HN, generator=g)
    k = torch.randn(SQ, B, groups, HN, generator=g)
    v = torch.randn(SQ, B, groups, HN, generator=g)
    return q, k, v


def _reference(q, k, v, allowed):
    """Attention from torch's SDPA (boolean mask: True = may attend)."""
    rep = HEADS // k.size(2)
    qq = q.permute(1, 2, 0, 3)
    kk = k.repeat_interleave(rep, 2).permute(1, 2, 0, 3)
    vv = v.repeat_interleave(rep, 2).permute(1, 2, 0, 3)
    out = F.scaled_dot_product_attention(qq, kk, vv, attn_mask=allowed)
    return out.permute(2, 0, 1, 3).reshape(SQ, B, HEADS * HN)


@pytest.mark.parametrize("groups", [HEADS, 2])
@pytest.mark.parametrize("mask_type", [AttnMaskType.causal, AttnMaskType.padding])
def test_matches_sdpa(world, groups, mask_type):
    config = tiny_transformer_config(1, HEADS * HN, HEADS, num_query_groups=groups)
    attention = CPUCoreAttention(config, 1, mask_type, "self")
    q, k, v = _qkv(groups)
    if mask_type == AttnMaskType.causal:
        mask, allowed = None, ~torch.triu(torch.ones(SQ, SQ, dtype=torch.bool), 1)
    else:
        valid = torch.arange(SQ)[None] < torch.tensor([10, SQ])[:, None]
        mask = ~valid[:, None, None, :].expand(B, 1, SQ, SQ)  # megatron: True = masked
        allowed = ~mask
    out = attention(q, k, v, mask)
    assert out.shape == (SQ, B, HEADS * HN)
    torch.testing.assert_close(out, _reference(q, k, v, allowed), rtol=0, atol=1e-5)
    assert torch.equal(out, attention(q, k, v, mask)), "not deterministic"


def test_given_mask_wins_over_causal_type(world):
    config = tiny_transformer_config(1, HEADS * HN, HEADS)
    attention = CPUCoreAttention(config, 1, AttnMaskType.causal, "self")
    q, k, v = _qkv(HEADS)
    nothing_masked = torch.zeros(1, 1, SQ, SQ, dtype=torch.bool)
    out = attention(q, k, v, nothing_masked)
    torch.testing.assert_close(out, _reference(q, k, v, None), rtol=0, atol=1e-5)


def test_dropout_follows_the_default_generator(world):
    config = tiny_transformer_config(1, HEADS * HN, HEADS, attention_dropout=0.5)
    attention = CPUCoreAttention(config, 1, AttnMaskType.causal, "self")
    q, k, v = _qkv(HEADS)
    torch.manual_seed(5)
    first = attention(q, k, v, None)
    torch.manual_seed(5)
    assert torch.equal(first, attention(q, k, v, None))
    assert not torch.equal(first, attention(q, k, v, None))
    attention.eval()
    causal = ~torch.triu(torch.ones(SQ, SQ, dtype=torch.bool), 1)
    expected = _reference(q, k, v, causal)
    torch.testing.assert_close(attention(q, k, v, None), expected, rtol=0, atol=1e-5)


def test_refuses_what_it_does_not_implement(world):
    config = tiny_transformer_config(1, HEADS * HN, HEADS)
    attention = CPUCoreAttention(config, 1, AttnMaskType.causal, "self")
    q, k, v = _qkv(HEADS)
    with pytest.raises(ConfigError, match="^megatron_ssd: packed sequences"):
        attention(q, k, v, None, packed_seq_params=PackedSeqParams())
    with pytest.raises(ConfigError, match="attention_bias"):
        attention(q, k, v, None, attention_bias=torch.zeros(1))
    off_by_one = tiny_transformer_config(1, HEADS * HN, HEADS, softmax_type="off-by-one")
    with pytest.raises(ConfigError, match="softmax_type"):
        CPUCoreAttention(off_by_one, 1, AttnMaskType.causal, "self")


def _core(attention_spec):
    core = attention_spec.submodules.core_attention
    return core.module if hasattr(core, "module") else core


def test_layer_spec_is_copied_not_mutated():
    spec = get_gpt_layer_local_spec()
    cpu = cpu_layer_spec(spec)
    assert _core(spec.submodules.self_attention) is DotProductAttention
    assert _core(cpu.submodules.self_attention) is CPUCoreAttention
    assert cpu.submodules.mlp is spec.submodules.mlp
    assert cpu.submodules.self_attention.params == {"attn_mask_type": AttnMaskType.causal}


def test_replaced_layer_class_is_kept():
    class MyLayer(TransformerLayer):
        pass

    spec = dataclasses.replace(get_gpt_layer_local_spec(), module=MyLayer)
    assert cpu_layer_spec(spec).module is MyLayer


def test_t5_decoder_self_and_cross_attention_are_replaced():
    cpu = cpu_layer_spec(decoder_model_with_local_spec())
    assert _core(cpu.submodules.self_attention) is CPUCoreAttention
    assert _core(cpu.submodules.cross_attention) is CPUCoreAttention


def test_block_spec_layers_are_replaced():
    layer = get_gpt_layer_local_spec()
    block = TransformerBlockSubmodules(layer_specs=[layer, layer], layer_norm=None)
    cpu = cpu_block_spec(block)
    assert [_core(s.submodules.self_attention) for s in cpu.layer_specs] == [CPUCoreAttention] * 2
    assert block.layer_specs == [layer, layer]


def test_non_layer_spec_is_refused():
    with pytest.raises(ConfigError, match="ModuleSpec of a transformer layer"):
        replace_core_attention(TransformerLayer, CPUCoreAttention)

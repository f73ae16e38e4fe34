"""megatron-core 0.19's ``HybridModel`` with offload-aware layers, bit for bit.

A tiny hybrid model with the pattern ``*-*-`` (attention, MLP, attention, MLP) is built
from megatron-core's local (non-Transformer-Engine) pieces of the GPT layer spec, with
the CPU core attention, and trained twice from the same seed: through Megatron's stock
schedule, and through ``megatron_ssd.megatron.get_forward_backward_func(cache=...)``
with every layer offloaded to real files (and once more with every layer kept). Losses
and every gradient must be ``torch.equal``; offload must have written and read bytes.
The comparison runs on CPU tensors over gloo on any machine (NOTE [Hidden CUDA]). Mamba
layers need CUDA kernels (NOTE [Mamba layers] in ``megatron_ssd/megatron/layer.py``) and
are covered by a GPU test only.
"""

from __future__ import annotations

import dataclasses
import os

import pytest
import torch
from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
from megatron.core.ssm.mlp_layer import MLPLayer
from megatron.core.transformer.identity_op import IdentityOp
from megatron.core.transformer.spec_utils import ModuleSpec
from megatron.core.transformer.transformer_layer import TransformerLayer, TransformerLayerSubmodules

from megatron_ssd import IOConfig, OffloadConfig, TensorCache
from megatron_ssd.config import PlannerConfig
from megatron_ssd.errors import ConfigError
from megatron_ssd.megatron import compat, get_forward_backward_func
from megatron_ssd.megatron.attention import cpu_layer_spec
from megatron_ssd.megatron.cpu_mode import cpu_mode, hide_cuda
from megatron_ssd.workloads.harness import SyntheticData, gpt_forward_step, run_steps
from megatron_ssd.megatron.layer import (
    OffloadHybridStack,
    OffloadMambaLayer,
    OffloadMLPLayer,
    OffloadTransformerLayer,
    assign_layer_ids,
    offload_layer_spec,
)
from megatron_ssd.workloads.models import tiny_transformer_config
from megatron_ssd.workloads.parallel import destroy_parallel, init_parallel
from megatron_ssd.adaptive import AdaptivePlanner

HYBRID = compat.hybrid_stack_classes()
pytestmark = pytest.mark.skipif(
    not HYBRID, reason="HybridModel / HybridStack arrived in megatron-core 0.19; this one has none"
)

VOCAB, SEQ, MBS, NMB, PATTERN = 128, 64, 4, 4, "*-*-"


def _local_submodules(**extra):
    """``HybridStackSubmodules`` of an attention-only and an MLP-only layer, cut from the
    local GPT layer spec (megatron's own hybrid specs name Transformer Engine modules)."""
    _, submodules_class = HYBRID
    local = cpu_layer_spec(get_gpt_layer_local_spec()).submodules
    attention = ModuleSpec(
        module=TransformerLayer,
        submodules=TransformerLayerSubmodules(
            input_layernorm=local.input_layernorm,
            self_attention=local.self_attention,
            self_attn_bda=local.self_attn_bda,
        ),
    )
    mlp = ModuleSpec(
        module=MLPLayer,
        submodules=TransformerLayerSubmodules(
            pre_mlp_layernorm=local.pre_mlp_layernorm, mlp=local.mlp, mlp_bda=local.mlp_bda
        ),
    )
    return submodules_class(attention_layer=attention, mlp_layer=mlp, **extra)


def _stack_spec() -> ModuleSpec:
    # post_layer_norm=False: the stack's final norm is always Transformer Engine's TENorm.
    return ModuleSpec(module=HYBRID[0], submodules=_local_submodules(), params={"post_layer_norm": False})


def _build(offload: bool, seed: int = 11):
    from megatron.core.models.hybrid.hybrid_model import HybridModel

    torch.manual_seed(seed)
    config = tiny_transformer_config(num_layers=len(PATTERN), hidden_size=64, num_attention_heads=4)
    spec = offload_layer_spec(_stack_spec()) if offload else _stack_spec()
    with cpu_mode():
        return HybridModel(
            config,
            spec,
            vocab_size=VOCAB,
            max_sequence_length=SEQ,
            hybrid_layer_pattern=PATTERN,
            position_embedding_type="learned_absolute",
        )


def _run(mode=None, path=None, steps: int = 3):
    """Train ``steps`` steps; with ``mode``, through an offload cache whose planner places
    every layer ``mode``. Returns the model, the run's result, the step stats and the
    I/O engine's stats."""
    model = _build(offload=mode is not None)
    data = SyntheticData("gpt", MBS, SEQ, VOCAB, seed=3)
    if mode is None:
        return model, run_steps([model], gpt_forward_step, data, NMB, SEQ, MBS, steps=steps), [], None
    io = IOConfig(max_inflight_bytes=256 * 1024)
    with TensorCache(OffloadConfig(paths=[path], device="cpu", min_tensor_bytes=4096, io=io)) as cache:
        planner = AdaptivePlanner(cache, PlannerConfig(mode=mode))
        stats = []
        fb = get_forward_backward_func(cache=cache, on_step=lambda s: (stats.append(s), planner.on_step(s)))
        result = run_steps([model], gpt_forward_step, data, NMB, SEQ, MBS, steps=steps, forward_backward_func=fb)
        io_stats = cache.engine.stats()
        layer_ids = list(cache.layer_ids)
    return model, result, stats, (io_stats, layer_ids)


def _assert_identical(a, b):
    assert len(a.losses) == len(b.losses) > 0
    assert all(torch.equal(x, y) for x, y in zip(a.losses, b.losses, strict=True))
    assert a.grads.keys() == b.grads.keys() and len(a.grads) > 0
    assert [n for n in a.grads if not torch.equal(a.grads[n], b.grads[n])] == []


@pytest.fixture(scope="module")
def world():
    init_parallel(seed=1234)  # gloo on CPU, nccl where CUDA is usable
    yield
    destroy_parallel()


@pytest.fixture
def cpu_world():
    """gloo and CPU models on any machine (NOTE [Hidden CUDA]), for this test only (the GPU
    test of this module needs ``world`` on the device)."""
    with hide_cuda():
        init_parallel(seed=1234)
        try:
            yield
        finally:
            destroy_parallel()


@pytest.mark.slow
def test_hybrid_offload_is_bit_identical_to_stock(cpu_world, tmp_path):
    _, stock, _, _ = _run()
    model, offloaded, stats, (io, layer_ids) = _run("offload", str(tmp_path))
    _, kept, keep_stats, _ = _run("keep", str(tmp_path))

    assert isinstance(model.decoder, OffloadHybridStack)
    assert [type(layer) for layer in model.decoder.layers] == [OffloadTransformerLayer, OffloadMLPLayer] * 2
    assert layer_ids == [1, 2, 3, 4]
    _assert_identical(offloaded, stock)
    _assert_identical(kept, stock)
    assert len(stats) == 3 and all(s.bytes_offloaded > 0 and s.bytes_reloaded > 0 for s in stats)
    assert io.bytes_written > 0 and io.bytes_read > 0
    assert all(s.bytes_offloaded == 0 for s in keep_stats)
    assert os.listdir(tmp_path) == []


def test_hybrid_layer_ids_are_unique(world):
    model = _build(offload=True)
    layers = assign_layer_ids([model])
    assert [layer.layer_id for layer in layers] == [1, 2, 3, 4]
    assert [layer.layer_id for layer in layers] == [layer.layer_number for layer in model.decoder.layers]


def test_hybrid_mtp_layers_stay_stock(world):
    """HybridModel builds each MTP depth's inner stack from the same submodules as its
    decoder; only the decoder's layers become offload-aware (NOTE [Hybrid stack])."""
    from megatron.core.models.hybrid.hybrid_model import HybridModel
    from megatron.core.tensor_parallel import ColumnParallelLinear
    from megatron.core.transformer.multi_token_prediction import (
        MultiTokenPredictionBlock,
        MultiTokenPredictionBlockSubmodules,
        MultiTokenPredictionLayer,
        MultiTokenPredictionLayerSubmodules,
    )
    from megatron.core.transformer.torch_norm import WrappedTorchNorm

    norm = WrappedTorchNorm
    mtp_layer = MultiTokenPredictionLayerSubmodules(
        enorm=norm, hnorm=norm, eh_proj=ColumnParallelLinear, layer_norm=norm
    )
    mtp = ModuleSpec(
        module=MultiTokenPredictionBlock,
        submodules=MultiTokenPredictionBlockSubmodules(
            layer_specs=[ModuleSpec(module=MultiTokenPredictionLayer, submodules=mtp_layer)]
        ),
    )
    submodules = _local_submodules(mtp_block_spec=mtp)
    spec = ModuleSpec(module=HYBRID[0], submodules=submodules, params={"post_layer_norm": False})
    torch.manual_seed(11)
    config = tiny_transformer_config(num_layers=len(PATTERN), hidden_size=64, num_attention_heads=4, mtp_num_layers=2)
    with cpu_mode():
        model = HybridModel(
            config, offload_layer_spec(spec), vocab_size=VOCAB, max_sequence_length=SEQ,
            hybrid_layer_pattern=f"{PATTERN}/*-/*-", position_embedding_type="learned_absolute",
        )
    assert [type(layer) for layer in model.decoder.layers] == [OffloadTransformerLayer, OffloadMLPLayer] * 2
    inner = [layer for depth in model.mtp.layers for layer in depth.mtp_model_layer.layers]
    assert [type(layer) for layer in inner] == [TransformerLayer, MLPLayer] * 2
    assert [layer.layer_id for layer in assign_layer_ids([model])] == [1, 2, 3, 4]


def test_offload_layer_spec_on_hybrid_stack_spec():
    stack_class, submodules_class = HYBRID
    spec = _stack_spec()
    before = dataclasses.replace(spec.submodules)
    wrapped = offload_layer_spec(spec)

    assert spec.module is stack_class and spec.submodules == before, "input left unchanged"
    assert wrapped.module is OffloadHybridStack and wrapped.params == spec.params
    # The spec keeps its submodules: HybridModel also builds its MTP block's inner stacks
    # from them, and those keep stock layers (NOTE [Hybrid stack]).
    assert wrapped.submodules is spec.submodules
    assert offload_layer_spec(wrapped) is wrapped, "idempotent"

    converted = offload_layer_spec(spec.submodules)  # a bare HybridStackSubmodules
    assert isinstance(converted, submodules_class)
    assert converted.attention_layer.module is OffloadTransformerLayer
    assert converted.mlp_layer.module is OffloadMLPLayer
    for name in ("mamba_layer", "gdn_layer", "dsa_layer", "mla_layer", "moe_layer"):
        assert getattr(converted, name) is IdentityOp, name
    assert converted.mtp_block_spec is None
    assert spec.submodules.attention_layer.module is TransformerLayer, "input left unchanged"
    assert offload_layer_spec(converted) == converted, "idempotent"


def test_offload_layer_spec_converts_every_layer_entry_and_keeps_mtp():
    from megatron.core.ssm.mamba_layer import MambaLayer
    from megatron.core.transformer.transformer_layer import MoETransformerLayer

    _, submodules_class = HYBRID
    base = _local_submodules()
    mtp = ModuleSpec(module=torch.nn.Identity)  # stands in for an MTP block spec: left alone
    full = submodules_class(
        mamba_layer=ModuleSpec(module=MambaLayer),
        gdn_layer=dataclasses.replace(base.attention_layer),
        attention_layer=base.attention_layer,
        dsa_layer=dataclasses.replace(base.attention_layer),
        mla_layer=ModuleSpec(module=IdentityOp),
        mlp_layer=base.mlp_layer,
        moe_layer=ModuleSpec(module=MoETransformerLayer),
        mtp_block_spec=mtp,
    )
    converted = offload_layer_spec(full)
    assert converted.mamba_layer.module is OffloadMambaLayer
    assert converted.gdn_layer.module is OffloadTransformerLayer
    assert converted.dsa_layer.module is OffloadTransformerLayer
    assert converted.mla_layer is full.mla_layer, "IdentityOp spec kept"
    assert converted.moe_layer.module.__name__ == "OffloadMoETransformerLayer"
    assert converted.mtp_block_spec is mtp


def test_offload_layer_spec_refuses_unknown_hybrid_entries():
    stack_class, _ = HYBRID
    bad = dataclasses.replace(_local_submodules(), gdn_layer=ModuleSpec(module=torch.nn.Linear))
    with pytest.raises(ConfigError, match=r"^megatron_ssd: HybridStackSubmodules.gdn_layer: .*'Linear'"):
        offload_layer_spec(ModuleSpec(module=stack_class, submodules=bad))
    subclass = type("MyStack", (stack_class,), {})
    with pytest.raises(ConfigError, match="'MyStack': a subclass of HybridStack"):
        offload_layer_spec(ModuleSpec(module=subclass, submodules=_local_submodules()))


# ------------------------------------------------------------------ Mamba layers (GPU)


@pytest.mark.gpu
@pytest.mark.te
def test_mamba_hybrid_offload_matches_stock_on_gpu(world, tmp_path):
    """Mamba + attention + MLP with megatron's own (Transformer Engine) hybrid spec.

    Needs a CUDA device, Transformer Engine, mamba-ssm and causal-conv1d. Mamba's Triton
    backward kernels may accumulate with atomics, so the offloaded run is held to bit
    identity only when two stock runs are themselves bit-identical, and to a tight
    tolerance otherwise.
    """
    pytest.importorskip("mamba_ssm", reason="needs mamba-ssm (CUDA/Triton kernels)")
    pytest.importorskip("causal_conv1d", reason="needs causal-conv1d (CUDA kernels)")
    from megatron.core.models.hybrid.hybrid_layer_specs import hybrid_stack_spec
    from megatron.core.models.hybrid.hybrid_model import HybridModel

    def build(offload):
        torch.manual_seed(5)
        config = tiny_transformer_config(4, 256, 4)
        spec = offload_layer_spec(hybrid_stack_spec) if offload else hybrid_stack_spec
        model = HybridModel(config, spec, vocab_size=256, max_sequence_length=128, hybrid_layer_pattern="M*M-")
        return model.cuda()

    def train(model, cache=None):
        fb = get_forward_backward_func(cache=cache) if cache is not None else None
        data = SyntheticData("gpt", 2, 128, 256, seed=1)
        return run_steps([model], gpt_forward_step, data, 2, 128, 2, steps=2, forward_backward_func=fb)

    stock, again = train(build(False)), train(build(False))
    with TensorCache(OffloadConfig(paths=[str(tmp_path)], min_tensor_bytes=4096, keep_last_layers=0)) as cache:
        model = build(True)
        offloaded = train(model, cache)
        written = cache.engine.stats().bytes_written
    assert sum(isinstance(m, OffloadMambaLayer) for m in model.modules()) == 2
    assert written > 0
    deterministic = all(torch.equal(a, b) for a, b in zip(stock.losses, again.losses)) and all(
        torch.equal(stock.grads[n], again.grads[n]) for n in stock.grads
    )
    if deterministic:
        _assert_identical(offloaded, stock)
    else:
        for a, b in zip(stock.losses, offloaded.losses, strict=True):
            torch.testing.assert_close(a, b, rtol=1e-2, atol=1e-3)

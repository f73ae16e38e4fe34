"""GPU-only checks: the Transformer Engine spec, sequence parallelism, CUDA streams.

Skipped with a reason on machines without CUDA / Transformer Engine (markers ``gpu``,
``te``); on a GPU machine they assert the same bit-identity as the CPU tests.
"""

from __future__ import annotations

import pytest
import torch

from megatron_ssd import OffloadConfig, TensorCache
from megatron_ssd.megatron import OffloadTransformerLayer, get_forward_backward_func, offload_layer_spec

VOCAB, SEQ, MBS, NMB = 256, 128, 2, 2


def _gpt(spec, offload: bool, **config_kw):
    from megatron_ssd.workloads.models import build_gpt, tiny_transformer_config

    from megatron.core import tensor_parallel

    # Weights initialised on the GPU draw from megatron's CUDA RNG tracker, which the first
    # build advances: reseed it too, or the second model starts from other weights.
    torch.manual_seed(3)
    tensor_parallel.model_parallel_cuda_manual_seed(3)
    config = tiny_transformer_config(3, 128, 4, **config_kw)
    model = build_gpt(config, VOCAB, SEQ, layer_spec=offload_layer_spec(spec) if offload else spec)
    return model.cuda()


def _train(model, cache=None):
    from megatron_ssd.workloads.harness import SyntheticData, gpt_forward_step, run_steps

    fb = get_forward_backward_func(cache=cache) if cache is not None else None
    data = SyntheticData("gpt", MBS, SEQ, VOCAB, seed=1)
    return run_steps([model], gpt_forward_step, data, NMB, SEQ, MBS, steps=2, forward_backward_func=fb)


@pytest.fixture(scope="module")
def world():
    from megatron_ssd.workloads.parallel import destroy_parallel, init_parallel

    init_parallel(seed=1234, backend="nccl")
    yield
    destroy_parallel()


def _same(a, b):
    assert all(torch.equal(x, y) for x, y in zip(a.losses, b.losses, strict=True))
    assert [n for n in a.grads if not torch.equal(a.grads[n], b.grads[n])] == []


@pytest.mark.gpu
def test_local_spec_on_cuda_bit_identical(world, tmp_path):
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec

    stock = _train(_gpt(get_gpt_layer_local_spec(), offload=False))
    with TensorCache(OffloadConfig(paths=[str(tmp_path)], min_tensor_bytes=4096)) as cache:
        model = _gpt(get_gpt_layer_local_spec(), offload=True)
        offloaded = _train(model, cache)
    assert any(isinstance(m, OffloadTransformerLayer) for m in model.modules())
    _same(stock, offloaded)


@pytest.mark.te
def test_transformer_engine_spec_bit_identical(world, tmp_path):
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_with_transformer_engine_spec

    spec = get_gpt_layer_with_transformer_engine_spec()
    stock = _train(_gpt(spec, offload=False))
    with TensorCache(OffloadConfig(paths=[str(tmp_path)], min_tensor_bytes=4096)) as cache:
        offloaded = _train(_gpt(spec, offload=True), cache)
        written = cache.engine.stats().bytes_written
    _same(stock, offloaded)
    assert written > 0


@pytest.mark.gpu
def test_cuda_write_is_ordered_after_the_producing_stream(tmp_path):
    """A tensor produced on a side stream must be written with its final values."""
    with TensorCache(OffloadConfig(paths=[str(tmp_path)], min_tensor_bytes=0)) as cache:
        cache.register_layers([torch.nn.Identity()], ids=["L"], install_hooks=False)
        cache.set_plan({"L": "offload"})
        side = torch.cuda.Stream()
        x = torch.randn(1 << 20, device="cuda", requires_grad=True)
        with torch.cuda.stream(side):
            with cache.microbatch():
                with cache.layer("L"):
                    y = (x.exp() * 3).sum()  # exp saves its output, produced on `side`
        torch.cuda.current_stream().wait_stream(side)
        cache.drain()
        y.backward()
        assert torch.equal(x.grad, x.detach().exp() * 3)
        stats = cache.finish_step()
    assert stats.bytes_offloaded > 0

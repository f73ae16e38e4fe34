"""CPU mode: the redirected CUDA spots, and megatron-core's stock models and schedule on CPU.

On a machine with CUDA the module runs with CUDA hidden (NOTE [Hidden CUDA], the
``cpu_only`` fixture), so it tests the same CPU path there.
"""

from __future__ import annotations

import threading

import pytest
import torch
from megatron.core.models.bert.bert_model import BertModel
from megatron.core.models.gpt.gpt_model import GPTModel
from megatron.core.models.T5.t5_model import T5Model
from megatron.core.pipeline_parallel import get_forward_backward_func
from megatron.core.pipeline_parallel.schedules import forward_backward_no_pipelining

import megatron_ssd.megatron.cpu_mode as cpu_mode_module
from megatron_ssd.megatron.attention import CPUCoreAttention
from megatron_ssd.megatron.cpu_mode import CPUDeviceMode, cpu_mode, cpu_mode_active
from megatron_ssd.workloads.harness import (
    SyntheticData,
    bert_forward_step,
    gpt_forward_step,
    run_steps,
    t5_forward_step,
)
from megatron_ssd.workloads.models import build_bert, build_gpt, build_t5, tiny_transformer_config
from megatron_ssd.workloads.parallel import destroy_parallel, init_parallel

pytestmark = pytest.mark.usefixtures("cpu_only")


def _modes():
    stack = torch.overrides._get_current_function_mode_stack()
    return [mode for mode in stack if isinstance(mode, CPUDeviceMode)]


def test_redirects_the_cuda_spots_megatron_uses():
    original = torch.cuda.current_device
    with cpu_mode() as active:
        assert active and cpu_mode_active()
        # schedules.py: total_num_tokens
        assert torch.zeros([], dtype=torch.int, device="cuda").device.type == "cpu"
        # p2p_communication.py: receive buffers and shape tensors
        assert torch.empty((3,), device=torch.cuda.current_device()).device.type == "cpu"
        assert torch.tensor([1, 2], device=torch.device("cuda", 0)).device.type == "cpu"
        torch.cuda.synchronize()
        # language_module.py: tied embedding copy on the last stage
        weight = torch.ones(2)
        assert weight.cuda() is weight
        # Calls without a CUDA device are untouched.
        assert torch.equal(torch.arange(3) * 2, torch.tensor([0, 2, 4]))
    assert torch.cuda.current_device is original
    assert not cpu_mode_active() and not _modes()


def test_is_reentrant_and_undone_on_error():
    original = (torch.cuda.current_device, torch.cuda.synchronize)
    with pytest.raises(RuntimeError, match="boom"):
        with cpu_mode():
            with cpu_mode():
                assert len(_modes()) == 1, "nested blocks share one mode"
                raise RuntimeError("boom")
    assert (torch.cuda.current_device, torch.cuda.synchronize) == original
    assert not _modes()


def test_mode_is_per_thread_and_stand_ins_are_counted():
    original = torch.cuda.current_device
    seen = {}
    inside = threading.Event()
    leave = threading.Event()

    def other_thread():
        with cpu_mode():
            inside.set()
            leave.wait(10)

    thread = threading.Thread(target=other_thread)
    thread.start()
    inside.wait(10)
    seen["main_active"] = cpu_mode_active()
    with cpu_mode():
        pass
    seen["still_installed"] = torch.cuda.current_device() == 0  # other thread still inside
    leave.set()
    thread.join(10)
    assert seen == {"main_active": False, "still_installed": True}
    assert torch.cuda.current_device is original  # restored when the last block exited


def test_megatron_rng_and_te_names_have_stand_ins_only_inside():
    """NOTE [CPU mode] 5 and 6: what ``CheckpointWithoutOutput`` reads on a machine
    without CUDA and without Transformer Engine."""
    from megatron.core.tensor_parallel import random as megatron_random

    original = megatron_random._get_cuda_rng_state, megatron_random._set_cuda_rng_state
    te_names = ("FP8GlobalStateManager", "activation_recompute_forward", "fp8_autocast")
    before = {name: hasattr(megatron_random, name) for name in te_names}
    with cpu_mode():
        states = megatron_random._get_all_rng_states()  # reads the CUDA generator's state
        megatron_random._set_all_rng_states(*states)
        assert states[1].numel() == 0
        if not megatron_random.HAVE_TE:
            assert megatron_random.FP8GlobalStateManager.is_fp8_enabled() is False
            with megatron_random.fp8_autocast(enabled=False, fp8_recipe=None):
                pass
            with megatron_random.activation_recompute_forward(activation_recompute=True, recompute_phase=True):
                pass
    assert (megatron_random._get_cuda_rng_state, megatron_random._set_cuda_rng_state) == original
    assert {name: hasattr(megatron_random, name) for name in te_names} == before


def test_is_a_noop_when_cuda_is_available(monkeypatch):
    monkeypatch.setattr(cpu_mode_module, "cuda_usable", lambda: True)
    original = torch.cuda.current_device
    with cpu_mode() as active:
        assert active is False
        assert torch.cuda.current_device is original and not _modes()


@pytest.fixture(scope="module")
def world(cpu_only):  # gloo even where CUDA is available
    info = init_parallel(seed=1234)
    yield info
    destroy_parallel()


MODELS = {
    "gpt": (build_gpt, gpt_forward_step, GPTModel, {}),
    "bert": (build_bert, bert_forward_step, BertModel, {}),
    "t5": (build_t5, t5_forward_step, T5Model, {"decoder_seq_length": 16}),
}
SEQ, MBS, NMB, VOCAB = 32, 2, 4, 128


def _train(kind: str, seed: int = 7):
    build, forward_step, _, extra = MODELS[kind]
    torch.manual_seed(seed)
    config = tiny_transformer_config(num_layers=2, hidden_size=64, num_attention_heads=4)
    model = build(config, vocab_size=VOCAB, seq_len=SEQ)
    data = SyntheticData(kind, MBS, SEQ, VOCAB, seed=3, **extra)
    result = run_steps([model], forward_step, data, NMB, SEQ, MBS, steps=2, **extra)
    return model, result


@pytest.mark.parametrize("kind", sorted(MODELS))
def test_stock_model_trains_with_the_stock_schedule(world, kind):
    assert get_forward_backward_func() is forward_backward_no_pipelining
    model, result = _train(kind)
    assert isinstance(model, MODELS[kind][2])
    attentions = [m for m in model.modules() if isinstance(m, CPUCoreAttention)]
    assert len(attentions) == (6 if kind == "t5" else 2)  # T5 decoder: self + cross
    assert [step.shape for step in result.losses] == [torch.Size([NMB])] * 2
    assert all(torch.isfinite(step).all() for step in result.losses)
    assert not torch.equal(result.losses[0], result.losses[1]), "SGD step changed nothing"
    names = {name for name, p in model.named_parameters() if p.requires_grad}
    assert set(result.grads) == names
    assert all(torch.isfinite(g).all() for g in result.grads.values())


@pytest.mark.e2e
def test_selective_recompute_with_output_discarding_runs_and_changes_nothing(world):
    """``recompute_modules=["layernorm"]`` (megatron's ``CheckpointWithoutOutput``, NOTE
    [CPU mode] 5 and 6), dropout on: losses and gradients equal the run without it."""
    def train(**overrides):
        torch.manual_seed(7)
        config = tiny_transformer_config(num_layers=2, hidden_size=64, num_attention_heads=4, hidden_dropout=0.1,
                                         **overrides)
        model = build_gpt(config, vocab_size=VOCAB, seq_len=SEQ)
        data = SyntheticData("gpt", MBS, SEQ, VOCAB, seed=3)
        return model, run_steps([model], gpt_forward_step, data, NMB, SEQ, MBS, steps=2)

    _, plain = train()
    model, selective = train(recompute_granularity="selective", recompute_modules=["layernorm"])
    assert all(layer.recompute_input_layernorm and layer.recompute_pre_mlp_layernorm for layer in model.decoder.layers)
    assert all(torch.equal(a, b) for a, b in zip(plain.losses, selective.losses, strict=True))
    assert [n for n in plain.grads if not torch.equal(plain.grads[n], selective.grads[n])] == []


@pytest.mark.parametrize("kind", sorted(MODELS))
def test_two_runs_are_bit_identical(world, kind):
    _, first = _train(kind)
    _, second = _train(kind)
    assert all(torch.equal(a, b) for a, b in zip(first.losses, second.losses))
    assert first.grads.keys() == second.grads.keys()
    assert all(torch.equal(first.grads[n], second.grads[n]) for n in first.grads)


@pytest.mark.parametrize("kind", sorted(MODELS))
def test_a_bf16_model_holds_every_parameter_and_buffer_in_bf16(world, kind):
    """megatron-core's torch fallback norms ignore ``params_dtype``; the builders cast the whole
    model, as Megatron-LM's ``Float16Module`` does (on CUDA a float32 norm output meets a bf16
    linear weight: "expected mat1 and mat2 to have the same dtype"). It then trains."""
    build, forward_step, _, extra = MODELS[kind]
    torch.manual_seed(7)
    config = tiny_transformer_config(num_layers=2, hidden_size=64, num_attention_heads=4,
                                     params_dtype=torch.bfloat16)
    model = build(config, vocab_size=VOCAB, seq_len=SEQ)
    floating = [(n, t.dtype) for n, t in [*model.named_parameters(), *model.named_buffers()] if t.is_floating_point()]
    assert floating and [(n, d) for n, d in floating if d != torch.bfloat16] == []
    data = SyntheticData(kind, MBS, SEQ, VOCAB, seed=3, **extra)
    result = run_steps([model], forward_step, data, NMB, SEQ, MBS, steps=1, **extra)
    assert all(torch.isfinite(step).all() for step in result.losses)

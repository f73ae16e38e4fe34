"""Megatron's pipeline schedules over gloo: 1F1B and interleaved equal no pipelining exactly.

One pair of processes runs every layout in turn (process start-up and imports dominate the
cost): the same tiny GPT, the same seeds and data, two SGD steps of four micro-batches.

- no pipelining (both ranks run the whole model: data-parallel size 2, no grad reduction);
- 1F1B with pipeline size 2, interleaved with pipeline size 2 and 2 virtual stages: each
  stage copies its weights from the whole model (``load_from_full_model``), since stages
  built alone draw different initial values. With untied embeddings every gradient is
  accumulated in the same order as without pipelining, so losses and gradients are
  bit-identical;
- tied embeddings with either pipeline schedule: the tied weight's gradient is the sum of the first stage's
  and the last stage's parts (all-reduced), where the single model adds the two parts per
  micro-batch; the float sums differ in the last bits, so only the first step's losses are
  exact and the rest is compared with a tolerance;
- tensor parallel size 2: row-parallel layers sum partial products across ranks, so
  results are close, not identical.

Everything runs on CPU tensors over gloo, on a GPU machine too (NOTE [Hidden CUDA]: the
``cpu_only`` fixture, and each spawned child hides CUDA itself).
"""

from __future__ import annotations

import os

import pytest
import torch
from megatron.core import parallel_state

from megatron_ssd.errors import ConfigError, MegatronSSDError
from megatron_ssd.workloads.harness import SyntheticData, gpt_forward_step, run_steps
from megatron_ssd.megatron.cpu_mode import hide_cuda
from megatron_ssd.workloads.spawn import spawn
from megatron_ssd.workloads.models import (
    build_gpt,
    build_model_chunks,
    single_stage_config,
    tiny_transformer_config,
)
from megatron_ssd.workloads.parallel import destroy_parallel, init_parallel

pytestmark = pytest.mark.usefixtures("cpu_only")

VOCAB, SEQ, MBS, NMB, LAYERS = 128, 32, 2, 4, 4


def _run_layout(tp: int, pp: int, vp, tie: bool) -> dict:
    init_parallel(tp, pp, vp, seed=1234)
    try:
        config = tiny_transformer_config(LAYERS, 64, 4)
        whole = build_gpt(
            single_stage_config(config), VOCAB, SEQ, share_embeddings_and_output_weights=tie
        )
        chunks = [whole]
        if pp > 1:
            chunks = build_model_chunks(
                build_gpt, config, VOCAB, SEQ, weights_from=whole,
                share_embeddings_and_output_weights=tie,
            )
        data = SyntheticData("gpt", MBS, SEQ, VOCAB, seed=5)
        result = run_steps(chunks, gpt_forward_step, data, NMB, SEQ, MBS, steps=2)
        return {"losses": result.losses, "grads": result.grads}
    finally:
        destroy_parallel(process_group=False)


LAYOUTS = {
    "none": (1, 1, None, False),
    "1f1b": (1, 2, None, False),
    "interleaved": (1, 2, 2, False),
    "none_tied": (1, 1, None, True),
    "1f1b_tied": (1, 2, None, True),
    "interleaved_tied": (1, 2, 2, True),
    "tp2": (2, 1, None, False),
}


def run_all_layouts() -> dict:
    with hide_cuda():  # a spawned child: gloo and CPU models on any machine
        try:
            return {name: _run_layout(*layout) for name, layout in LAYOUTS.items()}
        finally:
            destroy_parallel()


@pytest.fixture(scope="module")
def results():
    return spawn(run_all_layouts, 2, timeout_s=300)


def _merged(results, layout):
    """Losses of the last pipeline stage (rank 1) and the gradients of both stages."""
    grads = {**results[0][layout]["grads"], **results[1][layout]["grads"]}
    return results[1][layout]["losses"], grads


@pytest.mark.e2e
@pytest.mark.parametrize("layout", ["1f1b", "interleaved"])
def test_pipeline_equals_no_pipelining_exactly(results, layout):
    ref_losses, ref_grads = results[0]["none"]["losses"], results[0]["none"]["grads"]
    losses, grads = _merged(results, layout)
    assert all(t.numel() == 0 for t in results[0][layout]["losses"]), "first stage has no loss"
    assert all(torch.isfinite(t).all() for t in ref_losses)
    assert all(torch.equal(a, b) for a, b in zip(losses, ref_losses, strict=True))
    assert grads.keys() == ref_grads.keys()
    assert [n for n in ref_grads if not torch.equal(grads[n], ref_grads[n])] == []


@pytest.mark.e2e
def test_both_ranks_of_the_reference_agree(results):
    assert all(
        torch.equal(a, b)
        for a, b in zip(results[0]["none"]["losses"], results[1]["none"]["losses"], strict=True)
    )


@pytest.mark.e2e
@pytest.mark.parametrize("layout", ["1f1b_tied", "interleaved_tied"])
def test_tied_embeddings_pipeline(results, layout):
    ref_losses, ref_grads = results[0]["none_tied"]["losses"], results[0]["none_tied"]["grads"]
    losses, grads = _merged(results, layout)
    assert torch.equal(losses[0], ref_losses[0])
    torch.testing.assert_close(losses[1], ref_losses[1], rtol=1e-5, atol=1e-6)
    # The last stage's copy of the tied weight got the same (all-reduced) gradient.
    first_stage_copy = results[0][layout]["grads"]["embedding.word_embeddings.weight"]
    assert torch.equal(grads.pop("output_layer.weight"), first_stage_copy)
    assert grads.keys() == ref_grads.keys()
    for name in ref_grads:
        torch.testing.assert_close(grads[name], ref_grads[name], rtol=1e-4, atol=1e-6)


@pytest.mark.e2e
def test_tensor_parallel_2(results):
    ref_losses, ref_grads = results[0]["none"]["losses"], results[0]["none"]["grads"]
    for rank in (0, 1):
        for step, ref in zip(results[rank]["tp2"]["losses"], ref_losses, strict=True):
            torch.testing.assert_close(step, ref, rtol=1e-5, atol=1e-6)
    # Replicated parameters (layer norms, biases of row-parallel layers) match the whole model.
    norm = "decoder.layers.0.input_layernorm.weight"
    tp_grad = results[0]["tp2"]["grads"][norm]
    torch.testing.assert_close(tp_grad, ref_grads[norm], rtol=1e-4, atol=1e-6)


def _raise_value_error(message: str) -> None:
    raise ValueError(message)


@pytest.mark.e2e
def test_spawn_reports_the_child_traceback():
    with pytest.raises(MegatronSSDError, match=r"(?s)rank 0 failed:.*ValueError: bad input 42"):
        spawn(_raise_value_error, 1, "bad input 42", timeout_s=120)


@pytest.mark.e2e
def test_spawn_reports_a_silent_death():
    with pytest.raises(MegatronSSDError, match="rank 0 exited with code 3 without a result"):
        spawn(os._exit, 1, 3, timeout_s=120)


@pytest.mark.parametrize(
    "kwargs, rule",
    [
        ({"tensor_model_parallel_size": 3}, "multiple of tensor_model_parallel_size"),
        ({"virtual_pipeline_model_parallel_size": 2}, "needs pipeline_model_parallel_size >= 2"),
        ({"pipeline_model_parallel_size": 0}, "must be an integer >= 1"),
        ({"backend": "mpi"}, "backend"),
    ],
)
def test_init_parallel_rejects_bad_layouts(kwargs, rule):
    with pytest.raises(ConfigError, match=rule):
        init_parallel(**kwargs)
    assert not parallel_state.model_parallel_is_initialized()


@pytest.mark.parametrize(
    "overrides, rule",
    [
        ({"batch_p2p_comm": True, "overlap_p2p_comm": False}, "swaps activations and gradients"),
        ({"deallocate_pipeline_outputs": True}, "frees sent activations"),
        ({"sequence_parallel": True, "tensor_model_parallel_size": 2}, "sequence_parallel"),
    ],
)
def test_tiny_config_refuses_what_breaks_on_gloo(overrides, rule):
    layout = {"pipeline_model_parallel_size": 2, "virtual_pipeline_model_parallel_size": 2}
    with pytest.raises(ConfigError, match=rule):
        tiny_transformer_config(4, 64, 4, **{**layout, **overrides})

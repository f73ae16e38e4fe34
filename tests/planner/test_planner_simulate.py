"""simulate(): activation and FLOP estimates, a 1.3B-class GPT, lifetime arithmetic."""

from __future__ import annotations

import json
import math

import pytest

from megatron_ssd.config import Placement
from megatron_ssd.errors import ConfigError
from megatron_ssd.planner import predict
from megatron_ssd.planner.simulate import (
    stage_parameters,
    SimulationSpec,
    drive_lifetime_years,
    layer_activation_bytes,
    layer_forward_flops,
    prediction_error,
    simulate,
    spec_from_overrides,
    stage_profile,
)

# GPT of about 1.3B parameters (24 layers, h = 2048, 16 heads), s = 2048, b = 1
GPT_1_3B = dict(num_layers=24, hidden=2048, heads=16, seq_len=2048, micro_batch=1, vocab=50304)
SBH = 2048 * 1 * 2048


def test_activation_bytes_follow_korthikanti():
    unfused = dict(GPT_1_3B, flash_attention=False)  # the paper's counts, with the s x s scores
    spec = SimulationSpec(**unfused)
    assert layer_activation_bytes(spec) == SBH * (34 + 5 * 16 * 2048 // 2048)  # 478,150,656
    tp2 = SimulationSpec(**unfused, tp=2)
    assert layer_activation_bytes(tp2) == SBH * (10 + 24 // 2 + 5 * 16 * 2048 // (2048 * 2))
    sp2 = SimulationSpec(**unfused, tp=2, sequence_parallel=True)
    assert layer_activation_bytes(sp2) == SBH * 114 // 2
    flash = SimulationSpec(**GPT_1_3B)  # fused attention is the default
    assert layer_activation_bytes(flash) == SBH * 34
    fp32 = SimulationSpec(**unfused, dtype_bytes=4)
    assert layer_activation_bytes(fp32) == 2 * SBH * 114


def test_defaults_are_a_current_gpu_run():
    spec = SimulationSpec()
    assert spec.flash_attention and spec.dtype_bytes == 2 and spec.distributed_optimizer
    assert spec.gpu_flops == 989e12 and spec.gpu_memory_bytes == 80e9  # H100 SXM


def test_context_parallelism_splits_the_sequence():
    """Each of cp GPUs saves the activations of s / cp tokens; its queries still attend to
    all s keys, so only the score FLOPs keep the whole sequence."""
    base = dict(GPT_1_3B, seq_len=32768)
    one, four = SimulationSpec(**base), SimulationSpec(**base, cp=4)
    assert layer_activation_bytes(four) == layer_activation_bytes(one) // 4
    b, h, s = 1, 2048, 32768
    dense = lambda tokens: 24 * b * tokens * h * h  # the projections and the MLP
    scores = lambda queries: 4 * b * queries * s * h  # QK^T and attention x V over all s keys
    assert layer_forward_flops(one) == pytest.approx(dense(s) + scores(s))
    assert layer_forward_flops(four) == pytest.approx(dense(s // 4) + scores(s // 4))
    profile = stage_profile(four)
    # first the embedding's dropout mask for this GPU's tokens (1 byte each), then layer 0
    assert profile.layers[0].site_bytes == [(s // 4) * b * h] and not profile.layers[0].recomputable
    assert profile.layers[1].boundary_bytes == 2 * (s // 4) * b * h


@pytest.mark.parametrize("override, rule", [
    (dict(cp=2, flash_attention=False), r"cp = 2: context parallelism needs flash_attention=true"),
    (dict(cp=3), r"seq_len = 2048: must be a multiple of 2 x cp \(6\)"),
    (dict(cp=0), r"cp = 0: must be a number > 0"),
    (dict(dp=0), r"dp = 0: must be a number > 0"),
])
def test_context_and_data_parallel_rules(override, rule):
    with pytest.raises(ConfigError, match=rule):
        SimulationSpec(**{**GPT_1_3B, **override})


def test_distributed_optimizer_shards_the_optimizer_state_over_dp_and_cp():
    from megatron_ssd.planner.simulate import state_bytes_per_param

    assert state_bytes_per_param(SimulationSpec(**GPT_1_3B)) == 18
    assert state_bytes_per_param(SimulationSpec(**GPT_1_3B, dp=8)) == 6 + 12 / 8
    assert state_bytes_per_param(SimulationSpec(**GPT_1_3B, dp=2, cp=2)) == 6 + 12 / 4
    assert state_bytes_per_param(SimulationSpec(**GPT_1_3B, dp=8, distributed_optimizer=False)) == 18


@pytest.mark.slow
@pytest.mark.parametrize("seq_len, layout", [
    (2048, dict(tp=2, dp=4)),
    (32768, dict(tp=2, cp=2, dp=2)),
    (131072, dict(tp=8, cp=8)),
    (1048576, dict(tp=8, cp=64)),
])
def test_sequences_from_2k_to_1m_are_planned(seq_len, layout):
    result = simulate(spec_from_overrides([f"seq_len={seq_len}", *(f"{k}={v}" for k, v in layout.items())],
                                          model="gpt-7b"))
    assert result.plan.peak_activation_bytes <= result.plan.request.capacity_bytes
    assert result.keep_iteration_s > 0


def test_megatron_cpu_offloading_would_hold_the_saving_in_host_ram_per_node():
    spec = SimulationSpec(**GPT_1_3B, ssd_count=8, gpu_flops=312e12, gpu_memory_bytes=None, gpus_per_node=8)
    result = simulate(spec)
    assert result.memory_saved_bytes > 0
    assert result.cpu_offload_host_bytes_per_node == 8 * result.memory_saved_bytes
    assert result.to_dict()["cpu_offload_host_bytes_per_node"] == 8 * result.memory_saved_bytes
    assert "host RAM per 8-GPU node" in result.summary()


def test_forward_flops_follow_the_standard_count():
    spec = SimulationSpec(**GPT_1_3B)
    expected = 24 * 1 * 2048 * 2048**2 * (1 + 2048 / (6 * 2048))
    assert layer_forward_flops(spec) == pytest.approx(expected)
    assert layer_forward_flops(SimulationSpec(**GPT_1_3B, tp=4)) == pytest.approx(expected / 4)


def test_stage_profile_from_dimensions():
    spec = SimulationSpec(**GPT_1_3B, pp=4, num_microbatches=8, gpu_flops=312e12, mfu=0.5)
    first = stage_profile(spec)
    # the first stage starts with the embedding's tensors (NOTE [Sites outside the layers])
    assert [layer.layer_id for layer in first.layers] == ["embedding", *range(6)]
    assert first.microbatches_in_flight == 4 and first.other_s == 0.0
    forward = 24 * 2048**3 * (1 + 1 / 6) / 156e12
    assert first.layers[1].forward_s == pytest.approx(forward)
    assert first.layers[1].backward_s == pytest.approx(2 * forward)
    last = stage_profile(SimulationSpec(**GPT_1_3B, pp=4, num_microbatches=8, pipeline_rank=3))
    assert last.layers[0].layer_id == 18 and last.microbatches_in_flight == 1
    assert last.other_s > 0  # output layer and loss
    t5 = stage_profile(SimulationSpec(arch="t5", num_layers=2, hidden=512, heads=8, seq_len=256, micro_batch=2))
    assert len(t5.layers) == 5  # the encoder's embedding, 2 encoder and 2 decoder layers
    assert t5.layers[3].saved_bytes > t5.layers[2].saved_bytes  # decoder adds cross-attention


@pytest.mark.slow
def test_gpt_1_3b_simulation_is_plausible():
    spec = SimulationSpec(**GPT_1_3B, flash_attention=True, ssd_count=8, gpu_flops=312e12, mfu=0.45,
                          target_lifetime_years=None)
    result = simulate(spec)
    plan = result.plan
    offloaded = plan.layers_with("offload")
    assert 0 < len(offloaded) < 24
    # the embedding's mask first (the longest window), then layers in forward order; the
    # last layer may add the sites its forward saves early, written before the head's
    # peak (each site leaves memory when its own write ends: NOTE [Memory accounting])
    prefix = offloaded[:-1] if offloaded[-1] == 23 else offloaded
    assert prefix == ["embedding", *range(len(prefix) - 1)]
    last = plan.layers[-1]
    assert last.layer_id == 23 and (last.placement is Placement.KEEP or 0 < last.choice.sites < last.site_count)
    # layers + the embedding's mask and token ids + fp32 softmax of the logits
    assert plan.keep_peak_activation_bytes == 24 * SBH * 34 + SBH + 8 * 2048 + 4 * 2048 * 50304
    assert 0.2 < result.memory_saved_fraction < 1.0
    assert abs(result.overhead_fraction) < 1e-9 and plan.exposed_s == 0.0
    # a step of ~0.13 s and writes bounded by the array's 52 GB/s
    assert 0.05 < result.iteration_s < 0.5
    rate = plan.offloaded_bytes / result.iteration_s
    assert result.write_bytes_per_s_per_gpu == pytest.approx(rate)
    assert 0 < rate < 8 * 6.5e9
    # lifetime by hand: each of 8 drives takes rate / 8 bytes per second all day long
    per_drive_day = rate / 8 * 86400
    assert result.drive_bytes_per_day == pytest.approx(per_drive_day)
    assert result.lifetime_years == pytest.approx(7.0e15 / per_drive_day / 365)
    assert result.ssd_footprint_bytes == plan.offloaded_bytes
    text = result.summary()
    assert "lifetime" in text and "GB/s per GPU" in text and "offload" in text


def test_budget_simulation_uses_the_planner_budget():
    spec = SimulationSpec(**{**GPT_1_3B, "micro_batch": 4}, flash_attention=True, ssd_count=4, memory_budget=10 * 10**9)
    result = simulate(spec)
    assert result.plan.peak_activation_bytes <= 10 * 10**9
    assert result.overhead_fraction >= 0


def test_lifetime_arithmetic_by_hand():
    # 1 GB/s for a whole day is 86.4 TB; a drive rated 86.4 TB x 365 lasts one year
    assert drive_lifetime_years(1e9, 86.4e12 * 365) == pytest.approx(1.0)
    # 12.1 GB/s per GPU, 2 GPUs on 7 drives: 298.7 TB per drive per day
    per_drive_day = 12.1e9 * 2 / 7 * 86400
    assert per_drive_day == pytest.approx(298.7e12, rel=1e-3)
    assert drive_lifetime_years(12.1e9, 218e15, ssd_count=7, gpus_per_array=2) == pytest.approx(
        218e15 / per_drive_day / 365
    )
    assert drive_lifetime_years(1e9, 1e15, duty_cycle=0.5) == pytest.approx(2 * drive_lifetime_years(1e9, 1e15))
    assert drive_lifetime_years(0.0, 1e15) == math.inf


def test_prediction_error():
    assert prediction_error(1.1, 1.0) == pytest.approx(0.1)
    assert prediction_error(0.9, 1.0) == pytest.approx(0.1)
    assert prediction_error(0.0, 0.0) == 0.0
    assert prediction_error(0.01, 0.0) == math.inf
    assert prediction_error(0.01, 0.0, scale=1.0) == pytest.approx(0.01)
    errors = prediction_error({"step_s": 2.0, "exposed_s": 0.1}, {"step_s": 2.2, "exposed_s": 0.1})
    assert errors == {"step_s": pytest.approx(0.2 / 2.2), "exposed_s": 0.0}
    with pytest.raises(ConfigError, match="same keys"):
        prediction_error({"a": 1.0}, {"b": 1.0})


@pytest.mark.parametrize(
    "kwargs, match",
    [
        ({"pp": 5}, r"pp = 5: must divide the layer count \(24\)"),
        ({"arch": "llama"}, "arch = 'llama'"),
        ({"hidden": 2050}, "hidden = 2050: must be a multiple of heads"),
        ({"mfu": 1.5}, r"mfu = 1.5: must be in \[0.001, 1\]"),
        ({"ssd_count": 0}, "ssd_count = 0"),
        ({"pipeline_rank": 1}, "pipeline_rank = 1"),
    ],
)
def test_bad_spec_is_named(kwargs, match):
    with pytest.raises(ConfigError, match=match):
        SimulationSpec(**{**GPT_1_3B, **kwargs})


def test_spec_from_presets_and_overrides():
    spec = spec_from_overrides(["ssd_count=4", "memory_budget=8GiB", "flash_attention=true"], model="gpt-1.3b")
    assert (spec.num_layers, spec.hidden, spec.heads, spec.ssd_count) == (24, 2048, 16, 4)
    assert spec.memory_budget == 8 << 30 and spec.flash_attention is True
    with pytest.raises(ConfigError, match="model = 'gpt-9t'"):
        spec_from_overrides([], model="gpt-9t")
    with pytest.raises(ConfigError, match="unknown key 'ssd_cout'; did you mean 'ssd_count'"):
        spec_from_overrides(["ssd_cout=4"])


def test_result_json_form():
    result = simulate(SimulationSpec(**GPT_1_3B))  # the default 3-year wear bound of 1 drive allows no write
    data = json.loads(json.dumps(result.to_dict()))
    assert data["lifetime_years"] is None and data["write_bytes_per_s_per_gpu"] == 0.0
    assert data["plan"]["schema"] == "megatron_ssd.plan/3"
    assert data["spec"]["hidden"] == 2048


@pytest.mark.slow
def test_gpu_memory_holds_the_plan_under_what_the_model_state_leaves():
    """NOTE [Simulated capacity]: 13B at tp 8, sequence 32k on an 80 GB GPU keeps 87 GB of
    activations without a limit; with the GPU's memory the plan fits what remains."""
    spec = dict(num_layers=40, hidden=5120, heads=40, seq_len=32768, tp=8, flash_attention=True, gpu_flops=989e12,
                ssd_count=4)
    free = simulate(SimulationSpec(**spec, gpu_memory_bytes=None))
    assert free.plan.request.capacity_bytes is None and free.plan.keep_peak_activation_bytes > 80e9
    held = simulate(SimulationSpec(**spec))  # an 80 GB GPU by default
    params = stage_parameters(SimulationSpec(**spec))
    assert params == (40 * (4 + 8) * 5120**2 + 50304 * 5120) // 8
    assert held.plan.request.capacity_bytes == int(80e9 * 0.85 - 18 * params)
    assert held.plan.peak_activation_bytes <= held.plan.request.capacity_bytes
    assert held.plan.goal == "capacity" and "held under the GPU's" in held.summary()


def test_model_state_that_alone_overflows_the_gpu_is_one_clear_error():
    with pytest.raises(ConfigError, match=r"gpu_memory_bytes = 8e\+10: the stage's model state alone takes 231\.1 GB"):
        simulate(SimulationSpec(num_layers=40, hidden=5120, heads=40, gpu_memory_bytes=80e9))


@pytest.mark.slow
def test_target_lifetime_bounds_the_write_rate():
    spec = dict(num_layers=40, hidden=5120, heads=40, ssd_count=4, gpu_flops=312e12, gpu_memory_bytes=None)  # A100
    free = simulate(SimulationSpec(**spec, target_lifetime_years=None))
    assert free.lifetime_years < 0.2 and free.plan.offloaded_bytes > 0
    worn = simulate(SimulationSpec(**spec, target_lifetime_years=3))
    assert worn.plan.write_bytes_per_s <= worn.plan.request.max_write_bytes_per_s
    assert worn.lifetime_years >= 3


@pytest.mark.slow
def test_the_in_flight_bound_reaches_the_model_and_costs_no_hidden_wait():
    """NOTE [In-flight bound]: with the runtime's 256 MiB the plan of a GPT 7B at 32k on
    four drives moves a shorter prefix of every layer, so no forward waits."""
    free = simulate(spec_from_overrides(["ssd_count=4", "target_lifetime_years=null"], model="gpt-7b-32k"))
    bound = simulate(spec_from_overrides(["ssd_count=4", "target_lifetime_years=null", "max_inflight_bytes=256MiB"],
                                         model="gpt-7b-32k"))
    assert free.stage.io.max_inflight_bytes is None and bound.stage.io.max_inflight_bytes == 256 << 20
    timeline = predict(bound.stage, bound.plan.layer_choices)
    assert timeline.write_wait_s == 0.0 and bound.plan.step_s == pytest.approx(bound.plan.keep_step_s)
    assert 0 < bound.plan.offloaded_bytes < free.plan.offloaded_bytes
    with pytest.raises(ConfigError, match=r"SimulationSpec.max_inflight_bytes = 0: must be an integer > 0 bytes or null"):
        spec_from_overrides(["max_inflight_bytes=0"])

"""The tensors saved outside the layers in the planner (NOTE [Sites outside the layers]):
the embedding's plan as a layer before layer 0 that cannot be recomputed, on constructed
profiles (the cache's side: tests/cache/test_outside_sites.py)."""

from __future__ import annotations

import pytest

from megatron_ssd.config import EMBEDDING, Placement
from megatron_ssd.errors import ConfigError
from megatron_ssd.planner import IOProfile, LayerProfile, StageProfile, make_plan, predict, simulate, spec_from_overrides, PlanRequest

GB = 10**9
K, O, R = Placement.KEEP, Placement.OFFLOAD, Placement.RECOMPUTE


def stage(io: IOProfile = IOProfile(GB / 0.035, GB / 0.035), embedding: int = GB // 4) -> StageProfile:
    """An embedding side of ``embedding`` bytes (no compute of its own) before 4 layers of
    1 GB, 10 ms forward and 20 ms backward."""
    first = LayerProfile(EMBEDDING, 0.0, 0.0, embedding, site_bytes=[embedding], recomputable=False)
    return StageProfile(layers=[first] + [LayerProfile(i, 0.010, 0.020, GB) for i in range(4)], io=io)


def test_recompute_is_refused_for_a_layer_that_cannot_be_recomputed():
    with pytest.raises(ConfigError, match=r"'recompute' for layers \['embedding'\]: they are not recomputable"):
        predict(stage(), [R, K, K, K, K])
    with pytest.raises(ConfigError, match=r"recomputable = 'no': must be true or false"):
        LayerProfile(EMBEDDING, 0.0, 0.0, 1, recomputable="no")
    s = stage()
    assert StageProfile.from_json(s.to_json()) == s


def test_fixed_modes_keep_the_tensors_outside_the_layers():
    s = stage()
    assert s.fixed(O) == [K, O, O, O, O]
    assert s.fixed(O, keep_last=1) == [K, O, O, O, K]
    assert s.fixed(R) == [K, R, R, R, R] and s.fixed(O, keep_last=9) == [K] * 5


def test_the_embedding_has_the_longest_window_and_is_offloaded_first():
    """Its write runs beside layer 0's forward and its read is due last: with drives too
    slow for any whole layer (35 ms a layer against 20 ms of backward, one layer of
    read-ahead) the embedding's 250 MB still hides, and it lowers the peak."""
    plan = make_plan(stage(), PlanRequest(read_ahead_mode="fixed"))
    assert plan.layers[0].layer_id == EMBEDDING and plan.layers[0].placement is O
    assert all(lp.placement is K for lp in plan.layers[1:])
    assert plan.exposed_s == 0.0 and plan.step_s == pytest.approx(plan.keep_step_s)
    assert plan.peak_activation_bytes == plan.keep_peak_activation_bytes - GB // 4


def test_a_budget_never_recomputes_the_embedding():
    """Tight budget, no drives to speak of: recompute is the only move that helps the
    layers, and the embedding, which cannot take it, stays kept."""
    slow = IOProfile(1e3, 1e3)
    s = stage(io=slow)
    keep = predict(s, [K] * 5).peak_bytes
    plan = make_plan(s, PlanRequest(memory_budget=keep - 2 * GB, read_ahead_mode="fixed"))
    assert plan.layers[0].placement is K
    assert R in [lp.placement for lp in plan.layers[1:]]
    assert plan.peak_activation_bytes <= keep - 2 * GB


@pytest.mark.slow
def test_simulate_puts_the_embedding_mask_on_the_first_stage_only():
    spec = spec_from_overrides(["target_lifetime_years=1"], model="gpt-7b")
    result = simulate(spec)
    first = result.plan.layers[0]
    s, b, h = spec.seq_len, spec.micro_batch, spec.hidden
    assert first.layer_id == EMBEDDING and first.bytes == s * b * h // (spec.tp if spec.sequence_parallel else 1)
    # the first site a 1-year wear bound admits: the embedding's dropout mask, 0.02 GB off the peak
    assert first.placement is O and result.memory_saved_bytes == first.bytes
    assert "stage 0 with 32 layers" in result.summary() and "; embedding: offload" in result.summary()
    last = simulate(spec_from_overrides(["pipeline_rank=3"], model="gpt-70b"))
    assert EMBEDDING not in [lp.layer_id for lp in last.plan.layers]

"""The plan's unit (``LayerChoice``), the one default rule and the policy's eligibility
decisions (NOTE [One placement policy] in ``cache/policy.py``)."""

from __future__ import annotations

import pytest
import torch

from megatron_ssd.cache.policy import PlacementPolicy
from megatron_ssd.config import OffloadConfig
from megatron_ssd.errors import ConfigError
from megatron_ssd.placement import EMBEDDING, HEAD, LayerChoice, Placement, default_placement
from megatron_ssd.planner import IOProfile, LayerProfile, StageProfile

K, O, R = Placement.KEEP, Placement.OFFLOAD, Placement.RECOMPUTE


def _policy(**fields) -> PlacementPolicy:
    policy = PlacementPolicy(OffloadConfig(paths=["/tmp"], **fields), host_available=False)
    policy.layers.extend(range(5))
    return policy


def test_a_layer_choice_is_checked_and_normalised():
    assert LayerChoice.of(3, "offload") == LayerChoice(O)
    assert LayerChoice.of(3, LayerChoice("host", 2, [0, 1])) == LayerChoice(Placement.HOST, 2, (0, 1))  # type: ignore[arg-type]
    assert LayerChoice(O, read_ahead=[2, 1]).read_ahead == (2, 1)  # type: ignore[arg-type]  # as JSON gives it
    assert LayerChoice("offload").placement is O  # type: ignore[arg-type]
    with pytest.raises(ConfigError, match=r"^megatron_ssd: LayerChoice.placement = 'ssd': must be one of"):
        LayerChoice("ssd")  # type: ignore[arg-type]
    assert LayerChoice.from_dict(3, {"placement": "host", "sites": 1, "read_ahead": [0, 2]}) == \
        LayerChoice(Placement.HOST, 1, (0, 2))
    with pytest.raises(ConfigError, match=r"plan\[3\].choice = \{'placement': 'keep'\}: must be a mapping of exactly "
                                          r"\['placement', 'sites', 'read_ahead'\]"):
        LayerChoice.from_dict(3, {"placement": "keep"})
    with pytest.raises(ConfigError, match=r"^megatron_ssd: plan\[3\] = 'ssd': must be one of \['keep', 'offload', "
                                          r"'recompute', 'host'\]$"):
        LayerChoice.of(3, "ssd")
    with pytest.raises(ConfigError, match=r"sites\[3\] = True: must be an integer >= 0 \(sites to move\)"):
        LayerChoice.of(3, LayerChoice(O, sites=True))
    with pytest.raises(ConfigError, match=r"read_ahead\[3\] = 0: must be an integer >= 1 or a non-empty list"):
        LayerChoice.of(3, LayerChoice(O, read_ahead=0))


def test_the_default_rule_keeps_the_outside_sites_and_the_last_layers():
    layers = list(range(5))
    assert [default_placement(i, layers, 2) for i in layers] == [O, O, O, K, K]
    assert [default_placement(i, layers, 0, R) for i in layers] == [R] * 5
    assert [default_placement(i, layers, 9) for i in layers] == [K] * 5
    assert {default_placement(i, layers, 0, O) for i in (EMBEDDING, HEAD, None)} == {K}


def test_the_planner_models_the_default_the_cache_applies():
    """Before: ``StageProfile.fixed`` kept the layers not ``recomputable`` while the cache
    offloads every layer inside the model; both now ask ``default_placement``."""
    ids = [EMBEDDING, 0, 1, 2, 3, 4]
    stage = StageProfile([LayerProfile(i, 1.0, 2.0, 100, recomputable=i not in (EMBEDDING, 2)) for i in ids],
                         IOProfile(1e9, 1e9))
    for keep_last in (0, 1, 2, 7):  # 7: more than the layers (the cache kept only the last one before)
        for placement, default in ((O, None), (R, R), (O, O)):
            policy = _policy(keep_last_layers=keep_last)
            policy.set_plan({}, default)
            expected = stage.fixed(placement, keep_last if default is None else 0)
            assert [policy.layer(i) for i in ids] == expected, (keep_last, placement)


def test_the_plan_is_swapped_whole_default_included():
    policy = _policy(keep_last_layers=1)
    policy.set_plan({0: LayerChoice(O, sites=1, read_ahead=2)}, K)
    assert [policy.layer(i) for i in range(5)] == [O, K, K, K, K]
    assert policy.default is K and policy.read_ahead(0) == 2 and policy.read_ahead(1) == 1
    policy.set_plan({1: "keep"})
    assert [policy.layer(i) for i in range(5)] == [O, K, O, O, K] and policy.default is None
    with pytest.raises(ConfigError, match=r"^megatron_ssd: set_plan\(default=...\) = 'sdd': must be one of"):
        policy.set_plan({}, "sdd")
    with pytest.raises(TypeError):
        policy.state.choices[0] = LayerChoice(K)  # type: ignore[index]  # read-only


def test_the_policy_decides_which_tensors_may_move():
    policy = _policy(min_tensor_bytes=1024)
    assert policy.site_of(1024, unmovable=False, taken=3) == 3
    assert policy.site_of(1023, unmovable=False, taken=3) is None
    assert policy.site_of(1 << 20, unmovable=True, taken=0) is None
    policy.set_plan({0: LayerChoice(O, sites=1), 1: LayerChoice(O, sites=0), 2: "offload"}, Placement.HOST)
    assert [policy.tensor(0, site) for site in (0, 1, None)] == [O, K, K]
    assert [policy.moves(i) for i in range(5)] == [True, False, True, False, False]  # host without a pool: nothing
    weight = torch.nn.Linear(4, 4).weight
    policy.parameters.add(weight.untyped_storage()._cdata)
    assert policy.left_to_autograd(weight.detach()[0])  # a view of a parameter
    assert policy.left_to_autograd(torch.zeros(2, requires_grad=True))
    assert policy.left_to_autograd(torch.empty(2, device="meta"))
    assert not policy.left_to_autograd(torch.zeros(2, requires_grad=True) * 2)

"""The peers' rules as the placement policy runs them (``cache/peer_rules.py``): which
module groups Megatron's fine-grained offloading moves after its warm-up, what
Transformer Engine's first-N-layers rule moves, and when each one's reads are issued."""

from __future__ import annotations

import logging

import pytest

from megatron_ssd.placement import LayerChoice
from megatron_ssd.cache.peer_rules import FineGrainedRule, FirstLayersRule, rule_for
from megatron_ssd.cache.policy import PlacementPolicy
from megatron_ssd.config import OffloadConfig, PeerConfig, Placement, PlannerConfig
from megatron_ssd.errors import ConfigError

LAYERS = [1, 2, 3, 4]
GROUPS = ("attn_norm", "qkv_linear", "core_attn", "attn_proj", "mlp_norm")
BIG = 1 << 20


def _forward(rule, layers=LAYERS, groups=GROUPS, per_group=2, elements=BIG):
    """One micro-batch's forward: every layer's groups, ``per_group`` tensors each, then an
    MLP tensor outside the groups; the placements as {(layer, group): [placement, ...]}."""
    out = {}
    for layer in layers:
        for group in (*groups, "mlp_fc1"):
            for _ in range(per_group):
                out.setdefault((layer, group), []).append(rule.placement(layers, layer, group, elements))
    return out


def test_fine_grained_offloads_everything_while_warming_up_then_keeps_the_last_group_of_each_name():
    rule = FineGrainedRule(GROUPS, fraction=1.0, min_elements=BIG)
    warm = _forward(rule)
    assert all(p == [Placement.HOST] * 2 for (layer, group), p in warm.items() if group in GROUPS)
    assert all(p == [Placement.KEEP] * 2 for (layer, group), p in warm.items() if group == "mlp_fc1")
    assert rule.offloaded is None  # decided when the next forward starts
    steady = _forward(rule)
    moved = {key for key, p in steady.items() if p == [Placement.HOST] * 2}
    assert moved == {(layer, group) for layer in (1, 2, 3) for group in GROUPS}  # layer 4 is the margin
    assert steady[(4, "core_attn")] == [Placement.KEEP] * 2
    # every group is reloaded one layer ahead: K = the 5 margin groups after the last moved one
    assert {rule.read_ahead(LAYERS, layer, None) for layer in (1, 2, 3)} == {1}
    assert rule.read_ahead(LAYERS, 4, None) is None


def test_fine_grained_fraction_counts_groups_and_keeps_the_latest():
    rule = FineGrainedRule(GROUPS, fraction=0.5, min_elements=BIG)
    _forward(rule)
    steady = _forward(rule)
    # 15 eligible groups (layers 1-3); int(15 x 0.5) = 7 kept, the latest: 8 offloaded
    moved = [key for key in rule.groups if steady[key][0] is Placement.HOST]
    assert moved == rule.groups[:8] and len(rule.offloaded) == 8
    assert moved[-1] == (2, "core_attn")
    # K = 7 + 5 kept after the last moved group: position p reloads (p + 12) // 5 layers ahead
    assert rule.group_read_ahead[(1, "attn_norm")] == 2 and rule.group_read_ahead[(1, "mlp_norm")] == 3
    assert rule.read_ahead(LAYERS, 1, None) == 2  # a layer's earliest without a site


def test_fine_grained_zero_fraction_moves_nothing_after_warm_up():
    rule = FineGrainedRule(GROUPS, fraction=0.0, min_elements=BIG)
    _forward(rule)
    assert all(p[0] is Placement.KEEP for p in _forward(rule).values())
    assert rule.read_ahead(LAYERS, 1, None) is None


def test_fine_grained_leaves_small_tensors_unnamed_groups_and_unlisted_modules():
    rule = FineGrainedRule(("core_attn", "attn_proj"), fraction=1.0, min_elements=BIG)
    assert rule.placement(LAYERS, 1, "core_attn", BIG - 1) is Placement.KEEP  # under min_offloaded_tensor_size
    assert rule.placement(LAYERS, 1, "attn_norm", BIG) is Placement.KEEP  # not in offload_modules
    assert rule.placement(LAYERS, 1, None, BIG) is Placement.KEEP
    assert rule.placement(LAYERS, "embedding", "core_attn", BIG) is Placement.KEEP
    assert rule.placement(LAYERS, 1, "core_attn", BIG) is Placement.HOST


def test_fine_grained_a_group_without_large_tensors_is_no_group():
    """Megatron counts only groups with offloaded bytes; one whose tensors are all small
    neither takes the margin nor counts against the fraction."""
    rule = FineGrainedRule(GROUPS, fraction=1.0, min_elements=BIG)
    for _ in range(2):
        for layer in LAYERS:
            for group in GROUPS:
                rule.placement(LAYERS, layer, group, BIG if group != "attn_norm" or layer < 4 else 10)
    assert (4, "attn_norm") not in rule.groups
    assert (3, "attn_norm") not in rule.offloaded  # now the last attn_norm group: the margin
    assert (3, "qkv_linear") in rule.offloaded


def test_fine_grained_reads_use_each_sites_group():
    rule = FineGrainedRule(GROUPS, fraction=0.5, min_elements=BIG)
    for _ in range(2):
        for layer in LAYERS:
            for site, group in enumerate(GROUPS):
                rule.placement(LAYERS, layer, group, BIG, site)
    assert rule.read_ahead(LAYERS, 1, 0) == 2 and rule.read_ahead(LAYERS, 1, 4) == 3


def test_te_offloads_the_first_layers_and_reads_them_l_minus_n_minus_1_ahead():
    rule = FirstLayersRule(num_layers=2, min_elements=1000)
    assert [rule.placement(LAYERS, layer, None, 1000) for layer in LAYERS] == [
        Placement.HOST, Placement.HOST, Placement.KEEP, Placement.KEEP]
    assert rule.placement(LAYERS, 1, "core_attn", 999) is Placement.KEEP
    assert rule.placement(LAYERS, "head", None, 10**9) is Placement.KEEP
    assert rule.read_ahead(LAYERS, 1, None) == 1 and rule.read_ahead(LAYERS, 3, None) is None
    assert FirstLayersRule(num_layers=3).read_ahead(LAYERS, 2, 0) == 0  # N = L - 1: at its own backward


def test_te_refuses_every_layer():
    with pytest.raises(ConfigError, match=r"PeerConfig.num_layers = 4: must be <= 3 \(the model's 4 layers - 1"):
        FirstLayersRule(num_layers=4).placement(LAYERS, 1, None, 10**9)


def test_rule_for_takes_the_peers_own_minimum_unless_given():
    assert rule_for(PeerConfig()) is None and rule_for(None) is None
    fgo = rule_for(PeerConfig(rule="megatron-offload", offload_fraction=0.25, offload_modules=["core_attn"]))
    assert (fgo.min_elements, fgo.fraction, fgo.modules) == (1024 * 1024, 0.25, ("core_attn",))
    te = rule_for(PeerConfig(rule="te-offload", num_layers=3, min_tensor_elements=7))
    assert (te.num_layers, te.min_elements) == (3, 7)
    assert rule_for(PeerConfig(rule="te-offload")).min_elements == 256 * 1024


def _policy(peer):
    config = OffloadConfig(paths=["/tmp"], host_pool_bytes=1 << 20, planner=PlannerConfig(mode="keep"), peer=peer,
                           default_read_ahead=1)
    policy = PlacementPolicy(config, host_available=True)
    policy.layers.extend(LAYERS)
    policy.set_plan({}, Placement.KEEP)  # what the keep mode sets
    return policy


def test_the_policy_asks_the_rule_only_for_offloadable_tensors_the_plan_keeps():
    policy = _policy(PeerConfig(rule="te-offload", num_layers=2, min_tensor_elements=1))
    assert policy.tensor(1, site=0, group=None, elements=10) is Placement.HOST
    assert policy.tensor(1, site=None, group=None, elements=10) is Placement.KEEP  # under min_tensor_bytes
    assert policy.tensor(3, site=0, group=None, elements=10) is Placement.KEEP
    policy.set_plan({1: "offload"}, Placement.KEEP)
    assert policy.tensor(1, site=0, group=None, elements=10) is Placement.OFFLOAD  # the plan wins
    policy.set_plan({}, Placement.KEEP)
    policy.rule_active = False  # a paired keep step
    assert policy.tensor(1, site=0, group=None, elements=10) is Placement.KEEP
    assert policy.read_ahead(1) == 1  # L - N - 1
    policy.set_plan({1: LayerChoice(Placement.KEEP, read_ahead=3)}, Placement.KEEP)  # the tensors the rule moves
    assert policy.read_ahead(1) == 3  # the plan's read-ahead wins
    assert policy.read_ahead(4) == 1  # no say from the rule: default_read_ahead


def test_a_peer_rule_needs_keep_and_a_host_pool():
    with pytest.raises(ConfigError, match=r"PlannerConfig.mode = 'auto': must be keep with peer.rule te-offload"):
        OffloadConfig(paths=["/tmp"], host_pool_bytes=1 << 20, peer=PeerConfig(rule="te-offload"))
    with pytest.raises(ConfigError, match=r"OffloadConfig.host_pool_bytes = 0: must be > 0 with peer.rule"):
        OffloadConfig(paths=["/tmp"], host_pool_bytes=0, planner=PlannerConfig(mode="keep"),
                      peer=PeerConfig(rule="megatron-offload"))
    with pytest.raises(ConfigError, match=r"OffloadConfig.host_pool_bytes = 'auto': must be > 0 with peer.rule .*: "
                                          r"the rule moves tensors to the host tier \(auto is sized when"):
        OffloadConfig(paths=["/tmp"], planner=PlannerConfig(mode="keep"), peer=PeerConfig(rule="megatron-offload"))
    with pytest.raises(ConfigError, match=r"PeerConfig.offload_modules = \['attn_proj'\]: must name core_attn"):
        PeerConfig(offload_modules=["attn_proj"])
    with pytest.raises(ConfigError, match=r"PeerConfig.offload_fraction = 1.5: must be in \[0, 1\]"):
        PeerConfig(offload_fraction=1.5)


@pytest.mark.parametrize("old, new", [("megatron-fine-grained", "megatron-offload"), ("te-cpu-offload", "te-offload")])
def test_a_peers_old_name_is_read_as_its_one_name_with_one_warning(old, new, caplog):
    """Each peer has one name, in the config, in rok and in every table; its name before
    2026-12-07 is still read, with one warning line per process."""
    from megatron_ssd.config import load_config, schema

    schema._WARNED.discard((f"offload.peer.rule={old}", f"offload.peer.rule={new}"))
    with caplog.at_level(logging.WARNING, logger="megatron_ssd"):
        first = load_config(OffloadConfig, None, [f"peer.rule={old}", "planner.mode=keep", "host_pool_bytes=1MiB",
                                                  "paths=[/tmp]"])
        second = PeerConfig(rule=old)
    assert first.peer.rule == second.rule == new
    lines = [r.getMessage() for r in caplog.records if old in r.getMessage()]
    assert lines == [f"megatron_ssd: offload.peer.rule={old} is deprecated; use offload.peer.rule={new}"]

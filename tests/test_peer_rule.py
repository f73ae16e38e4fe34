"""The peers' placement rules decided once (``megatron_ssd/peer_rule.py``): the decisions
themselves, and the runtime rules of ``cache/peer_rules.py`` moving exactly the tensors,
with exactly the read-aheads, that the planner's pricing of the same rule assumes."""

from __future__ import annotations

import pytest

from megatron_ssd.cache.peer_rules import FineGrainedRule, FirstLayersRule
from megatron_ssd.peer_rule import (FGO_MIN_TENSOR_ELEMENTS, FGO_MODULES, TE_MIN_TENSOR_ELEMENTS, fine_grained_choice,
                                    fine_grained_member, first_layers_placement, first_layers_read_ahead)
from megatron_ssd.placement import EMBEDDING, Placement
from megatron_ssd.planner.peers import LayerAnatomy, megatron_offload, te_offload
from megatron_ssd.planner.profile import IOProfile, LayerProfile, StageProfile

MB = 10**6
ROLES = ("attn_norm_input", "qkv_input", "query", "key", "value", "attn_output", "attn_dropout_mask",
         "mlp_norm_input", "fc1_input", "act_input", "fc2_input", "mlp_dropout_mask")
GROUP = {"attn_norm_input": "attn_norm", "qkv_input": "qkv_linear", "query": "core_attn", "key": "core_attn",
         "value": "core_attn", "attn_output": "attn_proj", "mlp_norm_input": "mlp_norm", "fc1_input": "mlp_fc1",
         "act_input": "mlp_fc2", "fc2_input": "mlp_fc2"}
"""The module group the local layer spec saves each role in (None: outside the groups)."""
ANATOMY = LayerAnatomy(ROLES, dtype_bytes=2)
SITES = [(s + 3) * MB for s in range(12)]  # distinct: a moved site is known by its bytes


def test_fine_grained_member_needs_a_listed_group_and_the_minimum_size():
    assert fine_grained_member("core_attn", 1 << 20, FGO_MODULES, FGO_MIN_TENSOR_ELEMENTS)
    assert not fine_grained_member("core_attn", (1 << 20) - 1, FGO_MODULES, FGO_MIN_TENSOR_ELEMENTS)
    assert not fine_grained_member("mlp_fc1", 1 << 30, FGO_MODULES, 0)
    assert not fine_grained_member(None, 1 << 30, FGO_MODULES, 0)


def test_fine_grained_choice_keeps_the_margin_and_the_latest_beyond_the_fraction():
    groups = [(layer, name, True) for layer in (1, 2, 3) for name in ("a", "b")]
    assert fine_grained_choice(groups, 1.0) == {0: 1, 1: 1, 2: 1, 3: 1}  # layer 3 is the margin
    # int(4 x 0.5) = 2 kept: 0 and 1 move, K = 4 groups after group 1
    assert fine_grained_choice(groups, 0.5) == {0: 2, 1: 2}
    assert fine_grained_choice(groups, 0.0) == {}
    held = [(1, "a", True), (1, "b", False), (2, "a", True), (2, "b", True)]
    assert fine_grained_choice(held, 1.0) == {0: 1}  # a group holding nothing never moves


def test_first_layers_placement_and_read_ahead():
    assert [first_layers_placement(i, TE_MIN_TENSOR_ELEMENTS, 2, TE_MIN_TENSOR_ELEMENTS) for i in range(4)] == [
        Placement.HOST, Placement.HOST, Placement.KEEP, Placement.KEEP]
    assert first_layers_placement(0, TE_MIN_TENSOR_ELEMENTS - 1, 2, TE_MIN_TENSOR_ELEMENTS) is Placement.KEEP
    assert first_layers_placement(None, 1 << 30, 2, 0) is Placement.KEEP
    assert first_layers_read_ahead(4, 2) == 1 and first_layers_read_ahead(4, 3) == 0


def _stage(n):
    layers = [LayerProfile(i, 1.0, 2.0, sum(SITES), site_bytes=list(SITES), boundary_bytes=SITES[0])
              for i in range(n)]
    layers.insert(0, LayerProfile(EMBEDDING, 0.0, 0.0, 2 * MB, recomputable=False))
    return StageProfile(layers=layers, io=IOProfile(write_bytes_per_s=1e12, read_bytes_per_s=1e12,
                                                   host_bytes_per_s=1e12))


def _priced(point):
    """Per transformer layer id, ``[(site, read-ahead), ...]`` the pricing moves, in save order."""
    out = {}
    for layer, choice in zip(point.stage.layers, point.choices):
        if choice.placement is Placement.HOST:
            k = len(layer.sites) if choice.sites is None else choice.sites
            ahead = choice.read_ahead if isinstance(choice.read_ahead, tuple) else (choice.read_ahead,) * k
            out[layer.layer_id] = [(SITES.index(b), d) for b, d in zip(layer.sites[:k], ahead[:k])]
    return out


def _run(rule, ids, forwards):
    """Per layer id, ``[(site, read-ahead), ...]`` the runtime rule moves in its last of
    ``forwards`` forwards, each saving every layer's sites in order."""
    for _ in range(forwards):
        out = {}
        for layer in ids:
            for s, nbytes in enumerate(SITES):
                elements = ANATOMY.elements(s, nbytes)
                if rule.placement(ids, layer, GROUP.get(ROLES[s]), elements, s) is Placement.HOST:
                    out.setdefault(layer, []).append(s)
    return {layer: [(s, rule.read_ahead(ids, layer, s)) for s in sites] for layer, sites in out.items()}


@pytest.mark.parametrize("fraction", [1.0, 0.5, 7 / 12, 0.25, 0.0])
@pytest.mark.parametrize("modules, minimum", [(FGO_MODULES, FGO_MIN_TENSOR_ELEMENTS), (("core_attn",), 3 * MB)])
def test_fine_grained_runtime_moves_what_the_pricing_assumes(fraction, modules, minimum):
    stage = _stage(4)
    point = megatron_offload(stage, {i: ANATOMY for i in range(4)}, fraction, modules, transformer_engine=False,
                                  min_tensor_elements=minimum)
    runtime = _run(FineGrainedRule(modules, fraction, minimum), list(range(4)), forwards=2)  # warm-up, then decided
    assert runtime == _priced(point)
    if fraction == 1.0:
        assert sorted(runtime) == [0, 1, 2]  # the last layer's groups are the margin


@pytest.mark.parametrize("num_layers", [1, 2, 3])
@pytest.mark.parametrize("minimum", [TE_MIN_TENSOR_ELEMENTS, 4 * MB])
def test_first_layers_runtime_moves_what_the_pricing_assumes(num_layers, minimum):
    stage = _stage(4)
    point = te_offload(stage, {i: ANATOMY for i in range(4)}, num_layers, minimum)
    runtime = _run(FirstLayersRule(num_layers, minimum), list(range(4)), forwards=1)
    assert runtime == _priced(point)
    assert sorted(runtime) == list(range(num_layers))


def test_each_peer_is_one_descriptor_that_every_part_reads():
    """``peer_rule.PEERS``: each peer has a runtime rule and a pricing keyed by its one
    name, its settings are ``PeerConfig`` fields, its old names read as it, and the
    config, ``rok`` and the plot list exactly these peers."""
    import dataclasses

    from megatron_ssd.cache.peer_rules import RUNTIME, rule_for
    from megatron_ssd.commands import dominance, rok, rok_plot
    from megatron_ssd.config import PeerConfig
    from megatron_ssd.config.schema import _specs
    from megatron_ssd.peer_rule import GROUP_RULES, PEER_BY_NAME, PEER_RULE_ALIASES, PEERS
    from megatron_ssd.planner.peers import PRICING

    names = [p.name for p in PEERS]
    assert set(RUNTIME) == set(PRICING) == set(names) == set(PEER_BY_NAME)
    fields = {f.name for f in dataclasses.fields(PeerConfig)}
    for p in PEERS:
        assert p.swept in p.settings and set(p.settings) <= fields, p
        assert all(PEER_RULE_ALIASES[a] == p.name for a in p.aliases)
        assert rule_for(PeerConfig(rule=p.name)).name == p.name
        assert rule_for(PeerConfig(rule=p.name)).min_elements == p.min_tensor_elements
        assert rok.CURVES[p.name] == f"offload.peer.{p.swept}" and p.name in rok.PEERS and p.name in rok.MATCHED
        assert rok_plot.KINDS[p.name][0] == p.title and p.name in dominance.CURVE_PREFIXES
    assert GROUP_RULES == tuple(p.name for p in PEERS if p.by_group)
    rule_choices = next(r for r in _specs(PeerConfig)["rule"].rules).choices
    assert list(rule_choices) == ["none", *names]

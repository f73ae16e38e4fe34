"""The peers' rules as pricing rules (planner/peers.py): which tensors each rule moves or
frees, when it reads them back, and what the timeline model makes of it, on constructed
stages where the answer can be worked out by hand."""

from __future__ import annotations

import pytest

from megatron_ssd.config import EMBEDDING, Placement
from megatron_ssd.errors import ConfigError
from megatron_ssd.planner.peers import (
    LayerAnatomy,
    full_recompute,
    keep_everything,
    megatron_offload,
    price,
    selective_recompute,
    te_offload,
)
from megatron_ssd.planner.profile import IOProfile, LayerProfile, StageProfile
from megatron_ssd.planner.simulate import layer_anatomy, layer_site_bytes, spec_from_overrides, stage_profile
from megatron_ssd.planner.step_timeline import predict

K, H, R = Placement.KEEP, Placement.HOST, Placement.RECOMPUTE
MB = 10**6
# a flash-attention GPT layer's sites, site s of (s + 3) MB (at least 1.5M 16-bit elements: above both
# peers' minimum sizes), so each is known by its size
ROLES = ("attn_norm_input", "qkv_input", "query", "key", "value", "attn_output", "attn_dropout_mask",
         "mlp_norm_input", "fc1_input", "act_input", "fc2_input", "mlp_dropout_mask")
ANATOMY = LayerAnatomy(ROLES, {"core_attn": 0.25, "mlp": 0.5}, dtype_bytes=2)
SITES = [(s + 3) * MB for s in range(12)]
FAST = IOProfile(write_bytes_per_s=1e12, read_bytes_per_s=1e12, host_bytes_per_s=1e12)


def stage(n=5, io=FAST, with_embedding=False, **fields):
    layers = [LayerProfile(i, 1.0, 2.0, sum(SITES), site_bytes=list(SITES), boundary_bytes=SITES[0])
              for i in range(n)]
    if with_embedding:
        layers.insert(0, LayerProfile(EMBEDDING, 0.0, 0.0, 2 * MB, recomputable=False))
    return StageProfile(layers=layers, io=io, **fields)


def anatomy(st):
    return {layer.layer_id: ANATOMY for layer in st.layers if layer.layer_id != EMBEDDING}


def placements(point):
    return [c.placement for c in point.choices]


def moved(point, i):
    """The roles of the sites layer ``i`` of ``point`` moves to host memory."""
    layer = point.stage.layers[i]
    k = len(layer.sites) if point.choices[i].sites is None else point.choices[i].sites
    return [ROLES[SITES.index(b)] for b in layer.sites[:k]]


@pytest.mark.parametrize("fraction, host_layers, depth", [
    # 5 layers x 3 groups (qkv_linear, core_attn, attn_proj: the TE spec fuses both norms);
    # the last layer's 3 are the margin; int(12 x (1 - f)) of the other 12 are kept
    (1.0, 4, 1),    # 12 offloaded, 3 kept after them: reloaded one layer ahead
    (0.5, 2, 3),    # 6 offloaded, 9 kept after: every reload 3 layers ahead
    (0.25, 1, 4),   # int(9) = 9 kept of 12: 3 offloaded, 12 after: 4 layers ahead
    (0.0, 0, None),
])
def test_fine_grained_counts_groups_keeps_the_last_layer_and_reloads_k_groups_ahead(fraction, host_layers, depth):
    st = stage()
    point = megatron_offload(st, anatomy(st), fraction)
    assert placements(point) == [H] * host_layers + [K] * (5 - host_layers)
    for i in range(host_layers):
        # qkv_linear's two (the fused norm's input and output), core_attn's Q, K, V, attn_proj's input
        assert moved(point, i) == ["attn_norm_input", "qkv_input", "query", "key", "value", "attn_output"]
        assert list(point.choices[i].read_ahead[:6]) == [depth] * 6
    assert price(point).hosted_bytes == host_layers * sum(SITES[:6])


def test_fine_grained_fraction_counts_groups_not_bytes():
    """7 of the 12 eligible groups are layers 0 and 1 and layer 2's first group, whatever
    their bytes: layer 2 moves qkv_linear's two tensors (7 MB), not core attention's
    Q, K, V (18 MB)."""
    st = stage()
    point = megatron_offload(st, anatomy(st), fraction=7 / 12)  # int(12 x 5/12) = 5 kept
    assert placements(point) == [H, H, H, K, K]
    assert moved(point, 2) == ["attn_norm_input", "qkv_input"]
    # 7 offloaded, 8 kept after them: layer 0's three groups reload (0 + 8) // 3 = 2 and
    # (1 + 8) // 3 = (2 + 8) // 3 = 3 layers ahead
    assert list(point.choices[0].read_ahead[:6]) == [2, 2, 3, 3, 3, 3]


def test_fine_grained_local_spec_has_norm_groups_and_honours_the_minimum_size():
    st = stage()
    local = megatron_offload(st, anatomy(st), 1.0, transformer_engine=False)
    assert moved(local, 0) == ["attn_norm_input", "qkv_input", "query", "key", "value", "attn_output",
                               "mlp_norm_input"]  # 5 groups a layer, the last layer's 5 kept: one layer ahead
    assert list(local.choices[0].read_ahead[:7]) == [1, 1, 1, 1, 1, 1, 1]
    small = megatron_offload(st, anatomy(st), 1.0, min_tensor_elements=3 * MB)
    # Q (5 MB) is 2.5M elements, under 3M; K (6 MB) is 3M
    assert moved(small, 0) == ["key", "value", "attn_output"]


def test_fine_grained_refuses_what_megatron_refuses():
    st = stage()
    with pytest.raises(ConfigError, match=r"offload_modules = \['qkv_linear', 'attn_proj'\]: must name core_attn when it names attn_proj"):
        megatron_offload(st, anatomy(st), modules=("qkv_linear", "attn_proj"))
    with pytest.raises(ConfigError, match=r"activation_offload_fraction = 1\.5: must be a number in \[0, 1\]"):
        megatron_offload(st, anatomy(st), 1.5)
    with pytest.raises(ConfigError, match=r"anatomy\[0\] = None: must name the role of each of the layer's 12 sites"):
        megatron_offload(st, {}, 1.0)


def test_moved_sites_keep_their_bytes_and_use_points():
    spec = spec_from_overrides(["host_ram_bytes_per_node=256e9", "gpu_memory_bytes=null"], model="gpt-1.3b")
    st = stage_profile(spec)
    an = {layer.layer_id: layer_anatomy(spec) for layer in st.layers if layer.layer_id != EMBEDDING}
    point = megatron_offload(st, an, 1.0)
    before, after = st.layers[1], point.stage.layers[1]
    assert sorted(zip(before.sites, before.site_use)) == sorted(zip(after.sites, after.site_use))
    moved = set(zip(after.sites[:point.choices[1].sites], after.site_use[:point.choices[1].sites]))
    roles = an[0].site_roles
    expected = {(before.sites[s], before.site_use[s]) for s, r in enumerate(roles)
                if r in ("attn_norm_input", "qkv_input", "query", "key", "value", "attn_output")}
    assert moved == expected


def test_te_offloads_the_first_n_whole_layers_reloading_l_minus_n_minus_1_ahead():
    st = stage(with_embedding=True)
    point = te_offload(st, anatomy(st), 2)
    assert placements(point) == [K, H, H, K, K, K]  # the embedding's tensors are not a layer
    assert [c.sites for c in point.choices[1:3]] == [None, None]
    assert list(point.choices[1].read_ahead) == [2] * 12  # 5 - 2 - 1
    last = te_offload(st, anatomy(st), 4)
    assert list(last.choices[1].read_ahead) == [0] * 12  # N = L - 1: each reload starts at its own backward
    assert price(last).exposed_s > 0 and price(point).exposed_s == 0
    with pytest.raises(ConfigError, match=r"num_layers = 5: must be an integer in \[1, 4\]"):
        te_offload(st, anatomy(st), 5)


def test_te_with_pipelining_is_refused_as_megatron_refuses_it():
    st = stage(pipeline_size=2)
    point = te_offload(st, anatomy(st), 2)
    assert "Pipeline parallelism" in point.refused
    with pytest.raises(ConfigError, match="not priced, Megatron refuses it"):
        price(point)


def test_full_recompute_is_every_layer_or_the_first_block():
    st = stage(with_embedding=True)
    assert placements(full_recompute(st)) == [K] + [R] * 5
    assert placements(full_recompute(st, 2)) == [K, R, R, K, K, K]


def test_selective_core_attention_with_fused_attention_frees_nothing_and_costs_its_forward():
    st = stage(io=IOProfile(1e12, 1e12))
    keep = price(keep_everything(st))
    point = selective_recompute(st, anatomy(st), ("core_attn",))
    tl = price(point)
    assert tl.peak_bytes == keep.peak_bytes
    assert tl.step_s == pytest.approx(keep.step_s + 5 * 0.25 * 1.0)


def test_selective_mlp_frees_fc1_activation_and_fc2_inputs_until_its_backward():
    st = stage(io=IOProfile(1e12, 1e12))
    point = selective_recompute(st, anatomy(st), ("mlp",))
    tl = price(point)
    freed = SITES[8] + SITES[9] + SITES[10]
    held = sum(SITES) - freed
    # at the forward's end every layer holds 9 sites; the last layer's backward brings its 3 back
    assert tl.peak_bytes == 5 * held + freed
    assert tl.step_s == pytest.approx(5 * 3.0 + 5 * 0.5)
    both = price(selective_recompute(st, anatomy(st), ("core_attn", "mlp")))
    assert both.step_s == pytest.approx(5 * 3.0 + 5 * 0.75)
    with pytest.raises(ConfigError, match=r"recompute_modules = \['layernorm'\]: modelled are \['core_attn', 'mlp'\]"):
        selective_recompute(st, anatomy(st), ("layernorm",))


def test_price_is_the_planners_own_replay():
    st = stage()
    point = megatron_offload(st, anatomy(st), 0.5)
    direct = predict(point.stage, point.choices)
    assert price(point).step_s == direct.step_s and price(point).peak_bytes == direct.peak_bytes


def test_simulate_names_every_site():
    for overrides in ([], ["flash_attention=false"]):
        spec = spec_from_overrides(overrides, model="gpt-7b")
        an = layer_anatomy(spec)
        assert len(an.site_roles) == len(layer_site_bytes(spec))
        assert ("softmax_output" in an.site_roles) == ("flash_attention=false" in overrides)
        assert 0 < an.forward_share["core_attn"] < an.forward_share["mlp"] < 1
    t5 = spec_from_overrides([], model="t5-base")
    roles = layer_anatomy(t5, decoder=True).site_roles
    assert "cross_kv_input" in roles and roles.count("query") == 1 and "cross_query" in roles

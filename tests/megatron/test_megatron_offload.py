"""Offload-aware layers + wrapped schedules against megatron-core's stock ones, bit for bit.

Each comparison builds the same tiny model twice from the same seed: once from the stock
local spec run by Megatron's stock schedule, once from ``offload_layer_spec(spec)`` run by
``megatron_ssd.megatron.get_forward_backward_func(cache=...)`` with real files. Losses
and every gradient must be ``torch.equal``; offload must have moved bytes. They compare
CPU tensors over gloo on any machine (NOTE [Hidden CUDA]: the ``cpu_only`` fixture, and
the two-process runs hide CUDA in each child).
"""

from __future__ import annotations

import os

import pytest
import torch
from megatron.core.models.bert.bert_layer_specs import bert_layer_local_spec
from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
from megatron.core.models.T5.t5_spec import decoder_model_with_local_spec, encoder_model_with_local_spec
from megatron.core.transformer.spec_utils import ModuleSpec, build_module
from megatron.core.transformer.transformer_block import TransformerBlockSubmodules

from megatron_ssd import IOConfig, OffloadConfig, Placement, TensorCache
from megatron_ssd.errors import ConfigError, MegatronSSDError
from megatron_ssd.megatron import (
    OffloadTransformerLayer,
    get_forward_backward_func,
    offload_layer_spec,
)
from megatron_ssd.megatron.attention import cpu_layer_spec
from megatron_ssd.workloads.harness import SyntheticData, bert_forward_step, gpt_forward_step, run_steps, t5_forward_step
from megatron_ssd.megatron.cpu_mode import hide_cuda
from megatron_ssd.workloads.spawn import spawn
from megatron_ssd.workloads.models import (
    build_bert,
    build_gpt,
    build_model_chunks,
    build_t5,
    single_stage_config,
    tiny_transformer_config,
)
from megatron_ssd.workloads.parallel import destroy_parallel, init_parallel

pytestmark = pytest.mark.usefixtures("cpu_only")

VOCAB, SEQ, MBS, NMB, LAYERS = 128, 64, 4, 4, 3


def _cache(path: str, **kw) -> TensorCache:
    # A small in-flight bound makes forward wait for writes, so the memory comparison
    # does not depend on how fast this machine's disk is.
    io = IOConfig(max_inflight_bytes=256 * 1024)
    return TensorCache(OffloadConfig(paths=[path], device="cpu", min_tensor_bytes=4096, io=io, **kw))


def _build(kind: str, offload: bool, seed: int = 11):
    torch.manual_seed(seed)
    config = tiny_transformer_config(num_layers=LAYERS, hidden_size=64, num_attention_heads=4)
    wrap = offload_layer_spec if offload else (lambda s: s)
    if kind == "gpt":
        return build_gpt(config, VOCAB, SEQ, layer_spec=wrap(get_gpt_layer_local_spec())), gpt_forward_step, {}
    if kind == "bert":
        return build_bert(config, VOCAB, SEQ, layer_spec=wrap(bert_layer_local_spec)), bert_forward_step, {}
    model = build_t5(
        config,
        VOCAB,
        SEQ,
        layer_spec=wrap(encoder_model_with_local_spec()),
        decoder_layer_spec=wrap(decoder_model_with_local_spec()),
    )
    return model, t5_forward_step, {"decoder_seq_length": 32}


def _run(kind: str, cache=None, plan=None, steps: int = 2):
    model, forward_step, extra = _build(kind, offload=cache is not None)
    data = SyntheticData(kind, MBS, SEQ, VOCAB, seed=3, **extra)
    stats = []
    fb = None
    if cache is not None:
        fb = get_forward_backward_func(cache=cache, on_step=stats.append)
        if plan is not None:
            fb.register_model([model])
            cache.set_plan(plan)
    result = run_steps([model], forward_step, data, NMB, SEQ, MBS, steps=steps, forward_backward_func=fb, **extra)
    return model, result, stats


def _assert_identical(a, b):
    assert len(a.losses) == len(b.losses)
    assert all(torch.equal(x, y) for x, y in zip(a.losses, b.losses))
    assert a.grads.keys() == b.grads.keys()
    assert [n for n in a.grads if not torch.equal(a.grads[n], b.grads[n])] == []


@pytest.fixture(scope="module")
def world(cpu_only):  # gloo even where CUDA is available
    init_parallel(seed=1234)
    yield
    destroy_parallel()


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["gpt", "bert", "t5"])
def test_offload_is_bit_identical_to_stock(world, tmp_path, kind):
    _, stock, _ = _run(kind)
    with _cache(str(tmp_path)) as cache:
        model, offloaded, stats = _run(kind, cache)
        keep_plan = {layer: Placement.KEEP for layer in cache.layer_ids}
    with _cache(str(tmp_path)) as cache:  # a new model has new layers: a fresh cache
        _, kept, keep_stats = _run(kind, cache, plan=keep_plan)
    assert any(isinstance(m, OffloadTransformerLayer) for m in model.modules())
    _assert_identical(offloaded, stock)
    _assert_identical(kept, stock)
    assert len(stats) == 2
    assert all(s.bytes_offloaded > 0 for s in stats)
    assert all(s.bytes_offloaded == 0 for s in keep_stats)
    assert stats[-1].peak_resident_bytes < keep_stats[-1].peak_resident_bytes
    assert os.listdir(tmp_path) == []


def test_t5_layer_ids_are_unique_per_block(world, tmp_path):
    with _cache(str(tmp_path)) as cache:
        _run("t5", cache, steps=1)
        ids = cache.layer_ids
    assert ids == [f"encoder.{i}" for i in range(1, LAYERS + 1)] + [f"decoder.{i}" for i in range(1, LAYERS + 1)]


def test_mixed_placements_are_bit_identical(world, tmp_path):
    _, stock, _ = _run("gpt")
    plan = {1: Placement.OFFLOAD, 2: Placement.RECOMPUTE, 3: Placement.KEEP}
    with _cache(str(tmp_path)) as cache:
        _, mixed, stats = _run("gpt", cache, plan=plan)
        per_layer = stats[-1].layers
    _assert_identical(mixed, stock)
    assert per_layer[1].offloaded_bytes > 0
    assert per_layer[2].saved_bytes < per_layer[3].saved_bytes, "a recomputed layer saves (almost) nothing"
    assert per_layer[3].offloaded_bytes == 0


def test_host_tier_through_megatron_layers_is_bit_identical(world, tmp_path):
    """The host tier (``Placement.HOST``) beside SSD offload and recompute, through
    megatron-core's schedule and ``OffloadTransformerLayer``."""
    _, stock, _ = _run("gpt")
    plan = {1: Placement.HOST, 2: Placement.RECOMPUTE, 3: Placement.OFFLOAD}
    with _cache(str(tmp_path), host_pool_bytes=64 << 20) as cache:
        _, mixed, stats = _run("gpt", cache, plan=plan)
        host_left = cache.host.stats().extra["host_bytes"]
    _assert_identical(mixed, stock)
    per_layer = stats[-1].layers
    assert per_layer[1].hosted_bytes > 0 and per_layer[1].offloaded_bytes == 0
    assert per_layer[3].offloaded_bytes > 0 and per_layer[3].hosted_bytes == 0
    assert all(s.bytes_to_host > 0 and s.backpressure_keeps == 0 for s in stats)
    assert host_left == 0


def test_refuses_megatron_own_offloading(world, tmp_path):
    model, forward_step, _ = _build("gpt", offload=True)
    model.config.cpu_offloading = True
    with _cache(str(tmp_path)) as cache:
        fb = get_forward_backward_func(cache=cache)
        with pytest.raises(ConfigError, match=r"TransformerConfig.cpu_offloading = True"):
            fb.register_model([model])


@pytest.mark.parametrize(
    "overrides, shown",
    [
        ({"cuda_graph_impl": "local"}, "cuda_graph_impl = 'local'"),
        ({"enable_cuda_graph": True}, "cuda_graph_impl = 'local'"),  # __post_init__ turns it into local
    ],
)
def test_offload_layers_refuse_cuda_graphs_when_built(world, overrides, shown):
    config = tiny_transformer_config(num_layers=LAYERS, hidden_size=64, num_attention_heads=4, **overrides)
    spec = cpu_layer_spec(offload_layer_spec(get_gpt_layer_local_spec()))
    with pytest.raises(ConfigError, match=rf"^megatron_ssd: TransformerConfig\.{shown}: CUDA graph replay"):
        build_module(spec, config=config, layer_number=1)


@pytest.mark.parametrize(
    "field, value",
    [("cuda_graph_impl", "transformer_engine"), ("cuda_graph_impl", "full_iteration"),
     ("enable_cuda_graph", True), ("external_cuda_graph", True)],
)
def test_schedule_refuses_cuda_graphs_before_a_step(world, tmp_path, field, value):
    model, _, _ = _build("gpt", offload=True)
    setattr(model.config, field, value)  # set after the layers were built
    calls = []
    with _cache(str(tmp_path)) as cache:
        fb = get_forward_backward_func(cache=cache)
        with pytest.raises(ConfigError, match=rf"^megatron_ssd: TransformerConfig\.{field} = {value!r}: .*cuda_graph_impl='none'"):
            fb(forward_step_func=lambda *a: calls.append(a), data_iterator=iter([]), model=[model],
               num_microbatches=1, seq_length=SEQ, micro_batch_size=MBS)
        assert calls == [] and cache.open_records == []


def test_offload_layer_spec_accepts_block_specs_and_rejects_others():
    layer = get_gpt_layer_local_spec()
    block = TransformerBlockSubmodules(layer_specs=[layer, layer])
    wrapped = offload_layer_spec(block)
    assert [s.module for s in wrapped.layer_specs] == [OffloadTransformerLayer] * 2
    assert block.layer_specs[0].module is not OffloadTransformerLayer, "input left unchanged"
    assert offload_layer_spec(offload_layer_spec(layer)).module is OffloadTransformerLayer
    with pytest.raises(ConfigError, match="must be megatron-core's TransformerLayer"):
        offload_layer_spec(ModuleSpec(module=torch.nn.Linear))  # a spec, but not of a layer
    with pytest.raises(ConfigError, match="must be a ModuleSpec"):
        offload_layer_spec("not a spec")


def test_stock_function_when_no_cache():
    from megatron.core.pipeline_parallel import get_forward_backward_func as stock

    assert get_forward_backward_func() is stock()


def test_step_callback_time_is_in_no_step(tmp_path, monkeypatch):
    """NOTE [Search time]: what the step callback spends (the planner's search) is in
    neither the step it follows nor the next, on a clock the test moves by hand."""
    from types import SimpleNamespace

    from megatron_ssd.cache import accounting
    from megatron_ssd.megatron.schedules import OffloadSchedule

    now = [0.0]
    monkeypatch.setattr(accounting, "time", SimpleNamespace(perf_counter=lambda: now[0], process_time=lambda: now[0]))
    stats = []

    def callback(step_stats):  # a 100 s search between two steps
        stats.append(step_stats)
        now[0] += 100.0

    def inner(**kwargs):  # a 2 s step
        now[0] += 2.0

    with TensorCache(OffloadConfig(paths=[str(tmp_path)])) as cache:
        schedule = OffloadSchedule(inner, cache, on_step=callback)
        for _ in range(3):
            schedule(forward_step_func=None, model=torch.nn.Linear(2, 2))
    assert [s.wall_s for s in stats] == [2.0, 2.0, 2.0]
    assert [s.cpu_s for s in stats] == [2.0, 2.0, 2.0]


# ------------------------------------------------------------------ two gloo processes

LAYOUTS = {"1f1b": (1, 2, None), "interleaved": (1, 2, 2), "tp2": (2, 1, None), "dp2": (1, 1, None)}


def _layout_run(tp: int, pp: int, vp, path) -> dict:
    init_parallel(tp, pp, vp, seed=1234, timeout_s=90.0)  # a hung send fails in 90 s, not 300
    try:
        out = {}
        for offload in (False, True):
            config = tiny_transformer_config(4, 64, 4)
            torch.manual_seed(11)
            whole = build_gpt(single_stage_config(config), VOCAB, SEQ, share_embeddings_and_output_weights=False)
            spec = offload_layer_spec(get_gpt_layer_local_spec()) if offload else None
            if pp > 1:
                chunks = build_model_chunks(
                    build_gpt, config, VOCAB, SEQ, weights_from=whole, share_embeddings_and_output_weights=False,
                    layer_spec=spec,
                )
            else:
                torch.manual_seed(11)
                chunks = [build_gpt(config, VOCAB, SEQ, share_embeddings_and_output_weights=False, layer_spec=spec)]
            data = SyntheticData("gpt", MBS, SEQ, VOCAB, seed=5)
            cache, stats = None, []
            fb = None
            if offload:
                cache = TensorCache(OffloadConfig(paths=[path], device="cpu", min_tensor_bytes=4096, keep_last_layers=0))
                fb = get_forward_backward_func(cache=cache, on_step=stats.append)
            result = run_steps(chunks, gpt_forward_step, data, NMB, SEQ, MBS, steps=2, forward_backward_func=fb)
            entry = {"losses": result.losses, "grads": result.grads}
            if cache is not None:
                entry["open_records"] = cache.open_records
                entry["offloaded"] = [s.bytes_offloaded for s in stats]
                entry["run_dirs"] = list(cache.engine.paths)
                cache.close()
                entry["left_after_close"] = sorted(os.listdir(path))
            out[offload] = entry
        return out
    finally:
        destroy_parallel(process_group=False)


def run_layouts(path: str) -> dict:
    with hide_cuda():  # a spawned child: gloo and CPU models on any machine
        try:
            return {name: _layout_run(*layout, path) for name, layout in LAYOUTS.items()}
        finally:
            destroy_parallel()


@pytest.fixture(scope="module")
def two_ranks(tmp_path_factory):
    shared = str(tmp_path_factory.mktemp("shared_offload"))  # both ranks get the same path
    try:
        return spawn(run_layouts, 2, shared, timeout_s=400)
    except MegatronSSDError as err:
        # gloo's TCP transport on a loaded 2-core machine once never completed a p2p send of
        # the interleaved schedule (1 of 5 fresh-clone runs: rank 0 timed out in
        # send_backward_recv_backward, in Megatron's schedule, before any offload check).
        # Retry once in fresh processes; a real failure fails both times.
        if "Timed out waiting" not in str(err) and "timed out after" not in str(err):
            raise
        return spawn(run_layouts, 2, shared, timeout_s=400)


@pytest.mark.e2e
@pytest.mark.parametrize("layout", sorted(LAYOUTS))
def test_two_process_layouts_bit_identical(two_ranks, layout):
    for rank in (0, 1):
        stock, offloaded = two_ranks[rank][layout][False], two_ranks[rank][layout][True]
        assert all(torch.equal(a, b) for a, b in zip(stock["losses"], offloaded["losses"], strict=True))
        assert stock["grads"].keys() == offloaded["grads"].keys()
        assert [n for n in stock["grads"] if not torch.equal(stock["grads"][n], offloaded["grads"][n])] == []
        assert all(b > 0 for b in offloaded["offloaded"]), (rank, offloaded["offloaded"])
        assert offloaded["open_records"] == [], "every micro-batch record retired after its backward"
    # Same offload path on both ranks: private, distinct run directories, all removed.
    dirs0, dirs1 = two_ranks[0][layout][True]["run_dirs"], two_ranks[1][layout][True]["run_dirs"]
    assert set(dirs0).isdisjoint(dirs1)
    assert "-r0-" in os.path.basename(dirs0[0]) and "-r1-" in os.path.basename(dirs1[0])
    assert not any(os.path.exists(d) for d in dirs0 + dirs1)

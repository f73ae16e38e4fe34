"""megatron-core's output discarding (selective recompute of ``layernorm``) under the cache.

``CheckpointWithoutOutput`` frees a layer norm's output with ``untyped_storage().resize_(0)``
after ``linear_qkv`` / ``linear_fc1`` saved it, and refills the same storage before
backward (NOTE [Output discarding] in ``megatron_ssd/megatron/discard.py``). A tiny GPT
built with ``recompute_granularity="selective", recompute_modules=["layernorm"]`` is
trained through Megatron's stock schedule and through the offload-aware one; losses and
every gradient must be ``torch.equal``.

- :class:`PausedEngine` holds every write until the test releases it and only then copies
  the source bytes, as a GPU copy stream would run a queued device-to-host copy later: a
  source freed in between is what a GPU would copy from a reused block.
- The real POSIX engine, with a small in-flight bound so that writes are in flight while
  the forward goes on.
- ``Placement.RECOMPUTE`` of layers that discard (NOTE [Output discarding under
  RECOMPUTE] in ``megatron_ssd/megatron/recompute.py``).
"""

from __future__ import annotations

import os
import threading
from typing import List, Optional, Tuple

import pytest
import torch
from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
from megatron.core.tensor_parallel.random import CheckpointWithoutOutput

from megatron_ssd import IOConfig, OffloadConfig, Placement, TensorCache
from megatron_ssd.errors import WriteCancelled
from megatron_ssd.io.base import Engine, EngineStats, Extent, IOFuture, SwapHandle
from megatron_ssd.megatron import discard, get_forward_backward_func, offload_layer_spec
from megatron_ssd.megatron.cpu_mode import cpu_mode
from megatron_ssd.megatron.patching import mark, restore
from megatron_ssd.megatron.recompute import checkpoint_layer
from megatron_ssd.workloads.harness import SyntheticData, gpt_forward_step, run_steps
from megatron_ssd.workloads.models import build_gpt, tiny_transformer_config
from megatron_ssd.workloads.parallel import destroy_parallel, init_parallel

pytestmark = pytest.mark.usefixtures("cpu_only")

VOCAB, SEQ, MBS, NMB, LAYERS = 128, 64, 4, 2, 3
LAYERNORM = dict(recompute_granularity="selective", recompute_modules=["layernorm"])


class PausedEngine(Engine):
    """Keeps blobs in memory; a write reads its source only when :meth:`release` runs.

    A write whose source storage was freed by then is counted in :attr:`freed_sources`
    and stores zeros (a GPU would copy whatever reused the block, with a checksum of
    those same bytes). A cancelled write completes at once with
    :class:`~megatron_ssd.errors.WriteCancelled` on another thread, as a worker would.
    """

    def __init__(self) -> None:
        self.blobs = {}
        self.pending: List[Tuple[IOFuture, SwapHandle, torch.Tensor]] = []
        self.freed_sources = 0
        self.copied = 0
        self.cancelled = 0
        self.reads = 0
        self._lock = threading.Lock()
        self._next = 0

    @property
    def paths(self):
        return ()

    def write(self, src: torch.Tensor, block: bool = True) -> Optional[IOFuture]:
        with self._lock:
            self._next += 1
            handle = SwapHandle(src.numel(), (Extent(0, self._next, src.numel(), 0),))
            future: IOFuture = IOFuture(src.numel())
            future.on_cancel(lambda: self._cancel(future))
            self.pending.append((future, handle, src))
        return future

    def _cancel(self, future: IOFuture) -> None:
        with self._lock:
            found = [p for p in self.pending if p[0] is future]
            self.pending = [p for p in self.pending if p[0] is not future]
            self.cancelled += len(found)
        if found:
            threading.Thread(target=future.set_error, args=(WriteCancelled("paused write cancelled"),)).start()

    def release(self) -> int:
        """Copy and complete every pending write, in submission order."""
        with self._lock:
            done, self.pending = self.pending, []
        for future, handle, src in done:
            if src.untyped_storage().nbytes() < src.storage_offset() + src.numel():
                self.freed_sources += 1
                data = torch.zeros(src.numel(), dtype=torch.uint8)
            else:
                data = src.clone()
            self.copied += 1
            self.blobs[handle.extents[0].offset] = data
            future.set_result(handle)
        return len(done)

    def read(self, handle: SwapHandle, dst: torch.Tensor) -> IOFuture:
        self.reads += 1
        dst[: handle.nbytes].copy_(self.blobs[handle.extents[0].offset])
        return IOFuture.completed(dst, handle.nbytes)

    def alloc(self, nbytes: int, device: torch.device, handle: Optional[SwapHandle] = None) -> torch.Tensor:
        return torch.empty(nbytes, dtype=torch.uint8, device=device)

    def free(self, handle: SwapHandle) -> None:
        self.blobs.pop(handle.extents[0].offset, None)

    def stats(self) -> EngineStats:
        return EngineStats()

    def close(self) -> None:
        self.release()


@pytest.fixture(scope="module")
def world(cpu_only):  # gloo even where CUDA is available
    init_parallel(seed=1234)
    yield
    destroy_parallel()


def _model(offload: bool, **overrides):
    torch.manual_seed(11)
    config = tiny_transformer_config(num_layers=LAYERS, hidden_size=64, num_attention_heads=4, **overrides)
    spec = get_gpt_layer_local_spec()
    return build_gpt(config, VOCAB, SEQ, layer_spec=offload_layer_spec(spec) if offload else spec)


def _train(cache=None, plan=None, forward_step=gpt_forward_step, steps=2, **overrides):
    model = _model(cache is not None, **overrides)
    data = SyntheticData("gpt", MBS, SEQ, VOCAB, seed=3)
    stats: list = []
    fb = None
    if cache is not None:
        fb = get_forward_backward_func(cache=cache, on_step=stats.append)
        fb.register_model([model])
        cache.set_plan(plan or {layer: Placement.OFFLOAD for layer in cache.layer_ids})
    result = run_steps([model], forward_step, data, NMB, SEQ, MBS, steps=steps, forward_backward_func=fb)
    return model, result, stats


def _assert_identical(a, b):
    assert len(a.losses) == len(b.losses) > 0
    assert all(torch.equal(x, y) for x, y in zip(a.losses, b.losses, strict=True))
    assert a.grads.keys() == b.grads.keys() and len(a.grads) > 0
    assert [n for n in a.grads if not torch.equal(a.grads[n], b.grads[n])] == []


def _paused_cache(engine: PausedEngine) -> TensorCache:
    config = OffloadConfig(paths=["/unused"], device="cpu", min_tensor_bytes=4096, return_freed_pages=False)
    return TensorCache(config, engine=engine)


def _released_after_forward(engine: PausedEngine):
    """A forward step that lets the paused writes copy once the model's forward is done:
    after the layer norms' outputs were discarded, before backward."""

    def forward_step(data_iterator, model, *args, **kwargs):
        out = gpt_forward_step(data_iterator, model, *args, **kwargs)
        engine.release()
        return out

    return forward_step


@pytest.fixture(scope="module")
def stock(world):
    """The stock model and schedule, selective recompute of the layer norms."""
    model, result, _ = _train(**LAYERNORM)
    assert all(layer.recompute_input_layernorm and layer.recompute_pre_mlp_layernorm for layer in model.decoder.layers)
    return result


@pytest.mark.e2e
def test_queued_writes_of_a_discarded_output_never_copy_freed_memory(stock):
    engine = PausedEngine()
    with _paused_cache(engine) as cache:
        _, offloaded, stats = _train(cache, forward_step=_released_after_forward(engine), **LAYERNORM)
    _assert_identical(offloaded, stock)
    assert engine.freed_sources == 0
    assert engine.cancelled > 0, "the norms' outputs were queued when Megatron discarded them"
    assert all(s.bytes_discarded > 0 and s.bytes_offloaded > 0 and s.bytes_reloaded > 0 for s in stats)


@pytest.mark.e2e
def test_without_telling_the_cache_a_queued_write_copies_a_freed_storage(stock, monkeypatch):
    """Control for the test above: the discard wrapper's notice is what prevents it."""
    monkeypatch.setattr(discard, "active_cache", lambda: None)
    engine = PausedEngine()
    with _paused_cache(engine) as cache:
        _, offloaded, _ = _train(cache, forward_step=_released_after_forward(engine), steps=1, **LAYERNORM)
    assert engine.freed_sources > 0
    assert any(not torch.equal(offloaded.grads[n], stock.grads[n]) for n in stock.grads)


def test_offload_with_writes_in_flight_is_bit_identical(stock, tmp_path):
    """The real engine; a 256 KiB in-flight bound keeps writes queued during the forward."""
    io = IOConfig(max_inflight_bytes=256 * 1024)
    config = OffloadConfig(paths=[str(tmp_path)], device="cpu", min_tensor_bytes=4096, io=io)
    with TensorCache(config) as cache:
        _, offloaded, stats = _train(cache, **LAYERNORM)
    _assert_identical(offloaded, stock)
    assert all(s.bytes_discarded > 0 and s.bytes_offloaded > 0 for s in stats)
    assert os.listdir(tmp_path) == []


def test_recompute_keep_and_host_placements_are_bit_identical(stock, tmp_path):
    plan = {1: Placement.RECOMPUTE, 2: Placement.KEEP, 3: Placement.HOST}
    config = OffloadConfig(paths=[str(tmp_path)], device="cpu", min_tensor_bytes=4096, host_pool_bytes=64 << 20)
    with TensorCache(config) as cache:
        _, mixed, stats = _train(cache, plan=plan, **LAYERNORM)
    _assert_identical(mixed, stock)
    assert stats[-1].layers[1].saved_bytes < stats[-1].layers[2].saved_bytes, "layer 1 was recomputed"


def test_recompute_placement_without_offload_is_bit_identical(stock, tmp_path):
    """RECOMPUTE beside KEEP only: no write anywhere, so nothing but the bypass of NOTE
    [Output discarding under RECOMPUTE] decides the result."""
    plan = {1: Placement.RECOMPUTE, 2: Placement.KEEP, 3: Placement.RECOMPUTE}
    with TensorCache(OffloadConfig(paths=[str(tmp_path)], device="cpu", min_tensor_bytes=4096)) as cache:
        _, mixed, _ = _train(cache, plan=plan, **LAYERNORM)
    _assert_identical(mixed, stock)


# ------------------------------------------------------------------ the wrappers alone


def _norm_checkpoint(x: torch.Tensor, weight: torch.Tensor):
    """``CheckpointWithoutOutput`` around ``tanh``, its output saved by a matmul and then
    discarded, as a transformer layer does with its layer norm."""
    checkpoint = CheckpointWithoutOutput()
    y = checkpoint.checkpoint(torch.tanh, x)
    out = y @ weight
    checkpoint.discard_output_and_register_recompute(out)
    return checkpoint, y, out


def test_without_a_cache_the_wrappers_are_megatrons_methods(world):
    discard.install()
    assert discard.installed()
    x = torch.randn(8, 16, requires_grad=True)
    weight = torch.randn(16, 4, requires_grad=True)
    with torch.no_grad():
        expected = torch.tanh(x) @ weight
    with cpu_mode():  # NOTE [CPU mode] 5 and 6: megatron's RNG state and TE names
        checkpoint, y, out = _norm_checkpoint(x, weight)
        assert y.untyped_storage().nbytes() == 0, "Megatron's discard ran"
        assert checkpoint.outputs is not None
        out.sum().backward()
    assert y.untyped_storage().nbytes() == y.numel() * 4, "refilled by Megatron's hook"
    assert torch.equal(out.detach(), expected)
    assert torch.equal(weight.grad, torch.tanh(x.detach()).t() @ torch.ones(8, 4))


def test_restore_puts_megatrons_methods_back(monkeypatch):
    names = (discard.START, discard.DISCARD)
    cls = CheckpointWithoutOutput
    megatrons = {name: getattr(cls.__dict__[name], "original", cls.__dict__[name]) for name in names}
    for name in names:  # as before any install (an earlier test may have installed them)
        monkeypatch.setattr(cls, name, megatrons[name])
    assert not discard.installed()
    before = mark()
    discard.install()
    assert discard.installed()
    restore(before)
    assert not discard.installed()
    assert {name: cls.__dict__[name] for name in names} == megatrons


def test_inside_a_recomputed_layer_output_discarding_is_bypassed(world):
    discard.install()
    x = torch.randn(8, 16, requires_grad=True)
    weight = torch.randn(16, 4, requires_grad=True)
    seen = []

    def layer(x):
        checkpoint, y, out = _norm_checkpoint(x, weight)
        seen.append((checkpoint.outputs, y.untyped_storage().nbytes()))
        return out.exp()  # saves a tensor after the discard, as the rest of a layer does

    out = checkpoint_layer(layer, x)
    out.sum().backward()
    assert seen == [(None, 8 * 16 * 4)] * 2, "forward and recompute ran the norm plainly and kept its output"
    y = torch.tanh(x.detach())
    assert torch.equal(weight.grad, y.t() @ (y @ weight.detach()).exp())

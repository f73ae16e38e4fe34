"""Device-agnostic recompute: gradients bit-identical to the plain forward, dropout included.

The same tests run on a GPU machine (nccl, CUDA tensors), where attention dropout draws from
megatron's RNG tracker, so there they also check the tracker replay.
"""

from __future__ import annotations

import contextlib
import sys
import types

import pytest
import torch
import torch.utils.checkpoint as torch_checkpoint
from megatron.core import tensor_parallel
from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
from megatron.core.transformer.spec_utils import build_module

from megatron_ssd.megatron import compat
from megatron_ssd.megatron.attention import cpu_layer_spec
from megatron_ssd.workloads.models import tiny_transformer_config
from megatron_ssd.workloads.parallel import destroy_parallel, init_parallel
from megatron_ssd.megatron.recompute import QuantizationReplay, RNGReplay, checkpoint_layer, checkpoint_module


@pytest.fixture(scope="module")
def world():
    init_parallel()
    yield
    destroy_parallel()


def _layer(dropout: float):
    torch.manual_seed(0)
    config = tiny_transformer_config(1, 64, 4, hidden_dropout=dropout, attention_dropout=dropout)
    return build_module(cpu_layer_spec(get_gpt_layer_local_spec()), config=config, layer_number=1)


def _tracker_snapshot() -> dict:
    """Copies of megatron's RNG tracker states (empty on CPU: nothing forks it there)."""
    return {name: state.clone() for name, state in _tracker().get_states().items()}


def _tracker():
    return tensor_parallel.get_cuda_rng_tracker()


def _run(layer, forward, tracker_states):
    """Forward with fixed seeds, disturb the generators, backward; return output and grads."""
    layer.zero_grad(set_to_none=True)
    device = next(layer.parameters()).device
    x = torch.randn(32, 2, 64, generator=torch.Generator().manual_seed(1))
    x = x.to(device).requires_grad_()
    torch.manual_seed(7)
    if tracker_states:  # on GPU attention dropout draws from the tracker
        _tracker().set_states({name: state.clone() for name, state in tracker_states.items()})
    out, context = forward(layer, x)
    assert context is None
    torch.manual_seed(99)  # backward must not depend on the generators' state now
    (out.float() ** 2).sum().backward()
    grads = {name: p.grad.clone() for name, p in layer.named_parameters()}
    return out.detach(), x.grad, grads


def _plain(layer, x):
    return layer(x, attention_mask=None)


def _recomputed(layer, x):
    return checkpoint_layer(layer.forward, x, attention_mask=None)


def _recomputed_by_keyword(layer, x):
    """As ``TransformerBlock`` calls its layers: every tensor by keyword."""
    return checkpoint_layer(layer.forward, hidden_states=x, attention_mask=None)


@pytest.mark.parametrize("dropout", [0.0, 0.2])
def test_gradients_are_bit_identical(world, dropout):
    layer = _layer(dropout)
    states = _tracker_snapshot()
    plain = _run(layer, _plain, states)
    recomputed = _run(layer, _recomputed, states)
    assert torch.equal(plain[0], recomputed[0])
    assert torch.equal(plain[1], recomputed[1])
    assert plain[2].keys() == recomputed[2].keys()
    assert all(torch.equal(plain[2][n], recomputed[2][n]) for n in plain[2])
    via_module = _run(
        layer, lambda layer, x: checkpoint_module(layer, x, attention_mask=None), states
    )
    assert torch.equal(plain[1], via_module[1])
    by_keyword = _run(layer, _recomputed_by_keyword, states)
    assert torch.equal(plain[1], by_keyword[1])
    assert all(torch.equal(plain[2][n], by_keyword[2][n]) for n in plain[2])


def test_without_rng_replay_dropout_differs(world):
    """Control: the dropout test above really depends on replaying the generator."""
    layer = _layer(0.2)
    states = _tracker_snapshot()
    plain = _run(layer, _plain, states)
    unreplayed = _run(
        layer,
        lambda layer, x: torch_checkpoint.checkpoint(
            layer.forward, x, attention_mask=None, use_reentrant=False, preserve_rng_state=False
        ),
        states,
    )
    assert not torch.equal(plain[1], unreplayed[1])


@pytest.fixture
def tracker_saved():
    """Put megatron's RNG tracker back as it was (on GPU it holds the seeded states)."""
    saved = _tracker_snapshot()
    yield _tracker()
    if saved:
        _tracker().set_states(saved)
    else:
        _tracker().reset()


def test_tracker_states_are_replayed_and_restored(world, tracker_saved):
    forward_state = torch.tensor([1, 2, 3], dtype=torch.uint8)
    tracker_saved.set_states({"model-parallel-rng": forward_state})
    replay = RNGReplay()
    forward_ctx, recompute_ctx = replay.context_fn()
    with forward_ctx:
        pass
    live_state = torch.tensor([9, 9, 9], dtype=torch.uint8)
    tracker_saved.set_states({"model-parallel-rng": live_state})
    with recompute_ctx:
        assert torch.equal(tracker_saved.get_states()["model-parallel-rng"], forward_state)
    assert tracker_saved.get_states()["model-parallel-rng"] is live_state


def test_without_tracker_states_replay_does_nothing(world, tracker_saved):
    tracker_saved.reset()
    replay = RNGReplay()
    _, recompute_ctx = replay.context_fn()
    assert replay.forward_states is None
    with recompute_ctx:
        assert not tracker_saved.get_states()


class _PackRecorder:
    """Saved-tensor hooks that record what they are given (stand-in for a tensor cache)."""

    def __init__(self):
        self.packed = []

    def pack(self, tensor):
        self.packed.append(tensor)
        return tensor

    def unpack(self, tensor):
        return tensor


def test_outer_hooks_see_only_the_positional_inputs(world):
    """NOTE [Recompute and saved-tensor hooks]."""
    layer = _layer(0.0)
    device = next(layer.parameters()).device
    x = torch.randn(32, 2, 64, device=device, requires_grad=True)
    mask = torch.ones(1, 1, 32, 32, dtype=torch.bool, device=device).triu(1)
    recorder = _PackRecorder()
    with torch.autograd.graph.saved_tensors_hooks(recorder.pack, recorder.unpack):
        out, _ = checkpoint_layer(layer.forward, x, attention_mask=mask)
    # torch 2.6 to 2.11 also save a 0-element placeholder leaf that requires grad with the
    # inputs; a cache skips it like a parameter (docs/compatibility.md)
    inputs = [t for t in recorder.packed if not (t.is_leaf and t.requires_grad and t.numel() == 0)]
    assert [t is x for t in inputs] == [True]
    plain = _PackRecorder()
    with torch.autograd.graph.saved_tensors_hooks(plain.pack, plain.unpack):
        layer(x, attention_mask=mask)
    assert len(plain.packed) > 10, "without checkpointing the layer saves many tensors"
    out.sum().backward()
    assert x.grad is not None


# ------------------------------------------------------------------ FP8 under RECOMPUTE


class FakeTransformerEngine:
    """Transformer Engine's quantization state as ``compat.te_quantization`` reads it, in
    modules put into ``sys.modules``; records every context entered. ``layout`` is
    ``"2.9"`` (``quantization.autocast(recipe=)``) or ``"2.8"`` (``fp8.fp8_autocast(fp8_recipe=)``).
    """

    def __init__(self, layout: str):
        self.enabled = False
        self.recipe = None
        self.phase = None  # activation_recompute_forward's recompute_phase while inside one
        self.events = []
        fake = self

        class FP8GlobalStateManager:
            @staticmethod
            def is_fp8_enabled():
                return fake.enabled

            @staticmethod
            def get_fp8_recipe():
                return fake.recipe

        @contextlib.contextmanager
        def activation_recompute_forward(activation_recompute=False, recompute_phase=False):
            saved = fake.phase
            fake.phase = recompute_phase if activation_recompute else None
            fake.events.append(("region", recompute_phase))
            try:
                yield
            finally:
                fake.phase = saved

        @contextlib.contextmanager
        def autocast(enabled=True, recipe=None):
            saved = fake.enabled, fake.recipe
            fake.enabled, fake.recipe = enabled, recipe
            fake.events.append(("autocast", enabled, recipe))
            try:
                yield
            finally:
                fake.enabled, fake.recipe = saved

        self.autocast = autocast
        pytorch = types.ModuleType("transformer_engine.pytorch")
        distributed = types.ModuleType("transformer_engine.pytorch.distributed")
        distributed.activation_recompute_forward = activation_recompute_forward
        self.modules = {
            "transformer_engine": types.ModuleType("transformer_engine"),
            "transformer_engine.pytorch": pytorch,
            "transformer_engine.pytorch.distributed": distributed,
        }
        if layout == "2.9":
            quantization = types.ModuleType("transformer_engine.pytorch.quantization")
            quantization.FP8GlobalStateManager, quantization.autocast = FP8GlobalStateManager, autocast
            self.modules["transformer_engine.pytorch.quantization"] = quantization
        else:
            fp8 = types.ModuleType("transformer_engine.pytorch.fp8")
            fp8.FP8GlobalStateManager = FP8GlobalStateManager
            fp8.fp8_autocast = lambda enabled=True, fp8_recipe=None: autocast(enabled=enabled, recipe=fp8_recipe)
            self.modules["transformer_engine.pytorch.fp8"] = fp8

    def install(self, monkeypatch):
        for name in [n for n in sys.modules if n == "transformer_engine" or n.startswith("transformer_engine.")]:
            monkeypatch.delitem(sys.modules, name)
        for name, module in self.modules.items():
            monkeypatch.setitem(sys.modules, name, module)

    def state(self):
        return self.enabled, self.recipe, self.phase


@pytest.mark.parametrize("layout", ["2.9", "2.8"])
@pytest.mark.parametrize("fp8", [True, False])
def test_recompute_runs_under_the_forward_quantization_state(world, monkeypatch, layout, fp8):
    """NOTE [FP8 under RECOMPUTE]: the recomputation sees the FP8 flag and recipe the
    forward saw, inside TE's recompute region; the backward around it does not."""
    te = FakeTransformerEngine(layout)
    te.install(monkeypatch)
    layer = _layer(0.0)
    device = next(layer.parameters()).device
    x = torch.randn(32, 2, 64, device=device, requires_grad=True)
    seen = []

    def forward(hidden_states):
        seen.append(te.state())
        return layer.forward(hidden_states, attention_mask=None)

    recipe = object()
    with te.autocast(enabled=fp8, recipe=recipe if fp8 else None):
        out, _ = checkpoint_layer(forward, x)
    assert te.state() == (False, None, None)
    (out ** 2).sum().backward()
    expected = recipe if fp8 else None
    assert seen == [(fp8, expected, False), (fp8, expected, True)], "forward, then its recomputation"
    assert te.state() == (False, None, None), "the backward's state is back after the recomputation"
    assert te.events == [
        ("autocast", fp8, expected),  # the test's own, around the forward
        ("region", False),  # the forward, inside TE's recompute region
        ("autocast", fp8, expected),  # the recomputation: the forward's state again
        ("region", True),
    ]


def test_without_transformer_engine_there_is_no_quantization_state(monkeypatch):
    for name in [n for n in sys.modules if n == "transformer_engine" or n.startswith("transformer_engine.")]:
        monkeypatch.delitem(sys.modules, name)
    assert compat.te_quantization() is None
    replay = QuantizationReplay()
    forward_ctx, recompute_ctx = replay.context_fn()
    with forward_ctx, recompute_ctx:
        assert replay.engine is None and replay.enabled is False


@pytest.mark.gpu
@pytest.mark.te
def test_te_fp8_layer_under_recompute_matches_the_plain_layer(world):
    """A Transformer Engine layer run in FP8 (delayed scaling): plain, and recomputed by
    ``checkpoint_layer`` with backward outside the autocast, as a transformer block runs
    its layers. Needs a GPU with FP8 (Hopper or later) and Transformer Engine."""
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_with_transformer_engine_spec

    quantization = compat.te_quantization()
    try:
        from transformer_engine.pytorch.quantization import check_fp8_support
    except ImportError:
        from transformer_engine.pytorch.fp8 import check_fp8_support
    from transformer_engine.common.recipe import DelayedScaling

    available, reason = check_fp8_support()
    if not available:
        pytest.skip(f"FP8 not supported here: {reason}")
    config = tiny_transformer_config(1, 128, 4, fp8="hybrid", params_dtype=torch.bfloat16, bf16=True)
    spec = get_gpt_layer_with_transformer_engine_spec()
    torch.manual_seed(0)
    reference = build_module(spec, config=config, layer_number=1).cuda()
    state = reference.state_dict()

    def run(recompute: bool, replay: bool = True):
        layer = build_module(spec, config=config, layer_number=1).cuda()
        layer.load_state_dict(state)
        x = torch.randn(32, 2, 128, generator=torch.Generator().manual_seed(1)).to("cuda", torch.bfloat16)
        x.requires_grad_()
        with quantization.autocast(True, DelayedScaling()):
            if not recompute:
                out, _ = layer(x, attention_mask=None)
            elif replay:
                out, _ = checkpoint_layer(layer.forward, x, attention_mask=None)
            else:  # control: torch's checkpoint alone recomputes outside FP8
                out, _ = torch_checkpoint.checkpoint(layer.forward, x, attention_mask=None, use_reentrant=False)
        (out.float() ** 2).sum().backward()
        return out.detach(), x.grad, {n: p.grad.clone() for n, p in layer.named_parameters() if p.grad is not None}

    plain, again, recomputed = run(False), run(False), run(True)
    try:
        unreplayed = run(True, replay=False)
    except Exception:  # noqa: BLE001 - TE's FP8 backward may refuse recomputed bf16 tensors outright
        unreplayed = None

    def diff(a, b):
        return max([(a[0].float() - b[0].float()).abs().max().item(), (a[1].float() - b[1].float()).abs().max().item()]
                   + [(a[2][n].float() - b[2][n].float()).abs().max().item() for n in a[2]])

    noise = diff(plain, again)  # 0 unless the attention backward accumulates with atomics
    assert plain[2].keys() == recomputed[2].keys()
    assert diff(plain, recomputed) <= noise
    assert unreplayed is None or diff(plain, unreplayed) > noise, "control: recomputing outside FP8 changes the result"


# ------------------------------------------------------------------ module state under RECOMPUTE


def _live_tensors(exclude: set) -> int:
    """Tensors Python can reach, not counting ``exclude`` (ids) and the layer's own."""
    import gc

    gc.collect()
    return sum(1 for o in gc.get_objects() if torch.is_tensor(o) and id(o) not in exclude and o.numel() >= 64)


class _Stashing(torch.nn.Module):
    """Stores an intermediate on itself, as megatron-core 0.19's TransformerLayer stores
    ``mlp_norm_manager`` (which holds the post-attention residual)."""

    def __init__(self) -> None:
        super().__init__()
        self.linear = torch.nn.Linear(64, 64)

    def forward(self, x):
        self.stash = torch.softmax(self.linear(x), -1) * 2
        if torch.is_grad_enabled() and not hasattr(self, "seen_in_forward"):
            self.seen_in_forward = True
        else:  # the recomputation: an attribute the forward did not set
            self.added_in_recompute = True
        return self.stash.relu()


def test_the_recomputation_leaves_module_attributes_as_it_found_them():
    """NOTE [Module state under RECOMPUTE]: a rebinding made by the recomputation would hold
    the recomputed graph, and every tensor it saved, until the next forward."""
    module = _Stashing()
    x = torch.randn(8, 64, requires_grad=True)
    out = checkpoint_module(module, x)
    forward_stash = module.stash
    out.sum().backward()
    assert module.stash is forward_stash
    assert not hasattr(module, "added_in_recompute") and module.seen_in_forward
    # Control: torch's checkpoint alone keeps the recomputed stash (and its graph).
    control = _Stashing()
    out = torch_checkpoint.checkpoint(control, x, use_reentrant=False)
    forward_stash = control.stash
    out.sum().backward()
    assert control.stash is not forward_stash and control.stash.grad_fn is not None
    assert control.added_in_recompute


@pytest.mark.slow
def test_no_recomputed_tensor_outlives_the_backward_of_a_megatron_layer(world):
    """megatron-core's layer under checkpoint_layer leaves nothing alive after backward that
    the plain layer does not (with torch's checkpoint alone, megatron-core 0.19 keeps the
    recomputed attention probabilities, QKV and MLP inputs)."""
    layer = _layer(0.0)
    keep = {id(t) for t in [*layer.parameters(), *layer.buffers()]}

    def step(forward) -> int:
        layer.zero_grad(set_to_none=True)
        # Tensors alive before the step (other tests' garbage, module caches) are held, so
        # their ids are not reused, and not counted: only what the step leaves counts.
        import gc
        gc.collect()
        before = [o for o in gc.get_objects() if torch.is_tensor(o)]
        x = torch.randn(32, 2, 64, requires_grad=True)
        out, _ = forward(x)
        (out.float() ** 2).sum().backward()
        exclude = keep | {id(p.grad) for p in layer.parameters()} | {id(x), id(x.grad), id(out)} | set(map(id, before))
        return _live_tensors(exclude)

    step(lambda x: layer(hidden_states=x, attention_mask=None))  # warm-up: caches a first forward builds
    plain = step(lambda x: layer(hidden_states=x, attention_mask=None))
    recomputed = step(lambda x: checkpoint_layer(layer.forward, hidden_states=x, attention_mask=None))
    assert recomputed == plain
    if hasattr(layer, "mlp_norm_manager"):  # megatron-core 0.19: the control leaks
        leaked = step(lambda x: torch_checkpoint.checkpoint(layer.forward, hidden_states=x, attention_mask=None,
                                                            use_reentrant=False))
        assert leaked > plain

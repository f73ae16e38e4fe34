"""Offload-aware wrapper of megatron-core's pipeline schedules.

Megatron's own schedules (no pipelining, 1F1B, interleaved) run unchanged; the wrapper
only replaces the ``forward_step_func`` they call with one that opens a tensor-cache
record around each call, i.e. around one micro-batch's forward through one model chunk::

    from megatron_ssd.megatron import get_forward_backward_func
    forward_backward = get_forward_backward_func(cache=cache)   # same call as Megatron's
    losses = forward_backward(forward_step_func=..., data_iterator=..., model=model, ...)
    stats = forward_backward.last_stats                         # this step's StepStats
"""

from __future__ import annotations

import itertools
from typing import Any, Callable, Dict, List, Optional

import torch
from megatron.core import pipeline_parallel

from ..cache import StepStats, TensorCache
from ..errors import ConfigError
from ..peer_rule import GROUP_RULES
from . import compat, discard
from .groups import label_module_groups
from .layer import assign_layer_ids, check_no_cuda_graphs

__all__ = ["OffloadSchedule", "get_forward_backward_func", "set_default_cache", "get_default_cache", "check_no_megatron_offload"]

_DEFAULT_CACHE: Optional[TensorCache] = None


def set_default_cache(cache: Optional[TensorCache]) -> None:
    """Make ``cache`` the one :func:`get_forward_backward_func` uses when given none."""
    global _DEFAULT_CACHE
    _DEFAULT_CACHE = cache


def get_default_cache() -> Optional[TensorCache]:
    """The cache set by :func:`set_default_cache`, or None."""
    return _DEFAULT_CACHE


def check_no_megatron_offload(config: Any) -> None:
    """Refuse megatron-core's own activation offloading next to ours.

    Raises:
        ConfigError: ``cpu_offloading``, ``fine_grained_activation_offloading`` or (0.18+)
            ``moe_paged_stash`` is on.
    """
    for name in ("cpu_offloading", "fine_grained_activation_offloading") + tuple(
        attr for attr, _, _ in compat.CONFLICTING_FLAGS
    ):
        if getattr(config, name, False):
            raise ConfigError(
                f"TransformerConfig.{name} = True: megatron-core's own activation offloading cannot be "
                f"combined with ssd offload; turn one of them off"
            )


# NOTE [Record keys]
# A record holds the tensors one forward_step_func call saves: one micro-batch through one
# model chunk. Its key is (schedule call, chunk index, n-th forward of that chunk in the
# call). Megatron's schedules run each chunk's micro-batches forward in order (1F1B and
# interleaved alike), so the n-th forward of chunk c is micro-batch n of chunk c. The
# backward of a record needs no key: the layers arm prefetch hooks on their outputs at
# forward time, which carry their record, so a backward always reads its own tensors.


class OffloadSchedule:
    """A megatron-core ``forward_backward_func`` with a tensor-cache record per micro-batch.

    Args:
        inner: the function megatron-core's ``get_forward_backward_func`` returned.
        cache: the tensor cache the records go to.
        finish_step: call ``cache.finish_step()`` after each training call (not
            ``forward_only``) and keep the result in :attr:`last_stats`.
        on_step: optional callback receiving each step's :class:`StepStats`; the time it
            takes is in no step's numbers (the cache's step clock starts again when it
            returns, NOTE [Search time] in ``adaptive.py``).
    """

    def __init__(
        self,
        inner: Callable[..., Any],
        cache: TensorCache,
        finish_step: bool = True,
        on_step: Optional[Callable[[StepStats], None]] = None,
    ) -> None:
        self.inner = inner
        self.cache = cache
        self.finish_step = finish_step
        self.on_step = on_step
        self.last_stats: Optional[StepStats] = None
        self._calls = itertools.count()
        self._registered: set = set()
        discard.install()  # NOTE [Output discarding]

    def register_model(self, chunks: List[torch.nn.Module]) -> None:
        """Register the offload-aware layers and the parameters of every model chunk; label
        the layers' module groups when the cache's peer rule reads them."""
        new = [c for c in chunks if id(c) not in self._registered]
        if not new:
            return
        for chunk in new:
            config = getattr(chunk, "config", None)
            if config is not None:
                check_no_megatron_offload(config)
                check_no_cuda_graphs(config)  # NOTE [CUDA graphs] in layer.py
            self.cache.register_parameters(chunk)
            self._registered.add(id(chunk))
        known = set(self.cache.layer_ids)
        found = assign_layer_ids(new)
        layers = [l for l in found if l.layer_id not in known]
        if layers:
            self.cache.register_layers(layers, ids=[l.layer_id for l in layers], install_hooks=False)
        if self.cache.config.peer.rule in GROUP_RULES:  # NOTE [Module groups] in groups.py
            for layer in found:
                if not layer.ssd_module_groups:
                    layer.ssd_module_groups = label_module_groups(layer)

    def __call__(self, *, forward_step_func: Callable[..., Any], model: Any, forward_only: bool = False, **kwargs: Any) -> Any:
        chunks = list(model) if isinstance(model, (list, tuple)) else [model]
        self.register_model(chunks)
        call = next(self._calls)
        forwards: Dict[int, int] = {}

        def forward_step_in_record(data_iterator: Any, chunk: Any, *args: Any, **kw: Any) -> Any:
            index = next((i for i, c in enumerate(chunks) if c is chunk), 0)
            n = forwards.get(index, 0)
            forwards[index] = n + 1
            with self.cache.microbatch((call, index, n)):  # NOTE [Record keys]
                return forward_step_func(data_iterator, chunk, *args, **kw)

        result = self.inner(forward_step_func=forward_step_in_record, model=model, forward_only=forward_only, **kwargs)
        if self.finish_step and not forward_only:
            self.last_stats = self.cache.finish_step()
            if self.on_step is not None:
                self.on_step(self.last_stats)
                self.cache.accountant.restart_step_clock()  # NOTE [Search time] in adaptive.py
        return result


def get_forward_backward_func(
    pp_size: Optional[int] = None,
    vp_size: Optional[int] = None,
    *,
    cache: Optional[TensorCache] = None,
    finish_step: bool = True,
    on_step: Optional[Callable[[StepStats], None]] = None,
    **megatron_kwargs: Any,
) -> Callable[..., Any]:
    """megatron-core's ``get_forward_backward_func``, offload-aware.

    Same arguments and same returned call signature as megatron-core's (including
    0.19's ``schedule_pg_collection=``, see :func:`~.compat.schedule_kwargs`). With no
    cache (none given, none set by :func:`set_default_cache`) it returns Megatron's
    function unchanged. ``finish_step`` and ``on_step`` are :class:`OffloadSchedule`'s.
    """
    lookup = pipeline_parallel.get_forward_backward_func
    inner = lookup(pp_size, vp_size, **compat.schedule_kwargs(lookup, megatron_kwargs))
    cache = cache if cache is not None else _DEFAULT_CACHE
    if cache is None:
        return inner
    return OffloadSchedule(inner, cache, finish_step=finish_step, on_step=on_step)

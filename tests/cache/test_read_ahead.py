"""The cache issues each offloaded layer's read at the read-ahead its plan gives
(NOTE [Write and read issue points]), and training stays bit-identical."""

import copy

import pytest
import torch

from megatron_ssd import OffloadConfig, TensorCache
from megatron_ssd.errors import ConfigError

from tiny_model import TinyGPT, make_batches


def test_the_cache_issues_each_read_at_its_read_ahead(offload_dir):
    torch.manual_seed(0)
    model = TinyGPT(layers=6, hidden=64, seq=64)
    reference = copy.deepcopy(model)
    (batch,) = make_batches(steps=1, microbatches=1, batch=4, seq=64, vocab=256)[0]
    config = OffloadConfig(paths=[offload_dir], min_tensor_bytes=4096, prefetch_layers=1)
    with TensorCache(config) as cache:
        cache.register_layers(model.layers)
        cache.set_plan({i: "offload" for i in range(6)}, read_ahead={0: 4, 2: 3})
        assert cache.read_ahead() == {0: 4, 2: 3}
        issued = []
        real = cache.entries._prefetch
        running = []

        def record_prefetch(record, layer_id, distance):
            issued.append((running[-1], layer_id))
            return real(record, layer_id, distance)

        real_started = cache.entries.backward_started

        def started(record, layer_id):
            running.append(layer_id)
            return real_started(record, layer_id)

        cache.entries._prefetch, cache.entries.backward_started = record_prefetch, started
        with cache.microbatch():
            loss = model(batch)
        loss.backward()
        cache.finish_step()
        with pytest.raises(ConfigError, match=r"read_ahead\[1\] = 0: must be an integer >= 1 or a non-empty list of integers >= 0, one per site"):
            cache.set_plan({}, read_ahead={1: 0})
    reference(batch).backward()
    for a, b in zip(model.parameters(), reference.parameters()):
        assert torch.equal(a.grad, b.grad)
    # layer k is read when the backward of layer k + read_ahead starts (1 by default), needed first:
    # layer 2 (3 ahead) with layer 5, layer 0 (4 ahead) with layer 4; the tensors saved before
    # layer 0 (pseudo-layer "embedding", NOTE [Sites outside the layers]) 1 ahead of layer 0
    assert issued == [(5, 5), (5, 4), (5, 2), (4, 3), (4, 0), (2, 1), (0, "embedding")]

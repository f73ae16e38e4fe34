"""The tensors saved outside the layers in the cache (NOTE [Sites outside the layers]):
before the first layer they belong to pseudo-layer ``embedding``, after a layer to
``head``; both are sites a plan may move, gradients stay bit-identical, and neither can
be recomputed (the planner's side: tests/planner/test_planner_outside.py)."""

import copy

import pytest
import torch
import torch.nn.functional as F

from megatron_ssd.placement import LayerChoice
from megatron_ssd import OffloadConfig, TensorCache
from megatron_ssd.planner.measured_profile import stage_from_stats
from megatron_ssd.config import EMBEDDING, HEAD, Placement
from megatron_ssd.errors import ConfigError

from tiny_model import TinyGPT, make_batches

BATCH, SEQ, HIDDEN = 4, 64, 64
EMB_BYTES = BATCH * SEQ * HIDDEN * 4  # GELU's fp32 input, saved before layer 0


class EmbeddingGPT(TinyGPT):
    """TinyGPT whose embedding side saves an offloadable tensor (GELU keeps its input)."""

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = F.gelu(self.emb(tokens) + self.pos[: tokens.shape[1]])
        for layer in self.layers:
            x = layer(x)
        logits = self.head(self.ln(x))
        return F.cross_entropy(logits[:, :-1].reshape(-1, logits.shape[-1]), tokens[:, 1:].reshape(-1))


def train(model, batches, cache=None, plan=None, drain=False):
    """``drain``: wait for every write before each backward, so no offloaded tensor is
    still in memory when its read is due (else a loaded machine forwards it: NOTE
    [Forwarding])."""
    stats = []
    for microbatches in batches:
        if cache is not None and plan is not None:
            cache.set_plan(plan)
        for batch in microbatches:
            if cache is None:
                model(batch).backward()
                continue
            with cache.microbatch():
                loss = model(batch)
            if drain:
                cache.drain()
            loss.backward()
        if cache is not None:
            stats.append(cache.finish_step())
    return stats


def grads(model):
    return [p.grad.clone() for p in model.parameters()]


@pytest.mark.parametrize("moved", [EMBEDDING, HEAD])
def test_a_plan_moves_the_tensors_outside_the_layers_bit_identically(offload_dir, moved):
    torch.manual_seed(0)
    model = EmbeddingGPT(layers=3, hidden=HIDDEN, seq=SEQ)
    reference = copy.deepcopy(model)
    batches = make_batches(steps=2, microbatches=2, batch=BATCH, seq=SEQ, vocab=256)
    config = OffloadConfig(paths=[offload_dir], min_tensor_bytes=4096, default_read_ahead=1)
    with TensorCache(config) as cache:
        cache.register_layers(model.layers)
        keep = train(model, batches[:1], cache, {0: "keep", 1: "keep", 2: "keep"})[0]
        moved_stats = train(model, batches[1:], cache, {0: "keep", 1: "keep", 2: "keep", moved: "offload"},
                            drain=True)[0]
    train(reference, batches)
    assert [torch.equal(a, b) for a, b in zip(grads(model), grads(reference))] == [True] * len(grads(model))
    emb, head = keep.layers[EMBEDDING], keep.layers[HEAD]
    assert (emb.microbatches, head.microbatches) == (2, 2)
    assert emb.site_bytes == [2 * EMB_BYTES] and emb.small_bytes == 2 * BATCH * SEQ * 8  # + the token ids
    # the final norm's input and output, the logits and the loss's log-softmax
    assert len(head.site_bytes) >= 3 and keep.bytes_offloaded == 0
    layers = moved_stats.layers
    assert layers[moved].offloaded_bytes == layers[moved].saved_bytes > 0
    assert all(layers[i].offloaded_bytes == 0 for i in range(3))
    assert moved_stats.bytes_offloaded == layers[moved].saved_bytes
    # every moved byte came back, by a read or from memory (its write still in flight)
    assert moved_stats.bytes_reloaded + moved_stats.bytes_forwarded == layers[moved].saved_bytes
    if moved == EMBEDDING:  # its read is issued ahead, with layer 0's backward
        assert moved_stats.late_reads == 0 and moved_stats.bytes_reloaded == layers[moved].saved_bytes
    else:  # used first by backward: a head tensor is read only when backward unpacks it
        assert (moved_stats.late_reads > 0) == (moved_stats.bytes_reloaded > 0)


def test_the_profile_plans_the_embedding_before_layer_0_and_the_head_as_head_bytes(offload_dir):
    torch.manual_seed(0)
    model = EmbeddingGPT(layers=2, hidden=HIDDEN, seq=SEQ)
    batches = make_batches(steps=2, microbatches=2, batch=BATCH, seq=SEQ, vocab=256)
    with TensorCache(OffloadConfig(paths=[offload_dir], min_tensor_bytes=4096)) as cache:
        cache.register_layers(model.layers)
        keep = train(model, batches[:1], cache, {0: "keep", 1: "keep"})
        offload = train(model, batches[1:], cache, {0: "offload", 1: "offload"})
    stage = stage_from_stats(keep, offload)
    assert stage.layer_ids == [EMBEDDING, 0, 1]
    first = stage.layers[0]
    assert (first.recomputable, first.site_bytes, first.kept_bytes) == (False, [EMB_BYTES], BATCH * SEQ * 8)
    head = keep[0].layers[HEAD]
    assert stage.head_bytes == (head.saved_bytes + head.small_bytes) // 2 > 0


def test_the_outside_ids_cannot_be_recomputed_or_registered(offload_dir):
    with TensorCache(OffloadConfig(paths=[offload_dir])) as cache:
        with pytest.raises(ConfigError, match=r"plan\['embedding'\] = 'recompute': the tensors saved outside the "
                                              r"layers cannot be recomputed"):
            cache.set_plan({EMBEDDING: "recompute"})
        with pytest.raises(ConfigError, match=r"register_layers: layer id 'head' is reserved"):
            cache.register_layers([torch.nn.Linear(2, 2)], ids=[HEAD])
        assert cache.placement(EMBEDDING) is Placement.KEEP and cache.placement(HEAD) is Placement.KEEP
        cache.set_plan({}, Placement.OFFLOAD)  # a fixed mode moves the layers only
        assert cache.placement(EMBEDDING) is Placement.KEEP
        cache.set_plan({HEAD: LayerChoice(Placement.OFFLOAD, sites=1)})
        assert cache.placement(HEAD) is Placement.OFFLOAD and cache.plan().choices[HEAD].sites == 1

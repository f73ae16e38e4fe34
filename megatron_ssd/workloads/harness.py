"""Run a few training steps through megatron-core's own forward-backward schedules.

:func:`run_steps` is what a Megatron-LM ``train_step`` does, minus the distributed
optimizer: zero the gradients, call the schedule from ``get_forward_backward_func()`` (or
the one given, e.g. a wrapped one to compare against the stock one), collect the
micro-batch losses, apply a plain SGD update. Everything it returns is a tensor computed
by the model, so two runs compare with ``torch.equal``::

    data = SyntheticData("gpt", micro_batch_size=2, seq_length=32, vocab_size=128)
    result = run_steps([model], gpt_forward_step, data, num_microbatches=4,
                       seq_length=32, micro_batch_size=2, steps=2)
    result.losses[1]           # per-micro-batch losses of step 2 (last pipeline stage)
    result.grads["decoder.layers.1.mlp.linear_fc1.weight"]

Gradients are keyed by each parameter's name in the single-stage model (layer ``i`` of a
stage is named by its global layer number), so results of different pipeline layouts can
be merged and compared. :class:`SyntheticData` and the forward-step functions give GPT,
BERT and T5 seeded synthetic batches shaped as Megatron-LM's ``pretrain_*.py`` scripts
give them to the models.
"""

from __future__ import annotations

import dataclasses
import itertools
from functools import partial
from typing import Any, Callable, Iterator, Optional, Sequence

import torch
import torch.distributed as dist
import torch.nn.functional as F
from megatron.core import parallel_state
from megatron.core.pipeline_parallel import get_forward_backward_func
from megatron.core.utils import get_attr_wrapped_model, get_model_config

from ..errors import ConfigError
from ..megatron.cpu_mode import cpu_mode
from .models import global_named_parameters

__all__ = [
    "RunResult",
    "SGD",
    "SyntheticData",
    "bert_forward_step",
    "bert_loss_func",
    "finalize_embedding_grads",
    "gpt_forward_step",
    "gpt_loss_func",
    "run_steps",
    "train_step",
    "t5_forward_step",
    "t5_loss_func",
]


_KINDS = ("gpt", "bert", "t5")


class SyntheticData:
    """Seeded synthetic micro-batches for GPT, BERT or T5, usable as a data-iterator factory.

    ``data(step)`` returns an endless iterator over that step's micro-batches; micro-batch
    ``i`` of step ``s`` depends only on ``(seed, s, i)``, so every pipeline stage, model
    chunk and run sees the same data. Batches are CPU tensors; the forward-step functions
    move them to the model's device.

    Args:
        kind: ``"gpt"``, ``"bert"`` or ``"t5"``.
        micro_batch_size: Sequences per micro-batch.
        seq_length: Sequence length (the encoder's for T5).
        vocab_size: Token ids are drawn from ``[0, vocab_size)``.
        seed: Data seed.
        decoder_seq_length: T5 decoder length; ``seq_length`` when None.
    """

    def __init__(
        self,
        kind: str,
        micro_batch_size: int,
        seq_length: int,
        vocab_size: int,
        seed: int = 0,
        decoder_seq_length: Optional[int] = None,
    ) -> None:
        if kind not in _KINDS:
            raise ConfigError(f"kind ({kind!r}) must be one of {_KINDS}")
        for name, value, least in (
            ("micro_batch_size", micro_batch_size, 1),
            ("seq_length", seq_length, 2),
            ("vocab_size", vocab_size, 2),
        ):
            if value < least:
                raise ConfigError(f"{name} ({value}) must be >= {least}")
        self.kind = kind
        self.micro_batch_size = micro_batch_size
        self.seq_length = seq_length
        self.vocab_size = vocab_size
        self.seed = seed
        self.decoder_seq_length = decoder_seq_length or seq_length

    def __call__(self, step: int) -> Iterator[dict[str, torch.Tensor]]:
        """An endless iterator over the micro-batches of ``step``."""
        return (self.batch(step, index) for index in itertools.count())

    def batch(self, step: int, index: int) -> dict[str, torch.Tensor]:
        """Micro-batch ``index`` of ``step``."""
        generator = torch.Generator().manual_seed(
            ((self.seed * 1_000_003 + step) * 1_000_033 + index) % (2**63)
        )
        return getattr(self, f"_{self.kind}_batch")(generator)

    def _gpt_batch(self, g: torch.Generator) -> dict[str, torch.Tensor]:
        b, s = self.micro_batch_size, self.seq_length
        tokens = torch.randint(0, self.vocab_size, (b, s + 1), generator=g)
        return {
            "input_ids": tokens[:, :-1].contiguous(),
            "labels": tokens[:, 1:].contiguous(),
            "loss_mask": (torch.rand(b, s, generator=g) > 0.1).float(),
            "position_ids": torch.arange(s).unsqueeze(0).expand(b, s).contiguous(),
            # [1, 1, s, s], True = masked, as pretrain_gpt.py builds it.
            "attention_mask": torch.ones(s, s, dtype=torch.bool).triu(1).view(1, 1, s, s),
        }

    def _valid(self, length: int, g: torch.Generator) -> torch.Tensor:
        """``[b, length]``: True for real tokens, each row padded after a random length."""
        lengths = torch.randint(length // 2, length + 1, (self.micro_batch_size, 1), generator=g)
        return torch.arange(length).unsqueeze(0) < lengths

    def _bert_batch(self, g: torch.Generator) -> dict[str, torch.Tensor]:
        b, s = self.micro_batch_size, self.seq_length
        valid = self._valid(s, g)
        second_segment = torch.arange(s).unsqueeze(0) >= valid.sum(1, keepdim=True) // 2
        loss_mask = (torch.rand(b, s, generator=g) < 0.15) & valid
        loss_mask[:, 0] = True
        return {
            "tokens": torch.randint(0, self.vocab_size, (b, s), generator=g),
            "padding_mask": valid.long(),  # 1 = real token, as pretrain_bert.py passes it
            "tokentype_ids": (second_segment & valid).long(),
            "labels": torch.randint(0, self.vocab_size, (b, s), generator=g),
            "loss_mask": loss_mask.float(),
            "sentence_order": torch.randint(0, 2, (b,), generator=g),
        }

    def _t5_batch(self, g: torch.Generator) -> dict[str, torch.Tensor]:
        b, se, sd = self.micro_batch_size, self.seq_length, self.decoder_seq_length
        enc = self._valid(se, g)
        dec = self._valid(sd, g)
        causal = torch.tril(torch.ones(sd, sd, dtype=torch.bool))
        # [b, 1, sq, sk] boolean masks, True = masked (megatron's convention).
        return {
            "encoder_ids": torch.randint(0, self.vocab_size, (b, se), generator=g),
            "decoder_ids": torch.randint(0, self.vocab_size, (b, sd), generator=g),
            "labels": torch.randint(0, self.vocab_size, (b, sd), generator=g),
            "loss_mask": dec.float(),
            "encoder_mask": ~(enc.unsqueeze(1) & enc.unsqueeze(2)).unsqueeze(1),
            "decoder_mask": ~(dec.unsqueeze(1) & dec.unsqueeze(2) & causal).unsqueeze(1),
            "encoder_decoder_mask": ~(enc.unsqueeze(1) & dec.unsqueeze(2)).unsqueeze(1),
        }


def _next_batch(data_iterator: Iterator[dict[str, torch.Tensor]], model: torch.nn.Module):
    device = next(model.parameters()).device
    return {name: t.to(device) for name, t in next(data_iterator).items()}


def gpt_loss_func(loss_mask: torch.Tensor, output_tensor: torch.Tensor):
    """GPT loss as Megatron-LM's ``pretrain_gpt.py``: (sum, token count, report)."""
    mask = loss_mask.view(-1).float()
    loss = torch.sum(output_tensor.view(-1).float() * mask)
    num_tokens = mask.sum().clone().detach().to(torch.int)
    report = {
        "lm loss": torch.cat([loss.clone().detach().view(1), num_tokens.view(1)]),
        "loss": loss.detach() / num_tokens.clamp(min=1),
    }
    return loss, num_tokens, report


def gpt_forward_step(data_iterator, model, checkpoint_activations_microbatch=None):
    """Forward step for ``GPTModel`` on :class:`SyntheticData` ``"gpt"`` batches."""
    del checkpoint_activations_microbatch
    batch = _next_batch(data_iterator, model)
    output = model(
        batch["input_ids"], batch["position_ids"], batch["attention_mask"], labels=batch["labels"]
    )
    return output, partial(gpt_loss_func, batch["loss_mask"])


def bert_loss_func(loss_mask: torch.Tensor, sentence_order: torch.Tensor, output_tensor):
    """BERT loss as Megatron-LM's ``pretrain_bert.py``: masked-LM plus sentence order."""
    lm_loss_, sop_logits = output_tensor
    lm_loss = torch.sum(lm_loss_.view(-1).float() * loss_mask.reshape(-1)) / loss_mask.sum()
    report = {"lm loss": lm_loss.detach().clone()}
    loss = lm_loss
    if sop_logits is not None:
        sop_loss = F.cross_entropy(
            sop_logits.view(-1, 2).float(), sentence_order.view(-1), ignore_index=-1
        )
        report["sop loss"] = sop_loss.detach().clone()
        loss = lm_loss + sop_loss
    report["loss"] = loss.detach().clone()
    return loss, report


def bert_forward_step(data_iterator, model, checkpoint_activations_microbatch=None):
    """Forward step for ``BertModel`` on :class:`SyntheticData` ``"bert"`` batches."""
    del checkpoint_activations_microbatch
    batch = _next_batch(data_iterator, model)
    binary = get_attr_wrapped_model(model, "add_binary_head")
    output = model(
        batch["tokens"],
        batch["padding_mask"],
        tokentype_ids=batch["tokentype_ids"] if binary else None,
        lm_labels=batch["labels"],
    )
    return output, partial(bert_loss_func, batch["loss_mask"], batch["sentence_order"])


def t5_loss_func(loss_mask: torch.Tensor, output_tensor: torch.Tensor):
    """T5 loss as Megatron-LM's ``pretrain_t5.py``: masked mean of the token losses."""
    lm_loss = torch.sum(output_tensor.view(-1).float() * loss_mask.reshape(-1)) / loss_mask.sum()
    return lm_loss, {"lm loss": lm_loss.detach().clone(), "loss": lm_loss.detach().clone()}


def t5_forward_step(data_iterator, model, checkpoint_activations_microbatch=None):
    """Forward step for ``T5Model`` on :class:`SyntheticData` ``"t5"`` batches."""
    del checkpoint_activations_microbatch
    batch = _next_batch(data_iterator, model)
    output = model(
        batch["encoder_ids"],
        batch["decoder_ids"],
        batch["encoder_mask"],
        batch["decoder_mask"],
        batch["encoder_decoder_mask"],
        lm_labels=batch["labels"],
    )
    return output, partial(t5_loss_func, batch["loss_mask"])


@dataclasses.dataclass
class RunResult:
    """What :func:`run_steps` measured.

    Attributes:
        losses: One 1-D tensor per step: the loss of each micro-batch, in schedule order
            (empty on ranks that are not the last pipeline stage).
        grads: Every parameter's gradient after the last step's backward (before the
            update), cloned, keyed by the parameter's name in the single-stage model.
            Parameters without a gradient are absent.
    """

    losses: list[torch.Tensor]
    grads: dict[str, torch.Tensor]

    @property
    def mean_losses(self) -> list[float]:
        """Mean micro-batch loss of each step (empty on non-last pipeline stages)."""
        return [float(step.mean()) for step in self.losses if step.numel()]


class SGD:
    """Plain SGD, ``p -= lr * p.grad``, so that consecutive steps see different weights.

    Args:
        lr: Learning rate.
    """

    def __init__(self, lr: float = 0.1) -> None:
        if not lr > 0:
            raise ConfigError(f"lr ({lr!r}) must be > 0")
        self.lr = lr

    @torch.no_grad()
    def __call__(self, model_chunks: Sequence[torch.nn.Module], step: int) -> None:
        """Update every parameter that has a gradient."""
        del step
        for chunk in model_chunks:
            for param in chunk.parameters():
                if param.grad is not None:
                    param.add_(param.grad, alpha=-self.lr)


def finalize_embedding_grads(
    model: Sequence[torch.nn.Module],
    num_tokens: Optional[torch.Tensor] = None,
    pg_collection: Any = None,
    force_all_reduce: bool = False,
) -> None:
    """All-reduce the tied word-embedding gradient between the first and last stages.

    A ``finalize_model_grads_func`` for models that are not wrapped in megatron's
    ``DistributedDataParallel``: megatron's own ``finalize_model_grads`` reads the DDP
    wrapper's grad buffers. With tied input/output embeddings and a pipeline, the first
    stage holds the embedding copy and the last stage the output-layer copy; summing
    their gradients gives both the gradient of the tied weight (as
    ``_allreduce_word_embedding_grads`` does). Other gradients need no reduction without
    data parallelism.

    Args:
        model: The model chunks of this rank.
        num_tokens: Unused (per-token loss scaling is not supported here).
        pg_collection: Unused; megatron's global groups are used.
        force_all_reduce: Unused.
    """
    del pg_collection, force_all_reduce
    if num_tokens is not None:
        raise ConfigError("calculate_per_token_loss (True) is not supported by run_steps")
    group = parallel_state.get_embedding_group(check_initialized=False)
    if group is None or dist.get_world_size(group) <= 1:
        return
    if dist.get_rank() not in dist.get_process_group_ranks(group):
        return
    chunk = model[0] if parallel_state.is_pipeline_first_stage(ignore_virtual=True) else model[-1]
    module = get_attr_wrapped_model(chunk, "pre_process", return_model_obj=True)
    if not getattr(module, "share_embeddings_and_output_weights", False):
        return
    weight = module.shared_embedding_or_output_weight()
    if weight is not None and weight.grad is not None:
        dist.all_reduce(weight.grad, group=group)


def _named_grads(model_chunks: Sequence[torch.nn.Module]) -> dict[str, torch.Tensor]:
    grads: dict[str, torch.Tensor] = {}
    for chunk in model_chunks:
        for name, param in global_named_parameters(chunk):
            if param.grad is not None:
                grads[name] = param.grad.detach().clone()
    return grads


def train_step(
    chunks: Sequence[torch.nn.Module],
    forward_step_func: Callable[..., Any],
    data_iterators: Sequence[Iterator[Any]],
    step: int,
    *,
    num_microbatches: int,
    seq_length: int,
    micro_batch_size: int,
    forward_backward_func: Callable[..., Any],
    optimizer_step: Callable[[Sequence[torch.nn.Module], int], None],
    decoder_seq_length: Optional[int] = None,
    collect_grads: bool = False,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """One training step, the loop body of :func:`run_steps` and of ``megatron-ssd train``.

    Sets every gradient to None, calls ``forward_backward_func`` inside :func:`cpu_mode`
    with one data iterator per chunk, then ``optimizer_step(chunks, step)``.

    Returns:
        The ``"loss"`` of each micro-batch (empty on stages that are not the last), and,
        with ``collect_grads``, every gradient before the update (cloned; else ``{}``).
    """
    for chunk in chunks:
        chunk.zero_grad(set_to_none=True)
    with cpu_mode():
        store = forward_backward_func(
            forward_step_func=forward_step_func,
            data_iterator=list(data_iterators),
            model=list(chunks),
            num_microbatches=num_microbatches,
            seq_length=seq_length,
            micro_batch_size=micro_batch_size,
            decoder_seq_length=decoder_seq_length,
            forward_only=False,
        )
    losses = _collect_losses(store)
    grads = _named_grads(chunks) if collect_grads else {}
    optimizer_step(chunks, step)
    return losses, grads


def run_steps(
    model_chunks: Sequence[torch.nn.Module] | torch.nn.Module,
    forward_step_func: Callable[..., Any],
    data_iterators_factory: Callable[[int], Iterator[Any]],
    num_microbatches: int,
    seq_length: int,
    micro_batch_size: int,
    steps: int,
    forward_backward_func: Optional[Callable[..., Any]] = None,
    optimizer_step: Optional[Callable[[Sequence[torch.nn.Module], int], None]] = None,
    decoder_seq_length: Optional[int] = None,
) -> RunResult:
    """Run ``steps`` training steps through megatron-core's schedule.

    Each step: set every gradient to None, build one data iterator per model chunk with
    ``data_iterators_factory(step)`` (each chunk consumes its own iterator, as in the
    interleaved schedule), call ``forward_backward_func`` inside :func:`cpu_mode`, record
    the ``"loss"`` entry of each micro-batch's loss report, then call ``optimizer_step``.

    When the chunks' config has no ``finalize_model_grads_func``,
    :func:`finalize_embedding_grads` is installed for the duration of the run, as
    Megatron-LM's training loop installs its own. Gradients are not reduced over
    data-parallel ranks (each trains on its own); wrap the chunks in megatron's
    ``DistributedDataParallel`` and set ``finalize_model_grads`` for that.

    Args:
        model_chunks: This rank's model chunks (one per virtual stage), or one model.
        forward_step_func: ``(data_iterator, model) -> (output, loss_func)``; the loss
            function's report dict must hold a scalar ``"loss"``.
        data_iterators_factory: ``step -> iterator`` over that step's micro-batches.
        num_microbatches: Micro-batches per step.
        seq_length: Sequence length (the encoder's, for T5).
        micro_batch_size: Sequences per micro-batch.
        steps: Training steps (>= 1).
        forward_backward_func: Schedule to call; ``get_forward_backward_func()`` when None.
        optimizer_step: ``(model_chunks, step) -> None``; ``SGD(lr=0.1)`` when None.
        decoder_seq_length: Decoder sequence length for encoder-decoder models.

    Returns:
        Losses of every step and the last step's gradients.

    Raises:
        ConfigError: For ``steps`` or ``num_microbatches`` below 1.
    """
    chunks = list(model_chunks) if isinstance(model_chunks, (list, tuple)) else [model_chunks]
    if steps < 1:
        raise ConfigError(f"steps ({steps}) must be >= 1")
    if num_microbatches < 1:
        raise ConfigError(f"num_microbatches ({num_microbatches}) must be >= 1")
    if forward_backward_func is None:
        forward_backward_func = get_forward_backward_func()
    if optimizer_step is None:
        optimizer_step = SGD()
    config = get_model_config(chunks[0])
    installed = config.finalize_model_grads_func is None
    if installed:
        config.finalize_model_grads_func = finalize_embedding_grads
    losses: list[torch.Tensor] = []
    grads: dict[str, torch.Tensor] = {}
    try:
        for step in range(steps):
            last = step == steps - 1
            step_losses, step_grads = train_step(
                chunks, forward_step_func, [data_iterators_factory(step) for _ in chunks], step,
                num_microbatches=num_microbatches, seq_length=seq_length, micro_batch_size=micro_batch_size,
                forward_backward_func=forward_backward_func, optimizer_step=optimizer_step,
                decoder_seq_length=decoder_seq_length, collect_grads=last,
            )
            losses.append(step_losses)
            grads = step_grads if last else grads
    finally:
        if installed:
            config.finalize_model_grads_func = None
    return RunResult(losses=losses, grads=grads)


def _collect_losses(store: list[Any]) -> torch.Tensor:
    values = []
    for report in store:
        if not isinstance(report, dict) or "loss" not in report:
            raise ConfigError(
                "the loss function's report must be a dict with a scalar 'loss' entry, "
                f"got {type(report).__name__}"
            )
        values.append(report["loss"].detach().reshape(()).float().cpu())
    return torch.stack(values) if values else torch.empty(0)

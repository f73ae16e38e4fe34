"""Training data for the ``train`` job from a local text file (byte-level tokens)."""

from __future__ import annotations

import itertools
from typing import Dict, Iterator

import numpy as np
import torch

from ..errors import ConfigError

__all__ = ["TextFileData"]


class TextFileData:
    """Micro-batches of byte tokens cut from a local text file, in the format the GPT
    forward step expects (``input_ids``, ``labels``, ``loss_mask``, ``position_ids``,
    ``attention_mask``), deterministic per (step, index) like ``SyntheticData``.

    Args:
        path: a local text (or any) file; its bytes are the tokens (vocabulary 256).
        micro_batch_size: sequences per micro-batch.
        seq_length: tokens per sequence.
        seed: seed of the sampled offsets.
    """

    def __init__(self, path: str, micro_batch_size: int, seq_length: int, seed: int = 0) -> None:
        self.tokens = torch.from_numpy(np.fromfile(path, dtype=np.uint8).astype(np.int64))
        if self.tokens.numel() < seq_length + 2:
            raise ConfigError(
                f"TrainConfig.data = {path!r}: has {self.tokens.numel()} bytes, needs > seq_length + 1 "
                f"({seq_length + 1})"
            )
        self.micro_batch_size = micro_batch_size
        self.seq_length = seq_length
        self.seed = seed

    def __call__(self, step: int) -> Iterator[Dict[str, torch.Tensor]]:
        """An endless iterator over the micro-batches of ``step``."""
        return (self.batch(step, i) for i in itertools.count())

    def batch(self, step: int, index: int) -> Dict[str, torch.Tensor]:
        """Micro-batch ``index`` of ``step``: random windows of the file."""
        g = torch.Generator().manual_seed((self.seed * 1_000_003 + step) * 1_000_033 + index)
        b, s = self.micro_batch_size, self.seq_length
        starts = torch.randint(0, self.tokens.numel() - s - 1, (b,), generator=g)
        windows = torch.stack([self.tokens[i : i + s + 1] for i in starts.tolist()])
        return {
            "input_ids": windows[:, :-1].contiguous(),
            "labels": windows[:, 1:].contiguous(),
            "loss_mask": torch.ones(b, s),
            "position_ids": torch.arange(s).unsqueeze(0).expand(b, s).contiguous(),
            "attention_mask": torch.ones(s, s, dtype=torch.bool).triu(1).view(1, 1, s, s),
        }

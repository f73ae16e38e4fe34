"""CPU mode and Megatron-LM checkpoints: the CUDA generator state that ``save_checkpoint``
stores and ``load_checkpoint`` restores (NOTE [CPU mode] 7).

The end-to-end run (``--save`` on SIGTERM, a requeued job loading it) is
``tests/scripts/test_slurm_jobs.py::test_usr1_saves_a_checkpoint_and_the_requeued_job_starts_clean``.
"""

from __future__ import annotations

import pytest
import torch

from megatron_ssd.megatron.cpu_mode import cpu_mode

pytestmark = pytest.mark.usefixtures("cpu_only")


def test_torch_cuda_rng_state_has_stand_ins_only_inside():
    original = torch.cuda.get_rng_state, torch.cuda.set_rng_state
    with cpu_mode():
        state = torch.cuda.get_rng_state()  # raises on a CPU build without the stand-in
        assert state.dtype == torch.uint8 and state.numel() == 0
        torch.cuda.set_rng_state(state)  # no CUDA generator to restore
    assert (torch.cuda.get_rng_state, torch.cuda.set_rng_state) == original

"""Aligned host buffers and the staging buffer pool."""

from __future__ import annotations

import threading

import pytest
import torch

from megatron_ssd.config import IOConfig
from megatron_ssd.io.base import ALIGN
from megatron_ssd.io.buffers import BufferPool, aligned_empty, is_aligned, tensor_buffer
from waits import HANG_S  # tests/waits.py


@pytest.mark.parametrize("nbytes", [0, 1, 4095, 4096, 4097, 1 << 20])
def test_aligned_empty_is_aligned_and_padded(nbytes):
    for _ in range(4):
        t = aligned_empty(nbytes, pin=False)
        assert t.dtype == torch.uint8 and t.dim() == 1 and t.is_contiguous()
        assert t.data_ptr() % ALIGN == 0
        assert t.numel() == max(ALIGN, -(-nbytes // ALIGN) * ALIGN)


def test_aligned_empty_rejects_negative_size():
    with pytest.raises(ValueError, match="megatron_ssd:"):
        aligned_empty(-1)


def test_tensor_buffer_shares_memory():
    t = aligned_empty(8192)
    t.zero_()
    view = tensor_buffer(t, 4096, 10)
    view[3] = 7
    assert t[4099].item() == 7 and len(view) == 10
    assert is_aligned(t, 4096, 8192) and not is_aligned(t, 64, 4096) and not is_aligned(t, 0, 100)


def test_pool_blocks_when_empty_and_wakes_on_release():
    pool = BufferPool(count=1, nbytes=5000)
    assert pool.nbytes == 8192
    first = pool.acquire()
    assert first.data_ptr() % ALIGN == 0 and pool.available == 0
    got = []
    waiter = threading.Thread(target=lambda: got.append(pool.acquire()))
    waiter.start()
    waiter.join(0.05)
    assert waiter.is_alive() and not got
    pool.release(first)
    waiter.join(HANG_S)
    assert got and got[0] is first


def test_pool_timeout_and_bad_release():
    pool = BufferPool(count=1, nbytes=4096)
    buf = pool.acquire()
    with pytest.raises(TimeoutError, match="no staging buffer"):
        pool.acquire(timeout=0.01)
    with pytest.raises(ValueError, match="not an acquired buffer"):
        pool.release(torch.empty(4096, dtype=torch.uint8))
    pool.release(buf)
    with pytest.raises(ValueError, match="not an acquired buffer"):
        pool.release(buf)


def test_pool_from_config_sizes_one_buffer_per_worker():
    pool = BufferPool.from_config(IOConfig(threads=3, block_bytes=1 << 16))
    assert pool.count == 6 and pool.nbytes == 1 << 16 and pool.available == 6

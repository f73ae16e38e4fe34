"""tests/moved_bytes.py, the byte balance the offload tests assert, on constructed steps."""

from __future__ import annotations

import pytest

from moved_bytes import assert_bytes_come_back  # tests/moved_bytes.py


def test_a_write_completing_a_step_after_its_tensor_was_served_balances():
    # step 0 serves 0.3 from memory whose writes end, cancelled, in step 1; step 1 serves 0.4 whose
    # writes complete in step 2
    assert_bytes_come_back([(0.7, 0.7, 0.3, 0.0), (0.6, 0.6, 0.4, 0.3), (0.5 + 0.4, 0.5, 0.0, None)], rounding=0.0)


def test_a_byte_that_never_came_back_fails():
    with pytest.raises(AssertionError):
        assert_bytes_come_back([(1.0, 0.7, 0.3, 0.0), (1.0, 0.6, 0.3, 0.0)], rounding=0.0)


def test_a_read_of_bytes_never_written_fails():
    with pytest.raises(AssertionError):
        assert_bytes_come_back([(1.0, 1.2, 0.0, 0.0)], rounding=0.0)


def test_the_step_lines_rounding_is_allowed_per_value():
    # 0.75 written and 0.749 read print as 0.8 and 0.7
    assert_bytes_come_back([(0.8, 0.7, 0.0, 0.0)])
    with pytest.raises(AssertionError):
        assert_bytes_come_back([(0.8, 0.5, 0.0, 0.0)])

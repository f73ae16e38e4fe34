"""The ``megatron-ssd`` commands (train, plan, rok, simulate, bench-io, clean), above the
library: they build workloads, run them, and print or write what was measured. Nothing in
the library imports from here (``tests/test_layers.py``)."""

"""megatron-ssd's lab: the GPU check's parts, the sizing tables and the block-device
throttle. Measurement tools of this repository, run from a checkout's root
(``python -m megatron_ssd_lab.gpu_check ...``); setup.py does not ship them, and no module
of ``megatron_ssd`` imports them except ``rok --throttle``, lazily."""

"""docs/planner.md's H100 sizing table is what the code computes, and its rows obey the
planner's rules (capacity, wear bound, no zero-benefit writes)."""

import os

from megatron_ssd.planner.simulate import SIZING_DRIVES, SIZING_MODELS, sizing_markdown, sizing_rows

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def test_docs_table_is_current():
    with open(os.path.join(REPO, "docs", "planner.md"), encoding="utf-8") as fh:
        docs = fh.read()
    table = sizing_markdown(sizing_rows())
    assert table in docs, "run: python benchmarks/simulate_h100.py --markdown, and paste the table into docs/planner.md"


def test_rows_obey_the_planner_rules():
    rows = sizing_rows()
    assert len(rows) == len(SIZING_MODELS) * len(SIZING_DRIVES)
    assert {r["seq_len"] for r in rows} == {4096, 32768}
    for r in rows:
        assert r["planned_peak_bytes"] <= r["activation_capacity_bytes"], r["model"]
        assert r["memory_saved_bytes"] == r["keep_peak_bytes"] - r["planned_peak_bytes"]
        assert r["cpu_offload_host_bytes_per_node"] == 8 * r["memory_saved_bytes"]
        assert (r["write_bytes_per_s_per_gpu"] > 0) == (r["offloaded_layers"] > 0)
        # 3 years of 1-DWPD drives shared by 8 GPUs allow 18-74 MB/s per GPU
        assert r["wear_bound_write_bytes_per_s_per_gpu"] <= 7.0e15 * r["drives_per_node"] / (3 * 365 * 86400) / 8

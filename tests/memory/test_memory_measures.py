"""Memory measured independently of the tensor cache: RSS peaks, the allocator timeline,
and read-back buffers that go back to the kernel when freed."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
import threading

import pytest
import torch

from megatron_ssd.io.mapped import mapped_bytes, mapped_empty
from megatron_ssd.memory import AllocatorTimeline, PhaseMemory, RSSPeak, current_rss_bytes, peak_of_events
from megatron_ssd.memory.allocator_timeline import layer_peaks, working_peaks
from megatron_ssd.memory.phase import live_block_sizes
from megatron_ssd.memory.rss import reset_hwm
from waits import HANG_S, wait_until  # tests/waits.py

MiB = 1 << 20
REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
METHODS = ["sampled"] + (["vmhwm"] if reset_hwm() else [])


@pytest.mark.parametrize("method", METHODS)
def test_rss_peak_covers_a_touched_buffer(method):
    """The peak above the base is at least the RSS growth of touching 64 MiB, freed before it is read."""
    with RSSPeak(method=method) as peak:
        base = peak.mark_base()
        peak.reset()
        buf = torch.ones(64 * MiB, dtype=torch.uint8)  # every page written
        grown = current_rss_bytes() - base
        if method == "sampled":  # two reads by the sampler while the buffer is there; vmhwm needs none
            seen = peak.samples
            wait_until(lambda: peak.samples >= seen + 2, "the RSS sampler's reads")
        del buf
        assert grown >= 60 * MiB
        # the kernel batches per-thread RSS counters (up to 64 pages each): 1 MiB of slack
        assert peak.peak_above_base() >= grown - MiB
        assert peak.method == method


def test_rss_peak_restarts_on_reset():
    with RSSPeak() as peak:
        peak.mark_base()
        buf = torch.ones(64 * MiB, dtype=torch.uint8)
        del buf
        first = peak.peak_above_base()
        peak.reset()
        assert peak.peak_above_base() <= first - 48 * MiB


def test_rss_peak_rejects_a_bad_method():
    with pytest.raises(ValueError, match="megatron_ssd: RSSPeak\\(method='hwm'\\)"):
        RSSPeak(method="hwm")


def test_phase_memory_reports_per_step_and_above_base():
    memory = PhaseMemory("cpu")
    try:
        memory.start()
        for size in (8, 40):
            memory.step_begin()
            buf = torch.ones(size * MiB, dtype=torch.uint8)
            del buf
            memory.step_end()
        out = memory.summary(measured_from=1)
    finally:
        memory.close()
    assert len(out["rss_peak_per_step_bytes"]) == 2
    assert out["peak_rss_above_base_bytes"] >= 36 * MiB
    assert out["independent_peak_bytes"] == out["peak_rss_above_base_bytes"]
    assert out["rss_base_bytes"] > 0 and out["allocator_peak_bytes"] is None
    assert out["cuda_peak_allocated_above_base_bytes"] is None


def test_peak_of_events_frees_first_at_a_tie():
    assert peak_of_events([(0, 10), (1, -10), (1, 10), (2, 5)]) == 15
    assert peak_of_events([]) == 0


def test_working_peaks_take_out_what_the_cache_holds_and_split_inside_from_outside_the_layers():
    """NOTE [Working set by phase]: an embedding output (100) outside; inside a layer a
    saved tensor (50, which the cache then holds) and a temporary (30); outside again the
    logits (200); backward frees the saved tensor as the cache lets it go."""
    events = [(1, 100), (3, 50), (4, 30), (5, -30), (7, 200), (8, -200), (10, -50)]
    held = [(3, 50), (10, -50)]
    phases = [(2, False), (6, True), (9, False)]
    assert working_peaks(events, held, phases) == (100 + 30, 100 + 200)
    assert working_peaks(events, [], phases) == (100 + 50 + 30, 100 + 50 + 200)  # nothing held: all working
    assert working_peaks(events, held, []) == (0, 100 + 200)  # never inside a layer
    assert working_peaks([], [], []) == (0, 0)


def test_layer_peaks_take_a_forward_beyond_the_other_layers_and_a_backward_beyond_every_saved_tensor():
    """NOTE [Working set by layer], values worked by hand. Layer 0's forward saves 40 and
    keeps it (written out later); layer 1's forward saves 50 beside a 30 temporary, its
    peak 50 + 30 = 80 whatever layer 0 holds. Layer 1's backward reads 20 and 30 back,
    frees the first when used and makes a 25 gradient: 25 beyond its saved bytes, less
    the 20 already freed at the 25's birth. What survives the window (a 7 gradient) is no
    one's working set."""
    events = [(1, 40), (3, 50), (4, 30), (5, -30), (7, -50), (9, 20), (10, 30), (11, -20), (12, 25), (13, 7),
              (14, -25), (15, -30)]
    saved = [(1, 40, 0), (3, 50, 1), (7, -50, 1), (13, 7, None)]
    mapped = [(9, 20), (10, 30), (11, -20), (15, -30)]
    spans = [(0, (0, False)), (2, (1, False)), (6, None), (8, (1, True)), (16, None)]
    assert layer_peaks(events, saved, spans, mapped) == {0: (40, 0), 1: (80, 5)}
    # had the first read stayed to the end, the gradient would stand beside all of it
    later = [e if e != (11, -20) else (16, -20) for e in events]
    assert layer_peaks(later, saved, spans, [(9, 20), (10, 30), (15, -30), (16, -20)]) == {0: (40, 0), 1: (80, 25)}
    assert layer_peaks([], [], []) == {}


def test_the_head_backward_is_measured_as_a_layer_backward_is():
    """NOTE [Working set of the head's backward], values worked by hand: the head's
    forward makes a 200 logits temporary, moved and read back into a 200 buffer; its
    backward makes a 10 gradient beside the buffer, then layer 0's backward a 5 one. The
    head's backward needs 10 beyond what it saved; told at each unpack, it is one span."""
    events = [(1, 40), (4, 200), (5, -200), (7, 200), (8, 10), (9, -10), (10, -200), (12, 5), (13, -5)]
    saved = [(1, 40, 0)]
    mapped = [(7, 200), (10, -200)]
    spans = [(0, (0, False)), (2, None), (6, ("head", True)), (11, (0, True)), (14, None)]
    assert layer_peaks(events, saved, spans, mapped) == {0: (40, 5), "head": (0, 10)}
    with AllocatorTimeline() as timeline:
        timeline.phase(True, "head", backward=True)
        timeline.phase(True, "head", backward=True)  # a second unpack: the same span
        timeline.phase(True)  # leaving the layers names no span
        timeline.phase(False, 0, backward=True)
    assert [span for _, span in timeline._spans] == [("head", True), None, (0, True)]


def test_what_survives_the_window_is_no_working_set():
    """NOTE [Survivors]: a storage made inside the window and alive when it closes (a
    first step's gradients, its optimizer state) is state for later steps: counted in the
    window's peak, not in its working set."""
    MiB = 1 << 20
    kept = []
    with AllocatorTimeline() as timeline:
        timeline.phase(False, 0)
        kept.append(torch.ones(MiB // 4))  # 1 MiB, alive after the window
        temporary = torch.ones(2 * MiB // 4)
        del temporary
        torch.zeros(1)
    assert timeline.surviving_bytes == MiB
    assert timeline.peak_bytes >= 3 * MiB
    assert timeline.working_peaks()[0] == 2 * MiB
    assert timeline.layer_peaks() == {0: (2 * MiB, 0)}


def test_what_a_backward_made_and_a_later_step_freed_is_remade():
    """NOTE [Gradients remade each step]: of what survives the window, the storages a
    backward made (layer 1's 1 MiB, the head's 2 MiB) count once they have died since,
    those the forward made (a cache of 4 MiB) never; a storage still alive counts not."""
    MiB = 1 << 20
    kept = {}
    with AllocatorTimeline() as timeline:
        timeline.phase(False, 1)
        kept["cache"] = torch.ones(4 * MiB // 4)
        timeline.phase(True, "head", backward=True)
        kept["head"] = torch.ones(2 * MiB // 4)
        timeline.phase(False, 1, backward=True)
        kept["grad"] = torch.ones(MiB // 4)
        kept["other"] = torch.ones(MiB // 4)
    assert timeline.surviving_bytes == 8 * MiB
    assert timeline.remade() == {}  # nothing freed yet
    del kept["head"], kept["grad"], kept["cache"]
    assert timeline.remade() == {"head": 2 * MiB, 1: MiB}
    del kept["other"]
    assert timeline.remade() == {"head": 2 * MiB, 1: 2 * MiB}


def test_allocator_timeline_counts_fresh_storages_views_threads_and_mappings():
    """Values of a known sequence: views and in-place ops allocate nothing; a free on
    another thread and an unmap are seen; what existed before the window is the base."""
    before = torch.ones(16 * MiB, dtype=torch.uint8)
    with AllocatorTimeline() as timeline:
        a = torch.ones(10 * MiB, dtype=torch.uint8)  # 10
        b = a + 1  # 20
        m = mapped_empty(5 * MiB)  # 25
        view = m[:100]
        del a  # 15
        view.add_(1)
        b.view(-1)[:5].add_(1)
        del before  # allocated before the window: not counted
        held = [b]
        del b
        t = threading.Thread(target=held.clear)
        t.start()
        t.join()  # b freed on another thread: 5
        c = torch.empty(12 * MiB, dtype=torch.uint8)  # 17
        del m, view  # 12
        d = torch.empty(9 * MiB, dtype=torch.uint8)  # 21
    assert timeline.peak_bytes == 25 * MiB
    assert timeline.allocations == 5
    del c, d


def test_a_storage_wrapped_with_set_is_counted_once():
    """NOTE [Allocator timeline]: ``set_`` aliases the storage it is given. The tensor
    cache's pack wraps every saved tensor so (``storage_bytes``); it was counted a second
    time, for the tensor's life: a KEEP step of gpt-tiny at micro-batch 4 measured 424.7
    MiB where the saved tensors were 178 MiB of it, each counted twice."""
    from megatron_ssd.cache.identity import storage_bytes

    with AllocatorTimeline() as timeline:
        a = torch.ones(10 * MiB, dtype=torch.uint8)  # 10
        wrapped = storage_bytes(a)  # the same 10
        b = torch.ones(3 * MiB, dtype=torch.uint8)  # 13
    assert timeline.peak_bytes == 13 * MiB and timeline.allocations == 3  # set_ starts from an empty tensor: 0 bytes
    assert wrapped.untyped_storage().data_ptr() == a.untyped_storage().data_ptr()
    del a, b, wrapped


def test_saved_tensors_packed_by_the_cache_count_once(tmp_path):
    """A KEEP layer's saved tensors under the tensor cache (which wraps each with
    ``set_``): the window's peak is the same as with no cache at all."""
    from megatron_ssd import OffloadConfig, TensorCache

    def step(cache):
        x = torch.randn(256, 1024, requires_grad=True)
        with AllocatorTimeline() as timeline:
            if cache is None:
                y = torch.tanh(x).exp().sum()
            else:
                with cache.microbatch(), cache.layer(0):
                    y = torch.tanh(x).exp().sum()
            y.backward()
        return timeline.peak_bytes

    plain = step(None)
    config = OffloadConfig(paths=[str(tmp_path)], min_free_bytes=0, device="cpu")
    with TensorCache(config) as cache:
        cache.register_layers([torch.nn.Identity()], install_hooks=False)
        cache.set_plan({0: "keep"})
        cached = step(cache)
    assert plain > 0 and cached == plain


def test_mapped_buffer_is_page_aligned_and_unmapped_with_its_last_view():
    live = mapped_bytes()
    buf = mapped_empty(10_000)
    assert buf.numel() == 12288 and buf.data_ptr() % 4096 == 0
    view = buf[100:200]
    del buf
    assert mapped_bytes() == live + 12288
    del view
    assert mapped_bytes() == live
    with pytest.raises(ValueError, match="megatron_ssd: mapped_empty\\(nbytes=-1\\)"):
        mapped_empty(-1)


_CHILD = textwrap.dedent("""
    import json, sys, tempfile, torch
    from megatron_ssd import OffloadConfig
    from megatron_ssd.io import PosixEngine
    from megatron_ssd.memory import current_rss_bytes
    MiB = 1 << 20
    with tempfile.TemporaryDirectory() as d:
        engine = PosixEngine(OffloadConfig(paths=[d], min_free_bytes=0))
        blob = torch.arange(4 * MiB, dtype=torch.int32).to(torch.uint8)
        handles = [engine.write(blob).get() for _ in range(24)]
        # glibc raises its mmap threshold to the size of a freed mmap-served block: after
        # this, heap blocks serve everything below 30 MiB (NOTE [Mapped read buffers])
        del blob
        torch.empty(30 * MiB, dtype=torch.uint8).fill_(1)
        base = current_rss_bytes()
        back, pins = [], []
        for h in handles:  # each read-back buffer followed by a small block that stays
            dst = engine.alloc(h.nbytes, torch.device("cpu"), h)
            back.append(engine.read(h, dst).get())
            pins.append(torch.ones(64 << 10, dtype=torch.uint8))
        assert all(b[:256].equal(torch.arange(256, dtype=torch.uint8)) for b in back)
        full = current_rss_bytes()
        del back, dst
        after = current_rss_bytes()
        for h in handles:
            engine.free(h)
        engine.close()
    print(json.dumps({"base": base, "full": full, "after": after}))
""")


@pytest.mark.e2e
def test_read_back_memory_returns_to_the_os_when_freed():
    """In a fresh process: read back 96 MiB in 4 MiB blobs, each followed by a small
    tensor that stays (the pattern that left holes in the heap), free them: RSS drops back."""
    proc = subprocess.run([sys.executable, "-c", _CHILD], cwd=REPO, capture_output=True, text=True, timeout=HANG_S)
    assert proc.returncode == 0, proc.stderr[-2000:]
    import json

    r = json.loads(proc.stdout.strip().splitlines()[-1])
    assert r["full"] - r["base"] >= 90 * MiB
    assert r["after"] - r["base"] <= 16 * MiB, f"{(r['after'] - r['base']) / MiB:.1f} MiB still resident"


def test_live_block_sizes_count_live_blocks_by_size_largest_totals_first():
    snapshot = [
        {"blocks": [{"size": 8 * MiB, "state": "active_allocated"}, {"size": 2 * MiB, "state": "inactive"},
                    {"size": 8 * MiB, "state": "active_allocated"}]},
        {"blocks": [{"size": 20 * MiB, "state": "active_allocated"}, {"size": 1 * MiB, "state": "active_allocated"}]},
        {"blocks": []},
    ]
    assert live_block_sizes(snapshot) == [{"bytes": 20 * MiB, "count": 1}, {"bytes": 8 * MiB, "count": 2},
                                          {"bytes": 1 * MiB, "count": 1}]
    assert live_block_sizes(snapshot, top=1) == [{"bytes": 20 * MiB, "count": 1}]


def test_phase_memory_on_cuda_reports_what_stays_allocated_between_steps(monkeypatch):
    """The CUDA path through a fake ``torch.cuda``: the level when each measured step
    starts, above the phase's base, and the live blocks after the steps."""
    state = {"allocated": 100 * MiB, "peak": 0}
    fake = {
        "synchronize": lambda: None,
        "memory_allocated": lambda: state["allocated"],
        "memory_reserved": lambda: 2 * state["allocated"],
        "reset_peak_memory_stats": lambda: state.update(peak=state["allocated"]),
        "max_memory_allocated": lambda: state["peak"],
        "max_memory_reserved": lambda: 2 * state["peak"],
        "memory_snapshot": lambda: [{"blocks": [{"size": 3 * MiB, "state": "active_allocated"}]}],
    }
    for name, fn in fake.items():
        monkeypatch.setattr(torch.cuda, name, fn)
    memory = PhaseMemory("cuda")
    try:
        memory.start()  # base 100 MiB
        for held, transient in ((0, 50), (30, 50), (10, 50)):  # a step leaves `held` MiB allocated
            memory.step_begin()
            state["peak"] = state["allocated"] + transient * MiB
            state["allocated"] += held * MiB
            memory.step_end()
        out = memory.summary(measured_from=1)
    finally:
        memory.close()
    assert out["cuda_step_start_above_base_bytes"] == 30 * MiB  # the third step started 30 MiB up
    assert out["cuda_peak_allocated_above_base_bytes"] == 80 * MiB
    assert out["cuda_live_blocks_after"] == [{"bytes": 3 * MiB, "count": 1}]


def test_a_saved_tensor_is_an_activation_until_its_storage_dies_and_a_temporary_is_working_set():
    """NOTE [Working set by phase]: inside a layer a saved tensor (told by ``saved``) and a
    temporary; outside it a larger temporary. The saved tensor leaves the working set
    whoever holds it, and its death takes it out of both counts."""
    MiB = 1 << 20
    with AllocatorTimeline() as timeline:
        timeline.phase(False)
        saved = torch.ones(MiB // 4)  # 1 MiB
        timeline.saved(saved)
        temporary = torch.ones(2 * MiB // 4)
        del temporary
        timeline.phase(True)
        logits = torch.ones(3 * MiB // 4)
        del logits, saved
        torch.zeros(1)  # an operator: the frees are polled
    assert timeline.working_peaks() == (2 * MiB, 3 * MiB)


def test_a_storage_from_before_the_window_that_dies_inside_it_is_a_free():
    """NOTE [Frees of what came before]: the previous step's gradient (4 MiB), set to None at
    the step's start, and a new one made in backward: the step adds nothing above its
    start where the timeline is told of the old one, and 4 MiB where it is not."""
    MiB = 1 << 20

    def step(param):
        param.grad = None
        param.grad = torch.ones(MiB)  # 4 MiB

    for told, added in ((True, 0), (False, 4 * MiB)):
        param = torch.nn.Parameter(torch.zeros(MiB))
        param.grad = torch.ones(MiB)
        with AllocatorTimeline((p.grad for p in [param]) if told else ()) as timeline:
            step(param)
            torch.zeros(1)  # an operator: the frees are polled (its 4 bytes count too)
        assert timeline.peak_bytes == added + 4

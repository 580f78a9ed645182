"""The kernel's word on which pages of a frozen tensor were written (#50): under
``skip_unchanged="verify"`` a frozen base is compared only where it may have changed, and
every write the process makes to it still shows. Real userfaultfd and PAGEMAP_SCAN on this
machine's kernel (skipped where it has neither); no Ray."""

from __future__ import annotations

import ctypes
import mmap
import threading

import pytest
import torch

import memckpt
from memckpt.engine import write_watch
from memckpt.engine.write_watch import PAGE, WriteWatch

from tests.test_unchanged import _assert_same, _config, _restored, _snapshot_state, _train

MiB = 1 << 20

if WriteWatch.open() is None:
    pytest.skip("this kernel offers no asynchronous write-protect with PAGEMAP_SCAN "
                "(Linux 6.7+, userfaultfd allowed)", allow_module_level=True)


@pytest.fixture
def watch():
    w = WriteWatch.open()
    yield w
    w.close()


def _watched(w: WriteWatch, name: str, t: torch.Tensor) -> None:
    """Watch ``t`` as ``name`` once its pages' collapse is done."""
    if not w.watch(name, t):
        w.wait_ready()
        assert w.watch(name, t)


def _page_of(t: torch.Tensor, index: int) -> tuple[int, int]:
    """The byte range (from ``t``'s first byte) of the page holding element ``index``."""
    at = t.data_ptr() + index * t.element_size()
    lo = at // PAGE * PAGE
    return lo - t.data_ptr(), lo + PAGE - t.data_ptr()


def _middle(w: WriteWatch, name: str, t: torch.Tensor) -> list[tuple[int, int]]:
    """What a scan reports written of ``t``'s whole pages: its partial end pages may show
    too (the allocator writes beside it there), and are compared whatever the scan says."""
    at, n = t.data_ptr(), t.numel() * t.element_size()
    head, tail = -(-at // PAGE) * PAGE - at, (at + n) // PAGE * PAGE - at
    return [(max(lo, head), min(hi, tail)) for lo, hi in w.scan().get(name, [])
            if min(hi, tail) > max(lo, head)]


def test_a_write_through_p_data_shows_on_its_page_alone_and_once(watch):
    t = torch.randn(2 * MiB)  # 8 MiB
    _watched(watch, "w", t)
    assert _middle(watch, "w", t) == []
    i = 1_000_000
    t.data[i] = 7.0  # no version counter moves
    assert _middle(watch, "w", t) == [_page_of(t, i)]
    assert _middle(watch, "w", t) == []  # protected again
    t.data[i] = 8.0
    assert _middle(watch, "w", t) == [_page_of(t, i)]


@pytest.mark.parametrize("how", ["in place under no_grad", "a kernel's read() into it",
                                 "another thread", "a numpy view"])
def test_every_way_this_process_writes_shows(watch, tmp_path, how):
    t = torch.randn(2 * MiB)
    _watched(watch, "w", t)
    i = 1_500_000
    if how == "in place under no_grad":
        with torch.no_grad():
            t[i:i + 10].mul_(2)
    elif how == "a kernel's read() into it":
        src = tmp_path / "bytes"
        src.write_bytes(b"\x01" * 40)
        view = memoryview(t.numpy()).cast("B")
        with open(src, "rb", buffering=0) as f:
            assert f.readinto(view[i * 4:i * 4 + 40]) == 40
    elif how == "another thread":
        th = threading.Thread(target=lambda: t.data.__setitem__(i, 3.0))
        th.start()
        th.join()
    else:
        t.numpy()[i] = 5.0
    assert _page_of(t, i)[0] in [lo for lo, _ in watch.scan()["w"]]


def test_two_names_on_one_storage_both_see_a_write(watch):
    """Tied weights: the same pages watched under two names; one scan reports both (a scan
    per name would protect the page again and hide the write from the second)."""
    base = torch.randn(3 * MiB)
    tied = base.view(-1)
    _watched(watch, "a", base)
    _watched(watch, "b", tied)
    watch.scan()
    base.data[2_000_000] = 1.0
    found = watch.scan()
    page = _page_of(base, 2_000_000)
    assert page in found["a"] and page in found["b"]


def test_tensors_written_without_this_process_s_page_tables_are_not_watched(watch, tmp_path):
    """Shared memory (another process writes it through its own mapping), pinned memory (a
    device's DMA) and a file's pages (they follow the file) are compared, not watched."""
    shared = torch.randn(MiB).share_memory_()
    assert not write_watch.watchable(shared) and not watch.watch("s", shared)
    path = tmp_path / "weights"
    path.write_bytes(bytes(4 * MiB))
    mapped = torch.from_file(str(path), shared=False, size=MiB, dtype=torch.float32)
    mapped.sum()  # its pages in memory, still the file's
    watch.watch("f", mapped)
    watch.wait_ready()
    assert not watch.watch("f", mapped) and "f" not in watch.names


def test_memory_mapped_anew_beside_a_watched_tensor_keeps_its_writes_seen(watch):
    """A protected range reaches past a tensor's ends (to whole huge pages); memory mapped
    anew there is not under the watch, and the kernel refuses to scan the range: each
    tensor in it is then scanned alone, and a write to it still shows."""
    libc = ctypes.CDLL(None, use_errno=True)
    libc.mmap.restype = ctypes.c_void_p
    libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int,
                          ctypes.c_int, ctypes.c_long]
    libc.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
    rw, private = mmap.PROT_READ | mmap.PROT_WRITE, mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS
    raw = libc.mmap(None, 12 * MiB, rw, private, -1, 0)
    try:
        huge = write_watch.HUGE
        aligned = -(-raw // huge) * huge
        ctypes.memset(aligned, 1, 8 * MiB)  # all in memory: its huge pages can be collapsed
        t = torch.frombuffer((ctypes.c_char * (5 * MiB)).from_address(aligned + 3 * MiB // 2 + 64),
                             dtype=torch.float32)
        _watched(watch, "w", t)
        assert watch._armed[0][0] == aligned  # out to the huge page before it
        watch.scan()
        fixed = 0x10  # MAP_FIXED: a new mapping where that huge page's head was
        assert libc.mmap(aligned, PAGE, rw, private | fixed, -1, 0) == aligned
        t.data[100_000] = 9.0
        assert _middle(watch, "w", t) == [_page_of(t, 100_000)]
        t.data[200_000] = 9.0
        assert _middle(watch, "w", t) == [_page_of(t, 200_000)]
        assert _middle(watch, "w", t) == []
        watch.close()
        del t
    finally:
        libc.munmap(raw, 12 * MiB)


# -- through a Checkpointer -------------------------------------------------------------------
def _big_lora(seed: int = 0) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    """A frozen 16 MiB base and a small trainable head (the inputs of ``_train``)."""
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(512, 8192), torch.nn.Linear(8192, 16))
    for p in model[0].parameters():
        p.requires_grad_(False)
    return model, torch.optim.AdamW(list(model[1].parameters()), lr=1e-2)


def _run(tmp_path, name: str, writes: dict[int, callable], steps: int = 8):
    """Steps 1 to ``steps`` of ``_big_lora`` under "verify", ``writes[step](model)`` before that
    step's snapshot; the watch ready from step 2. Returns each step's state and what its
    snapshot compared."""
    model, opt = _big_lora()
    state = memckpt.TrainState(model, opt)
    cfg = _config(tmp_path, name)
    ckpt = memckpt.Checkpointer(cfg)
    ckpt.restore(state)
    expect, compared = {}, {}
    for step in range(1, steps + 1):
        _train(model, opt, step)
        if step in writes:
            writes[step](model)
        assert ckpt.step(state, step)
        ckpt.wait()
        if step == 1:
            ckpt.engine.watch.wait_ready()
        expect[step] = _snapshot_state(model, opt)
        compared[step] = ckpt.stats.last_compared_bytes
    assert [n for n in ckpt.engine.watch.names] == [WEIGHT]  # the bias: 32 KiB, compared
    ckpt.close()
    return cfg, expect, compared


WEIGHT = "model/model/0.weight"


def _restored_big(cfg, step: int) -> dict[str, torch.Tensor]:
    return _restored(cfg, step, build=_big_lora)


def test_an_unchanged_frozen_base_is_compared_only_at_its_ends_and_restores_exactly(tmp_path):
    cfg, expect, compared = _run(tmp_path, "watch-quiet", {})
    # from step 4 on both slots were taken with the watch on: at most the partial pages
    # at the two ends of each frozen tensor are read, not its 16 MiB
    for step in range(4, 9):
        assert compared[step] <= 2 * PAGE + 32 * 1024, (step, compared[step])
    for step in (7, 8):  # the two a rank's slots hold
        _assert_same(_restored_big(cfg, step), expect[step])


def test_a_write_behind_autograd_is_caught_in_the_slot_taken_after_it_and_the_one_after(
        tmp_path):
    """The write lands before step 5's snapshot (slot A copies it); step 6's slot (B) held
    step 4's bytes and must copy it too, though the scan that saw the write was step 5's."""
    def write(model):  # the middle, and the partial pages at its two ends
        for i, j in ((4000, 17), (0, 0), (-1, -1)):
            model[0].weight.data[i, j] = 123.0

    cfg, expect, compared = _run(tmp_path, "watch-write", {5: write}, steps=6)
    assert expect[5]["m/0.weight"][4000, 17] == expect[5]["m/0.weight"][-1, -1] == 123.0
    for step in (5, 6):
        _assert_same(_restored_big(cfg, step), expect[step])
    assert compared[5] <= 4 * PAGE + 32 * 1024  # the pages written, not the base

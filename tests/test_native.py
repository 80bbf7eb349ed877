"""The native reader: exact bytes, modes, alignment contract, EOF, errors."""

from __future__ import annotations

import errno
import mmap
import os
import shutil
import tempfile
import threading
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import native
from native import HAVE_AIO, BypassFile, ReadOp, ReadPool, read_batch

BLOCK = native.DEFAULT_BLOCK_SIZE
SIZE = 1 << 20


@pytest.fixture(scope="module")
def payload() -> bytes:
    return os.urandom(SIZE + 1234)  # odd size: the last block is partial


@pytest.fixture()
def disk_file(tmp_path: Path, payload: bytes) -> Path:
    path = tmp_path / "data.bin"
    path.write_bytes(payload)
    return path


@pytest.fixture()
def tmpfs_file(payload: bytes):
    if not os.path.isdir("/dev/shm"):
        pytest.skip("no /dev/shm")
    directory = tempfile.mkdtemp(dir="/dev/shm", prefix="moeslab-test-")
    path = Path(directory, "data.bin")
    path.write_bytes(payload)
    yield path
    shutil.rmtree(directory)


@pytest.fixture()
def region():
    buffer = mmap.mmap(-1, 2 * SIZE)
    yield buffer
    buffer.close()


def _ops_for(file: BypassFile, spans: list[tuple[int, int]], stride: int = 3 * BLOCK) -> list[ReadOp]:
    """Ops with congruent destinations, spaced so rounded ranges never collide."""
    ops, cursor = [], 0
    for offset, length in spans:
        destination = cursor + offset % BLOCK
        ops.append(file.op(offset, length, destination))
        cursor = -(-(destination + length) // BLOCK) * BLOCK + stride
    return ops


SPANS = [(0, 1), (1, 4095), (4095, 2), (5000, 70_001), (123_457, 9), (SIZE + 1234 - 77, 77)]


@pytest.mark.parametrize(
    ("where", "mode", "refuse", "expected"),
    [
        ("disk", "auto", False, "direct"),
        ("disk", "direct", False, "direct"),
        ("disk", "auto", True, "dontneed"),
        ("disk", "dontneed", False, "dontneed"),
        ("disk", "buffered", False, "buffered"),
        ("tmpfs", "auto", True, "dontneed"),
        ("tmpfs", "buffered", False, "buffered"),
    ],
)
@pytest.mark.parametrize("aio", [True, False], ids=["aio", "threads"])
def test_bytes_land_exactly(request, payload, region, where, mode, refuse, expected, aio):
    path = request.getfixturevalue("disk_file" if where == "disk" else "tmpfs_file")
    with BypassFile.open(path, mode=mode, refuse_direct=refuse) as file:
        assert file.mode == expected
        assert file.fell_back == (refuse and mode == "auto")
        ops = _ops_for(file, SPANS)
        with ReadPool(threads=3, aio=aio) as pool:
            results = pool.read(region, ops)
            stats = pool.aio_stats()
    # Only direct reads go through kernel AIO, all of a call's at once.
    through_aio = aio and HAVE_AIO and expected == "direct"
    assert (stats.calls, stats.ranges) == ((1, len(ops)) if through_aio else (0, 0))
    assert stats.reread == stats.refused == stats.busy == 0
    for op, result in zip(ops, results):
        assert result.ok, result.describe()
        assert result.delivered == op.length
        assert result.transferred >= op.length
        assert result.service_ns > 0
        landed = region[op.region_offset : op.region_offset + op.length]
        assert landed == payload[op.file_offset : op.file_offset + op.length]


def test_tmpfs_auto_reports_what_it_got(tmpfs_file):
    # Linux >= 6.6 tmpfs accepts O_DIRECT; older kernels refuse it (EINVAL) and we fall back.
    with BypassFile.open(tmpfs_file) as file:
        assert file.mode in ("direct", "dontneed")
        assert file.fell_back == (file.mode == "dontneed")


def test_strict_direct_refusal_raises(disk_file):
    with pytest.raises(OSError) as caught:
        BypassFile.open(disk_file, mode="direct", refuse_direct=True)
    assert caught.value.errno == errno.EINVAL
    assert str(disk_file) in str(caught.value)


def test_missing_file_and_bad_mode(tmp_path):
    with pytest.raises(FileNotFoundError):
        BypassFile.open(tmp_path / "nope")
    with pytest.raises(ValueError, match="mode must be"):
        BypassFile.open(tmp_path / "nope", mode="fast")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="block_size"):
        BypassFile.open(tmp_path / "nope", block_size=1000)


@pytest.mark.parametrize("mode", ["auto", "buffered"])
def test_short_read_at_eof_is_an_error(disk_file, region, mode):
    size = disk_file.stat().st_size
    with BypassFile.open(disk_file, mode=mode) as file, ReadPool(threads=1) as pool:
        ops = [file.op(size - 10, 100, (size - 10) % BLOCK)]
        [result] = pool.read(region, ops)
        stats = pool.aio_stats()
    assert result.status == native.STATUS_SHORT_READ
    assert result.delivered == 10
    assert "short read" in result.describe()
    # Kernel AIO returns the short count; the range is read again with pread, which reports it.
    assert stats.reread == (1 if HAVE_AIO and file.mode == "direct" else 0)


def test_rounded_length_past_eof_is_fine(disk_file, payload, region):
    # The last 77 bytes end mid-block: the rounded read runs past EOF legitimately.
    with BypassFile.open(disk_file) as file:
        assert file.mode == "direct"
        offset = len(payload) - 77
        [result] = read_batch(region, [file.op(offset, 77, offset % BLOCK)])
    assert result.ok
    assert region[offset % BLOCK : offset % BLOCK + 77] == payload[-77:]


def test_direct_reads_may_fill_slack_buffered_do_not(disk_file, payload, region):
    for mode, slack_written in (("direct", True), ("buffered", False)):
        region[: 2 * BLOCK] = b"\xee" * (2 * BLOCK)
        with BypassFile.open(disk_file, mode=mode) as file:
            [result] = read_batch(region, [file.op(100, 10, 100)])
        assert result.ok
        assert region[100:110] == payload[100:110]
        assert (region[:100] == payload[:100]) is slack_written
        assert (region[:100] == b"\xee" * 100) is not slack_written


def test_alignment_contract_is_validated(disk_file, region):
    with BypassFile.open(disk_file) as file, ReadPool(threads=1) as pool:
        with pytest.raises(ValueError, match="not congruent"):
            pool.read(region, [file.op(0, 10, 1)])
        with pytest.raises(ValueError, match="outside the region"):
            pool.read(region, [file.op(0, BLOCK, len(region))])
        short = memoryview(region)[: 3 * BLOCK - 100]
        with pytest.raises(ValueError, match="outside the region"):  # only the rounded end spills over
            pool.read(short, [file.op(2 * BLOCK + 10, 10, 2 * BLOCK + 10)])
        short.release()
        with pytest.raises(ValueError, match="must be in"):
            pool.read(region, [file.op(100, 10, -3996)])
        view = memoryview(region)[1:]
        with pytest.raises(ValueError, match="not aligned"):
            pool.read(view, [file.op(1, 10, 0)])
        view.release()
        with pytest.raises(ValueError, match="block_size"):
            pool.read(region, [file.op(0, 10, 0)], block_size=3000)
        with pytest.raises(BufferError):
            pool.read(b"read-only", [file.op(0, 10, 0)])


def test_rounded_ranges_must_not_overwrite_other_requested_bytes(disk_file, payload, region):
    with BypassFile.open(disk_file) as file, ReadPool(threads=2) as pool:
        # A's rounded range [0, 8192) would overwrite B's requested bytes with other file bytes.
        with pytest.raises(ValueError, match="overlap"):
            pool.read(region, [file.op(0, 5000, 0), file.op(6000 + 8 * BLOCK, 10, 6000)])
        with pytest.raises(ValueError, match="overlap"):
            pool.read(region, [file.op(0, 100, 0), file.op(BLOCK, 100, 0)])
        # Adjacent ranges of one file at one displacement share their slack harmlessly.
        results = pool.read(region, [file.op(0, 5000, 0), file.op(5000, 10, 5000)])
    assert all(r.ok for r in results)
    assert region[:5010] == payload[:5010]


@pytest.mark.parametrize("aio", [True, False], ids=["aio", "threads"])
def test_per_op_errno(region, disk_file, aio):
    with BypassFile.open(disk_file) as file, ReadPool(threads=2, aio=aio) as pool:
        bad_fd = ReadOp(fd=999_999, file_offset=0, length=10, region_offset=BLOCK, mode="direct")
        good, bad = pool.read(region, [file.op(0, 10, 0), bad_fd])
        stats = pool.aio_stats()
    assert good.ok
    assert bad.status == errno.EBADF
    assert "EBADF" in bad.describe()
    # io_submit refuses the bad descriptor's range: it is read with pread, which names the errno.
    assert stats.refused == (1 if aio and HAVE_AIO else 0)


def test_without_kernel_aio_reads_run_on_the_threads_and_the_pool_says_why(disk_file, payload, region):
    """io_setup refused (here: more events than the kernel allows; elsewhere: no Linux AIO at all)."""
    with BypassFile.open(disk_file) as file, ReadPool(threads=2, aio_depth=1 << 30) as pool:
        ops = _ops_for(file, SPANS)
        results = pool.read(region, ops)
        stats = pool.aio_stats()
    assert all(result.ok for result in results)
    for op in ops:
        assert (
            region[op.region_offset : op.region_offset + op.length]
            == payload[op.file_offset : op.file_offset + op.length]
        )
    assert not stats.enabled and stats.calls == stats.ranges == 0
    assert stats.reason.startswith("io_setup failed: E") if HAVE_AIO else stats.reason
    assert ReadPool(threads=1, aio=False).aio_stats().reason == "not asked for"


def test_pool_serves_many_threads_and_closes(disk_file, payload):
    with BypassFile.open(disk_file) as file:
        pool = ReadPool(threads=4)
        assert pool.threads == 4
        regions = [mmap.mmap(-1, 64 * BLOCK) for _ in range(6)]
        errors: list[BaseException] = []

        def worker(index: int) -> None:
            try:
                for round_ in range(5):
                    offset = (index * 7919 + round_ * 104_729) % (SIZE - 40 * BLOCK)
                    ops = _ops_for(file, [(offset, 5 * BLOCK + 3), (offset + 9 * BLOCK + 1, 777)], stride=BLOCK)
                    results = pool.read(regions[index], ops)
                    for op, result in zip(ops, results):
                        assert result.ok
                        got = regions[index][op.region_offset : op.region_offset + op.length]
                        assert got == payload[op.file_offset : op.file_offset + op.length]
            except BaseException as error:  # surfaced below
                errors.append(error)

        threads = [threading.Thread(target=worker, args=(i,)) for i in range(6)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
        stats = pool.aio_stats()
        # Every call took one of the 4 AIO contexts, or found them all in use and ran on the threads.
        assert stats.calls + stats.busy == (30 if HAVE_AIO and file.mode == "direct" else 0)
        pool.close()
        pool.close()
        assert pool.closed
        with pytest.raises(ValueError, match="closed"):
            pool.read(regions[0], [file.op(0, 1, 0)])
        for buffer in regions:
            buffer.close()
    assert not errors, errors


def test_empty_batch_and_zero_length(region, disk_file):
    with BypassFile.open(disk_file) as file:
        assert read_batch(region, []) == []
        [result] = read_batch(region, [file.op(5, 0, 5)])
    assert result.ok and result.delivered == 0 and result.transferred == 0


def test_advice_and_block_sizes(disk_file):
    with BypassFile.open(disk_file, mode="buffered") as file:
        native.advise_willneed(file.fd, 0, 4096)
        native.advise_dontneed(file.fd)
        sizes = native.block_sizes(file.fd)
    assert set(sizes) == {"st_blksize", "f_bsize", "f_frsize", "device_logical"}
    assert sizes["st_blksize"] > 0
    with pytest.raises(OSError):
        native.advise_willneed(999_999, 0, 10)
    with pytest.raises(ValueError):
        native.advise_willneed(0, -1, 10)
    logical = native.device_logical_block_size(disk_file)
    assert logical is None or logical in (512, 1024, 2048, 4096)


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(spans=st.lists(st.tuples(st.integers(0, SIZE - 1), st.integers(1, 3 * BLOCK)), min_size=1, max_size=6))
def test_any_spans_land_exactly(disk_file, payload, region, spans):
    spans = [(offset, min(length, SIZE - offset)) for offset, length in spans]
    with BypassFile.open(disk_file) as file:
        ops = _ops_for(file, spans, stride=0)
        results = read_batch(region, ops, threads=3)
    for op, result in zip(ops, results):
        assert result.ok
        landed = region[op.region_offset : op.region_offset + op.length]
        assert landed == payload[op.file_offset : op.file_offset + op.length]


# ---------------------------------------------------------------------------------------------
# The stacked copy (native/slotcopy.c)


def test_stack_copies_each_tensor_of_each_row_into_its_destination():
    from native import _slotcopy

    src = bytes(range(256)) * 4
    first, second = bytearray(2 * 8), bytearray(2 * 4)
    _slotcopy.stack(src, [first, second], [8, 4], [0, 100, 300, 500])  # rows (0, 100) and (300, 500)
    assert bytes(first) == src[0:8] + src[300:308]
    assert bytes(second) == src[100:104] + src[500:504]


def test_stack_refuses_out_of_range_input_and_copies_nothing():
    import pytest

    from native import _slotcopy

    src = bytes(64)
    dst = bytearray(b"\x01" * 16)
    with pytest.raises(ValueError, match=r"row 1 tensor 0: bytes 60\.\.68 are outside the source's 64"):
        _slotcopy.stack(src, [dst], [8], [0, 60])
    with pytest.raises(ValueError, match="destination 0 holds 16 bytes; 3 rows of 8 need 24"):
        _slotcopy.stack(src, [dst], [8], [0, 8, 16])
    with pytest.raises(ValueError, match="sources\\[1\\] is negative"):
        _slotcopy.stack(src, [dst], [8], [0, -8])
    with pytest.raises(ValueError, match="2 destinations, 1 lengths, 2 sources"):
        _slotcopy.stack(src, [dst, dst], [8], [0, 8])
    assert bytes(dst) == b"\x01" * 16

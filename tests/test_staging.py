"""Staged direct reads: the same bytes as unstaged ones, counted; and when auto stages."""

from __future__ import annotations

import mmap
import os
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import native
from native import BypassFile, ReadPool
from native.staging import HUGE_PAGE, StagingBuffer, StagingChoice, choose_staging, slab_gets_huge_pages

BLOCK = native.DEFAULT_BLOCK_SIZE
SIZE = 6 << 20  # larger than one 2 MiB stride, so long reads go in pieces


@pytest.fixture(scope="module")
def payload() -> bytes:
    return os.urandom(SIZE + 555)  # odd size: the last block is partial


@pytest.fixture()
def disk_file(tmp_path: Path, payload: bytes) -> Path:
    path = tmp_path / "data.bin"
    path.write_bytes(payload)
    return path


@pytest.fixture()
def region():
    buffer = mmap.mmap(-1, 16 << 20)
    yield buffer
    buffer.close()


@pytest.fixture()
def staging():
    buffer = StagingBuffer(threads=2, stride=HUGE_PAGE)
    yield buffer
    buffer.close()


def _ops(file: BypassFile, spans: list[tuple[int, int]]) -> list:
    ops, cursor = [], 0
    for offset, length in spans:
        destination = cursor + offset % BLOCK
        ops.append(file.op(offset, length, destination))
        cursor = -(-(destination + length) // BLOCK) * BLOCK + BLOCK
    return ops


def _landed(region, op) -> bytes:
    return region[op.region_offset : op.region_offset + op.length]


def _read(file: BypassFile, region, spans, staging: StagingBuffer | None, above: int = 0):
    ops = _ops(file, spans)
    pool = ReadPool(threads=2, staging=staging, stage_above=above)
    try:
        results = pool.read(region, ops)
        stats = pool.staging_stats()
    finally:
        pool.close()
        del pool  # the native pool holds the staging buffer until it is freed
    return ops, results, stats


SPANS = [(1, 4095), (5000, 3 << 20), (BLOCK * 3, 2 << 20), (777_777, 70_001), (SIZE + 555 - 77, 77)]


def test_staged_reads_land_exactly_and_are_counted(disk_file, payload, region, staging):
    with BypassFile.open(disk_file) as file:
        assert file.mode == "direct"
        ops, results, stats = _read(file, region, SPANS, staging)
    for op, result in zip(ops, results):
        assert result.ok, result.describe()
        assert result.delivered == op.length
        assert _landed(region, op) == payload[op.file_offset : op.file_offset + op.length]
    assert stats.enabled and stats.stride == HUGE_PAGE and stats.stage_above == 0
    assert stats.staged_reads == len(SPANS)
    assert stats.staged_bytes == sum(r.transferred for r in results)
    assert stats.copy_ms > 0


def test_short_reads_stay_above_the_threshold_and_buffered_files_never_stage(disk_file, payload, region, staging):
    spans = [(0, 1000), (BLOCK, 3 << 20)]
    with BypassFile.open(disk_file) as file:
        _, results, stats = _read(file, region, spans, staging, above=1 << 20)
    assert all(r.ok for r in results)
    assert (stats.staged_reads, stats.staged_bytes) == (1, results[1].transferred)
    with BypassFile.open(disk_file, mode="buffered") as file:
        ops, results, stats = _read(file, region, spans, staging)
    assert all(r.ok for r in results) and stats.staged_reads == 0
    for op in ops:
        assert _landed(region, op) == payload[op.file_offset : op.file_offset + op.length]


def test_short_read_at_eof_through_staging_is_an_error(disk_file, region, staging):
    size = disk_file.stat().st_size
    with BypassFile.open(disk_file) as file:
        _, [result], _ = _read(file, region, [(size - 10, 100)], staging)
    assert result.status == native.STATUS_SHORT_READ
    assert result.delivered == 10


def test_staging_arguments_are_checked(staging):
    with pytest.raises(ValueError, match="strides for"):
        ReadPool(threads=3, staging=staging)
    with pytest.raises(ValueError, match="stage_above"):
        ReadPool(threads=2, staging=staging, stage_above=-1)
    with pytest.raises(ValueError, match="aligned"):
        native._bypassio.Pool(1, bytearray(4 << 20), 1 << 20, 0)  # a bytearray is not 1 MiB aligned
    with pytest.raises(ValueError, match="stage_stride"):
        native._bypassio.Pool(1, staging.view, 4096, 0)
    with pytest.raises(ValueError, match="multiple of"):
        StagingBuffer(threads=1, stride=HUGE_PAGE + 4096)
    pool = ReadPool(threads=2, staging=staging)
    with pytest.raises(BufferError):  # the pool still reads into it
        staging.close()
    pool.close()
    del pool
    assert ReadPool(threads=1).staging_stats().enabled is False


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    spans=st.lists(st.tuples(st.integers(0, SIZE - 1), st.integers(1, 5 << 20)), min_size=1, max_size=3),
    above=st.sampled_from([0, BLOCK, 1 << 20]),
)
def test_any_staged_spans_land_exactly(disk_file, payload, region, staging, spans, above):
    spans = [(offset, min(length, SIZE - offset)) for offset, length in spans]
    if sum(length + 2 * BLOCK for _, length in spans) > len(region):
        spans = spans[:1]
    with BypassFile.open(disk_file) as file:
        ops, results, _ = _read(file, region, spans, staging, above)
    for op, result in zip(ops, results):
        assert result.ok
        assert _landed(region, op) == payload[op.file_offset : op.file_offset + op.length]


# ---------------------------------------------------------------- the choice


SHMEM_NEVER = "always within_size advise [never] deny force"


def fake_sysfs(
    root: Path,
    target: Path,
    *,
    anon="always [madvise] never",
    shmem=SHMEM_NEVER,
    segments=254,
    sectors_kb=4096,
    partition=False,
) -> Path:
    thp = root / "kernel" / "mm" / "transparent_hugepage"
    thp.mkdir(parents=True)
    (thp / "enabled").write_text(anon + "\n")
    (thp / "shmem_enabled").write_text(shmem + "\n")
    st_dev = target.stat().st_dev
    disk = root / "devices" / "disk"
    node = disk / "part1" if partition else disk
    node.mkdir(parents=True)
    (disk / "queue").mkdir()
    (disk / "queue" / "max_segments").write_text(f"{segments}\n")
    (disk / "queue" / "max_sectors_kb").write_text(f"{sectors_kb}\n")
    (root / "dev" / "block").mkdir(parents=True)
    (root / "dev" / "block" / f"{os.major(st_dev)}:{os.minor(st_dev)}").symlink_to(node)
    return root


EXPERT = 2_936_832
SHM_LINE = "tmpfs /dev/shm tmpfs rw,relatime,size=24683772k{huge} 0 0"


def fake_mounts(root: Path, *hugeness: str | None) -> Path:
    """A mount table with one /dev/shm mount per entry of `hugeness` (its huge= option, None: none),
    each on top of the one before, between unrelated mounts."""
    lines = ["/dev/vda1 / ext4 rw,relatime,huge=always 0 0"]
    lines += [SHM_LINE.format(huge="" if huge is None else f",huge={huge}") for huge in hugeness]
    lines.append("tmpfs /dev/shm/inner tmpfs rw,huge=always 0 0")
    path = root / "mounts"
    path.write_text("\n".join(lines) + "\n")
    return path


@pytest.mark.parametrize("partition", [False, True])
def test_auto_stages_where_the_segment_limit_splits_reads(tmp_path, disk_file, partition):
    sysfs = fake_sysfs(tmp_path / "sys", disk_file, partition=partition)
    mounts = fake_mounts(tmp_path, None)
    choice = choose_staging([str(disk_file)], largest_read=EXPERT, sysfs=sysfs, mounts=mounts, platform="linux")
    assert choice == StagingChoice(True, choice.reason, 4 << 20, 254 * 4096)
    assert "segment limit" in choice.reason


@pytest.mark.parametrize(
    ("options", "largest", "fragment"),
    [
        (dict(anon="always madvise [never]"), EXPERT, "enabled=never"),
        (dict(shmem="always within_size advise never deny [force]"), EXPERT, "shmem_enabled=force"),
        (dict(segments=1024), EXPERT, "not split by the segment limit"),
        (dict(sectors_kb=512), EXPERT, "not split by the segment limit"),
        ({}, 512 << 10, "not split by the segment limit"),
    ],
)
def test_auto_leaves_staging_off_where_it_cannot_pay(tmp_path, disk_file, options, largest, fragment):
    sysfs = fake_sysfs(tmp_path / "sys", disk_file, **options)
    mounts = fake_mounts(tmp_path, None)
    choice = choose_staging([str(disk_file)], largest_read=largest, sysfs=sysfs, mounts=mounts, platform="linux")
    assert not choice.enabled and fragment in choice.reason


@pytest.mark.parametrize(
    ("shmem", "mounts", "huge", "fragment"),
    [
        # shmem_enabled governs the kernel's internal shmem mount, not /dev/shm (measured here:
        # within_size and always there gave a prefaulted slab no huge page; huge=within_size on the
        # mount did): before, a non-never setting turned staging off and left the reads split.
        ("always within_size [advise] never deny force", [None], False, "/dev/shm mounted with huge=never"),
        ("[always] within_size advise never deny force", [None], False, "huge=never"),
        (SHMEM_NEVER, ["within_size"], True, "/dev/shm mounted with huge=within_size"),
        (SHMEM_NEVER, ["always"], True, "huge=always"),
        (SHMEM_NEVER, ["advise"], False, "huge=advise"),  # fallocate never madvises: small pages
        (SHMEM_NEVER, ["always", None], False, "huge=never"),  # the later mount hides the earlier
        (SHMEM_NEVER, [None, "within_size"], True, "huge=within_size"),
        (SHMEM_NEVER, [], False, "huge=never"),  # no /dev/shm mount found
        ("always within_size advise never [deny] force", ["always"], False, "shmem_enabled=deny"),
        ("always within_size advise never deny [force]", [None], True, "shmem_enabled=force"),
    ],
)
def test_the_slab_gets_huge_pages_by_its_mount(tmp_path, disk_file, shmem, mounts, huge, fragment):
    sysfs = fake_sysfs(tmp_path / "sys", disk_file, shmem=shmem)
    table = fake_mounts(tmp_path, *mounts)
    got, why = slab_gets_huge_pages(sysfs=sysfs, mounts=table)
    assert (got, fragment in why) == (huge, True), why
    choice = choose_staging([str(disk_file)], largest_read=EXPERT, sysfs=sysfs, mounts=table, platform="linux")
    assert choice.enabled is not huge  # a slab on huge pages takes whole reads: no staging copy
    assert (fragment in choice.reason) is huge, choice.reason


def test_the_slab_mount_read_here_matches_the_kernel(tmp_path):
    """On this host: a slab made in /dev/shm is on huge pages exactly when slab_gets_huge_pages says so."""
    if not Path("/proc/self/mounts").exists():
        pytest.skip("no /proc/self/mounts (not Linux)")
    from shared.slab import Slab

    def shmem_huge_bytes() -> int:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("ShmemHugePages:"):
                return int(line.split()[1]) * 1024
        return 0

    huge, why = slab_gets_huge_pages()
    before = shmem_huge_bytes()
    slab = Slab.create(total_slots=8, slot_bytes=HUGE_PAGE, prefault=True)
    try:
        grew = shmem_huge_bytes() - before
    finally:
        slab.close()
        slab.unlink()
    # Another process may make or drop huge shmem meanwhile: only the direction is asserted.
    assert (grew >= 4 * HUGE_PAGE) is huge, (why, grew)


def test_requests_and_platforms(tmp_path, disk_file):
    files = [str(disk_file)]
    assert not choose_staging(files, largest_read=EXPERT, platform="darwin").enabled
    assert not choose_staging(files, largest_read=EXPERT, sysfs=tmp_path / "empty", platform="linux").enabled
    assert choose_staging(files, largest_read=EXPERT, requested="off").reason == "staging off by request"
    forced = choose_staging(files, largest_read=EXPERT, requested="on", platform="darwin")
    assert forced.enabled and forced.stride == 4 << 20 and forced.stage_above == 0
    with pytest.raises(ValueError, match="staging must be one of"):
        choose_staging(files, largest_read=EXPERT, requested="always")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="largest_read must be positive, got 0"):
        choose_staging(files, largest_read=0)

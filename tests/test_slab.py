"""The POSIX shared-memory slab: naming, sizing, attach, footprint, cleanup."""

from __future__ import annotations

import os
import stat
import sys

import posix_ipc
import pytest

from shared.slab import MAX_NAME_LENGTH, SLAB_NAME_PREFIX, SLOT_ALIGNMENT, Slab, check_slab_name, new_slab_name

SLOT = SLOT_ALIGNMENT


def test_names_are_short_random_and_prefixed():
    names = {new_slab_name() for _ in range(50)}
    assert len(names) == 50
    for name in names:
        assert name.startswith(SLAB_NAME_PREFIX)
        assert len(name) <= MAX_NAME_LENGTH
        assert check_slab_name(name) == name
    for bad in ("moeslab-x", "/other-123", "/moeslab-" + "a" * 30, "/moeslab-a/b"):
        with pytest.raises(ValueError, match="slab name"):
            check_slab_name(bad)


def test_create_maps_the_whole_segment_with_mode_0600():
    with Slab.create(total_slots=3, slot_bytes=2 * SLOT) as slab:
        assert slab.size == 6 * SLOT
        assert len(slab.buffer) == slab.size
        assert [slab.slot_offset(i) for i in range(3)] == [0, 2 * SLOT, 4 * SLOT]
        if sys.platform.startswith("linux"):
            info = os.stat("/dev/shm" + slab.name)
            assert stat.S_IMODE(info.st_mode) == 0o600
            assert info.st_size == slab.size
        with pytest.raises(posix_ipc.ExistentialError):  # O_CREX: never reuse a live name
            Slab.create(total_slots=1, slot_bytes=SLOT, name=slab.name)
    assert not os.path.exists("/dev/shm" + slab.name)


@pytest.mark.parametrize(
    ("slots", "stride", "message"),
    [
        (0, SLOT, "total_slots"),
        (1, 0, "slot_bytes"),
        (1, SLOT + 4096, "multiple of 16384"),
        (1, 4096, "16384"),
    ],
)
def test_bad_geometry_is_refused(slots, stride, message):
    with pytest.raises(ValueError, match=message):
        Slab.create(total_slots=slots, slot_bytes=stride)


def test_attach_sees_the_same_bytes_and_does_not_unlink():
    with Slab.create(total_slots=2, slot_bytes=SLOT) as owner:
        view = owner.slot_view(1)
        view[:5] = b"hello"
        view.release()
        with Slab.attach(owner.name, total_slots=2, slot_bytes=SLOT) as worker:
            assert not worker.owner
            assert bytes(worker.slot_view(1)[:5]) == b"hello"
        assert os.path.exists("/dev/shm" + owner.name) or not sys.platform.startswith("linux")
        with pytest.raises(ValueError, match="need"):
            Slab.attach(owner.name, total_slots=3, slot_bytes=SLOT)
        with pytest.raises(ValueError, match="outside"):
            owner.slot_view(2)


def test_a_view_of_consecutive_slots_spans_exactly_them():
    with Slab.create(total_slots=4, slot_bytes=SLOT) as slab:
        view = slab.slots_view(1, 2)
        assert len(view) == 2 * SLOT
        view[SLOT : SLOT + 3] = b"abc"  # the second slot of the view is slot 2
        view.release()
        second = slab.slot_view(2)
        assert bytes(second[:3]) == b"abc"
        second.release()
        for first, count in ((3, 2), (0, 0), (4, 1), (-1, 1)):
            with pytest.raises(ValueError):
                slab.slots_view(first, count)


def test_attach_to_a_missing_segment_fails():
    with pytest.raises(posix_ipc.ExistentialError):
        Slab.attach(new_slab_name(), total_slots=1, slot_bytes=SLOT)


def test_close_releases_the_mapping():
    slab = Slab.create(total_slots=1, slot_bytes=SLOT)
    try:
        view = slab.slot_view(0)
        with pytest.raises(BufferError):  # an exported view keeps the mapping open
            slab.close()
        assert not slab.closed
        view.release()
        slab.close()
        slab.close()
        assert slab.closed
        with pytest.raises(ValueError, match="closed"):
            slab.slot_view(0)
    finally:
        slab.unlink()
        slab.unlink()


def test_resident_bytes_follow_touched_pages():
    with Slab.create(total_slots=4, slot_bytes=SLOT) as slab:
        assert slab.resident_bytes() == 0
        view = slab.slot_view(2)
        view[:1] = b"x"
        view.release()
        touched = slab.resident_bytes()
        assert 0 < touched <= SLOT
    with Slab.create(total_slots=4, slot_bytes=SLOT, prefault=True) as slab:
        assert slab.resident_bytes() == slab.size


def test_names_without_a_session_tag(monkeypatch):
    """Outside the test session (a user's launch) there is no tag: names still work."""
    from shared.slab import SLAB_TAG_ENV

    monkeypatch.delenv(SLAB_TAG_ENV, raising=False)
    name = new_slab_name()
    assert name.startswith(SLAB_NAME_PREFIX) and len(name) <= MAX_NAME_LENGTH
    assert check_slab_name(name) == name
    monkeypatch.setenv(SLAB_TAG_ENV, "bad/tag")
    with pytest.raises(ValueError, match="bad/tag"):
        new_slab_name()

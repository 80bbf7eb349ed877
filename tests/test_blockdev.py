"""native.blockdev.mount_of on a mount table given by hand: the mount that holds a path."""

from __future__ import annotations

from native.blockdev import mount_of

TABLE = """\
/dev/vda1 / ext4 rw,relatime 0 0
tmpfs /dev/shm tmpfs rw,size=1k 0 0
tmpfs /dev/shm tmpfs rw,huge=within_size 0 0
/dev/vdb1 /data\\040set xfs rw 0 0
"""


def test_the_longest_point_holds_a_path_and_a_later_mount_hides_an_earlier(tmp_path):
    table = tmp_path / "mounts"
    table.write_text(TABLE)
    shm = mount_of("/dev/shm/moeslab-slab", mounts=table)
    assert (shm.point, shm.type, shm.option("huge"), shm.option("size")) == ("/dev/shm", "tmpfs", "within_size", None)
    assert mount_of("/data set/model.safetensors", mounts=table).type == "xfs"  # \040 is a space
    assert mount_of("/data settled", mounts=table).point == "/"  # a prefix of the name is no parent
    assert mount_of("/", mounts=table).type == "ext4"
    assert mount_of("/", mounts=tmp_path / "missing") is None

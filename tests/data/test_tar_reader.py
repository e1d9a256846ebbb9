"""vitattn.data.shards.reading against Python's tarfile, the reader webdataset uses: the same files, names and bytes
for every tar layout tarfile writes, and the same refusals for damaged tars."""

import gzip
import io
import tarfile

import pytest

from vitattn.data.shards import read_shard
from vitattn.data.shards.reading import BLOCK, is_plain_tar, tar_members

LONG = "a-directory-with-a-long-name/" * 5 + "sample-0001.jpg"  # over 100 characters: prefix, GNU L or pax path
NAMES = ["k0.jpg", "k0.txt", "k0.json", "ключ-1.jpg", "ключ-1.txt", LONG, "sub/dir/k2.cls", "empty.txt"]


def _tar(fmt: int, names: list[str] = NAMES) -> bytes:
    """A tar of ``names`` (with a directory, a symlink and a webdataset metadata member among them)."""
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w", format=fmt) as tar:
        for i, name in enumerate(names):
            if i == 3:
                folder = tarfile.TarInfo("sub")
                folder.type = tarfile.DIRTYPE
                tar.addfile(folder)
                link = tarfile.TarInfo("link.jpg")
                link.type, link.linkname = tarfile.SYMTYPE, "k0.jpg"
                tar.addfile(link)
                meta = tarfile.TarInfo("__meta__/info.json")
                meta.size = 2
                tar.addfile(meta, io.BytesIO(b"{}"))
            data = b"" if name == "empty.txt" else (name.encode() * (i * 97 + 1))[: i * 700 + 3]
            info = tarfile.TarInfo(name)
            info.size, info.mtime = len(data), 1_700_000_000
            tar.addfile(info, io.BytesIO(data))
    return buf.getvalue()


def _with_tarfile(data: bytes) -> list[tuple[str, bytes]]:
    with tarfile.open(fileobj=io.BytesIO(data), mode="r|*") as tar:
        return [(m.name, tar.extractfile(m).read()) for m in tar if m.isreg() and not m.name.startswith("__meta__")]


@pytest.mark.parametrize("fmt", [tarfile.USTAR_FORMAT, tarfile.GNU_FORMAT, tarfile.PAX_FORMAT])
def test_the_files_names_and_bytes_are_tarfiles(fmt):
    ascii_only = fmt == tarfile.USTAR_FORMAT  # ustar has no room for non-ASCII names
    data = _tar(fmt, [n for n in NAMES if n.isascii() or not ascii_only])
    expected = _with_tarfile(data)
    assert LONG in [name for name, _ in expected] and len(expected) >= 6
    assert is_plain_tar(io.BytesIO(data))
    assert [(name, member) for _, name, member in tar_members(io.BytesIO(data))] == expected


def test_a_tar_that_ends_inside_a_member_is_refused_as_tarfile_refuses_it():
    data = _tar(tarfile.PAX_FORMAT)
    with tarfile.open(fileobj=io.BytesIO(data)) as tar:
        member = max(tar.getmembers(), key=lambda m: m.size)
    cut = data[: member.offset_data + member.size // 2]
    with pytest.raises(tarfile.ReadError, match="unexpected end of data"):
        list(tar_members(io.BytesIO(cut)))
    with pytest.raises(tarfile.ReadError):
        _with_tarfile(cut)


def test_a_damaged_header_fails_its_checksum():
    data = bytearray(_tar(tarfile.GNU_FORMAT))
    second = BLOCK + -(-len(b"k0.jpg") // BLOCK) * BLOCK  # the second member's header
    data[second + 5] ^= 0x55
    with pytest.raises(tarfile.ReadError, match="bad checksum"):
        list(tar_members(io.BytesIO(bytes(data))))


def test_compressed_or_foreign_files_are_not_plain_tars():
    data = _tar(tarfile.PAX_FORMAT)
    assert not is_plain_tar(io.BytesIO(gzip.compress(data)))
    assert not is_plain_tar(io.BytesIO(b"this is not a tar file" * 100))
    assert not is_plain_tar(io.BytesIO(data[:100]))


def test_read_shard_gives_the_same_samples_from_a_plain_and_a_gzipped_shard(tmp_path):
    data = _tar(tarfile.PAX_FORMAT)
    plain, packed = tmp_path / "00000.tar", tmp_path / "00001.tar.gz"
    plain.write_bytes(data)
    packed.write_bytes(gzip.compress(data))  # not plain: read through webdataset's tarfile path
    samples = [[{k: v for k, v in s.items() if k != "__url__"} for s in read_shard(str(p))] for p in (plain, packed)]
    assert samples[0] == samples[1]
    files = dict(_with_tarfile(data))
    assert samples[0][0] == {"__key__": "k0", "jpg": files["k0.jpg"], "txt": files["k0.txt"], "json": files["k0.json"]}

"""pagedkv.atomic_write: the one atomic file replacement (temporary file, fsync, rename,
directory fsync), its failure paths and the state they leave."""

from __future__ import annotations

import errno
import os
import stat

import pytest

from pagedkv.atomic_write import AtomicFile, sync_directory, temp_name_beside
from pagedkv.errors import InvariantViolation


def _record_fsyncs(monkeypatch) -> list[tuple[str, str]]:
    """Replace os.fsync by a recorder: ``(kind, realpath)`` per call, kind "dir" or "file"."""
    calls: list[tuple[str, str]] = []
    real = os.fsync

    def fsync(fd):
        kind = "dir" if stat.S_ISDIR(os.fstat(fd).st_mode) else "file"
        calls.append((kind, os.path.realpath(f"/proc/self/fd/{fd}")))
        return real(fd)

    monkeypatch.setattr(os, "fsync", fsync)
    return calls


def test_commit_syncs_the_file_then_renames_then_syncs_the_directory(tmp_path, monkeypatch):
    target = tmp_path / "out.bin"
    target.write_bytes(b"old")
    calls = _record_fsyncs(monkeypatch)
    with AtomicFile(target) as f:
        temp = f.temp_path
        assert os.path.dirname(temp) == str(tmp_path)
        assert os.path.basename(temp).startswith(".out.bin.") and temp.endswith(".tmp")
        f.write(b"new ")
        f.write(memoryview(b"bytes"))
        assert target.read_bytes() == b"old"        # not visible before the commit
        assert calls == []
    assert calls == [("file", temp), ("dir", str(tmp_path))]
    assert target.read_bytes() == b"new bytes"
    assert sorted(os.listdir(tmp_path)) == ["out.bin"]
    assert f.state == "committed"


def test_an_exception_in_the_block_leaves_the_target_and_no_temporary(tmp_path, monkeypatch):
    target = tmp_path / "out.bin"
    target.write_bytes(b"old")
    calls = _record_fsyncs(monkeypatch)
    with pytest.raises(KeyError), AtomicFile(target) as f:
        f.write(b"partial")
        raise KeyError("boom")
    assert target.read_bytes() == b"old"
    assert os.listdir(tmp_path) == ["out.bin"]
    assert calls == [] and f.state == "aborted"
    f.abort()                                       # idempotent
    assert f.state == "aborted"


def test_a_failing_file_sync_aborts_before_the_rename(tmp_path, monkeypatch):
    target = tmp_path / "out.bin"

    def fsync(fd):
        raise OSError(errno.EIO, "injected")

    monkeypatch.setattr(os, "fsync", fsync)
    f = AtomicFile(target)
    f.write(b"x")
    with pytest.raises(OSError, match="injected"):
        f.commit()
    assert os.listdir(tmp_path) == [] and f.state == "aborted"


def test_a_failing_directory_sync_raises_after_the_rename(tmp_path, monkeypatch):
    target = tmp_path / "out.bin"
    real = os.fsync

    def fsync(fd):
        if stat.S_ISDIR(os.fstat(fd).st_mode):
            raise OSError(errno.EIO, "injected directory sync failure")
        return real(fd)

    monkeypatch.setattr(os, "fsync", fsync)
    f = AtomicFile(target)
    f.write(b"x")
    with pytest.raises(OSError, match="injected directory sync failure"):
        f.commit()
    assert target.read_bytes() == b"x" and f.state == "renamed"


@pytest.mark.parametrize("code", [errno.EINVAL, errno.ENOTSUP])
def test_a_filesystem_that_cannot_sync_directories_is_not_an_error(tmp_path, monkeypatch, code):
    real = os.fsync

    def fsync(fd):
        if stat.S_ISDIR(os.fstat(fd).st_mode):
            raise OSError(code, "not here")
        return real(fd)

    monkeypatch.setattr(os, "fsync", fsync)
    sync_directory(tmp_path)
    with AtomicFile(tmp_path / "a") as f:
        f.write(b"1")
    assert (tmp_path / "a").read_bytes() == b"1" and f.state == "committed"


def test_sync_false_skips_both_fsyncs(tmp_path, monkeypatch):
    calls = _record_fsyncs(monkeypatch)
    with AtomicFile(tmp_path / "a", sync=False) as f:
        f.write(b"1")
    assert calls == [] and (tmp_path / "a").read_bytes() == b"1"


def test_names_relative_to_a_directory_descriptor(tmp_path, monkeypatch):
    fd = os.open(tmp_path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        calls = _record_fsyncs(monkeypatch)
        with AtomicFile("obj", dir_fd=fd, temp_name=".obj.tmp", mode=0o600) as f:
            f.write(b"payload")
            assert os.listdir(tmp_path) == [".obj.tmp"]
        assert calls == [("file", str(tmp_path / ".obj.tmp")), ("dir", str(tmp_path))]
        assert (tmp_path / "obj").read_bytes() == b"payload"
        assert stat.S_IMODE(os.stat(tmp_path / "obj").st_mode) == 0o600
    finally:
        os.close(fd)


def test_the_temporary_name_is_never_reused_or_followed(tmp_path):
    (tmp_path / "elsewhere").write_bytes(b"keep")
    os.symlink(tmp_path / "elsewhere", tmp_path / ".t.tmp")
    with pytest.raises(FileExistsError, match=r"creating the temporary file \.t\.tmp next to it"):
        AtomicFile(tmp_path / "t", temp_name=str(tmp_path / ".t.tmp"))
    assert (tmp_path / "elsewhere").read_bytes() == b"keep"
    assert not (tmp_path / "t").exists()
    assert temp_name_beside("/a/b/c.hfq") != temp_name_beside("/a/b/c.hfq")


def test_a_missing_directory_names_the_target(tmp_path):
    with pytest.raises(FileNotFoundError) as info:
        AtomicFile(tmp_path / "nope" / "x")
    assert info.value.filename == str(tmp_path / "nope" / "x")


def test_steps_out_of_order_raise_and_change_nothing(tmp_path):
    f = AtomicFile(tmp_path / "a")
    with pytest.raises(InvariantViolation, match="is open, this step needs it finished"):
        f.rename()
    assert f.state == "open" and os.listdir(tmp_path) == [os.path.basename(f.temp_path)]
    f.finish()
    with pytest.raises(InvariantViolation, match="is finished, this step needs it open"):
        f.finish()
    f.rename()
    f.abort()                                       # after the rename: nothing to delete
    assert os.listdir(tmp_path) == ["a"] and f.state == "renamed"
    assert "renamed" in repr(f)


def _failing_close(monkeypatch, fail_fd: list[int]) -> list[int]:
    """Replace os.close: every call is recorded; the descriptor in ``fail_fd`` is really
    closed and then reported as failed with EIO (as close(2) does on NFS: the descriptor is
    released whatever close returns)."""
    closed: list[int] = []
    real = os.close

    def close(fd):
        closed.append(fd)
        real(fd)
        if fail_fd and fd == fail_fd[0]:
            raise OSError(errno.EIO, "injected close failure")

    monkeypatch.setattr(os, "close", close)
    return closed


def test_a_failing_close_releases_the_descriptor_once_and_deletes_the_temporary(
        tmp_path, monkeypatch):
    # close(2) releases the descriptor even when it reports an error; closing it again in
    # abort() would close whatever another thread opened under that number meanwhile, and
    # the EBADF it raised skipped the unlink, leaving the temporary file behind.
    target = tmp_path / "out.bin"
    target.write_bytes(b"old")
    f = AtomicFile(target)
    f.write(b"new bytes")
    closed = _failing_close(monkeypatch, [f.fd])
    fd = f.fd
    with pytest.raises(OSError) as info:
        f.commit()
    assert info.value.errno == errno.EIO
    assert closed.count(fd) == 1
    assert target.read_bytes() == b"old"
    assert os.listdir(tmp_path) == ["out.bin"]
    assert f.state == "aborted"

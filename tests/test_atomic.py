"""Atomic writes leave either the old content or the new, never a half-written one."""

import os
import stat

import pytest

from omni.atomic import write_directory, write_text


def test_failed_write_leaves_the_previous_directory(tmp_path):
    final = tmp_path / "step_000002"
    write_directory(final, lambda tmp: (tmp / "weights.bin").write_bytes(b"old"))

    def fail_midway(tmp):
        (tmp / "weights.bin").write_bytes(b"half a")
        raise OSError("disk full")

    with pytest.raises(OSError, match="disk full"):
        write_directory(final, fail_midway)
    assert (final / "weights.bin").read_bytes() == b"old"
    assert [p.name for p in tmp_path.iterdir()] == ["step_000002"]  # no temporary left behind


def test_nested_directories_and_replacement(tmp_path):
    final = tmp_path / "model"
    write_directory(final, lambda tmp: (tmp / "a").mkdir() or (tmp / "a" / "x").write_text("1"))
    write_directory(final, lambda tmp: (tmp / "b").write_text("2"))
    assert sorted(p.name for p in final.iterdir()) == ["b"]


def test_write_text_replaces(tmp_path):
    write_text(tmp_path / "latest", "step_000001")
    write_text(tmp_path / "latest", "step_000002")
    assert (tmp_path / "latest").read_text() == "step_000002"
    assert [p.name for p in tmp_path.iterdir()] == ["latest"]


def test_replacing_never_leaves_the_old_content_nowhere(tmp_path, monkeypatch):
    """A crash between taking the old directory away and putting the new one in place keeps
    the old content on disk (renamed aside), never deleted before its successor exists."""
    import omni.atomic as atomic

    final = tmp_path / "step_000002"
    write_directory(final, lambda tmp: (tmp / "weights.bin").write_bytes(b"old"))
    real_replace = atomic.os.replace

    def crash_when_the_new_one_goes_in(src, dst):
        if str(dst) == str(final):
            raise OSError("killed")
        return real_replace(src, dst)

    monkeypatch.setattr(atomic.os, "replace", crash_when_the_new_one_goes_in)
    with pytest.raises(OSError, match="killed"):
        write_directory(final, lambda tmp: (tmp / "weights.bin").write_bytes(b"new"))
    kept = [p.read_bytes() for p in tmp_path.rglob("weights.bin")]
    assert b"old" in kept


@pytest.mark.parametrize("umask", [0o022, 0o002, 0o077])
def test_what_is_renamed_into_place_respects_the_umask(tmp_path, umask):
    """Not the private 0700/0600 of the temporary names: the modes `mkdir` and `open` give."""
    old = os.umask(umask)
    try:
        final = write_directory(
            tmp_path / "step_000001", lambda tmp: (tmp / "sub").mkdir() or (tmp / "sub" / "w").write_bytes(b"1")
        )
        write_text(tmp_path / "latest", "step_000001")
    finally:
        os.umask(old)
    mode = lambda p: stat.S_IMODE(p.stat().st_mode)  # noqa: E731
    assert (mode(final), mode(final / "sub")) == (0o777 & ~umask,) * 2
    assert (mode(final / "sub" / "w"), mode(tmp_path / "latest")) == (0o666 & ~umask,) * 2

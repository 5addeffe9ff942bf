"""TorchServe's temp directory gets a short name, whatever the run directory's length."""

from __future__ import annotations

import stat
from pathlib import Path

import pytest

from archive_tools import short_tmp, ts_logs
from handlers.errors import Inf2ServeError


def test_a_long_run_directory_gets_a_short_private_link(tmp_path: Path) -> None:
    run = tmp_path / ("long-" * 30) / "run"
    run.mkdir(parents=True)
    link = short_tmp.short_tmp(run)
    try:
        assert len(f"{link}/.ts.sock.65535") <= short_tmp.SOCKET_PATH_MAX
        assert link.is_symlink() and link.resolve() == (run / "tmp").resolve()
        mode = link.parent.stat().st_mode
        assert stat.S_IMODE(mode) == 0o700  # ours alone: nobody else can swap the link
        assert (run / ts_logs.TMP_LINK_FILE).read_text() == str(link)
        (link / "f").write_text("x")  # written through the link, kept in the run directory
        assert (run / "tmp" / "f").read_text() == "x"
        again = short_tmp.short_tmp(run)  # a new start replaces the earlier link
        assert again != link and not link.parent.exists()
        link = again
    finally:
        short_tmp.drop_short_tmp(run)
    assert not link.parent.exists() and not (run / ts_logs.TMP_LINK_FILE).exists()
    assert (run / "tmp" / "f").exists()  # the files stay


def test_where_even_the_short_path_is_too_long_it_says_so(tmp_path: Path,
                                                          monkeypatch) -> None:
    deep = tmp_path / ("d" * 90)
    deep.mkdir()
    monkeypatch.setattr(short_tmp, "SHORT_TMP_BASES", (str(deep),))
    run = tmp_path / "run"
    run.mkdir()
    with pytest.raises(Inf2ServeError, match=r"past the 107-byte limit of a Unix socket path; "
                                             "set TMPDIR to a short directory"):
        short_tmp.short_tmp(run)
    assert not (run / ts_logs.TMP_LINK_FILE).exists() and not list(deep.iterdir())

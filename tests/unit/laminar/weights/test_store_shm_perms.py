"""A relay's shared-memory folder is private to the user the relay runs as: created 0700, its files
0600, and a folder that belongs to another user is refused at open with an error naming both
(another user could otherwise plant weights that rollouts load)."""
from __future__ import annotations

import os
import shutil
import stat
import uuid
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")

from laminar.weights.local_write import write_version  # noqa: E402
from laminar.weights.store import ShmStore  # noqa: E402


@pytest.fixture
def folder():
    d = Path(f"/dev/shm/laminar-unit-{uuid.uuid4().hex[:10]}")
    yield d
    shutil.rmtree(d, ignore_errors=True)


def mode(p: Path) -> int:
    return stat.S_IMODE(os.stat(p).st_mode)


def test_folder_and_files_are_private(folder):
    store = ShmStore(folder, retain=1)
    store.open()
    try:
        for v in range(3):
            write_version(store, {"w": torch.full((5000,), float(v))}, v, chunk_bytes=4096)
        assert mode(folder) == 0o700
        files = sorted(folder.iterdir())
        assert {p.name for p in files} >= {"current", "slot0.bin", "slot1.bin", "v1.bin", "v1.manifest"}
        assert {p.name: mode(p) for p in files} == {p.name: 0o600 for p in files}
    finally:
        store.close()


@pytest.mark.skipif(os.geteuid() != 0, reason="needs root to give the folder to another user")
def test_a_folder_of_another_user_is_refused(folder):
    folder.mkdir(mode=0o700)
    os.chown(folder, 4242, 4242)
    store = ShmStore(folder)
    with pytest.raises(PermissionError) as err:
        store.open()
    assert str(folder) in str(err.value) and "4242" in str(err.value) and str(os.geteuid()) in str(err.value)
    assert os.stat(folder).st_uid == 4242  # left as it was: nothing removed or taken over


def test_an_open_folder_is_made_private(folder):
    folder.mkdir(mode=0o755)
    os.chmod(folder, 0o777)
    store = ShmStore(folder)
    store.open()
    try:
        assert mode(folder) == 0o700
    finally:
        store.close()


@pytest.mark.skipif(os.geteuid() != 0, reason="needs root to give the folder to another user")
def test_weights_are_not_loaded_from_a_folder_of_another_user(folder):
    from laminar.weights.pull import LocalWeights
    store = ShmStore(folder)
    store.open()
    try:
        write_version(store, {"w": torch.ones(100)}, 1, chunk_bytes=4096)
        assert LocalWeights(folder).current_version() == 1
        os.chown(folder, 4242, 4242)
        with pytest.raises(PermissionError, match="4242"):
            LocalWeights(folder).latest()
    finally:
        store.close()

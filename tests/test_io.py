"""Atomic, durable writes: a crash leaves the old file or the whole new one."""

import os

import pytest
import torch

from eaglespec import io


@pytest.mark.parametrize("kind", ["safetensors", "torch", "json"])
def test_every_atomic_write_is_flushed_to_disk_with_its_folder(tmp_path, monkeypatch, kind):
    synced = []
    real = os.fsync

    def spy(fd):
        synced.append(os.readlink(f"/proc/self/fd/{fd}"))
        return real(fd)

    monkeypatch.setattr(os, "fsync", spy)
    path = tmp_path / f"out.{kind}"
    {"safetensors": lambda: io.atomic_save_safetensors({"w": torch.ones(3)}, path),
     "torch": lambda: io.atomic_torch_save({"step": 1}, path),
     "json": lambda: io.atomic_write_json({"step": 1}, path)}[kind]()
    assert path.is_file() and str(tmp_path) in synced  # the folder's new entry
    assert any(p.startswith(str(tmp_path / f".out.{kind}.")) for p in synced)  # the data, before the rename
    assert [p.name for p in tmp_path.iterdir()] == [path.name]


def test_a_failed_write_leaves_the_old_file(tmp_path):
    path = tmp_path / "state.pt"
    io.atomic_torch_save({"step": 1}, path)
    with pytest.raises(Exception):
        io.atomic_torch_save({"step": lambda: 2}, path)  # fails half-way through the write
    assert torch.load(path, weights_only=True) == {"step": 1}
    assert [p.name for p in tmp_path.iterdir()] == ["state.pt"]  # no temporary left

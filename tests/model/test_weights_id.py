"""A checkpoint's id in the cache namespace (``model.weights_id.weights_digest``): every byte of
its weights counts, and each file is read once per node while it stays as it was."""

from __future__ import annotations

import os

import pytest

from model import weights_id
from model.weights_id import weights_digest

pytestmark = [pytest.mark.security]


@pytest.fixture()
def ckpt(tmp_path, monkeypatch):
    monkeypatch.setenv("TIDE_HOME", str(tmp_path / "home"))
    d = tmp_path / "ckpt"
    d.mkdir()
    (d / "config.json").write_text('{"model_type": "deepseek_v3"}')
    for name in ("model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors"):
        (d / name).write_bytes(os.urandom(5 << 20))  # larger than the first and last MiB together
    return d


def test_a_weight_changed_in_the_middle_changes_the_id_though_size_and_mtime_stay(ckpt):
    """A checkpoint retrained in the middle of a file (same size, mtime put back) is another
    checkpoint: its old KV must not load as valid."""
    before = weights_digest(ckpt)
    assert weights_digest(ckpt) == before  # stable
    path = ckpt / "model-00002-of-00002.safetensors"
    st = path.stat()
    with open(path, "r+b") as f:
        f.seek(5 << 19)
        byte = f.read(1)
        f.seek(5 << 19)
        f.write(bytes([byte[0] ^ 1]))
    os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns))
    assert path.stat().st_size == st.st_size and path.stat().st_mtime_ns == st.st_mtime_ns
    assert weights_digest(ckpt) != before


def test_each_file_is_read_once_while_it_stays_as_it_was(ckpt, monkeypatch):
    reads: list[str] = []
    real_open = open

    def counting_open(path, mode="r", *a, **kw):
        if str(path).endswith(".safetensors") and "b" in mode:
            reads.append(os.path.basename(path))
        return real_open(path, mode, *a, **kw)

    monkeypatch.setattr(weights_id, "open", counting_open, raising=False)
    first = weights_digest(ckpt)
    assert sorted(reads) == sorted(p.name for p in ckpt.glob("*.safetensors"))
    reads.clear()
    assert weights_digest(ckpt) == first and reads == []  # from the node's memo
    (ckpt / "model-00001-of-00002.safetensors").write_bytes(os.urandom(5 << 20))
    assert weights_digest(ckpt) != first and reads == ["model-00001-of-00002.safetensors"]
    memo = next((ckpt.parent / "home" / "digests").iterdir())
    assert memo.stat().st_mode & 0o777 == 0o600
    memo.write_text("not json")  # a damaged memo: the file is read again
    reads.clear()
    weights_digest(ckpt)
    assert len(reads) == 1

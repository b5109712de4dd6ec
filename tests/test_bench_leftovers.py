"""benchmarks.leftovers: the snapshot the fault tests and the soak benchmark share sees each kind of
thing a launch could leave behind, and nothing that was already there."""

from __future__ import annotations

import socket
import subprocess
import sys
import tempfile
import threading
from pathlib import Path

import pytest

BENCHMARKS = Path(__file__).resolve().parents[1] / "benchmarks"
sys.path.insert(0, str(BENCHMARKS.parent))

from benchmarks.leftovers import Snapshot  # noqa: E402


@pytest.mark.version_independent
def test_a_child_a_listening_port_a_thread_a_descriptor_and_a_temp_file_each_show(tmp_path, monkeypatch):
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    (tmp_path / "ipykernel_4242").mkdir()  # the kernel's own cell files: never counted
    before = Snapshot.take()
    assert before.grown_since(before) == {}

    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"])
    server = socket.socket()
    server.bind(("127.0.0.1", 0))
    server.listen()
    stop = threading.Event()
    thread = threading.Thread(target=stop.wait, name="left-behind")
    thread.start()
    (tmp_path / "nbkit-run.json").write_text("{}")
    (tmp_path / "torchinductor_root").mkdir()  # torch's compile cache, made by a first import of torch._dynamo
    try:
        grown = Snapshot.take().grown_since(before)
        assert grown["child processes"] == [child.pid]
        assert grown["listening ports"] == [server.getsockname()[1]]
        assert grown["threads"] == [f"left-behind#{thread.ident}"]
        assert any("socket:[" in fd for fd in grown["descriptors"])
        assert grown["files in the temporary directory"] == [str(tmp_path / "nbkit-run.json")]
        counts = Snapshot.take().counts()
        assert counts["children"] == before.counts()["children"] + 1
        assert counts["threads"] == before.counts()["threads"] + 1
        assert counts["rss_mib"] > 0
    finally:
        stop.set()
        thread.join()
        server.close()
        child.kill()
        child.wait()
    (tmp_path / "nbkit-run.json").unlink()
    assert Snapshot.take().grown_since(before) == {}  # all released: nothing left

"""tests/http_server.py: the server the shard tests and the benchmark read from over HTTP.

The test id names the server that ran (nginx where installed, else Python's http.server); CI
installs nginx and sets REQUIRE_NGINX=1, so there a missing nginx fails instead of falling back.
"""

from __future__ import annotations

import socket
import urllib.error
import urllib.request

import pytest

import http_server
from http_server import serve

SERVER = "nginx" if http_server.nginx_binary() else "http.server"


def _refused(base_url: str) -> bool:
    port = int(base_url.rsplit(":", 1)[1])
    try:
        socket.create_connection(("127.0.0.1", port), timeout=2).close()
    except ConnectionRefusedError:
        return True
    return False


def _serves_read_only(tmp_path, expect: str) -> str:
    """Serves a file byte for byte, 404 for a missing one, refuses a PUT; gone after the block.
    Returns the base URL it had."""
    data = bytes(range(256)) * 1000  # not text: served as it is, no encoding
    (tmp_path / "shard.tar").write_bytes(data)
    with serve(tmp_path) as (base, name):
        assert name == expect and base.startswith("http://127.0.0.1:")
        with urllib.request.urlopen(f"{base}/shard.tar", timeout=10) as resp:
            assert resp.status == 200 and resp.read() == data
        with pytest.raises(urllib.error.HTTPError) as missing:
            urllib.request.urlopen(f"{base}/missing.tar", timeout=10)
        assert missing.value.code == 404
        put = urllib.request.Request(f"{base}/shard.tar", data=b"x", method="PUT")
        with pytest.raises(urllib.error.HTTPError) as refused:
            urllib.request.urlopen(put, timeout=10)
        assert refused.value.code in (405, 501)  # nginx: not allowed; http.server: unsupported
    assert (tmp_path / "shard.tar").read_bytes() == data
    assert _refused(base)  # stopped, and nothing else took its place
    return base


@pytest.mark.parametrize("server", [SERVER])
def test_serves_a_folder_read_only_and_stops_after(tmp_path, server):
    _serves_read_only(tmp_path, server)


@pytest.mark.skipif(SERVER != "nginx", reason="http.server sends whole files only")
def test_nginx_answers_a_range_request(tmp_path):
    (tmp_path / "shard.tar").write_bytes(bytes(range(256)))
    with serve(tmp_path) as (base, _):
        request = urllib.request.Request(f"{base}/shard.tar", headers={"Range": "bytes=10-19"})
        with urllib.request.urlopen(request, timeout=10) as resp:
            assert resp.status == 206 and resp.read() == bytes(range(10, 20))


def test_without_nginx_python_serves_unless_nginx_is_required(tmp_path, monkeypatch):
    monkeypatch.setattr(http_server, "nginx_binary", lambda: None)
    monkeypatch.delenv("REQUIRE_NGINX", raising=False)
    _serves_read_only(tmp_path, "http.server")
    monkeypatch.setenv("REQUIRE_NGINX", "1")
    with pytest.raises(RuntimeError, match="nginx is not installed, but REQUIRE_NGINX=1"):
        with serve(tmp_path):
            pass


def test_stopped_when_the_block_raises(tmp_path):
    with pytest.raises(KeyError):
        with serve(tmp_path) as (base, _):
            raise KeyError("the test failed")
    assert _refused(base)


def test_a_port_taken_meanwhile_is_tried_once_more(tmp_path, monkeypatch):
    # Another program listens on the first "free" port before the server binds it.
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        free = http_server.find_free_port()
        ports = iter([taken.getsockname()[1], free])
        monkeypatch.setattr(http_server, "find_free_port", lambda: next(ports))
        with serve(tmp_path) as (base, _):
            assert base == f"http://127.0.0.1:{free}"

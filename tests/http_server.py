"""A real HTTP server for the tests and the benchmark: a folder served read-only on 127.0.0.1.

    with serve(folder) as (base_url, name):
        urllib.request.urlopen(f"{base_url}/train-000000.tar").read()

Debian's nginx where installed (what shards sit behind in practice: a static file server), else
Python's ``http.server``; ``name`` says which. Each is a child process of its own on a free port,
stopped when the block ends. ``REQUIRE_NGINX=1`` (``.ci/run`` sets it) makes a missing nginx an
error instead of the fallback, so CI cannot pass on the fallback alone.
"""

from __future__ import annotations

import contextlib
import http.client
import os
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

from multi_train_utils.distributed_utils import find_free_port

START_TIMEOUT_S = 30.0
IN_USE = "Address already in use"  # both servers' words when the port was taken meanwhile

# Everything nginx writes (pid, error log, temp files) stays in its prefix folder, so it runs
# as any user; as root its worker would drop to "nobody", who cannot read a 0700 test folder.
NGINX_CONF = """\
{user}worker_processes 1;
pid "{prefix}/nginx.pid";
error_log "{prefix}/server.log";
events {{
    worker_connections 64;
}}
http {{
    access_log off;
    sendfile on;
    default_type application/octet-stream;
    client_body_temp_path "{prefix}/client_body";
    proxy_temp_path "{prefix}/proxy";
    fastcgi_temp_path "{prefix}/fastcgi";
    uwsgi_temp_path "{prefix}/uwsgi";
    scgi_temp_path "{prefix}/scgi";
    server {{
        listen 127.0.0.1:{port};
        root "{root}";
    }}
}}
"""


def nginx_binary() -> str | None:
    """nginx's path, or None; a normal user's PATH often lacks /usr/sbin, where Debian puts it."""
    found = shutil.which("nginx")
    return found or ("/usr/sbin/nginx" if os.access("/usr/sbin/nginx", os.X_OK) else None)


def _nginx_command(nginx: str, prefix: Path, root: Path, port: int) -> list[str]:
    conf = prefix / "nginx.conf"
    user = "user root;\n" if os.geteuid() == 0 else ""
    conf.write_text(NGINX_CONF.format(user=user, prefix=prefix, root=root, port=port))
    # -e: the log before the config is read; one file with the output (see _start).
    return [nginx, "-p", str(prefix), "-c", str(conf), "-e", str(prefix / "server.log"),
            "-g", "daemon off;"]


def _python_command(root: Path, port: int) -> list[str]:
    return [sys.executable, "-m", "http.server", "--bind", "127.0.0.1", "--directory", str(root),
            str(port)]


def _answers(port: int) -> bool:
    """Whether an HTTP server answers on ``port`` (any status: ``/`` may be forbidden)."""
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=1)
    try:
        conn.request("HEAD", "/")
        conn.getresponse()
        return True
    except (OSError, http.client.HTTPException):
        return False
    finally:
        conn.close()


def _stop(proc: subprocess.Popen) -> None:
    """SIGTERM (nginx: a fast shutdown, its worker first), then SIGKILL."""
    if proc.poll() is None:
        proc.terminate()
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def _start(command: list[str], port: int, log: Path) -> subprocess.Popen | None:
    """``command`` running and answering on ``port``; None when it exited because the port was
    taken after ``find_free_port`` released it; a ``RuntimeError`` with its log otherwise."""
    with open(log, "wb") as out:  # a fresh log each try; nginx appends its errors to it
        # In this process's group: what stops the group (Ctrl-C, timeout) stops the server too.
        proc = subprocess.Popen(command, stdin=subprocess.DEVNULL, stdout=out,
                                stderr=subprocess.STDOUT)
    deadline = time.monotonic() + START_TIMEOUT_S
    while not _answers(port) or proc.poll() is not None:
        exited = proc.poll() is not None
        text = log.read_text(errors="replace")
        if exited and IN_USE in text:
            return None
        if exited or time.monotonic() > deadline:
            _stop(proc)
            why = f"exited with {proc.returncode}" if exited else \
                f"did not answer in {START_TIMEOUT_S:.0f} s"
            raise RuntimeError(f"{' '.join(command)} {why} on 127.0.0.1:{port}; its log:\n"
                               f"{text[-3000:]}")
        time.sleep(0.05)
    return proc


@contextlib.contextmanager
def serve(folder: str | os.PathLike) -> Iterator[tuple[str, str]]:
    """``(base_url, name)`` of a server of ``folder``'s files (``name``: "nginx" or
    "http.server") until the block ends; it is stopped even when the block raises."""
    nginx = nginx_binary()
    if nginx is None and os.environ.get("REQUIRE_NGINX") == "1":
        raise RuntimeError("nginx is not installed, but REQUIRE_NGINX=1: install it "
                           "(apt-get install nginx, as .ci/run does) or unset REQUIRE_NGINX")
    root = Path(folder).resolve()
    with tempfile.TemporaryDirectory(prefix="http-server-") as tmp:
        prefix = Path(tmp)
        proc = None
        for _ in range(2):  # once more if another program took the free port first
            port = find_free_port()
            command = (_nginx_command(nginx, prefix, root, port) if nginx else
                       _python_command(root, port))
            if proc := _start(command, port, prefix / "server.log"):
                break
        if proc is None:
            raise RuntimeError(f"{command[0]} found no free port twice in a row: {IN_USE}")
        try:
            yield f"http://127.0.0.1:{port}", "nginx" if nginx else "http.server"
        finally:
            _stop(proc)

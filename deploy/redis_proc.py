"""A local redis-server child process on a free loopback port (tests, benchmarks, `tide up`)."""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import time
from pathlib import Path


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class RedisServer:
    """``detach=True`` starts it in its own session so it outlives this process (``tide up``)."""

    def __init__(self, workdir: Path, password: str | None = None, detach: bool = False,
                 save: str = "", tls: tuple[Path, Path, Path] | None = None) -> None:
        """``tls``: (CA cert, server cert, server key) to serve TLS only (``rediss://``)."""
        self.workdir = workdir
        self.password = password
        self.detach = detach
        self.save = save
        self.tls = tls
        self.port = free_port()
        self.proc: subprocess.Popen | None = None

    @property
    def url(self) -> str:
        auth = f":{self.password}@" if self.password else ""
        scheme = "rediss" if self.tls else "redis"
        return f"{scheme}://{auth}127.0.0.1:{self.port}/0"

    def start(self) -> RedisServer:
        self.workdir.mkdir(mode=0o700, parents=True, exist_ok=True)
        binary = shutil.which("redis-server")
        if binary is None:
            raise RuntimeError("redis-server is not installed (scripts/setup.sh installs it)")
        args = [binary]
        if self.password:  # in a 0600 file, not on the command line (readable in /proc by anyone)
            conf = self.workdir / "redis.conf"
            fd = os.open(conf, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
            with os.fdopen(fd, "w") as f:
                f.write(f"requirepass {self.password}\n")
            args.append(str(conf))
        args += ["--bind", "127.0.0.1", "--save", self.save, "--appendonly", "no", "--dir", str(self.workdir)]
        if self.tls:
            ca, cert, key = self.tls
            args += ["--port", "0", "--tls-port", str(self.port), "--tls-ca-cert-file", str(ca),
                     "--tls-cert-file", str(cert), "--tls-key-file", str(key), "--tls-auth-clients", "no"]
        else:
            args += ["--port", str(self.port)]
        log = open(self.workdir / "redis.log", "ab")  # noqa: SIM115 - owned by the child
        self.proc = subprocess.Popen(args, stdout=log, stderr=subprocess.STDOUT, start_new_session=self.detach)
        log.close()
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                tail = (self.workdir / "redis.log").read_text(errors="replace")[-500:]
                raise RuntimeError(f"redis-server exited with {self.proc.returncode}: {tail}")
            try:
                with socket.create_connection(("127.0.0.1", self.port), timeout=0.2):
                    return self
            except OSError:
                time.sleep(0.05)
        raise RuntimeError("redis-server did not start")

    def kill(self) -> None:
        if self.proc is not None:
            self.proc.kill()
            self.proc.wait()
            self.proc = None

    def restart_empty(self) -> None:
        self.kill()
        self.start()


def wait_healthy(url: str, timeout_s: float = 300.0, on_wait=lambda: None) -> None:
    """Poll ``url``/health until it answers 200, calling ``on_wait()`` between polls (it may
    raise to give up early); RuntimeError after ``timeout_s``."""
    import httpx

    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            if httpx.get(url + "/health", timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        on_wait()
        time.sleep(0.5)
    raise RuntimeError(f"{url} did not become healthy within {timeout_s:.0f} s")

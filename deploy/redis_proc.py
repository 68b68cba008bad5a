"""A local redis-server child process on a free loopback port (tests, benchmarks, `tide up`)."""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import time
from pathlib import Path


def free_port() -> int:
    return free_ports(1)[0]


def free_ports(n: int) -> list[int]:
    """``n`` distinct free loopback ports (held open together while they are chosen)."""
    socks = [socket.socket() for _ in range(n)]
    try:
        for s in socks:
            s.bind(("127.0.0.1", 0))
        return [s.getsockname()[1] for s in socks]
    finally:
        for s in socks:
            s.close()


class RedisServer:
    """``detach=True`` starts it in its own session so it outlives this process (``tide up``)."""

    def __init__(self, workdir: Path, password: str | None = None, detach: bool = False,
                 save: str = "", tls: tuple[Path, Path, Path] | None = None, config: str = "",
                 port: int | None = None, appendonly: bool = False) -> None:
        """``tls``: (CA cert, server cert, server key) to serve TLS only (``rediss://``);
        ``config``: more lines of redis.conf; ``port``: default a free one; ``appendonly``: log
        every write (fsync each second), so a crash loses at most a second of them."""
        self.workdir = workdir
        self.password = password
        self.detach = detach
        self.save, self.appendonly = save, appendonly
        self.tls = tls
        self.config = config
        self.port = port or free_port()
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
        if self.password or self.config:  # in a 0600 file, not on the command line (anyone reads /proc)
            conf = self.workdir / "redis.conf"
            fd = os.open(conf, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
            with os.fdopen(fd, "w") as f:
                if self.password:
                    f.write(f"requirepass {self.password}\nmasterauth {self.password}\n")
                f.write(self.config)
            args.append(str(conf))
        args += ["--bind", "127.0.0.1", "--save", self.save, "--appendonly", "yes" if self.appendonly else "no",
                 "--appendfsync", "everysec", "--dir", str(self.workdir)]
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
                    pass
            except OSError:
                time.sleep(0.05)
                continue
            if self.proc.poll() is None:  # ours answers, not another process on the port
                return self
        raise RuntimeError("redis-server did not start")

    def kill(self) -> None:
        if self.proc is not None:
            self.proc.kill()
            self.proc.wait()
            self.proc = None

    def restart_empty(self) -> None:
        self.kill()
        self.start()


class RedisClusterServer:
    """A local Redis Cluster on loopback (tests, benchmarks): ``primaries`` primaries with
    ``replicas`` replicas each, made with ``redis-cli --cluster create``; a failed primary's
    replica takes over after ``node_timeout_ms``."""

    def __init__(self, workdir: Path, primaries: int = 3, replicas: int = 1, password: str | None = None,
                 node_timeout_ms: int = 1000, tls: tuple[Path, Path, Path] | None = None) -> None:
        """``tls``: (CA cert, server cert, server key): clients, replication and the cluster bus
        over TLS only (``rediss+cluster://``)."""
        if primaries < 3:
            raise ValueError(f"a Redis Cluster needs at least 3 primaries, got {primaries}")
        self.password, self.tls = password, tls
        config = (f"cluster-enabled yes\ncluster-config-file nodes.conf\ncluster-node-timeout {node_timeout_ms}\n"
                  "cluster-require-full-coverage no\nrepl-diskless-sync-delay 0\n")
        if tls:
            config += "tls-cluster yes\ntls-replication yes\n"
        n = primaries * (1 + replicas)
        ports = free_ports(2 * n)  # each node's client port and cluster bus port
        self.servers = [RedisServer(workdir / f"node{i}", password=password, port=ports[2 * i], tls=tls,
                                    config=config + f"cluster-port {ports[2 * i + 1]}\n")
                        for i in range(n)]
        self.primaries, self.replicas = primaries, replicas

    @property
    def url(self) -> str:
        auth = f":{self.password}@" if self.password else ""
        alive = [s for s in self.servers if s.proc is not None]
        return ("rediss" if self.tls else "redis") + "+cluster://" + auth + ",".join(f"127.0.0.1:{s.port}" for s in alive)

    def _cli(self, *args: str, timeout: float = 60) -> str:
        binary = shutil.which("redis-cli")
        if binary is None:
            raise RuntimeError("redis-cli is not installed (scripts/setup.sh installs redis-server, which has it)")
        env = {**os.environ, "REDISCLI_AUTH": self.password} if self.password else None  # not on the command line
        tls = ["--tls", "--cacert", str(self.tls[0])] if self.tls else []
        r = subprocess.run([binary, *tls, *args], capture_output=True, text=True, timeout=timeout, env=env)
        if r.returncode:
            raise RuntimeError(f"redis-cli {' '.join(args[:3])} failed: {(r.stdout + r.stderr)[-800:]}")
        return r.stdout

    def start(self) -> RedisClusterServer:
        try:
            for s in self.servers:
                s.start()
            self._cli("--cluster", "create", *(f"127.0.0.1:{s.port}" for s in self.servers),
                      "--cluster-replicas", str(self.replicas), "--cluster-yes")
            self.wait_ok()
        except BaseException:
            self.kill()  # nothing of a cluster that did not start is left running
            raise
        return self

    def info(self, server: RedisServer, section: str) -> dict[str, str]:
        out = self._cli("-p", str(server.port), "cluster" if section == "cluster" else "info",
                        "info" if section == "cluster" else section)
        return dict(line.strip().split(":", 1) for line in out.splitlines() if ":" in line)

    def wait_ok(self, timeout_s: float = 30.0) -> None:
        """Every live node says the cluster is ok, there are ``primaries`` primaries, and every
        live replica is in sync with its primary."""
        deadline = time.monotonic() + timeout_s
        while True:
            alive = [s for s in self.servers if s.proc is not None]
            try:
                ok = all(self.info(s, "cluster").get("cluster_state") == "ok" for s in alive)
                roles = [self.info(s, "replication") for s in alive]
                primaries = [r for r in roles if r.get("role") == "master"]
                # a replica that never finished its first sync would not take over a failed primary
                ok = ok and len(primaries) == self.primaries and all(
                    r.get("master_link_status") == "up" for r in roles if r.get("role") == "slave")
            except RuntimeError:
                ok = False
            if ok:
                return
            if time.monotonic() > deadline:
                raise RuntimeError(f"the Redis Cluster is not ok after {timeout_s:.0f} s")
            time.sleep(0.1)

    def primary_of(self, key: str) -> RedisServer:
        """The live primary that serves ``key``'s hash slot."""
        alive = [s for s in self.servers if s.proc is not None]
        slot = int(self._cli("-p", str(alive[0].port), "cluster", "keyslot", key))
        for line in self._cli("-p", str(alive[0].port), "cluster", "nodes").splitlines():
            fields = line.split()
            ranges = [r.partition("-") for r in fields[8:] if not r.startswith("[")]
            if "master" in fields[2] and any(int(a) <= slot <= int(b or a) for a, _, b in ranges):
                port = int(fields[1].split("@")[0].rpartition(":")[2])
                return next(s for s in alive if s.port == port)
        raise RuntimeError(f"no live primary serves slot {slot}")

    def primary_servers(self) -> list[RedisServer]:
        return [s for s in self.servers if s.proc is not None and self.info(s, "replication").get("role") == "master"]

    def kill(self) -> None:
        for s in self.servers:
            s.kill()


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

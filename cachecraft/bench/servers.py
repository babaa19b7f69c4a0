"""Throw-away Redis and PostgreSQL servers on loopback, for ``bench cluster`` and the tests.

Both come from the Debian packages ``redis-server`` and ``postgresql``; where a binary
is missing, :class:`ServerUnavailable` says which package to install. Each server runs
in its own temporary directory on a free 127.0.0.1 port, tuned for throw-away use (no
persistence, no fsync), and is stopped afterwards. As root, PostgreSQL runs as the
``postgres`` user (it refuses root).
"""

from __future__ import annotations

import contextlib
import glob
import os
import pwd
import shutil
import signal
import socket
import subprocess
import tempfile
import time
import uuid
from pathlib import Path

HOST = "127.0.0.1"


class ServerUnavailable(RuntimeError):
    """A throw-away server cannot be started here; the message says why (one line)."""


def free_port() -> int:
    """A TCP port free on loopback right now."""
    with socket.socket() as sock:
        sock.bind((HOST, 0))
        return sock.getsockname()[1]


def _wait_port(port: int, timeout_s: float = 20.0, proc: subprocess.Popen | None = None) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc is not None and proc.poll() is not None:
            raise ServerUnavailable(f"the server meant for {HOST}:{port} exited with code {proc.returncode}")
        with contextlib.suppress(OSError), socket.create_connection((HOST, port), timeout=0.2):
            return
        time.sleep(0.05)
    raise RuntimeError(f"server on {HOST}:{port} did not start within {timeout_s}s")


def stop_process(proc: subprocess.Popen, timeout_s: float) -> None:
    """Ask ``proc`` to end (SIGTERM), and kill it if it has not within ``timeout_s``."""
    if proc.poll() is not None:
        return
    proc.terminate()
    try:
        proc.wait(timeout_s)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


def _nice(cmd: list[str], niceness: int) -> list[str]:
    return ["nice", "-n", str(niceness), *cmd] if niceness and shutil.which("nice") else cmd


class RedisServer:
    """One ``redis-server`` on loopback, no persistence; can be stopped and started again.
    ``niceness`` lowers its priority (the tests' servers yield to the code under test; a
    benchmark's must not, or they starve under load and time out)."""

    niceness = 0

    def __init__(self, directory: Path, maxmemory: str | None = None, password: str | None = None,
                 tls: bool = False) -> None:
        self.binary = shutil.which("redis-server")
        if self.binary is None:
            raise ServerUnavailable("redis-server not installed (apt-get install redis-server)")
        self.directory, self.port, self.maxmemory = Path(directory), free_port(), maxmemory
        self.directory.mkdir(parents=True, exist_ok=True)
        self.password, self.tls = password, tls
        if tls:
            if shutil.which("openssl") is None:
                raise ServerUnavailable("openssl not installed (needed to make a TLS certificate)")
            self.ca = self.directory / "ca.pem"
            key, cert = self.directory / "key.pem", self.directory / "cert.pem"
            subprocess.run(["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "1",
                            "-subj", "/CN=127.0.0.1", "-addext", "subjectAltName=IP:127.0.0.1",
                            "-keyout", str(key), "-out", str(cert)],
                           check=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
            shutil.copy(cert, self.ca)
            self.tls_args = ["--port", "0", "--tls-port", str(self.port), "--tls-cert-file", str(cert),
                             "--tls-key-file", str(key), "--tls-ca-cert-file", str(self.ca),
                             "--tls-auth-clients", "no"]
        self.proc: subprocess.Popen | None = None

    @property
    def url(self) -> str:
        auth = f":{self.password}@" if self.password else ""
        if self.tls:
            return f"rediss://{auth}{HOST}:{self.port}/0?ssl_ca_certs={self.ca}"
        return f"redis://{auth}{HOST}:{self.port}/0"

    def start(self) -> "RedisServer":
        cmd = [self.binary, "--bind", HOST, "--dir", str(self.directory),
               "--save", "", "--appendonly", "no", "--protected-mode", "yes"]
        cmd += self.tls_args if self.tls else ["--port", str(self.port)]
        if self.maxmemory:
            cmd += ["--maxmemory", self.maxmemory, "--maxmemory-policy", "allkeys-lru"]
        if self.password:
            cmd += ["--requirepass", self.password]
        self.proc = subprocess.Popen(_nice(cmd, self.niceness), stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        _wait_port(self.port, proc=self.proc)
        return self

    def stop(self) -> None:
        if self.proc is not None:
            stop_process(self.proc, 10)
            self.proc = None


class PostgresCluster:
    """A throw-away PostgreSQL cluster (``initdb`` + ``pg_ctl``) on loopback, trust auth."""

    niceness = 0

    def __init__(self, durable: bool = False) -> None:
        # not durable: commits are not flushed (fast); a crash (halt) may lose the last ones
        self.durable = durable
        self.bindir = _pg_bindir()
        if self.bindir is None:
            raise ServerUnavailable("PostgreSQL server binaries not installed (apt-get install postgresql)")
        self.user = None
        if os.geteuid() == 0:
            try:
                pwd.getpwnam("postgres")
            except KeyError:
                raise ServerUnavailable("running as root and there is no postgres user to run PostgreSQL as")
            self.user = "postgres"
        self.directory = Path(tempfile.mkdtemp(prefix="cachecraft-pg-"))
        if self.user is not None:
            shutil.chown(self.directory, self.user)
        self.data = self.directory / "data"
        self.port = free_port()

    def _run(self, *args: str) -> None:
        cmd = [str(Path(self.bindir) / args[0]), *args[1:]]
        if self.user is not None:
            cmd = ["runuser", "-u", self.user, "--", *cmd]
        subprocess.run(_nice(cmd, self.niceness), check=True, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                       cwd=self.directory)

    def start(self) -> "PostgresCluster":
        self._run("initdb", "-D", str(self.data), "-U", "cachecraft", "--auth=trust", "-E", "UTF8",
                  "--no-sync")
        self.resume()
        return self

    def halt(self) -> None:
        """Stop the server at once, as a crash would (its data stays for :meth:`resume`)."""
        with contextlib.suppress(OSError, ValueError, IndexError):  # a frozen server acts on no signal until thawed
            self.thaw()
        with contextlib.suppress(subprocess.CalledProcessError):
            self._run("pg_ctl", "-D", str(self.data), "-m", "immediate", "-w", "stop")

    def freeze(self) -> None:
        """Stop every process of the server (SIGSTOP), as a hung server: its host still
        accepts connections and acknowledges data, but nothing answers until :meth:`thaw`."""
        for pid in reversed(self._processes()):
            os.kill(pid, signal.SIGSTOP)

    def thaw(self) -> None:
        """Let a :meth:`freeze` server run again."""
        for pid in self._processes():
            os.kill(pid, signal.SIGCONT)

    def _processes(self) -> list[int]:
        """The postmaster's pid, then its children's."""
        postmaster = int((self.data / "postmaster.pid").read_text().split()[0])
        children = []
        for stat in glob.glob("/proc/[0-9]*/stat"):
            with contextlib.suppress(OSError, IndexError, ValueError):
                # the fields after the command's closing parenthesis: state, then parent pid
                if int(Path(stat).read_text().rsplit(")", 1)[1].split()[1]) == postmaster:
                    children.append(int(Path(stat).parent.name))
        return [postmaster, *children]

    def resume(self) -> None:
        """Start the server on the cluster's data (after :meth:`start` made it, or a :meth:`halt`)."""
        opts = f"-c listen_addresses={HOST} -c port={self.port} -c unix_socket_directories={self.directory}"
        if not self.durable:
            opts += " -c fsync=off -c synchronous_commit=off -c full_page_writes=off"
        self._run("pg_ctl", "-D", str(self.data), "-o", opts, "-l", str(self.directory / "log"), "-w",
                  "start")

    def url(self, database: str = "postgres") -> str:
        return f"postgresql+psycopg://cachecraft@{HOST}:{self.port}/{database}"

    def create_database(self) -> str:
        """A new empty database; returns its SQLAlchemy URL."""
        import psycopg

        name = "t_" + uuid.uuid4().hex[:12]
        with psycopg.connect(f"host={HOST} port={self.port} user=cachecraft dbname=postgres",
                             autocommit=True) as conn:
            conn.execute(f'CREATE DATABASE "{name}"')
        return self.url(name)

    def stop(self) -> None:
        """Stop the server and remove its data."""
        self.halt()
        shutil.rmtree(self.directory, ignore_errors=True)


def _pg_bindir() -> str | None:
    found = shutil.which("pg_ctl")
    if found:
        return str(Path(os.path.realpath(found)).parent)
    candidates = sorted(glob.glob("/usr/lib/postgresql/*/bin/pg_ctl"))
    return str(Path(candidates[-1]).parent) if candidates else None

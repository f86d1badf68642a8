"""A real S3-compatible server (moto's) on a free localhost port, for the object-storage tests.

One server per test process, started by the first test that asks for it (several test modules
import these fixtures) and stopped at exit. The credentials are fake and reach s3fs the usual way,
through the environment, which subprocesses (extraction ranks, torchrun workers) inherit.
"""

from __future__ import annotations

import atexit
import logging
import os
import uuid

import pytest

SECRET = "dflash-test-secret-0123456789"  # searched for in everything written: it must never appear
BUCKET = "s3://bucket"
_started: list = []


@pytest.fixture(scope="session")
def s3_server() -> str:
    pytest.importorskip("s3fs")
    server_module = pytest.importorskip("moto.server")
    if not _started:
        logging.getLogger("werkzeug").setLevel(logging.ERROR)
        server = server_module.ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
        server.start()
        atexit.register(server.stop)
        host, port = server.get_host_and_port()
        os.environ.update(
            AWS_ACCESS_KEY_ID="dflash-test-key",
            AWS_SECRET_ACCESS_KEY=SECRET,
            AWS_ENDPOINT_URL=f"http://{host}:{port}",
            AWS_DEFAULT_REGION="us-east-1",
        )
        import fsspec

        fsspec.filesystem("s3", skip_instance_cache=True).mkdir(BUCKET)
        _started.append(server)
    return BUCKET


@pytest.fixture
def s3_url(s3_server) -> str:
    """A fresh prefix in the bucket."""
    return f"{s3_server}/{uuid.uuid4().hex[:8]}"

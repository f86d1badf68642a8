"""A real S3-compatible server (moto's) on a free localhost port, for the object-storage tests.

The credentials are fake and reach s3fs the usual way, through the environment, which subprocesses
(extraction ranks, torchrun workers) inherit.
"""

from __future__ import annotations

import logging
import os
import uuid

import pytest

SECRET = "dflash-test-secret-0123456789"  # searched for in everything written: it must never appear


@pytest.fixture(scope="session")
def s3_server():
    pytest.importorskip("s3fs")
    server_module = pytest.importorskip("moto.server")
    logging.getLogger("werkzeug").setLevel(logging.ERROR)
    server = server_module.ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
    server.start()
    host, port = server.get_host_and_port()
    env = {"AWS_ACCESS_KEY_ID": "dflash-test-key", "AWS_SECRET_ACCESS_KEY": SECRET,
           "AWS_ENDPOINT_URL": f"http://{host}:{port}", "AWS_DEFAULT_REGION": "us-east-1"}
    saved = {name: os.environ.get(name) for name in env}
    os.environ.update(env)
    import fsspec

    fsspec.filesystem("s3").mkdir("bucket")
    try:
        yield "s3://bucket"
    finally:
        for name, value in saved.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value
        server.stop()


@pytest.fixture
def s3_url(s3_server):
    """A fresh prefix in the bucket."""
    return f"{s3_server}/{uuid.uuid4().hex[:8]}"

"""A real S3 for tests: moto's server on 127.0.0.1, reached the way a worker reaches a bucket (by env)."""

from __future__ import annotations

import logging
from contextlib import contextmanager
from typing import Iterator

import boto3
import pytest
from moto.server import ThreadedMotoServer

from tests.prefect_server import free_port


class Moto:
    """A moto S3 server that can be stopped and started on the same port; moto keeps its objects
    in process-global backends, so a restart is an outage, not a data loss (tests/test_s3_store.py)."""

    def __init__(self) -> None:
        self.port = free_port()
        self.endpoint = f"http://127.0.0.1:{self.port}"
        self.server: ThreadedMotoServer | None = None

    def start(self) -> None:
        self.server = ThreadedMotoServer(ip_address="127.0.0.1", port=self.port, verbose=False)
        self.server.start()

    def stop(self) -> None:
        assert self.server is not None
        self.server.stop()
        self.server = None


@contextmanager
def moto_s3(key_id: str, secret: str, *buckets: str) -> Iterator[Moto]:
    """A started server with ``buckets`` made, and ``AWS_*`` in this process's env pointing at it (the
    standard credential chain, as on a worker) until the block ends; a test may stop and restart it."""
    logging.getLogger("werkzeug").setLevel(logging.WARNING)  # one INFO line per request otherwise
    server = Moto()
    with pytest.MonkeyPatch.context() as env:
        for key, value in {"AWS_ENDPOINT_URL": server.endpoint, "AWS_ACCESS_KEY_ID": key_id,
                           "AWS_SECRET_ACCESS_KEY": secret, "AWS_DEFAULT_REGION": "us-east-1"}.items():
            env.setenv(key, value)
        server.start()
        try:
            s3 = boto3.client("s3")
            for bucket in buckets:
                s3.create_bucket(Bucket=bucket)
            yield server
        finally:
            if server.server is not None:
                server.stop()

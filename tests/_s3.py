"""A moto S3 server on 127.0.0.1 for the durable-tier and storage tests (as s3fs's own tests use).

Import it after ``pytest.importorskip("s3fs")`` and ``pytest.importorskip("moto.server")``.
"""

from __future__ import annotations

import uuid

from moto import server as moto_server

from tests._dist import free_port


class S3:
    """A moto S3 server on loopback that can be stopped and restarted on the same port."""

    def __init__(self) -> None:
        self.port = free_port()
        self.endpoint = f"http://127.0.0.1:{self.port}"
        self.server = None
        self.options = {"key": "testing", "secret": "testing", "skip_instance_cache": True,
                        "use_listings_cache": False,
                        "client_kwargs": {"endpoint_url": self.endpoint, "region_name": "us-east-1"},
                        "config_kwargs": {"connect_timeout": 1, "read_timeout": 10, "retries": {"max_attempts": 1}}}

    def start(self) -> None:
        self.server = moto_server.ThreadedMotoServer(ip_address="127.0.0.1", port=self.port, verbose=False)
        self.server.start()

    def stop(self) -> None:
        self.server.stop()

    def new_bucket(self) -> str:
        import boto3

        name = f"ckpt-{uuid.uuid4().hex[:8]}"
        boto3.client("s3", endpoint_url=self.endpoint, aws_access_key_id="testing", aws_secret_access_key="testing",
                     region_name="us-east-1").create_bucket(Bucket=name)
        return name

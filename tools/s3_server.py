"""A real S3 server on a loopback port for tests and benches: moto's standalone server.

`S3Server.start()` runs `python -m moto.server` as a subprocess, creates an IAM user with a key
and the bucket while moto still accepts anonymous calls, then turns authentication on, so a wrong
key is refused as by AWS. `env()` is what a process needs to reach it (the standard AWS
variables, which s3fs reads); `stop()` ends the subprocess.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time
import urllib.request
from dataclasses import dataclass
from pathlib import Path

# moto starts in about a second; on a loaded 2-core host it was seen to take several.
_START_TIMEOUT_S = 60.0
_ADMIN_POLICY = {"Version": "2012-10-17", "Statement": [{"Effect": "Allow", "Action": "*", "Resource": "*"}]}


def _free_port(host: str = "127.0.0.1") -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])


@dataclass
class S3Server:
    log_file: Path
    bucket: str = "fathom"
    # Loopback by default; a bridge address where other network namespaces must reach it.
    host: str = "127.0.0.1"
    port: int = 0
    access_key: str = ""
    secret_key: str = ""
    process: subprocess.Popen[bytes] | None = None

    def __post_init__(self) -> None:
        self.port = self.port or _free_port(self.host)

    @property
    def endpoint(self) -> str:
        return f"http://{self.host}:{self.port}"

    def env(self, *, access_key: str | None = None, secret_key: str | None = None) -> dict[str, str]:
        """The variables s3fs reads; other keys than the server's own to test a refusal."""
        return {
            "AWS_ENDPOINT_URL": self.endpoint,
            "AWS_ACCESS_KEY_ID": self.access_key if access_key is None else access_key,
            "AWS_SECRET_ACCESS_KEY": self.secret_key if secret_key is None else secret_key,
            "AWS_DEFAULT_REGION": "us-east-1",
        }

    def url(self, prefix: str = "") -> str:
        return f"s3://{self.bucket}/{prefix}".rstrip("/")

    def start(self) -> None:
        with open(self.log_file, "ab") as log:
            self.process = subprocess.Popen(
                [sys.executable, "-m", "moto.server", "-H", self.host, "-p", str(self.port)],
                stdout=log,
                stderr=subprocess.STDOUT,
                env={**os.environ, "MOTO_ALLOW_NONEXISTENT_REGION": "true"},
            )
        deadline = time.monotonic() + _START_TIMEOUT_S
        while True:
            try:
                with urllib.request.urlopen(f"{self.endpoint}/moto-api/", timeout=2):
                    break
            except OSError:
                if self.process.poll() is not None or time.monotonic() > deadline:
                    self.stop()
                    raise RuntimeError(f"moto server did not start; see {self.log_file}") from None
                time.sleep(0.1)
        self._set_up()

    def _set_up(self) -> None:
        import boto3  # a test dependency: the processes under test use s3fs, not boto3

        anonymous = {"endpoint_url": self.endpoint, "region_name": "us-east-1",
                     "aws_access_key_id": "setup", "aws_secret_access_key": "setup"}
        iam = boto3.client("iam", **anonymous)  # type: ignore[call-overload]
        iam.create_user(UserName="fathom")
        iam.put_user_policy(UserName="fathom", PolicyName="all", PolicyDocument=json.dumps(_ADMIN_POLICY))
        key = iam.create_access_key(UserName="fathom")["AccessKey"]
        self.access_key, self.secret_key = key["AccessKeyId"], key["SecretAccessKey"]
        boto3.client("s3", **anonymous).create_bucket(Bucket=self.bucket)  # type: ignore[call-overload]
        # From now on every request must be signed with a key that IAM knows.
        request = urllib.request.Request(f"{self.endpoint}/moto-api/reset-auth", data=b"0", method="POST",
            # A form content type (urllib's default) would leave moto's handler an empty body.
            headers={"Content-Type": "text/plain"},
        )
        with urllib.request.urlopen(request, timeout=10):
            pass

    def stop(self) -> None:
        if self.process is not None and self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()
        self.process = None

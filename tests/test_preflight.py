"""Store preflight: before Prefect starts or anything launches, ``spotlight run`` checks that the run
store can be reached and written. Each bad input is one line naming the URL and the cause, exit 2,
nothing written, no secret printed.

Against a moto S3 server that enforces IAM auth (moto's ``/moto-api/reset-auth``, as its
``set_initial_no_auth_action_count`` does in server mode), with users made through boto3.
"""

from __future__ import annotations

import json
import logging
import os
import subprocess
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import boto3
import pytest
import requests
from moto.server import ThreadedMotoServer

from spotlight.store import UnreachableStoreError, preflight
from tests.conftest import cli_env, spotlight_cmd
from tests.prefect_server import free_port

BUCKET = "spotlight-preflight"
FAKE_SECRET = "PLANTEDpreflight+secret/zz9"  # a rejected secret must not be printed either


class Users:
    def __init__(self, endpoint: str, users: dict[str, tuple[str, str]]):
        self.endpoint, self.users = endpoint, users

    def s3(self):
        key, secret = self.users["admin"]
        return boto3.client("s3", endpoint_url=self.endpoint, region_name="us-east-1",
                            aws_access_key_id=key, aws_secret_access_key=secret)


@pytest.fixture(scope="module")
def authed() -> Users:
    """A moto server with a bucket and IAM users (admin, writer: s3:*; reader: get/list only), then auth on."""
    logging.getLogger("werkzeug").setLevel(logging.WARNING)
    port = free_port()
    endpoint = f"http://127.0.0.1:{port}"
    server = ThreadedMotoServer(ip_address="127.0.0.1", port=port, verbose=False)
    server.start()
    bootstrap = dict(endpoint_url=endpoint, region_name="us-east-1", aws_access_key_id="AKIABOOTSTRAP",
                     aws_secret_access_key="bootstrap")
    iam = boto3.client("iam", **bootstrap)
    users = {}
    for name, actions in (("admin", ["s3:*", "iam:*"]), ("writer", ["s3:*"]), ("reader", ["s3:GetObject", "s3:ListBucket"])):
        iam.create_user(UserName=name)
        iam.put_user_policy(UserName=name, PolicyName="store", PolicyDocument=json.dumps(
            {"Version": "2012-10-17", "Statement": [{"Effect": "Allow", "Action": actions, "Resource": "*"}]}))
        key = iam.create_access_key(UserName=name)["AccessKey"]
        users[name] = (key["AccessKeyId"], key["SecretAccessKey"])
    boto3.client("s3", **bootstrap).create_bucket(Bucket=BUCKET)
    requests.post(f"{endpoint}/moto-api/reset-auth", data=b"0", timeout=10).raise_for_status()  # enforce from now
    yield Users(endpoint, users)
    requests.post(f"{endpoint}/moto-api/reset-auth", data=b"inf", timeout=10).raise_for_status()  # process-wide
    server.stop()


def _env(tmp: Path, endpoint: str, credentials: tuple[str, str] | None) -> dict[str, str]:
    """The CLI's environment with no AWS setting of this machine: only the endpoint and these credentials."""
    empty = tmp / "empty-home"
    empty.mkdir(exist_ok=True)
    env = {k: v for k, v in cli_env(tmp, ephemeral=True).items() if not k.startswith("AWS_")}
    env.update(AWS_ENDPOINT_URL=endpoint, AWS_DEFAULT_REGION="us-east-1", AWS_EC2_METADATA_DISABLED="true",
               HOME=str(empty), AWS_CONFIG_FILE=str(empty / "config"), AWS_SHARED_CREDENTIALS_FILE=str(empty / "credentials"))
    if credentials is not None:
        env.update(AWS_ACCESS_KEY_ID=credentials[0], AWS_SECRET_ACCESS_KEY=credentials[1])
    return env


def test_each_bad_store_is_one_line_and_exit_2(authed: Users, tmp_path: Path):
    closed = f"http://127.0.0.1:{free_port()}"
    url = f"s3://{BUCKET}/runs/preflight"
    cases = {  # name: (run URL, endpoint, credentials, what the line must say)
        "missing bucket": ("s3://no-such-bucket-1a/run", authed.endpoint, authed.users["writer"],
                           "the bucket no-such-bucket-1a does not exist (NoSuchBucket"),
        "no credentials": (url, authed.endpoint, None, "no AWS credentials found"),
        "rejected credentials": (url, authed.endpoint, ("AKIANOSUCHUSER000000", FAKE_SECRET),
                                 "the credentials were rejected: the access key id is not known (InvalidAccessKeyId"),
        "access denied": (url, authed.endpoint, authed.users["reader"], "access denied"),
        "unreachable endpoint": (url, closed, authed.users["writer"], f"cannot connect to the endpoint {closed}"),
    }
    secrets = [FAKE_SECRET, *(secret for _, secret in authed.users.values())]

    def spotlight_run(name: str) -> tuple[Path, int, str]:
        run_url, endpoint, credentials, _ = cases[name]
        home = tmp_path / name.replace(" ", "-")
        home.mkdir()
        proc = subprocess.run(spotlight_cmd("run", overrides=[f"run.url={run_url}"]), cwd=home, timeout=300, text=True,
                              env=_env(home, endpoint, credentials), stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
        return home, proc.returncode, proc.stdout

    with ThreadPoolExecutor(2) as pool:  # two at a time: each spends ~10 s of CPU importing before it checks
        results = dict(zip(cases, pool.map(spotlight_run, cases)))
    for name, (home, returncode, out) in results.items():
        lines = [line for line in out.splitlines() if line.strip()]
        assert returncode == 2, f"{name}: exit {returncode}\n{out}"
        assert len(lines) == 1 and "Traceback" not in out, f"{name}: not one line:\n{out}"
        assert lines[0].startswith(f"error: run store {cases[name][0]} is not usable: "), f"{name}: {lines[0]}"
        assert cases[name][3] in lines[0], f"{name}: {lines[0]}"
        assert not any(secret in out for secret in secrets), f"{name}: a secret was printed"
        assert not any((home / "prefect-home").rglob("*.db")), f"{name}: Prefect started"
    assert authed.s3().list_objects_v2(Bucket=BUCKET).get("KeyCount") == 0, "nothing may be written"


def test_preflight_passes_a_good_store_and_leaves_nothing(authed: Users, tmp_path: Path):
    writer = authed.users["writer"]
    good = {"endpoint_url": authed.endpoint, "key": writer[0], "secret": writer[1],
            "client_kwargs": {"region_name": "us-east-1"}}
    preflight(f"s3://{BUCKET}/runs/good", good)
    assert authed.s3().list_objects_v2(Bucket=BUCKET).get("KeyCount") == 0
    with pytest.raises(UnreachableStoreError, match=r"^run store s3://spotlight-preflight/runs/good is not usable: the "
                       r"credentials were rejected: the secret key does not match the key id \(SignatureDoesNotMatch, "
                       r"while writing a probe object\)$"):
        preflight(f"s3://{BUCKET}/runs/good", {**good, "secret": FAKE_SECRET})
    local = tmp_path / "runs/new/run"
    preflight(f"file://{local}")
    assert not (tmp_path / "runs").exists(), "the folders the probe needed are removed again"
    (tmp_path / "file").write_text("")
    with pytest.raises(UnreachableStoreError, match=f"run store file://{tmp_path}/file/run is not usable: "):
        preflight(f"file://{tmp_path}/file/run")
    assert os.listdir(tmp_path) == ["file"]

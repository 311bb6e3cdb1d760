"""The ground every part stands on: layout, settings, schema, login page, compose file."""

from __future__ import annotations

import os
import subprocess
import sys
import sysconfig
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]


def test_import_platform_is_still_the_standard_library_module():
    # platform/ is on sys.path (pytest's pythonpath, manage.py, asgi); it must not shadow the stdlib.
    import platform

    assert str(REPO / "platform") in sys.path
    assert Path(platform.__file__).parent == Path(sysconfig.get_paths()["stdlib"])
    assert platform.python_version().startswith("3.11")
    assert not (REPO / "platform" / "__init__.py").exists()


def test_the_django_process_sees_the_standard_library_platform_too():
    out = subprocess.run(
        [sys.executable, "manage.py", "shell", "-c", "import platform, django; print(platform.system(), django.get_version())"],
        cwd=REPO, capture_output=True, text=True, timeout=120, check=True,
    )
    system, version = out.stdout.splitlines()[-1].split()
    assert system == "Linux"
    assert version.startswith("5.2")


def test_check_deploy_passes_with_production_settings(tmp_path):
    env = dict(
        os.environ,
        SECRET_KEY="a-long-random-production-secret-key-0123456789-abcdefghijklmnopqrstuvwxyz",
        FATHOM_HTTPS="true",
        DEBUG="false",
        FATHOM_DATA_DIR=str(tmp_path),
        ALLOWED_HOSTS="fathom.example.com",
    )
    out = subprocess.run(
        [sys.executable, "manage.py", "check", "--deploy", "--fail-level", "WARNING"],
        cwd=REPO, env=env, capture_output=True, text=True, timeout=120,
    )
    assert out.returncode == 0, out.stdout + out.stderr
    assert "no issues" in out.stdout


def test_a_malformed_environment_variable_stops_the_process_naming_it(tmp_path):
    env = dict(os.environ, DEBUG="maybe", FATHOM_DATA_DIR=str(tmp_path))
    out = subprocess.run([sys.executable, "manage.py", "check"], cwd=REPO, env=env, capture_output=True, text=True, timeout=120)
    assert out.returncode != 0
    assert "DEBUG must be one of" in out.stderr


@pytest.mark.django_db
def test_the_openapi_schema_and_docs_page_are_served(client):
    schema = client.get("/api/schema/")
    assert schema.status_code == 200
    body = schema.content.decode()
    for path in ("/api/runs/", "/api/runs/{id}/cancel/", "/api/datasets/", "/api/deployments/", "/api/runs/{run_id}/events/"):
        assert path in body
    docs = client.get("/api/docs/")
    assert docs.status_code == 200
    assert b"swagger" in docs.content.lower()
    assert b"cdn." not in docs.content  # assets are served by Fathom itself


@pytest.mark.django_db
def test_the_login_page_is_served_and_pages_need_a_login(client):
    page = client.get("/login/")
    assert page.status_code == 200
    assert b"Log in to Fathom" in page.content
    assert client.get("/").status_code == 302


@pytest.mark.django_db
def test_a_user_logs_in_through_the_form_and_sees_the_runs_page(client, alice):
    response = client.post("/login/", {"username": "alice", "password": "alice-password-1"}, follow=True)
    assert response.status_code == 200
    assert b"Runs" in response.content
    assert response.context["user"].username == "alice"


@pytest.mark.django_db
def test_the_api_requires_authentication(client):
    assert client.get("/api/runs/").status_code in (401, 403)


@pytest.mark.django_db
def test_a_token_is_exchanged_for_username_and_password(client, alice):
    response = client.post("/api/auth/token/", {"username": "alice", "password": "alice-password-1"})
    assert response.status_code == 200
    token = response.json()["token"]
    me = client.get("/api/me/", HTTP_AUTHORIZATION=f"Token {token}")
    assert me.json()["username"] == "alice"
    assert client.post("/api/auth/token/", {"username": "alice", "password": "nope"}).status_code == 400


def test_docker_compose_file_is_valid():
    def compose(*args: str, token: str = "a-join-token") -> subprocess.CompletedProcess[str]:
        env = {k: v for k, v in os.environ.items() if k != "FATHOM_JOIN_TOKEN"}
        if token:
            env["FATHOM_JOIN_TOKEN"] = token
        return subprocess.run(
            ["docker-compose", "-f", "docker-compose.yml", *args], cwd=REPO, capture_output=True, text=True, timeout=60, env=env
        )

    out = compose("config", "-q")
    assert out.returncode == 0, out.stderr
    # Hosts join with the join token: the file refuses to start without one, naming it.
    missing = compose("config", "-q", token="")
    assert missing.returncode != 0 and "set FATHOM_JOIN_TOKEN in .env" in missing.stderr
    services = compose("--profile", "gpu", "config", "--services").stdout.split()
    assert {"postgres", "redis", "web", "worker", "beat", "host", "host-gpu"} <= set(services)
    # No service reaches another over 127.0.0.1 (it may only be a name the web process answers to).
    rendered = compose("--profile", "gpu", "config").stdout
    assert [line for line in rendered.splitlines() if "127.0.0.1" in line and "ALLOWED_HOSTS" not in line] == []
    assert "FATHOM_PUBLIC_URL: http://web:8000" in rendered

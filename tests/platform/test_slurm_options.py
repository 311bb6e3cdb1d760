"""The executor setting and a run's Slurm options: checked once (settings at start, a run's
overrides at submit), and a bad value is refused naming the variable or the field."""

from __future__ import annotations

import subprocess
import sys

import pytest

from runs.models import Run
from tests.platform.conftest import REPO, process_env

pytestmark = pytest.mark.django_db


def create_run(api, **body):
    return api.post("/api/runs/", {"name": "r", **body}, format="json")


def settings_error(**env: str) -> str:
    """What a process that loads the settings with `env` says on stderr (it must fail)."""
    done = subprocess.run(
        [sys.executable, "-c", "import django; django.setup()"], cwd=REPO / "platform",
        env=process_env(DJANGO_SETTINGS_MODULE="controlplane.settings", **env), capture_output=True, text=True,
    )  # fmt: skip
    assert done.returncode != 0
    return done.stderr.strip().splitlines()[-1]


def test_an_unknown_executor_stops_the_process_naming_the_variable():
    assert settings_error(FATHOM_EXECUTOR="kubernetes").endswith(
        "FATHOM_EXECUTOR must be one of ['local', 'hosts', 'slurm']; got 'kubernetes'"
    )


def test_a_bad_slurm_default_stops_the_process_naming_the_variable():
    assert "FATHOM_SLURM_TIME_LIMIT must be a Slurm time limit" in settings_error(FATHOM_SLURM_TIME_LIMIT="an hour")
    assert "FATHOM_SLURM_PARTITION must be a Slurm name" in settings_error(FATHOM_SLURM_PARTITION="gpu;rm -rf /")
    assert settings_error(FATHOM_SLURM_SIGNAL_LEAD="0").endswith("FATHOM_SLURM_SIGNAL_LEAD must be from 1 to 65535 seconds; got 0")
    assert settings_error(FATHOM_SLURM_TIME_LIMIT="2", FATHOM_SLURM_SIGNAL_LEAD="120").endswith(
        "FATHOM_SLURM_TIME_LIMIT must be longer than the 120 s ahead of it at which the job is told to checkpoint and stop "
        "(FATHOM_SLURM_SIGNAL_LEAD); got '2' (120 s)"
    )


def test_slurm_options_are_refused_when_runs_do_not_go_to_slurm(alice_api):
    response = create_run(alice_api, slurm={"partition": "gpu"})
    assert response.status_code == 400
    assert response.json()["slurm"] == [
        "runs here start with the local executor; Slurm options apply only under FATHOM_EXECUTOR=slurm"
    ]


BAD_OPTIONS = [
    ({"time_limit": "1 hour"}, "time_limit", "must be a Slurm time limit (minutes, MM:SS, HH:MM:SS, D-HH"),
    ({"time_limit": 60}, "time_limit", "got 60"),
    # The default lead is 300 s: a job signalled as it starts would only checkpoint and stop.
    ({"time_limit": "4:59"}, "time_limit", "must be longer than the 300 s ahead of it at which the job is told to checkpoint"),
    ({"time_limit": "0:05:00"}, "time_limit", "(FATHOM_SLURM_SIGNAL_LEAD); got '0:05:00' (300 s)"),
    ({"partition": "gpu\n#SBATCH --uid=0"}, "partition", "must be a Slurm name of 1 to 64 letters"),
    ({"account": "a b"}, "account", "must be a Slurm name"),
    ({"qos": "x" * 65}, "qos", "must be a Slurm name"),
    ({"gpus_per_node": -1}, "gpus_per_node", "must be a whole number from 0 to 64"),
    ({"gpus_per_node": True}, "gpus_per_node", "got True"),
    ({"nodes": 4}, "nodes", "is not a Slurm option; the options are partition, account, qos, time_limit, gpus_per_node"),
]


@pytest.mark.parametrize(("options", "field", "message"), BAD_OPTIONS)
def test_it_rejects_a_bad_slurm_option_naming_the_field(alice_api, settings, options, field, message):
    settings.EXECUTOR = "slurm"
    response = create_run(alice_api, slurm=options)
    assert response.status_code == 400, response.content
    assert message in response.json()["slurm"][field][0]
    assert Run.objects.count() == 0


def test_a_run_keeps_its_slurm_options_resolved_over_the_defaults(alice_api, settings):
    settings.EXECUTOR = "slurm"
    settings.SLURM_DEFAULTS = {**settings.SLURM_DEFAULTS, "account": "lab", "time_limit": "2-00"}
    response = create_run(alice_api, slurm={"time_limit": "30", "gpus_per_node": 8})
    assert response.status_code == 201, response.content
    assert response.json()["slurm"] == {"partition": "", "account": "lab", "qos": "", "time_limit": "30", "gpus_per_node": 8}
    assert response.json()["slurm_job_id"] == ""


@pytest.mark.parametrize(
    ("time_limit", "seconds"),
    [("0", None), ("1", 60), ("1:30", 90), ("2:00:00", 7200), ("1-0", 86400), ("1-2:3", 93780), ("1-2:3:4", 93784)],
)
def test_a_time_limit_is_read_in_each_of_slurms_formats(time_limit, seconds):
    from launch.slurm_options import time_limit_seconds

    assert time_limit_seconds(time_limit) == seconds

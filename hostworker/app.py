"""The host worker's Celery app: the control plane's broker, no result backend, no Django."""

from __future__ import annotations

from celery import Celery

from hostworker.config import HostConfig


def make_app(config: HostConfig) -> Celery:
    # No fixups: Celery's Django fixup would load Django settings wherever DJANGO_SETTINGS_MODULE
    # happens to be set, and a host has none.
    app = Celery("fathom-host", broker=config.broker_url, include=["hostworker.tasks"], fixups=[])
    app.conf.update(
        task_serializer="json",
        accept_content=["json"],
        task_ignore_result=True,  # the control plane learns what runs from heartbeats and events
        task_acks_late=True,
        task_reject_on_worker_lost=True,
        worker_prefetch_multiplier=1,
        broker_connection_retry_on_startup=True,
        worker_hijack_root_logger=False,
    )
    if config.broker_url.startswith("filesystem://"):
        # The embedded default's broker: folders under the shared data folder, as the control
        # plane's settings name them.
        folders = {sub: config.data_dir / "broker" / sub for sub in ("queue", "processed", "control")}
        for folder in folders.values():
            folder.mkdir(parents=True, exist_ok=True)
        app.conf.broker_transport = "hostworker.broker:Transport"
        app.conf.broker_transport_options = {
            "data_folder_in": str(folders["queue"]),
            "data_folder_out": str(folders["queue"]),
            "processed_folder": str(folders["processed"]),
            "control_folder": str(folders["control"]),
            "store_processed": False,
        }
    return app


config = HostConfig.from_env()
app = make_app(config)

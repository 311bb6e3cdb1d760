"""`python manage.py fathom runs create|watch|cancel`: runs from the command line.

The same services as the REST API do the work, so a run created here is validated, queued and
launched exactly like one created from the dashboard.
"""

from __future__ import annotations

import json
import time
from argparse import ArgumentParser
from pathlib import Path
from typing import Any

from django.contrib.auth import get_user_model
from django.core.management.base import BaseCommand, CommandError
from tqdm import tqdm

from controlplane.events import events_after
from controlplane.exceptions import InvalidInput
from runs import datasets, services, specs
from runs.models import Dataset, Run

# The watcher reads the database this often: slow enough to cost nothing, fast enough to feel live.
WATCH_POLL_SECONDS = 0.5
WATCH_BATCH = 5000  # events read per poll; the rest come with the next


class Command(BaseCommand):
    help = "Create, watch and cancel training runs."

    def add_arguments(self, parser: ArgumentParser) -> None:
        resources = parser.add_subparsers(dest="resource", required=True)
        runs = resources.add_parser("runs").add_subparsers(dest="action", required=True)
        create = runs.add_parser("create", help="queue a run from a spec file")
        create.add_argument("--spec", type=Path, required=True, help="JSON: sections model, layout, train, nodes, faults")
        create.add_argument("--recipe", default="tiny")
        create.add_argument("--dataset", default="", help="a dataset id, or a .txt/.jsonl file on the server")
        create.add_argument("--name", default="")
        create.add_argument("--user", default="admin", help="the run's owner")
        create.add_argument("--watch", action="store_true", help="follow the run until it finishes")
        watch = runs.add_parser("watch", help="follow a run until it finishes")
        watch.add_argument("run_id", type=int)
        cancel = runs.add_parser("cancel", help="stop a run; its last checkpoint is kept")
        cancel.add_argument("run_id", type=int)

    def handle(self, *args: Any, action: str, **options: Any) -> None:
        try:
            if action == "create":
                run = self.create(**options)
                self.stdout.write(f"run {run.pk} queued ({run.layout_label}, {run.total_steps} steps)")
                if options["watch"]:
                    self.watch(run.pk)
            elif action == "watch":
                self.watch(options["run_id"])
            elif action == "cancel":
                run = services.do_cancel_run(self.get_run(options["run_id"]))
                self.stdout.write(f"run {run.pk}: {run.status}{' (cancel requested)' if run.is_active else ''}")
        except InvalidInput as exc:
            raise CommandError(f"{exc.field}: {exc.message}") from None

    def get_run(self, run_id: int) -> Run:
        run = Run.objects.filter(pk=run_id).first()
        if run is None:
            raise CommandError(f"no run {run_id}")
        return run

    def create(self, *, spec: Path, recipe: str, dataset: str, name: str, user: str, **_: Any) -> Run:
        owner = get_user_model().objects.filter(username=user).first()
        if owner is None:
            raise CommandError(f"--user: no user named {user!r}")
        try:
            overrides = json.loads(spec.read_text())
        except (OSError, json.JSONDecodeError) as exc:
            raise CommandError(f"--spec: cannot read {spec}: {exc}") from None
        chosen = None
        if dataset.isdigit():
            chosen = Dataset.objects.filter(pk=int(dataset), owner=owner).first()
            if chosen is None:
                raise CommandError(f"--dataset: {user} has no dataset {dataset}")
        elif dataset:
            chosen = datasets.do_create_dataset(owner, Path(dataset).name, path=dataset, by_administrator=True)
        run_spec = specs.resolve_spec(overrides, recipe)
        return services.do_create_run(owner, name or spec.stem, run_spec, chosen, recipe=recipe)

    def watch(self, run_id: int) -> None:
        run = self.get_run(run_id)
        seen = 0
        with tqdm(total=run.total_steps, desc=f"run {run_id}", unit="step") as bar:
            while True:
                for event in events_after(run.events.all(), seen, WATCH_BATCH):
                    seen = event["seq"]
                    if event["kind"] == "metrics":
                        bar.n = event.get("step", bar.n)
                        bar.set_postfix(loss=f"{event.get('loss', 0):.4f}", tok_s=f"{event.get('tokens_per_s', 0):.0f}")
                    elif event["kind"] in ("restarting", "rank_failed", "checkpoint", "exported"):
                        bar.write(f"{event['kind']}: {json.dumps({k: v for k, v in event.items() if k not in ('seq', 'time', 'source', 'kind')})}")
                run.refresh_from_db()
                if not run.is_active:
                    bar.refresh()
                    break
                time.sleep(WATCH_POLL_SECONDS)
        self.stdout.write(f"run {run_id} {run.status}{': ' + run.status_reason if run.status_reason else ''}")
        if run.status != Run.Status.SUCCEEDED:
            raise CommandError(f"run {run_id} ended {run.status}")

"""Domain operations on datasets and runs. Views, consumers, tasks and the CLI call these.

`check_*` validate and raise; `do_*` change state, record events and publish them after the
transaction commits, so a websocket never shows what the database does not hold.
"""

from __future__ import annotations

import copy
import dataclasses
import hashlib
import json
import math
import os
import re
import secrets
import shutil
from collections.abc import Iterable
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from django.conf import settings
from django.db import transaction
from django.db.models import F, Max, QuerySet
from django.utils import timezone
from tokenizers import Tokenizer

from controlplane import observability
from controlplane.events import publish_on_commit, reserve_seqs
from controlplane.exceptions import InvalidInput, WrongState
from controlplane.queue import enqueue_on_commit
from hosts import capacity
from hosts.models import Host
from notifications.services import RUN_EVENTS, notify_on_commit
from runs import executors, slurm
from runs.models import Checkpoint, Dataset, PretrainedModel, Project, Run, RunEvent
from runs.slurm_options import FIELDS as SLURM_FIELDS
from runs.slurm_options import SlurmOptionError, SlurmOptions
from runs.slurm_options import check as check_slurm_values
from runs.slurm_options import check_signal_lead as check_slurm_signal_lead
from training.checkpoint_storage import is_committed_at
from training.config import RECIPES, DataConfig, RunSpec, SpecError
from training.pretrained import check_folder, resolved_dict
from training.storage import Storage, StorageError, check_storage, dataset_url, failure_reason, local_root

CONTROL_SOURCE = "control"

# --- Specs -------------------------------------------------------------------------------------


def deep_merge(base: dict[str, Any], override: dict[str, Any]) -> dict[str, Any]:
    merged = copy.deepcopy(base)
    for key, value in override.items():
        if isinstance(value, dict) and isinstance(merged.get(key), dict):
            merged[key] = deep_merge(merged[key], value)
        else:
            merged[key] = value
    return merged


def check_spec(
    spec: dict[str, Any],
    recipe: str = "tiny",
    validation_dataset: Dataset | None = None,
    pretrained: PretrainedModel | None = None,
) -> RunSpec:
    """A full RunSpec: the recipe's values, overridden by what the user gave, with the held-out
    dataset the run chose (its path, as `resolve_data` stores it), so the evaluation settings are
    checked against the held-out data the run will have. A run from a pretrained model takes its
    model from the folder (only `model.seq_len` is the user's), and its layout is checked
    against that model."""
    if recipe not in RECIPES:
        raise InvalidInput("recipe", f"must be one of {', '.join(RECIPES)}; got {recipe!r}")
    if not isinstance(spec, dict):
        raise InvalidInput("spec", "must be an object with sections model, layout, train, nodes, faults")
    _refuse_server_paths(spec)
    base = RECIPES[recipe]().to_dict()
    if validation_dataset is not None:
        base["data"]["validation_dataset"] = validation_dataset.path
    merged = deep_merge(base, spec)
    if pretrained is not None:
        model = spec.get("model")
        chosen = sorted(set(model) - {"seq_len"}) if isinstance(model, dict) else []
        if chosen:
            raise InvalidInput(
                f"spec.model.{chosen[0]}",
                f"a run from pretrained model {pretrained.pk} ({pretrained.name}) takes its model from it; "
                "only spec.model.seq_len may be set",
            )
        merged["data"]["pretrained"] = pretrained.path
        try:
            merged = resolved_dict(merged)
        except SpecError as exc:
            raise InvalidInput("pretrained", f"pretrained model {pretrained.pk} ({pretrained.name}): {exc.message}") from None
    try:
        return RunSpec.from_dict(merged)
    except SpecError as exc:
        raise InvalidInput(f"spec.{exc.field}", exc.message) from None


# What a user names instead of each path the ranks read: objects the control plane checks the
# owner of, and turns into paths itself when it stores the run (`resolve_data`).
_DATA_OBJECT_FOR_PATH = {
    "dataset": 'choose one of your datasets with the run\'s "dataset" field (a dataset id)',
    "tokenizer": 'reuse the tokenizer of one of your runs with the run\'s "tokenizer_run" field (a run id)',
    "storage": "the server chooses where checkpoints are kept (FATHOM_STORAGE_URL)",
    "validation_dataset": 'choose one of your datasets with the run\'s "validation_dataset" field (a dataset id)',
    "pretrained": 'start from one of your pretrained models with the run\'s "pretrained" field (a model id)',
}


def _refuse_server_paths(spec: dict[str, Any]) -> None:
    data = spec.get("data")
    if data is None:
        return
    if not isinstance(data, dict):
        raise InvalidInput("spec.data", "must be an object; a run names its data with the dataset and tokenizer_run fields")
    for name, value in data.items():
        if name in _DATA_OBJECT_FOR_PATH and value not in ("", None):
            raise InvalidInput(
                f"spec.data.{name}", f"server paths are not accepted; {_DATA_OBJECT_FOR_PATH[name]}"
            )


def check_run_data(
    spec: RunSpec,
    dataset: Dataset | None,
    tokenizer_run: Run | None,
    validation_dataset: Dataset | None = None,
    pretrained: PretrainedModel | None = None,
) -> None:
    """What can be known before launch about the data a run names: that the ranks can read it.

    Ownership is checked where the ids are resolved (the serializer's querysets); this checks
    that the objects still hold what a rank needs, so a missing file is a 400 now rather than a
    failed run later.
    """
    for field, chosen in (("dataset", dataset), ("validation_dataset", validation_dataset)):
        if chosen is None:
            continue
        if local_root(chosen.path) is None:
            try:
                stored = Storage.open(chosen.path)
                present = stored.fs.exists(stored.root)
            except Exception as exc:  # storage's many errors: say which object and why
                raise InvalidInput(
                    field, f"dataset {chosen.pk} ({chosen.name}) at {chosen.path} cannot be read: {failure_reason(exc)}"
                ) from None
            if not present:
                raise InvalidInput(
                    field, f"the object of dataset {chosen.pk} ({chosen.name}), {chosen.path}, is gone; upload it again"
                )
            continue
        path = Path(chosen.path)
        try:
            size = path.stat().st_size
        except OSError:
            raise InvalidInput(field, f"the file of dataset {chosen.pk} ({chosen.name}) is gone; upload it again") from None
        if size == 0 or not os.access(path, os.R_OK):
            raise InvalidInput(field, f"the file of dataset {chosen.pk} ({chosen.name}) is empty or unreadable")
    if pretrained is not None and tokenizer_run is not None:
        raise InvalidInput(
            "tokenizer_run", f"a run from pretrained model {pretrained.pk} ({pretrained.name}) uses its tokenizer; leave this empty"
        )
    if pretrained is not None:
        try:
            check_folder(Path(pretrained.path))
        except SpecError as exc:
            raise InvalidInput("pretrained", f"pretrained model {pretrained.pk} ({pretrained.name}): {exc.message}") from None
    if tokenizer_run is not None:
        tokenizer_file = tokenizer_run.tokenizer_dir / "tokenizer.json"
        try:
            vocab = Tokenizer.from_file(str(tokenizer_file)).get_vocab_size()
        except Exception:  # tokenizers raises its own exception types for a missing or broken file
            raise InvalidInput(
                "tokenizer_run", f"run {tokenizer_run.pk} has no tokenizer yet; choose a run that has started training"
            ) from None
        if vocab > spec.model.vocab_size:
            raise InvalidInput(
                "tokenizer_run",
                f"the tokenizer of run {tokenizer_run.pk} has {vocab} tokens, more than "
                f"spec.model.vocab_size={spec.model.vocab_size}; raise the vocabulary size to at least {vocab}",
            )


def run_storage() -> str:
    """What a run's `data.storage` holds: empty while storage is the data dir itself, whose run
    folders already hold their checkpoints; else FATHOM_STORAGE_URL."""
    root = local_root(settings.STORAGE_URL)
    if root is not None and root.resolve() == settings.DATA_DIR:
        return ""
    return str(settings.STORAGE_URL)


def check_run_storage() -> None:
    """Storage must answer and take a write before a run that will checkpoint there is queued:
    bad credentials, a missing bucket or an unreachable endpoint are a 400 now, not a failed run
    at its first checkpoint."""
    url = run_storage()
    if not url:
        return
    try:
        check_storage(url)
    except StorageError as exc:
        raise InvalidInput("storage", f"{exc}; an administrator must fix FATHOM_STORAGE_URL or its credentials") from None


def check_slurm_options(overrides: dict[str, Any] | None) -> SlurmOptions | None:
    """The run's Slurm options (the install's defaults with its overrides), checked; None when
    runs do not go to Slurm, where overrides are refused rather than ignored."""
    if settings.EXECUTOR != "slurm":
        if overrides:
            raise InvalidInput(
                "slurm", f"runs here start with the {settings.EXECUTOR} executor; Slurm options apply only under FATHOM_EXECUTOR=slurm"
            )
        return None
    if overrides is not None and not isinstance(overrides, dict):
        raise InvalidInput("slurm", f"must be an object with some of {', '.join(SLURM_FIELDS)}")
    try:
        options = check_slurm_values(overrides or {}, settings.SLURM_DEFAULTS)
        check_slurm_signal_lead(options, settings.SLURM_SIGNAL_LEAD_SECONDS)
    except SlurmOptionError as exc:
        raise InvalidInput(f"slurm.{exc.field}", exc.message) from None
    if options.partition:
        try:
            known = slurm.partitions()
        except slurm.SlurmError as exc:
            raise InvalidInput("slurm", f"Slurm did not answer ({exc}); an administrator must look at the cluster") from None
        if options.partition not in known:
            raise InvalidInput("slurm.partition", f"must be one of the cluster's partitions: {', '.join(known)}; got {options.partition!r}")
    return options


# --- Datasets -------------------------------------------------------------------------------


def _scan_dataset(path: Path, fmt: str) -> tuple[int, str]:
    """Counts records and hashes the file; a JSONL line that is not an object with text fails."""
    digest = hashlib.sha256()
    records = 0
    with path.open("rb") as f:
        for number, raw in enumerate(f, start=1):
            digest.update(raw)
            line = raw.strip()
            if not line:
                continue
            if fmt == Dataset.Format.JSONL:
                try:
                    obj = json.loads(line)
                except json.JSONDecodeError as exc:
                    raise InvalidInput("file", f"line {number} is not valid JSON ({exc.msg})") from None
                if not isinstance(obj, dict) or not (isinstance(obj.get("text"), str) or isinstance(obj.get("messages"), list)):
                    raise InvalidInput("file", f'line {number} must be an object with a "text" string or a "messages" list')
            else:
                try:
                    raw.decode("utf-8")
                except UnicodeDecodeError:
                    raise InvalidInput("file", f"line {number} is not UTF-8 text") from None
            records += 1
    if records == 0:
        raise InvalidInput("file", "holds no text")
    return records, digest.hexdigest()


def dataset_format(filename: str) -> str:
    suffix = Path(filename).suffix.lower()
    if suffix in (".txt", ".text", ".md"):
        return Dataset.Format.TEXT
    if suffix in (".jsonl", ".ndjson"):
        return Dataset.Format.JSONL
    raise InvalidInput("file", f"must be a .txt or .jsonl file; got {Path(filename).name!r}")


def check_dataset_path(raw: str) -> Path:
    """A server file an administrator registers; relative paths are taken under the data dir."""
    path = Path(raw)
    if not path.is_absolute():
        path = settings.DATA_DIR / path
    path = path.resolve()
    if not path.is_file():
        raise InvalidInput("path", f"no file at {path}")
    return path


def do_create_dataset(
    owner: Any, name: str, *, upload: Any = None, path: str = "", by_administrator: bool = False
) -> Dataset:
    """Stores an uploaded file (or registers a server file, for administrators) after checking every line.

    Only an administrator (staff in the API, the operator at the server's CLI) may name a server
    path: any other user could otherwise read, through a run, a file of the server or another
    user's upload.
    """
    if (upload is None) == (not path):
        raise InvalidInput("file", "give either an uploaded file or (administrators only) a path on the server")
    if path and not by_administrator:
        raise InvalidInput("path", "only administrators may register a server file as a dataset; upload the file instead")
    if upload is not None:
        fmt = dataset_format(upload.name)
        if upload.size > settings.MAX_DATASET_BYTES:
            raise InvalidInput("file", f"is {upload.size} bytes; the limit is {settings.MAX_DATASET_BYTES}")
        folder = settings.DATASETS_DIR / secrets.token_hex(8)
        folder.mkdir(parents=True)
        target = folder / Path(upload.name).name
        with target.open("wb") as out:
            for chunk in upload.chunks():
                out.write(chunk)
        try:
            records, sha = _scan_dataset(target, fmt)
        except InvalidInput:
            target.unlink()
            folder.rmdir()
            raise
    else:
        target = check_dataset_path(path)
        fmt = dataset_format(target.name)
        records, sha = _scan_dataset(target, fmt)
    size = target.stat().st_size
    where = str(target)
    if run_storage() and local_root(run_storage()) is None:
        where = _store_dataset(target, sha, removes_local=upload is not None)
    return Dataset.objects.create(
        owner=owner, name=name or target.name, format=fmt, path=where, size_bytes=size, records=records, sha256=sha
    )


def _store_dataset(target: Path, sha: str, *, removes_local: bool) -> str:
    """Puts a checked dataset on object storage, named by its checksum, where every host's ranks
    read it; an upload's local copy is dropped (an administrator's server file stays)."""
    url = dataset_url(run_storage(), sha, target.name)
    try:
        stored = Storage.open(url)
        stored.fs.put_file(str(target), stored.root)
    except Exception as exc:  # s3fs and botocore raise many types; the object and reason are what users need
        raise InvalidInput("file", f"could not be stored at {url}: {failure_reason(exc)}") from None
    finally:
        if removes_local:
            shutil.rmtree(target.parent, ignore_errors=True)
    return url


# --- Pretrained models ------------------------------------------------------------------------

# The files of a Hugging Face Llama folder a run reads; an upload holds these and nothing else.
PRETRAINED_FILE_NAMES = re.compile(
    r"^(config\.json|generation_config\.json|tokenizer\.json|tokenizer_config\.json|special_tokens_map\.json"
    r"|model\.safetensors|model\.safetensors\.index\.json|model-\d{5}-of-\d{5}\.safetensors)$"
)


def do_register_pretrained(
    owner: Any, name: str, *, uploads: list[Any] | None = None, path: str = "", by_administrator: bool = False
) -> PretrainedModel:
    """Stores an uploaded Hugging Face Llama folder (its files, flat), or registers a server
    folder (administrators only, as for datasets), once Fathom's decoder can compute its model."""
    if bool(uploads) == bool(path):
        raise InvalidInput("files", "give either the folder's files as uploads or (administrators only) a folder on the server")
    if path and not by_administrator:
        raise InvalidInput("path", "only administrators may register a server folder as a model; upload its files instead")
    field = "path" if path else "files"
    if uploads:
        names = [Path(upload.name).name for upload in uploads]
        wrong = [n for n in names if not PRETRAINED_FILE_NAMES.match(n)]
        if wrong:
            raise InvalidInput(
                "files",
                f"{wrong[0]} is not a file of a Hugging Face Llama folder; upload config.json, tokenizer.json (and its "
                "tokenizer_config.json, special_tokens_map.json, generation_config.json) and model.safetensors or "
                "model.safetensors.index.json with its model-NNNNN-of-NNNNN.safetensors",
            )
        if len(set(names)) != len(names):
            raise InvalidInput("files", "holds one file name twice")
        size = sum(upload.size for upload in uploads)
        if size > settings.MAX_PRETRAINED_BYTES:
            raise InvalidInput("files", f"are {size} bytes together; the limit is {settings.MAX_PRETRAINED_BYTES}")
        folder = settings.PRETRAINED_DIR / secrets.token_hex(8)
        folder.mkdir(parents=True)
        for upload, file_name in zip(uploads, names, strict=True):
            with (folder / file_name).open("wb") as out:
                for chunk in upload.chunks():
                    out.write(chunk)
    else:
        folder = Path(path) if Path(path).is_absolute() else settings.DATA_DIR / path
        folder = folder.resolve()
        if not folder.is_dir():
            raise InvalidInput("path", f"no folder at {folder}")
    try:
        model = check_folder(folder)
    except SpecError as exc:
        if uploads:
            shutil.rmtree(folder, ignore_errors=True)
        raise InvalidInput(field, exc.message) from None
    size = sum(f.stat().st_size for f in folder.iterdir() if f.is_file())
    described = {k: v for k, v in dataclasses.asdict(model).items() if k != "seq_len"}
    # An upload's folder is named at random; a registered one was named by whoever put it there.
    default_name = f"llama-{model.n_layers}x{model.dim}" if uploads else folder.name
    return PretrainedModel.objects.create(
        owner=owner, name=name or default_name, path=str(folder), size_bytes=size, model=described
    )


# --- Runs ------------------------------------------------------------------------------------


def resolve_data(
    spec: RunSpec,
    dataset: Dataset | None,
    tokenizer_run: Run | None,
    validation_dataset: Dataset | None = None,
    pretrained: PretrainedModel | None = None,
) -> RunSpec:
    """The spec with the paths of the objects the run names, and only those: the dataset's file,
    the tokenizer the other run's ranks keep in its folder (or the pretrained folder's), the
    held-out dataset's file and the pretrained folder. Empty: the demo corpus, a tokenizer trained
    on the data, no second held-out file, a model initialised from the seed. The data section's
    other settings (the validation fraction) are the user's and stay."""
    tokenizer = str(tokenizer_run.tokenizer_dir) if tokenizer_run is not None else ""
    if pretrained is not None:
        tokenizer = str(Path(pretrained.path) / "tokenizer.json")
    data = DataConfig(
        dataset=dataset.path if dataset is not None else "",
        tokenizer=tokenizer,
        storage=run_storage(),
        validation_dataset=validation_dataset.path if validation_dataset is not None else "",
        validation_fraction=spec.data.validation_fraction,
        pretrained=pretrained.path if pretrained is not None else "",
    )
    return dataclasses.replace(spec, data=data)


def do_create_run(
    owner: Any,
    name: str,
    spec: RunSpec,
    dataset: Dataset | None,
    tokenizer_run: Run | None = None,
    *,
    priority: int = 0,
    validation_dataset: Dataset | None = None,
    pretrained: PretrainedModel | None = None,
    recipe: str = "",
    project: Project | None = None,
    slurm_options: SlurmOptions | None = None,
) -> Run:
    """Queues a run. The objects it names must be the owner's own: callers resolve ids among them.

    The spec is stored resolved, data paths included: from here to the ranks nobody parses or
    fills it in again (the launcher writes it as stored)."""
    check_run_data(spec, dataset, tokenizer_run, validation_dataset, pretrained)
    check_fits_cluster(spec)
    check_run_storage()
    resolved = resolve_data(spec, dataset, tokenizer_run, validation_dataset, pretrained)
    with transaction.atomic():
        run = Run.objects.create(
            owner=owner, name=name, spec=resolved.to_dict(), dataset=dataset, tokenizer_run=tokenizer_run,
            validation_dataset=validation_dataset, pretrained=pretrained, priority=priority, recipe=recipe,
            project=project, slurm=slurm_options.to_dict() if slurm_options is not None else {},
        )
        _record(run, "queued", {"status": Run.Status.QUEUED})
        enqueue_on_commit("runs.tasks.launch_run", run.pk)
    return run


def do_cancel_run(run: Run) -> Run:
    """Asks the run to stop. A queued run stops at once; a live one when its agent says so."""
    if not run.is_active:
        raise WrongState("status", f"only queued, starting, running or restarting runs can be cancelled; this one is {run.status}")
    with transaction.atomic():
        # Claim a queued run before its launch task does: whichever UPDATE matches wins.
        if Run.objects.filter(pk=run.pk, status=Run.Status.QUEUED).update(
            status=Run.Status.CANCELLED, cancel_requested=True, finished_at=timezone.now()
        ):
            _record(run, "cancelled", {"status": Run.Status.CANCELLED, "reason": "cancelled before it started"})
            transaction.on_commit(lambda: _signal_cancel(run.pk, started=False))
        else:
            Run.objects.filter(pk=run.pk).update(cancel_requested=True)
            _record(run, "cancel_requested", {})
            transaction.on_commit(lambda: _signal_cancel(run.pk, started=True))
    run.refresh_from_db()
    return run


def _signal_cancel(run_id: int, *, started: bool) -> None:
    run = Run.objects.get(pk=run_id)
    executors.for_run(run).cancel(run, started=started)


def do_resume_run(run: Run) -> Run:
    """Queues a failed or cancelled run again; it continues from its latest checkpoint."""
    with transaction.atomic():
        claimed = Run.objects.filter(pk=run.pk, status__in=[Run.Status.FAILED, Run.Status.CANCELLED]).update(
            status=Run.Status.QUEUED, resume=True, cancel_requested=False, status_reason="", finished_at=None,
            slurm_job_id="",  # a new launch, a new job (the old one's id stays in the run's events)
        )
        if not claimed:
            raise WrongState("status", f"only failed or cancelled runs can be resumed; this one is {run.status}")
        _record(run, "queued", {"status": Run.Status.QUEUED, "resume": True})
        enqueue_on_commit("runs.tasks.launch_run", run.pk)
    run.refresh_from_db()
    return run


def do_set_status(run: Run, status: str, reason: str = "", *, only_from: Iterable[str] = Run.ACTIVE) -> bool:
    """Moves an active run to `status` and records it; False if the run had already moved on."""
    now = timezone.now()
    changes: dict[str, Any] = {"status": status, "status_reason": reason}
    if status in Run.FINISHED:
        changes["finished_at"] = now
    if status == Run.Status.RUNNING:
        changes["started_at"] = now
    with transaction.atomic():
        if not Run.objects.filter(pk=run.pk, status__in=list(only_from)).update(**changes):
            return False
        if status in Run.FINISHED:
            _release_devices(run)
        _record(run, "status", {"status": status, "reason": reason})
    run.refresh_from_db()
    return True


def _release_devices(run: Run) -> None:
    """A run that ended gives back the devices nothing of it holds any more, and queued runs are
    offered them; the rest go back once their hosts' beats say its agents are gone."""
    if capacity.release([run.pk]):
        enqueue_on_commit("hosts.tasks.schedule_runs")


def check_fits_cluster(spec: RunSpec) -> None:
    """Refuses a run the registered hosts could never hold, even all free (no hosts: the run
    starts on the worker's machine, as before hosts existed)."""
    hosts = list(Host.objects.all())
    if reason := capacity.why_it_never_fits(capacity.need_of(spec.to_dict()), hosts):
        raise InvalidInput("spec.nodes", reason)


# --- Events ------------------------------------------------------------------------------------

# How an agent's event moves the run's status, and the statuses it may move the run from: a
# late `agent_started` from a second node must not send a running run back to starting, and
# finished runs never move.
_STATUS_BY_KIND = {
    "agent_started": Run.Status.STARTING,
    "metrics": Run.Status.RUNNING,
    "resumed": Run.Status.RUNNING,
    "restarting": Run.Status.RESTARTING,
    "succeeded": Run.Status.SUCCEEDED,
    "failed": Run.Status.FAILED,
    "cancelled": Run.Status.CANCELLED,
}
_MOVES_FROM = {
    Run.Status.STARTING: [Run.Status.QUEUED],
    Run.Status.RUNNING: [Run.Status.QUEUED, Run.Status.STARTING, Run.Status.RESTARTING],
    Run.Status.RESTARTING: [Run.Status.QUEUED, Run.Status.STARTING, Run.Status.RUNNING],
    **{final: list(Run.ACTIVE) for final in Run.FINISHED},
}


# What an agent's batch may hold (the API schema says the same: runs.serializers.IngestSerializer).
NODE_SOURCE = re.compile(r"node-([0-9]{1,6})")  # the sender: the node whose token the batch carries
MAX_BATCH_EVENTS = 10000
MAX_KIND_LENGTH = 32


def check_source(body: Any) -> int:
    """The node a batch names as its sender (`node-K`): its token must be that node's, so this
    is checked before the token, and the rest of the batch after."""
    if not isinstance(body, dict):
        raise InvalidInput("non_field_errors", 'must be an object {"source": ..., "events": [...]}')
    source = body.get("source")
    if source is None:
        raise InvalidInput("source", "This field is required.")
    match = NODE_SOURCE.fullmatch(source) if isinstance(source, str) else None
    if match is None:
        raise InvalidInput("source", "must be node-K, the sending agent's node (K a node number: node-0, node-1, …)")
    return int(match[1])


def check_ingest_batch(body: Any) -> tuple[str, list[dict[str, Any]]]:
    """An agent's batch `{"source", "events": [{"seq", "kind", "time"?, "data"?}]}`, checked in
    one pass: the source and the events, each with `seq`, `kind` (stripped), `time` (None when
    absent) and `data`. The first bad value raises, naming it as `events.3.kind`.

    Plain checks, not a serializer per event: at 1,000 points/s a DRF field per value was a
    tenth of the ingest's time, and this runs before any database work.
    """
    check_source(body)
    source = body["source"]
    raw_events = body.get("events")
    if raw_events is None:
        raise InvalidInput("events", "This field is required.")
    if not isinstance(raw_events, list):
        raise InvalidInput("events", "must be a list of events")
    if len(raw_events) > MAX_BATCH_EVENTS:
        raise InvalidInput("events", f"holds {len(raw_events)} events; at most {MAX_BATCH_EVENTS} per batch")
    events: list[dict[str, Any]] = []
    for index, raw in enumerate(raw_events):
        field = f"events.{index}"
        if not isinstance(raw, dict):
            raise InvalidInput(field, "must be an object with seq, kind, time and data")
        seq = raw.get("seq")
        if seq is None:
            raise InvalidInput(f"{field}.seq", "This field is required.")
        if not isinstance(seq, int) or isinstance(seq, bool):
            raise InvalidInput(f"{field}.seq", "A valid integer is required.")
        if seq < 1:
            raise InvalidInput(f"{field}.seq", "Ensure this value is greater than or equal to 1.")
        kind = raw.get("kind")
        if kind is None:
            raise InvalidInput(f"{field}.kind", "This field is required.")
        if not isinstance(kind, str) or not kind.strip():
            raise InvalidInput(f"{field}.kind", "must be a non-empty string")
        kind = kind.strip()
        if len(kind) > MAX_KIND_LENGTH:
            raise InvalidInput(f"{field}.kind", f"Ensure this field has no more than {MAX_KIND_LENGTH} characters.")
        when = raw.get("time")
        if when is not None and (
            not isinstance(when, (int, float)) or isinstance(when, bool) or not math.isfinite(when)
        ):
            raise InvalidInput(f"{field}.time", "must be a finite number (seconds since the epoch)")
        data = raw.get("data", {})
        if not isinstance(data, dict):
            raise InvalidInput(f"{field}.data", "must be an object")
        events.append({"seq": seq, "kind": kind, "time": when, "data": data})
    return source, events


def _event_time(value: Any) -> datetime:
    if isinstance(value, (int, float)):
        return datetime.fromtimestamp(value, tz=UTC)
    return timezone.now()


def _record(run: Run, kind: str, data: dict[str, Any], *, publish: bool = True) -> RunEvent:
    """Records an event of the control plane itself; call inside a transaction.

    `publish=False`: the caller publishes it with the batch it belongs to, in seq order."""
    seq = reserve_seqs(Run, run.pk, 1)
    event = RunEvent.objects.create(
        run=run, seq=seq, source=CONTROL_SOURCE, source_seq=seq, kind=kind, time=timezone.now(), data=data
    )
    if publish:
        publish_on_commit(run_group(run.pk), [event.as_message()])
    if kind in ("status", "cancelled") and data["status"] in RUN_EVENTS:
        # Every status change is recorded here (a queued run cancelled before it started as
        # `cancelled`, the others as `status`): the one place the owner's webhooks hear of it.
        notify_on_commit(run.owner_id, RUN_EVENTS[data["status"]], {"run": run.pk})
    return event


def do_record_event(run: Run, kind: str, data: dict[str, Any]) -> RunEvent:
    """Records an event of the control plane (an export, say) in the run's history."""
    with transaction.atomic():
        return _record(run, kind, data)


def do_note_waiting(run: Run, reason: str, **data: Any) -> bool:
    """A queued run's reason for waiting (the executor's queue, say), recorded as a `waiting`
    event when it changed; False when it had not, or the run left the queue."""
    with transaction.atomic():
        if not Run.objects.filter(pk=run.pk, status=Run.Status.QUEUED).exclude(status_reason=reason).update(status_reason=reason):
            return False
        _record(run, "waiting", {"reason": reason, **data})
    return True


def do_ingest_events(run: Run, source: str, events: list[dict[str, Any]]) -> int:
    """Stores an agent's batch (duplicates ignored), applies it to the run, publishes after commit.

    `events` as `check_ingest_batch` returns them. Returns the highest `source_seq` held from
    this source, which the agent takes as its ack.

    A batch costs a fixed handful of statements whatever its size (the row lock, the source's
    highest seq, one INSERT, one UPDATE of the run), and one channel message: at 1,000 points/s
    the ingest's time per batch, not per event, is what a point waits for.
    """
    with transaction.atomic():
        # The run's row is locked first: two posts of one source (a retry racing the request it
        # repeats) are serialised, and what is read here holds until commit (on SQLite the
        # IMMEDIATE transaction serialises writers instead).
        row = (
            Run.objects.select_for_update()
            .values("last_seq", "status", "started_at", "node_reports", "silent_nodes", "cancel_requested")
            .get(pk=run.pk)
        )
        held_up_to = int(RunEvent.objects.filter(run=run, source=source).aggregate(top=Max("source_seq"))["top"] or 0)
        # Only a redelivery holds seqs at or below the source's highest: ask which, then.
        repeated = [e["seq"] for e in events if e["seq"] <= held_up_to]
        held: set[int] = set()
        if repeated:
            stored_again = RunEvent.objects.filter(run=run, source=source, source_seq__in=repeated)
            held.update(stored_again.values_list("source_seq", flat=True))
        fresh = sorted((e for e in events if e["seq"] not in held), key=lambda e: e["seq"])
        # A batch may repeat a seq within itself when a reporter retried mid-write.
        unique = list({e["seq"]: e for e in fresh}.values())
        changes: dict[str, Any] = {}
        stored: list[RunEvent] = []
        status: Run.Status | None = None
        if unique:
            first = int(row["last_seq"]) + 1
            stored = RunEvent.objects.bulk_create(
                RunEvent(
                    run=run,
                    seq=first + i,
                    source=source,
                    source_seq=e["seq"],
                    kind=e["kind"],
                    time=_event_time(e.get("time")),
                    data=e.get("data") or {},
                )
                for i, e in enumerate(unique)
            )
            changes["last_seq"] = first + len(stored) - 1
            observability.count_ingested(len(stored))  # counted once the batch commits
            status = _changes_from_events(run, stored, changes)
        if status == Run.Status.FAILED and row["cancel_requested"]:
            # Each agent is stopped by a signal of its own: one that is not stopped yet when
            # another closes the rendezvous reports a failed rendezvous. The run was cancelled.
            status = Run.Status.CANCELLED
        moved = status is not None and row["status"] in _MOVES_FROM[status]
        if moved:
            now = timezone.now()
            changes["status"] = status
            if status in Run.FINISHED:
                changes["finished_at"] = now
            if status == Run.Status.RUNNING and row["started_at"] is None:
                changes["started_at"] = now
            if status == Run.Status.RUNNING:
                changes["status_reason"] = ""  # a running run waits for nothing (a requeued job's reason goes)
        back_after = _note_report(source, row["node_reports"], row["silent_nodes"], changes)
        if changes:
            Run.objects.filter(pk=run.pk).update(**changes)
        # The control plane's own events follow the batch that caused them, in this order.
        if moved:
            # Every status change is an event, so a page that follows the events shows it.
            reason = changes.get("status_reason", "")
            stored.append(_record(run, "status", {"status": status, "reason": reason}, publish=False))
            if status in Run.FINISHED:
                _release_devices(run)
        if moved and status == Run.Status.SUCCEEDED:
            # The final checkpoint is exported to Hugging Face format as soon as the run succeeds
            # (once: each node agent of a multi-node run reports its own success).
            final = Checkpoint.objects.filter(run=run).order_by("-step").first()
            if final is not None:
                enqueue_on_commit("runs.tasks.export_checkpoint", final.pk)
        if any(e.kind == "checkpoint" for e in stored) or status in Run.FINISHED:
            stored += _mark_pruned(run)
        if back_after is not None:
            stored.append(_record(run, "node_reporting", {"node": source, "silent_s": back_after}, publish=False))
        publish_on_commit(run_group(run.pk), [e.as_message() for e in stored])
    return max([held_up_to, *(e["seq"] for e in unique)])


def _changes_from_events(run: Run, events: list[RunEvent], changes: dict[str, Any]) -> Run.Status | None:
    """Adds to `changes` (columns of the run's row) what an agent's events say; records the
    checkpoints they report. Returns the status the last status-moving event asks for, if any."""
    changes["last_report_at"] = timezone.now()
    status: Run.Status | None = None
    restarts = 0
    for event in events:
        data = event.data
        if event.kind == "metrics":
            changes.update(step=data.get("step", 0), last_loss=data.get("loss"), tokens_per_s=data.get("tokens_per_s"))
        elif event.kind == "checkpoint" or (event.kind == "resumed" and data.get("path")):
            # A run resumes only from a committed checkpoint: if the rank that committed it died
            # before reporting it, the resume reports it.
            checkpoint, _ = Checkpoint.objects.get_or_create(run=run, step=data["step"], defaults={"path": data["path"]})
            if isinstance(data.get("eval_loss"), (int, float)) and checkpoint.eval_loss is None:
                Checkpoint.objects.filter(pk=checkpoint.pk).update(eval_loss=data["eval_loss"])
        elif event.kind == "eval" and isinstance(data.get("eval_loss"), (int, float)):
            # A checkpoint reported before its step's evaluation arrived (a resume re-reports one).
            Checkpoint.objects.filter(run=run, step=data.get("step"), eval_loss__isnull=True).update(
                eval_loss=data["eval_loss"]
            )
        elif event.kind == "restarting":
            restarts += 1
        elif event.kind == "failed" or event.kind == "succeeded" or event.kind == "cancelled":
            changes["status_reason"] = data.get("reason", "")
        status = _STATUS_BY_KIND.get(event.kind, status)
    if restarts:
        changes["restarts"] = F("restarts") + restarts
    return status


# What checkpoint lists may be sorted by (`?ordering=`); a leading "-" is descending. Checkpoints
# without an eval loss come last either way: "deploy the best" means the best evaluated one.
CHECKPOINT_ORDERINGS = ("step", "-step", "eval_loss", "-eval_loss", "created_at", "-created_at")


def order_checkpoints(checkpoints: QuerySet[Checkpoint], ordering: str | None) -> QuerySet[Checkpoint]:
    """`checkpoints` in the order `?ordering=` names; None (no parameter): the model's order (run, step)."""
    if ordering is None:
        return checkpoints
    if ordering not in CHECKPOINT_ORDERINGS:
        raise InvalidInput("ordering", f"must be one of {', '.join(CHECKPOINT_ORDERINGS)}; got {ordering!r}")
    name = ordering.removeprefix("-")
    field = F(name).desc(nulls_last=True) if ordering.startswith("-") else F(name).asc(nulls_last=True)
    return checkpoints.order_by(field, "run", "step")


def _mark_pruned(run: Run) -> list[RunEvent]:
    """Marks the run's checkpoints whose folders the trainer deleted (`train.keep_checkpoints`).

    Rank 0 prunes before it reports the checkpoint that replaced them, so checking when a
    checkpoint event arrives (and when the run ends) catches every pruning."""
    pruned: list[RunEvent] = []
    for checkpoint in Checkpoint.objects.filter(run=run, pruned_at__isnull=True):
        on_object_storage = local_root(checkpoint.path) is None
        if is_committed_at(checkpoint.path) if on_object_storage else Path(checkpoint.path).exists():
            continue
        if Checkpoint.objects.filter(pk=checkpoint.pk, pruned_at__isnull=True).update(pruned_at=timezone.now()):
            data = {"step": checkpoint.step, "exported": bool(checkpoint.export_path)}
            pruned.append(_record(run, "checkpoint_pruned", data, publish=False))
    return pruned


def _note_report(source: str, reports: dict[str, Any], silent: list[str], changes: dict[str, Any]) -> float | None:
    """Keeps when each node agent last posted (into `changes`, from the locked row's values); a
    silent one that posts again is reported back: returns how long it was quiet, then."""
    if not source.startswith("node-"):
        return None
    now = timezone.now().timestamp()
    quiet = now - float(reports.get(source, now))
    changes["node_reports"] = {**reports, source: now}
    if source not in silent:
        return None
    changes["silent_nodes"] = [s for s in silent if s != source]
    return round(quiet, 1)


def do_mark_silent_nodes(run: Run, silent_after: float) -> list[str]:
    """Records `node_silent` for each node agent of an active run that has not posted for
    `silent_after` seconds; returns them. `_note_report` clears them when they post again."""
    now = timezone.now().timestamp()
    with transaction.atomic():
        row = Run.objects.select_for_update().filter(pk=run.pk, status__in=Run.ACTIVE).values("node_reports", "silent_nodes").first()
        if row is None:
            return []
        newly = [
            source for source, at in sorted(row["node_reports"].items())
            if now - float(at) > silent_after and source not in row["silent_nodes"]
        ]
        if newly:
            Run.objects.filter(pk=run.pk).update(silent_nodes=[*row["silent_nodes"], *newly])
            for source in newly:
                quiet = now - float(row["node_reports"][source])
                _record(run, "node_silent", {"node": source, "silent_s": round(quiet, 1), "threshold_s": silent_after})
    return newly


def run_group(run_id: int) -> str:
    return f"run-{run_id}"

"""What a run's request holds, checked before it is stored: its spec (the recipe's values under
the user's), its data (datasets, tokenizer, pretrained model: objects the user owns, never server
paths), where its checkpoints go, and its Slurm options. Each check raises a 400 naming the field.
"""

from __future__ import annotations

import copy
import os
from pathlib import Path
from typing import Any

from django.conf import settings
from tokenizers import Tokenizer

from controlplane.exceptions import InvalidInput
from launch import slurm
from launch.slurm_options import FIELDS as SLURM_FIELDS
from launch.slurm_options import SlurmOptionError, SlurmOptions
from launch.slurm_options import check as check_slurm_values
from launch.slurm_options import check_signal_lead as check_slurm_signal_lead
from launch.slurm_options import install_defaults as install_slurm_defaults
from runs.models import Dataset, PretrainedModel, Run
from training.config import RECIPES, RunSpec, SpecError
from training.pretrained import check_folder, resolved_dict
from training.storage import Storage, StorageError, check_storage, failure_reason, local_root


def deep_merge(base: dict[str, Any], override: dict[str, Any]) -> dict[str, Any]:
    merged = copy.deepcopy(base)
    for key, value in override.items():
        if isinstance(value, dict) and isinstance(merged.get(key), dict):
            merged[key] = deep_merge(merged[key], value)
        else:
            merged[key] = value
    return merged


def resolve_spec(
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
    model = spec.get("model")
    if isinstance(model, dict):
        # The recipe's head size and MLP width were derived from its own dim and heads: where the
        # user changes those and not these, they are derived again from the user's.
        if ("dim" in model or "n_heads" in model) and "head_dim" not in model:
            base["model"]["head_dim"] = 0
        if "dim" in model and "ffn_dim" not in model:
            base["model"]["ffn_dim"] = 0
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
        options = check_slurm_values(overrides or {}, install_slurm_defaults())
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

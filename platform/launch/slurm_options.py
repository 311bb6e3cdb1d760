"""The Slurm options of a run: the install's defaults (settings, from FATHOM_SLURM_*) with the
run's own overrides, checked once, at submit, and stored resolved on the run.

The defaults are checked by the same rules as a run's overrides, when Django starts
(`install_defaults`, from launch/apps.py). Every value ends up as an `#SBATCH` line of a script:
the rules below are also what keeps anything but a Slurm name or number out of it.
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from django.conf import settings

from controlplane.env import ConfigurationError
from training.field_error import FieldError

# Slurm's partition, account and QoS names: letters, digits and _ . - (what sacctmgr accepts).
_NAME = re.compile(r"[A-Za-z0-9_.-]{1,64}")
# sbatch --time: minutes, minutes:seconds, hours:minutes:seconds, days-hours,
# days-hours:minutes, days-hours:minutes:seconds ("0" is no limit).
_TIME = re.compile(r"\d+(:\d{1,2}){0,2}|\d+-\d{1,2}(:\d{1,2}){0,2}")
TIME_FORMATS = "minutes, MM:SS, HH:MM:SS, D-HH, D-HH:MM or D-HH:MM:SS"
MAX_GPUS_PER_NODE = 64  # more than any node has; a typo (640) is refused, not queued forever


class SlurmOptionError(FieldError):
    """A Slurm option that is not allowed; `field` is its name under the run's `slurm`."""


@dataclass(kw_only=True, frozen=True)
class SlurmOptions:
    partition: str = ""  # empty: the cluster's default partition
    account: str = ""  # empty: the submitting user's default account
    qos: str = ""  # empty: the account's default QoS
    time_limit: str = ""  # sbatch --time; empty: the partition's default limit
    gpus_per_node: int = 0  # sbatch --gpus-per-node; 0: a CPU job (no --gpus-per-node)

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


FIELDS = tuple(f.name for f in dataclasses.fields(SlurmOptions))


def check(values: Mapping[str, Any], base: SlurmOptions | None = None) -> SlurmOptions:
    """`base` (the install's defaults) with `values` over it; raises SlurmOptionError naming
    the first bad field and what it accepts."""
    chosen = dict((base or SlurmOptions()).to_dict())
    for name, value in values.items():
        if name not in FIELDS:
            raise SlurmOptionError(name, f"is not a Slurm option; the options are {', '.join(FIELDS)}")
        chosen[name] = value
    for name in ("partition", "account", "qos"):
        value = chosen[name]
        if not isinstance(value, str) or (value and not _NAME.fullmatch(value)):
            raise SlurmOptionError(name, f"must be a Slurm name of 1 to 64 letters, digits or _ . - (or empty); got {value!r}")
    time_limit = chosen["time_limit"]
    if not isinstance(time_limit, str) or (time_limit and not _TIME.fullmatch(time_limit)):
        raise SlurmOptionError("time_limit", f"must be a Slurm time limit ({TIME_FORMATS}) or empty; got {time_limit!r}")
    gpus = chosen["gpus_per_node"]
    if isinstance(gpus, bool) or not isinstance(gpus, int) or not 0 <= gpus <= MAX_GPUS_PER_NODE:
        raise SlurmOptionError("gpus_per_node", f"must be a whole number from 0 to {MAX_GPUS_PER_NODE}; got {gpus!r}")
    return SlurmOptions(**chosen)


def time_limit_seconds(time_limit: str) -> int | None:
    """A checked `time_limit` in seconds; None when there is none (empty, or "0")."""
    days, _, clock = time_limit.rpartition("-")
    parts = [int(p) for p in clock.split(":")]
    if days:  # days-hours[:minutes[:seconds]]
        hours, minutes, seconds = (parts + [0, 0])[:3]
    elif len(parts) == 3:  # hours:minutes:seconds
        hours, minutes, seconds = parts
    else:  # minutes[:seconds]
        hours, minutes, seconds = 0, parts[0], (parts + [0])[1]
    total = ((int(days or 0) * 24 + hours) * 60 + minutes) * 60 + seconds
    return total or None


def check_signal_lead(options: SlurmOptions, lead_seconds: int) -> None:
    """A time limit must outlast the time-limit signal's lead (FATHOM_SLURM_SIGNAL_LEAD): a job
    signalled as it starts would only ever checkpoint and stop."""
    limit = time_limit_seconds(options.time_limit) if options.time_limit else None
    if limit is not None and limit <= lead_seconds:
        raise SlurmOptionError(
            "time_limit",
            f"must be longer than the {lead_seconds} s ahead of it at which the job is told to checkpoint and "
            f"stop (FATHOM_SLURM_SIGNAL_LEAD); got {options.time_limit!r} ({limit} s)",
        )


def install_defaults() -> SlurmOptions:
    """The install's defaults (settings.SLURM_DEFAULTS, as FATHOM_SLURM_* set them), checked;
    raises ConfigurationError naming the variable that is wrong and what it accepts."""
    try:
        options = check(settings.SLURM_DEFAULTS)
        check_signal_lead(options, settings.SLURM_SIGNAL_LEAD_SECONDS)
    except SlurmOptionError as exc:
        raise ConfigurationError(f"{settings.SLURM_VARIABLES[exc.field]} {exc.message}") from None
    return options

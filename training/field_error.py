"""The one shape of "this value is not allowed": the field it is in and why.

A run's spec (`training.config.SpecError`), a deployment's replica options
(`serving.vllm.OptionError`), a run's Slurm options and the control plane's own checks
(`InvalidInput`) each raise a subclass, so the CLI prints any of them the same way and the REST
API answers each with a 400 that names the field (DRF's nested shape for a dotted path). Stdlib
only: serving and the ranks import it as well as the control plane.
"""

from __future__ import annotations


class FieldError(ValueError):
    """A value that is not allowed; `field` names it (a dotted path where it is nested, as the
    form or the API client shows it) and `message` says what is allowed."""

    def __init__(self, field: str, message: str) -> None:
        super().__init__(f"{field}: {message}")
        self.field = field
        self.message = message

    @classmethod
    def require(cls, condition: bool, field: str, message: str) -> None:
        """Raise this error for `field` unless `condition` holds."""
        if not condition:
            raise cls(field, message)

"""A deployment's replica count following its load: the policy (`Autoscaling`, the API's
`autoscaling`), and the decision each sync makes from the replicas' own figures (`decide`).

Load is what vLLM reports: requests running and waiting, summed over the ready replicas
(`deployments.supervision.scrape`, every DEPLOYMENT_SYNC_SECONDS); idleness also asks when a key
last made a request (`ApiKey.last_used_at`), since the supervisor's own liveness probe makes a
token every 15 s and the scrapes, 2 s apart, miss a short request. A request *waits* in vLLM when its replica's batch is full
(`max_num_seqs` running) or its KV cache is, so waiting requests per replica is the signal that
more replicas would answer sooner, whatever the model and device; KubeAI and Knative scale on
requests in flight per replica the same way.

- **Up**: one replica more once the mean waiting requests per ready replica has stayed above
  `target_waiting` for `window_s`, while fewer than `max_replicas` run and none is still starting
  (a starting replica takes the waiting requests when it is ready; adding another meanwhile
  would overshoot).
- **Down**: one replica fewer once, for `cooldown_s` and `cooldown_s` after the last change,
  nothing waited and the running requests fit in one replica fewer (`max_num_seqs` each), while
  more than `max(min_replicas, 1)` run.
- **To zero** (`min_replicas: 0`): asleep once no request ran or waited at any scrape, and no
  key made one, for `idle_s` (the dashboard's playground, which takes no key, keeps none awake). The next request wakes it (`deployments.wake`) and is held until a replica is ready,
  up to `wake_timeout_s`, then answered 503 with Retry-After.

Each decision comes with its reason, which the deployment's timeline records.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

from controlplane.exceptions import InvalidInput
from serving.deployment_config import MAX_REPLICAS


@dataclass(frozen=True, kw_only=True)
class Autoscaling:
    min_replicas: int = 1
    max_replicas: int = 1
    # Mean requests waiting per ready replica above which one more replica is added.
    target_waiting: float = 1.0
    window_s: float = 30.0  # how long the target must be exceeded before a replica is added
    cooldown_s: float = 300.0  # how long the load must fit on fewer replicas before one is removed
    idle_s: float = 600.0  # with min_replicas 0: how long without a request before it sleeps
    wake_timeout_s: float = 300.0  # how long a request to a sleeping deployment is held

    def __post_init__(self) -> None:
        for name in ("min_replicas", "max_replicas"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or not 0 <= value <= MAX_REPLICAS:
                raise InvalidInput(f"autoscaling.{name}", f"must be an integer from 0 to {MAX_REPLICAS}; got {value!r}")
        if self.max_replicas < max(self.min_replicas, 1):
            raise InvalidInput(
                "autoscaling.max_replicas",
                f"must be at least 1 and at least min_replicas ({self.min_replicas}); got {self.max_replicas}",
            )
        for name in ("target_waiting", "window_s", "cooldown_s", "idle_s", "wake_timeout_s"):
            value = getattr(self, name)
            if not isinstance(value, (int, float)) or isinstance(value, bool) or not value > 0:
                raise InvalidInput(f"autoscaling.{name}", f"must be a positive number; got {value!r}")

    @classmethod
    def from_dict(cls, data: Any) -> Autoscaling:
        if not isinstance(data, dict):
            raise InvalidInput("autoscaling", f"must be an object (min_replicas, max_replicas, …) or null; got {data!r}")
        known = [f.name for f in dataclasses.fields(cls)]
        for key in data:
            if key not in known:
                raise InvalidInput(f"autoscaling.{key}", f"is not an autoscaling field; fields are {', '.join(known)}")
        return cls(**data)

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    def check_replicas(self, replicas: int, field: str = "replicas") -> None:
        """The count a deployment starts with lies within the bounds (and is at least one)."""
        if not max(self.min_replicas, 1) <= replicas <= self.max_replicas:
            raise InvalidInput(
                field,
                f"must lie within autoscaling's min_replicas and max_replicas "
                f"({max(self.min_replicas, 1)} to {self.max_replicas}); got {replicas}",
            )


@dataclass(frozen=True)
class Load:
    """The replicas' own figures at one scrape."""

    ready: int  # replicas that answered the scrape
    running: float
    waiting: float
    last_request_at: float | None = None  # when a key last made a request (a Unix time)

    @classmethod
    def of(cls, metrics: dict[str, Any], last_request_at: float | None = None) -> Load:
        """From a `metrics` event's data (`supervision.scrape`)."""
        return cls(
            ready=int(metrics.get("replicas_scraped") or 0), running=float(metrics.get("running") or 0),
            waiting=float(metrics.get("waiting") or 0), last_request_at=last_request_at,
        )  # fmt: skip


@dataclass(frozen=True)
class ScalerState:
    """Since when each condition has held without a break (None: it does not hold now), and when
    the count last changed. Kept in the deployment's row between syncs."""

    over_since: float | None = None
    fits_since: float | None = None
    idle_since: float | None = None
    changed_at: float = 0.0

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> ScalerState:
        known = {f.name for f in dataclasses.fields(cls)}
        return cls(**{k: v for k, v in data.items() if k in known})

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


@dataclass(frozen=True)
class Decision:
    replicas: int
    reason: str


def decide(
    policy: Autoscaling, replicas: int, max_num_seqs: int, load: Load, state: ScalerState, now: float
) -> tuple[ScalerState, Decision | None]:
    """The scaler's state after this scrape, and the count to move to with why (None: keep it)."""

    def since(held: bool, start: float | None) -> float | None:
        return (start if start is not None else now) if held else None

    if not policy.min_replicas <= replicas <= policy.max_replicas:  # the policy changed since
        bound = min(max(replicas, policy.min_replicas), policy.max_replicas)
        return ScalerState(changed_at=now), Decision(
            bound, f"{replicas} replicas lie outside autoscaling's {policy.min_replicas} to {policy.max_replicas}"
        )
    per_replica = load.waiting / load.ready if load.ready else 0.0
    state = dataclasses.replace(
        state,
        over_since=since(per_replica > policy.target_waiting, state.over_since),
        fits_since=since(load.waiting == 0 and load.running <= max_num_seqs * (replicas - 1), state.fits_since),
        idle_since=since(load.running == 0 and load.waiting == 0, state.idle_since),
    )
    quiet_since = max(state.idle_since, load.last_request_at or 0.0) if state.idle_since is not None else None
    decision = None
    if state.over_since is not None and now - state.over_since >= policy.window_s:
        if replicas < policy.max_replicas and load.ready >= replicas:
            decision = Decision(
                replicas + 1,
                f"{per_replica:.2g} requests waiting per replica, over the target of {policy.target_waiting:g}, "
                f"for {now - state.over_since:.0f} s",
            )
    elif (
        state.fits_since is not None
        and replicas > max(policy.min_replicas, 1)
        and min(now - state.fits_since, now - state.changed_at) >= policy.cooldown_s
    ):
        decision = Decision(
            replicas - 1,
            f"no request waiting and {load.running:.0f} running (room for {max_num_seqs} a replica) "
            f"for {now - state.fits_since:.0f} s",
        )
    elif (
        policy.min_replicas == 0
        and replicas > 0
        and quiet_since is not None
        and min(now - quiet_since, now - state.changed_at) >= policy.idle_s
    ):
        decision = Decision(0, f"no request for {now - quiet_since:.0f} s")
    if decision is not None:
        state = ScalerState(changed_at=now)
    return state, decision

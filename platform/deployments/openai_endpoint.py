"""Fathom's OpenAI-compatible endpoint: `/v1/chat/completions`, `/v1/completions`, `/v1/models`.

This is the data plane, so it is a bare ASGI app mounted beside Django (controlplane/asgi.py),
not a Django view: Django's middleware stack holds a sync-only middleware (WhiteNoise), which
sends every request through one shared thread, and each stream would pay Django's per-chunk
response machinery. Here a request costs a key check (a dictionary lookup once the key was
seen; the database at most every KEY_CACHE_S), the key's rate limit if it has one (one Redis
script, or a deque in memory: deployments.ratelimit), and then `serving`'s Gateway: parsing,
validation, least-outstanding routing, failover and error bodies. Its use (requests, tokens)
is counted in memory and written in batches (deployments.usage). The dashboard's playground is
a Django view (it needs the session and CSRF) and routes through the same gateways.
"""

from __future__ import annotations

import asyncio
import hmac
import json
import logging
import math
import time
import weakref
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from asgiref.sync import sync_to_async
from channels.db import database_sync_to_async
from django.conf import settings
from django.http import HttpRequest, HttpResponse, StreamingHttpResponse
from django.views.decorators.http import require_POST

from controlplane.observability import V1_USAGE
from deployments import scaling, services
from deployments.models import ApiKey, Deployment
from deployments.ratelimit import Limiter, limiter_for_settings
from deployments.usage import USAGE
from runs.exports import merged_folder
from serving.app import Receive, Scope, Send, read_body, send_json, send_response
from serving.export_store import local_copy
from serving.gateway import Gateway, deployment_gateway
from serving.openai_errors import OpenAIError
from serving.openai_requests import ENDPOINTS, unknown_endpoint
from serving.router import ProxyResponse, error_response

# How long a checked key is trusted without asking the database again: revoking a key,
# changing its rate limit or stopping a deployment reaches every web process within this.
KEY_CACHE_S = 5.0
# A key used within this long is kept checked in the background (KeyCache says why).
KEY_WARM_S = 60.0

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Served:
    """A deployment as the endpoint needs it: read with the key, then cached with it."""

    pk: int
    model: str  # the served model name
    status: str
    export_path: str
    max_model_len: int
    folder: Path
    routing: str
    # Scaled to zero when idle (autoscaling's min_replicas 0): how long a request that finds no
    # replica is held while one starts. None: such a request is answered at once.
    wake_timeout_s: float | None = None

    @classmethod
    def of(cls, deployment: Deployment) -> Served:
        # Its tokenizer's folder: the pretrained model's own, or the checkpoint's export (each
        # export carries the run's tokenizer, the merged one too).
        if deployment.pretrained is not None:
            source = deployment.pretrained.path
        elif deployment.merged:
            source = str(merged_folder(deployment.checkpoint))  # type: ignore[arg-type]
        else:
            source = deployment.checkpoint.export_path  # type: ignore[union-attr]
        policy = deployment.autoscaling_policy
        return cls(
            pk=deployment.pk,
            model=deployment.served_model_name,
            status=deployment.status,
            export_path=source,
            max_model_len=int(deployment.options.get("max_model_len", 1024)),
            folder=deployment.folder,
            routing=deployment.routing,
            wake_timeout_s=policy.wake_timeout_s if policy is not None and policy.min_replicas == 0 else None,
        )


class Gateways:
    """One Gateway per deployment and event loop: routers hold an HTTP session bound to a loop,
    and their outstanding-request counts must be shared by every request the process serves."""

    def __init__(self) -> None:
        self._gateways: dict[tuple[int, int], Gateway] = {}

    def for_deployment(self, served: Served) -> Gateway:
        key = (served.pk, id(asyncio.get_running_loop()))
        gateway = self._gateways.get(key)
        if gateway is None:
            gateway = self._gateways[key] = deployment_gateway(
                name=served.model,
                max_model_len=served.max_model_len,
                # An export on object storage: its tokenizer, downloaded once per web process
                # (this blocks the loop once per deployment, for a few small files).
                checkpoint=local_copy(served.export_path, settings.DATA_DIR / "cache", tokenizer_only=True)
                if served.export_path
                else "",
                state_dir=served.folder,
                routing=served.routing,
            )
        return gateway


GATEWAYS = Gateways()


@dataclass(frozen=True)
class CheckedKey:
    """A valid key as the endpoint needs it: which key (to count its use), its limit, its deployment."""

    key_id: int
    prefix: str
    rate_limit_per_minute: int | None
    served: Served


class KeyCache:
    """Checked keys by their SHA-256, each trusted for KEY_CACHE_S after its lookup began. Unknown
    keys are not kept (anyone can send those), so they always go to the database.

    One lookup per key at a time: requests that arrive while a key is being checked wait for
    that check instead of starting their own. A burst of a hundred chats on one key (a cold
    cache, or every KEY_CACHE_S) otherwise queued a hundred lookups on the one thread Django's
    database calls share, each opening and closing a connection, while holding the GIL the
    event loop needed to relay the streams already running (bench.serving's burst).

    Keys used in the last KEY_WARM_S are checked again in the background before their entries
    expire, all in one query, so a request after a quiet spell finds its key checked. Before,
    the first request after each expiry waited for the lookup, and so did every request that
    came while it ran: each burst of bench.serving (they come more than KEY_CACHE_S apart)
    reached the router 8-17 ms late, the time that lookup took while the loop was busy
    accepting the burst. An entry still expires KEY_CACHE_S after its lookup began, so a revoked
    key is refused within KEY_CACHE_S as before."""

    def __init__(self) -> None:
        self._entries: dict[str, _Entry] = {}
        self._checking: dict[str, asyncio.Future[CheckedKey | None]] = {}
        self._refresh_scheduled: weakref.WeakSet[asyncio.AbstractEventLoop] = weakref.WeakSet()

    async def check(self, authorization: str) -> CheckedKey | None:
        raw = authorization.removeprefix("Bearer ").strip() if authorization.startswith("Bearer ") else ""
        if not raw.startswith(ApiKey.PREFIX):
            return None
        digest = ApiKey.hash(raw)
        entry = self._entries.get(digest)
        now = time.monotonic()
        if entry is not None and now - entry.looked_up_at < KEY_CACHE_S:
            entry.used_at = now
            return entry.checked
        check = self._checking.get(digest)
        if check is None or check.get_loop() is not asyncio.get_running_loop():
            check = self._checking[digest] = asyncio.ensure_future(self._check(ApiKey.lookup_of(raw), digest))
        # shield: a caller that goes away (its client hung up) does not cancel the others' check.
        return await asyncio.shield(check)

    def forget(self, key_id: int) -> None:
        """Drops a key from this process's cache (it was revoked here); other processes drop it
        when their entry expires."""
        for digest, entry in list(self._entries.items()):
            if entry.checked.key_id == key_id:
                self._entries.pop(digest, None)

    async def _check(self, lookup: str, digest: str) -> CheckedKey | None:
        started = time.monotonic()
        try:
            checked = (await _checked_keys({digest: lookup}))[digest]
        finally:
            if self._checking.get(digest) is asyncio.current_task():  # not a later loop's check
                del self._checking[digest]
        self._store(digest, checked, started)
        if checked is not None:
            self._schedule_refresh()
        return checked

    def _store(self, digest: str, checked: CheckedKey | None, looked_up_at: float) -> None:
        entry = self._entries.get(digest)
        if checked is None:
            self._entries.pop(digest, None)
        elif entry is None:
            self._entries[digest] = _Entry(checked, looked_up_at, used_at=looked_up_at)
        elif looked_up_at > entry.looked_up_at:
            entry.checked, entry.looked_up_at = checked, looked_up_at

    def _schedule_refresh(self) -> None:
        """A timer on this loop, not a task: a loop that ends (a test's) just drops it."""
        loop = asyncio.get_running_loop()
        if loop not in self._refresh_scheduled:
            self._refresh_scheduled.add(loop)
            loop.call_later(KEY_CACHE_S / 4, self._refresh, loop)

    def _refresh(self, loop: asyncio.AbstractEventLoop) -> None:
        """Every KEY_CACHE_S / 4 while keys are in use: looks up again, in one query, the keys
        used within KEY_WARM_S whose entries are past half their life; forgets the others once
        they expire."""
        self._refresh_scheduled.discard(loop)
        now = time.monotonic()
        due: dict[str, str] = {}
        in_use = False
        for digest, entry in list(self._entries.items()):
            age = now - entry.looked_up_at
            if now - entry.used_at >= KEY_WARM_S:
                if age >= KEY_CACHE_S:
                    del self._entries[digest]
                continue
            in_use = True
            if age >= KEY_CACHE_S / 2:
                due[digest] = entry.checked.prefix
        if due:
            refresh = asyncio.ensure_future(self._refresh_due(due, now))
            refresh.add_done_callback(_log_failed_refresh)
        if in_use:
            self._schedule_refresh()

    async def _refresh_due(self, due: dict[str, str], started: float) -> None:
        for digest, checked in (await _checked_keys(due)).items():
            if digest in self._entries:  # renews, never brings back a key forgotten meanwhile (revoked here)
                self._store(digest, checked, started)


@dataclass
class _Entry:
    checked: CheckedKey
    looked_up_at: float  # when the lookup that read it began: its trust counts from there
    used_at: float


def _log_failed_refresh(refresh: asyncio.Future[None]) -> None:
    # Nobody awaits it; the entries expire as if it had not run, and a request then looks up.
    if not refresh.cancelled() and refresh.exception() is not None:
        log.warning("refreshing the API keys in use failed: %r", refresh.exception())


KEYS = KeyCache()


def _forget_changed_key(sender: Any, key_id: int, **kwargs: Any) -> None:
    KEYS.forget(key_id)  # revoked or changed here: this process stops trusting its entry at once


services.api_key_changed.connect(_forget_changed_key)
# Limits are kept where the settings keep the cache: Redis when configured, else this process.
LIMITER: Limiter = limiter_for_settings()


# database_sync_to_async (Channels') closes stale connections around the call, as Django does
# around a request: this app runs outside Django's request cycle.
@database_sync_to_async
def _checked_keys(wanted: dict[str, str]) -> dict[str, CheckedKey | None]:
    """For each {digest: lookup prefix}, the key as checked, or None (unknown, revoked, or its
    hash differs): one query for any number of keys."""
    found = {
        key.lookup: key
        for key in ApiKey.objects.select_related("deployment__checkpoint", "deployment__pretrained").filter(
            lookup__in=set(wanted.values()), revoked=False
        )
    }
    checked: dict[str, CheckedKey | None] = {}
    for digest, lookup in wanted.items():
        key = found.get(lookup)
        checked[digest] = (
            CheckedKey(
                key_id=key.pk,
                prefix=key.lookup,
                rate_limit_per_minute=key.rate_limit_per_minute,
                served=Served.of(key.deployment),
            )
            if key is not None and hmac.compare_digest(digest, key.key_hash)
            else None
        )
    return checked


@database_sync_to_async
def _active_deployment_named(name: str) -> bool:
    return Deployment.objects.filter(served_model_name=name, status__in=Deployment.ACTIVE).exists()


def _requested_model(raw: bytes) -> str | None:
    try:
        body = json.loads(raw or b"null")
    except ValueError:
        return None  # the gateway answers malformed JSON with its own 400
    return body.get("model") if isinstance(body, dict) and isinstance(body.get("model"), str) else None


def _unauthorized() -> ProxyResponse:
    return error_response(
        OpenAIError(
            401,
            "A valid API key is required: send 'Authorization: Bearer <key>' (keys start with fth-).",
            "invalid_request_error",
            None,
            "invalid_api_key",
        )
    )


def _rate_limited(checked: CheckedKey, wait_s: float) -> ProxyResponse:
    """OpenAI's answer to a request over a requests-per-minute limit: 429, its error body, and
    Retry-After in whole seconds (the official clients wait that long before retrying)."""
    limit = checked.rate_limit_per_minute
    seconds = max(1, math.ceil(wait_s))
    response = error_response(
        OpenAIError(
            429,
            f"Rate limit reached for the key {checked.prefix}… on requests per min (RPM): Limit {limit}, "
            f"Used {limit}, Requested 1. Please try again in {seconds}s.",
            "requests",
            None,
            "rate_limit_exceeded",
        )
    )
    response.headers.update(
        {
            "retry-after": str(seconds),
            "x-ratelimit-limit-requests": str(limit),
            "x-ratelimit-remaining-requests": "0",
            "x-ratelimit-reset-requests": f"{wait_s:.3f}s",
        }
    )
    return response


async def _answer(scope: Scope, receive: Receive) -> tuple[ProxyResponse | dict[str, Any], CheckedKey | None]:
    """The response to one request (a gateway's ProxyResponse, or a JSON document) and the key
    it was made with, if a valid one."""
    path, method = scope["path"], scope["method"]
    if path != "/v1/models" and path not in ENDPOINTS:
        return error_response(unknown_endpoint(path)), None
    allowed = "GET" if path == "/v1/models" else "POST"
    if method != allowed:
        return error_response(
            OpenAIError(
                405, f"{path} takes {allowed}, not {method}.", "invalid_request_error", None, "method_not_allowed"
            )
        ), None
    body = await read_body(receive) if method == "POST" else b""
    authorization = next((v.decode("latin-1") for k, v in scope["headers"] if k == b"authorization"), "")
    checked = await KEYS.check(authorization)
    if checked is None:
        return _unauthorized(), None
    if checked.rate_limit_per_minute is not None:
        wait_s = await LIMITER.wait_s(checked.prefix, checked.rate_limit_per_minute)
        if wait_s is not None:
            return _rate_limited(checked, wait_s), checked
    served = checked.served
    gateway = GATEWAYS.for_deployment(served)
    if path == "/v1/models":
        return gateway.models(), checked
    asked = _requested_model(body)
    if asked is not None and asked != served.model and await _active_deployment_named(asked):
        return error_response(
            OpenAIError(403, f"This API key is for the model {served.model!r}, not {asked!r}.",
                        "invalid_request_error", "model", "model_not_allowed")
        ), checked  # fmt: skip
    if served.status not in Deployment.ACTIVE:
        return error_response(
            OpenAIError(503, f"The deployment {served.model!r} is {served.status}.", "server_error")
        ), checked
    if served.wake_timeout_s is not None and not gateway.serving(served.model):
        refused = await _hold_until_served(served, gateway, served.wake_timeout_s)
        if refused is not None:
            return refused, checked
    return await gateway.handle(path, body), checked


# How often a held request looks for a ready replica (the state file, re-read when it changes)
# and asks for the deployment to be woken (one conditional update: a no-op once it is).
HOLD_POLL_S = 0.25
WAKE_EVERY_S = 1.0


async def _hold_until_served(served: Served, gateway: Gateway, timeout_s: float) -> ProxyResponse | None:
    """Holds a request to a deployment scaled to zero (or on its way there) until a replica is
    ready, waking it; None once one is, else, after `timeout_s`, a 503 with Retry-After that the
    official clients wait out before they retry."""
    deadline = time.monotonic() + timeout_s
    next_wake = 0.0
    while time.monotonic() < deadline:
        if gateway.serving(served.model):
            return None
        if time.monotonic() >= next_wake:
            await _wake(served.pk)
            next_wake = time.monotonic() + WAKE_EVERY_S
        await asyncio.sleep(HOLD_POLL_S)
    response = error_response(
        OpenAIError(
            503, f"The deployment {served.model!r} was asleep and no replica was ready within {timeout_s:g} s; "
            "it is starting: try again shortly.", "server_error", None, "model_waking",
        )
    )  # fmt: skip
    response.headers["retry-after"] = str(max(1, math.ceil(timeout_s / 10)))
    return response


@database_sync_to_async
def _wake(deployment_id: int) -> bool:
    return scaling.wake(deployment_id)


async def openai_endpoint(scope: Scope, receive: Receive, send: Send) -> None:
    """The ASGI app for every HTTP request under /v1/."""
    answer, checked = await _answer(scope, receive)
    try:
        if isinstance(answer, ProxyResponse):
            await send_response(send, answer, receive)
        else:
            await send_json(send, 200, answer)
    finally:
        usage = answer.usage if isinstance(answer, ProxyResponse) else None
        if usage is not None and V1_USAGE in scope:  # for /metrics, whether the client saw it or not
            scope[V1_USAGE].append((usage.prompt_tokens, usage.completion_tokens))
        if checked is not None:  # every request a valid key made counts, refused ones included
            USAGE.record(
                checked.key_id,
                usage.prompt_tokens if usage else 0,
                usage.completion_tokens if usage else 0,
            )


# --- The dashboard's playground (a Django view) --------------------------------------------


async def _relay(response: ProxyResponse) -> HttpResponse | StreamingHttpResponse:
    relayed: HttpResponse | StreamingHttpResponse
    if response.stream is None:
        relayed = HttpResponse(response.body or b"", status=response.status, content_type=response.content_type)
    else:
        # iter_bytes closes the relay when the client hangs up: the upstream request ends and
        # its routing slot is freed.
        relayed = StreamingHttpResponse(
            response.iter_bytes(), status=response.status, content_type=response.content_type
        )
        relayed["Cache-Control"] = "no-cache"
        relayed["X-Accel-Buffering"] = "no"
    if response.replica:
        relayed["X-Fathom-Replica"] = response.replica
    return relayed


@require_POST
async def playground_chat(request: HttpRequest, deployment_id: int) -> HttpResponse | StreamingHttpResponse:
    """The dashboard's chat: the owner's session instead of a key (CSRF-checked), same gateways."""
    user = await request.auser()
    deployment = await _owned_deployment(user, deployment_id)
    if deployment is None:
        return HttpResponse(
            OpenAIError(404, "No such deployment.", "invalid_request_error", None, "not_found").body_bytes(),
            status=404,
            content_type="application/json",
        )
    try:
        body: Any = json.loads(request.body or b"null")
    except ValueError:
        body = None
    if isinstance(body, dict):
        body["model"] = deployment.served_model_name
    raw = json.dumps(body).encode() if isinstance(body, dict) else request.body
    return await _relay(await GATEWAYS.for_deployment(Served.of(deployment)).handle("/v1/chat/completions", raw))


@sync_to_async
def _owned_deployment(user: Any, deployment_id: int) -> Deployment | None:
    if not user.is_authenticated:
        return None
    return Deployment.objects.select_related("checkpoint", "pretrained").filter(pk=deployment_id, owner=user).first()

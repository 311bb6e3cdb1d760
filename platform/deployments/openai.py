"""Fathom's OpenAI-compatible endpoint: `/v1/chat/completions`, `/v1/completions`, `/v1/models`.

Async views, so a stream holds no thread: the key is checked here, everything else (parsing,
validation, least-outstanding routing, failover, error bodies) is `serving`'s Gateway. The
dashboard's playground uses the same path with the owner's session instead of a key.
"""

from __future__ import annotations

import asyncio
import hmac
import json
from datetime import timedelta
from typing import Any

from asgiref.sync import sync_to_async
from django.http import HttpRequest, HttpResponse, JsonResponse, StreamingHttpResponse
from django.utils import timezone
from django.views.decorators.csrf import csrf_exempt
from django.views.decorators.http import require_GET, require_POST

from deployments.models import ApiKey, Deployment
from serving.errors import OpenAIError
from serving.gateway import Gateway
from serving.requests import PromptCounter, ServedModel
from serving.router import ProxyResponse, Router, StateFileReplicas

# last_used_at is a hint for humans; writing it on every request would add a DB write per call.
KEY_TOUCH_INTERVAL = timedelta(minutes=1)


class Gateways:
    """One Gateway per deployment and event loop: routers hold an httpx client bound to a loop,
    and their outstanding-request counts must be shared by every request the process serves."""

    def __init__(self) -> None:
        self._gateways: dict[tuple[int, int], Gateway] = {}

    def for_deployment(self, deployment: Deployment) -> Gateway:
        key = (deployment.pk, id(asyncio.get_running_loop()))
        gateway = self._gateways.get(key)
        if gateway is None:
            export = deployment.checkpoint.export_path
            model = ServedModel(
                name=deployment.served_model_name,
                max_model_len=int(deployment.options.get("max_model_len", 1024)),
                counter=PromptCounter(export) if export else None,
            )
            gateway = self._gateways[key] = Gateway()
            gateway.add(model, Router(StateFileReplicas(deployment.folder), model=model.name))
        return gateway


GATEWAYS = Gateways()


def _error(error: OpenAIError) -> HttpResponse:
    return HttpResponse(error.body_bytes(), status=error.status, content_type="application/json")


def _unauthorized(message: str) -> HttpResponse:
    return _error(OpenAIError(401, message, "invalid_request_error", None, "invalid_api_key"))


@sync_to_async
def _key_for(header: str) -> ApiKey | None:
    raw = header.removeprefix("Bearer ").strip() if header.startswith("Bearer ") else ""
    if not raw.startswith(ApiKey.PREFIX):
        return None
    key = ApiKey.objects.select_related("deployment__checkpoint").filter(lookup=raw[: len(ApiKey.PREFIX) + 8], revoked=False).first()
    if key is None or not hmac.compare_digest(ApiKey.hash(raw), key.key_hash):
        return None
    if key.last_used_at is None or timezone.now() - key.last_used_at > KEY_TOUCH_INTERVAL:
        ApiKey.objects.filter(pk=key.pk).update(last_used_at=timezone.now())
    return key


@sync_to_async
def _active_deployment_named(name: str) -> Deployment | None:
    return Deployment.objects.filter(served_model_name=name, status__in=Deployment.ACTIVE).first()


def _requested_model(raw: bytes) -> str | None:
    try:
        body = json.loads(raw or b"null")
    except ValueError:
        return None  # the gateway answers malformed JSON with its own 400
    return body.get("model") if isinstance(body, dict) and isinstance(body.get("model"), str) else None


async def _relay(response: ProxyResponse) -> HttpResponse | StreamingHttpResponse:
    relayed: HttpResponse | StreamingHttpResponse
    if response.stream is None:
        relayed = HttpResponse(response.body or b"", status=response.status, content_type=response.content_type)
    else:
        # iter_bytes closes the relay when the client hangs up: the upstream request ends and
        # its routing slot is freed.
        relayed = StreamingHttpResponse(response.iter_bytes(), status=response.status, content_type=response.content_type)
        relayed["Cache-Control"] = "no-cache"
        relayed["X-Accel-Buffering"] = "no"
    if response.replica:
        relayed["X-Fathom-Replica"] = response.replica
    return relayed


async def _proxy(request: HttpRequest, path: str) -> HttpResponse | StreamingHttpResponse:
    key = await _key_for(request.headers.get("Authorization", ""))
    if key is None:
        return _unauthorized("A valid API key is required: send 'Authorization: Bearer <key>' (keys start with fth-).")
    deployment = key.deployment
    asked = _requested_model(request.body)
    if asked is not None and asked != deployment.served_model_name and await _active_deployment_named(asked):
        return _error(
            OpenAIError(403, f"This API key is for the model {deployment.served_model_name!r}, not {asked!r}.",
                        "invalid_request_error", "model", "model_not_allowed")
        )
    if deployment.status not in Deployment.ACTIVE:
        return _error(OpenAIError(503, f"The deployment {deployment.served_model_name!r} is {deployment.status}.", "server_error"))
    return await _relay(await GATEWAYS.for_deployment(deployment).handle(path, request.body))


@csrf_exempt
@require_POST
async def chat_completions(request: HttpRequest) -> HttpResponse | StreamingHttpResponse:
    return await _proxy(request, "/v1/chat/completions")


@csrf_exempt
@require_POST
async def completions(request: HttpRequest) -> HttpResponse | StreamingHttpResponse:
    return await _proxy(request, "/v1/completions")


@require_GET
async def models(request: HttpRequest) -> HttpResponse:
    key = await _key_for(request.headers.get("Authorization", ""))
    if key is None:
        return _unauthorized("A valid API key is required: send 'Authorization: Bearer <key>'.")
    return JsonResponse(GATEWAYS.for_deployment(key.deployment).models())


@require_POST
async def playground_chat(request: HttpRequest, deployment_id: int) -> HttpResponse | StreamingHttpResponse:
    """The dashboard's chat: the owner's session instead of a key (CSRF-checked), same path."""
    user = await request.auser()
    deployment = await _owned_deployment(user, deployment_id)
    if deployment is None:
        return _error(OpenAIError(404, "No such deployment.", "invalid_request_error", None, "not_found"))
    try:
        body: Any = json.loads(request.body or b"null")
    except ValueError:
        body = None
    if isinstance(body, dict):
        body["model"] = deployment.served_model_name
    raw = json.dumps(body).encode() if isinstance(body, dict) else request.body
    return await _relay(await GATEWAYS.for_deployment(deployment).handle("/v1/chat/completions", raw))


@sync_to_async
def _owned_deployment(user: Any, deployment_id: int) -> Deployment | None:
    if not user.is_authenticated:
        return None
    return Deployment.objects.select_related("checkpoint").filter(pk=deployment_id, owner=user).first()

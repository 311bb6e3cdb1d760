"""The OpenAI surface over deployments: parse, validate, route, answer. No web framework.

`Gateway.handle(path, raw_body)` is all an HTTP view needs: it returns a `ProxyResponse`
(status, content type, and a body or an async byte stream) for any input, errors included, in
OpenAI's shape. Django's ASGI view (after authenticating the API key) and the standalone
`serving.app` both call it.
"""

from __future__ import annotations

import dataclasses
import json
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from serving.openai_errors import OpenAIError, invalid_request
from serving.openai_requests import PromptCounter, ServedModel, check_request, request_weight
from serving.router import ProxyResponse, Router, StateFileReplicas, error_response
from serving.routing import DEFAULT_POLICY


@dataclass
class ServedDeployment:
    """A deployment as a gateway serves it: its model (name, context, tokenizer) and its router."""

    model: ServedModel
    router: Router


class Gateway:
    """Deployments by model name. Add or remove them as the control plane starts and stops them.

    A deployment's LoRA adapters are models of their own, named as its replicas serve them
    (`Router.adapters`, read off the state file): checked as the base model is, routed to the
    replicas that serve them, listed in /v1/models with the base as their `parent`."""

    def __init__(self) -> None:
        self._deployments: dict[str, ServedDeployment] = {}

    def add(self, model: ServedModel, router: Router) -> None:
        self._deployments[model.name] = ServedDeployment(model, router)

    async def remove(self, name: str) -> None:
        deployment = self._deployments.pop(name, None)
        if deployment is not None:
            await deployment.router.aclose()

    async def aclose(self) -> None:
        for name in list(self._deployments):
            await self.remove(name)

    def _served(self) -> dict[str, tuple[ServedModel, ServedDeployment]]:
        """Every model name served now (the deployments' and their adapters') → its model and deployment."""
        served = {}
        for name, deployment in self._deployments.items():
            for adapter in deployment.router.adapters() - self._deployments.keys():
                served[adapter] = (dataclasses.replace(deployment.model, name=adapter), deployment)
            served[name] = (deployment.model, deployment)
        return served

    def models(self) -> dict[str, Any]:
        """The `/v1/models` answer: each deployment's model, and each adapter with its base as `parent`."""
        now = int(time.time())
        return {
            "object": "list",
            "data": [
                {
                    "id": name,
                    "object": "model",
                    "created": now,
                    "owned_by": "fathom",
                    "max_model_len": model.max_model_len,
                    **({"parent": deployment.model.name} if name != deployment.model.name else {}),
                }
                for name, (model, deployment) in sorted(self._served().items())
            ],
        }

    def serving(self, name: str) -> bool:
        """True while some replica of the deployment `name` may take a request."""
        deployment = self._deployments.get(name)
        return deployment is not None and bool(deployment.router.routable())

    async def handle(self, path: str, raw_body: bytes) -> ProxyResponse:
        try:
            try:
                body = json.loads(raw_body or b"null")
            except ValueError as exc:
                raise invalid_request(f"the request body is not valid JSON: {exc}") from exc
            served = self._served()
            model = check_request(path, body, {name: model for name, (model, _) in served.items()})
        except OpenAIError as error:
            return error_response(error)
        return await served[model.name][1].router.forward(path, body, weight=request_weight(path, body))


def deployment_gateway(
    *, name: str, max_model_len: int, checkpoint: str, state_dir: str | Path, routing: str = DEFAULT_POLICY
) -> Gateway:
    """A gateway for one deployment: prompts counted with its checkpoint's tokenizer (none when
    `checkpoint` is empty), requests routed by its `routing` policy to the routable replicas its
    supervisor writes to `state_dir`. The control plane's /v1 endpoint and `serving.app` both
    build theirs here."""
    model = ServedModel(name=name, max_model_len=max_model_len, counter=PromptCounter(checkpoint) if checkpoint else None)
    gateway = Gateway()
    gateway.add(model, Router(StateFileReplicas(state_dir), model=name, policy=routing))
    return gateway

"""LoRA adapters on a running replica: what a PEFT folder says, and loading or unloading them
through vLLM's runtime endpoints so that attaching one restarts nothing.

A replica starts with its deployment's adapters (`--lora-modules`, `serving.vllm.replica_launch`).
When the control plane changes them it rewrites the deployment's config file and sends the
supervisor SIGHUP (`request_adapters`, `serving.deployment_config.request_change`); the supervisor then brings each ready replica to the new
set with `POST /v1/load_lora_adapter` and `/v1/unload_lora_adapter` (vLLM serves these when
`VLLM_ALLOW_RUNTIME_LORA_UPDATING` is set, which only replicas with `max_loras` get). The state
file lists each replica's adapters, and routers send an adapter's requests only to replicas that
list it.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import httpx

from serving.deployment_config import request_change
from serving.vllm import OptionError, ReplicaOptions

ADAPTER_CONFIG = "adapter_config.json"
ADAPTER_WEIGHTS = "adapter_model.safetensors"


@dataclass(frozen=True)
class AdapterInfo:
    """What a PEFT adapter folder's `adapter_config.json` says that serving needs."""

    path: Path
    rank: int
    base: str  # `base_model_name_or_path`: the model it was trained on

    @classmethod
    def read(cls, path: str | Path) -> AdapterInfo:
        path = Path(path)
        config_file = path / ADAPTER_CONFIG
        OptionError.require(
            config_file.is_file(), "adapter", f"{path} has no {ADAPTER_CONFIG}: it is not a PEFT adapter folder"
        )
        OptionError.require((path / ADAPTER_WEIGHTS).is_file(), "adapter", f"{path} has no {ADAPTER_WEIGHTS}")
        config = json.loads(config_file.read_text())
        return cls(path=path, rank=int(config.get("r", 0)), base=str(config.get("base_model_name_or_path") or ""))

    def check_servable(self, options: ReplicaOptions) -> None:
        """Raises `OptionError` when replicas with `options` cannot load this adapter."""
        OptionError.require(
            options.max_loras > 0, "max_loras", "must be at least 1 for a deployment that serves adapters"
        )
        OptionError.require(
            0 < self.rank <= options.max_lora_rank,
            "max_lora_rank",
            f"is {options.max_lora_rank}, but the adapter at {self.path} has rank {self.rank}",
        )


def request_adapters(state_dir: str | Path, adapters: dict[str, str]) -> bool:
    """Sets the adapters of the deployment whose supervisor runs in `state_dir` and asks it to
    bring its running replicas to them. False when no supervisor runs there (its next start reads
    the config file anyway)."""
    return request_change(state_dir, adapters=adapters)


@dataclass(frozen=True)
class AdapterChange:
    loaded: list[str]
    unloaded: list[str]
    failed: dict[str, str]  # name → what the replica said

    def __bool__(self) -> bool:
        return bool(self.loaded or self.unloaded or self.failed)


async def bring_to(client: httpx.AsyncClient, url: str, serving: list[str], wanted: dict[str, str]) -> AdapterChange:
    """Loads onto the replica at `url` the adapters of `wanted` it lacks and unloads the ones of
    `serving` that `wanted` no longer has; `serving` is updated to what the replica then serves."""
    loaded, unloaded, failed = [], [], {}
    for name in [n for n in serving if n not in wanted]:
        answer = await _post(client, f"{url}/v1/unload_lora_adapter", {"lora_name": name})
        if answer is None or answer.status_code == 404:  # gone with its replica, or never there
            unloaded.append(name)
        elif answer.status_code == 200:
            unloaded.append(name)
        else:
            failed[name] = answer.text[:500]
    for name in sorted(set(wanted) - set(serving)):
        answer = await _post(client, f"{url}/v1/load_lora_adapter", {"lora_name": name, "lora_path": wanted[name]})
        if answer is not None and answer.status_code == 200:
            loaded.append(name)
        else:
            failed[name] = answer.text[:500] if answer is not None else "the replica did not answer"
    serving[:] = sorted((set(serving) - set(unloaded)) | set(loaded))
    return AdapterChange(loaded=loaded, unloaded=unloaded, failed=failed)


async def _post(client: httpx.AsyncClient, url: str, body: dict[str, str]) -> httpx.Response | None:
    try:
        # Loading reads the adapter's weights from disk: seconds for a large one.
        return await client.post(url, json=body, timeout=120)
    except httpx.HTTPError:
        return None

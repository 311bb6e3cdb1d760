"""A quantized checkpoint served on CPU through the same options, checks and launch path."""

from __future__ import annotations

import asyncio
import dataclasses
from pathlib import Path

import httpx
import pytest

from serving.supervisor import DeploymentConfig, Supervisor
from serving.tiny_checkpoint import quantize_int8_w8a8
from serving.vllm import CheckpointInfo, DeviceInfo, ReplicaOptions, check_compatible

pytestmark = [pytest.mark.vllm, pytest.mark.slow]


async def test_an_int8_w8a8_checkpoint_serves_on_cpu_and_agrees_with_the_float_model(
    tmp_path: Path, tiny_checkpoint: Path, vllm_python: str
) -> None:
    checkpoint = quantize_int8_w8a8(tiny_checkpoint, tmp_path / "tiny-w8a8")
    options = ReplicaOptions(
        max_model_len=256, max_num_seqs=4, enforce_eager=True, quantization="int8_w8a8", dtype="float32"
    )
    info = CheckpointInfo.read(checkpoint)
    assert info.quant == "int8_w8a8"
    check_compatible(options, info, DeviceInfo.local_cpu())

    config = DeploymentConfig(
        name="tiny-int8",
        checkpoint=str(checkpoint),
        state_dir=str(tmp_path / "state"),
        python=vllm_python,
        options=options,
        ready_timeout_s=300,
    )
    float_config = dataclasses.replace(
        config,
        name="tiny",
        checkpoint=str(tiny_checkpoint),
        state_dir=str(tmp_path / "float"),
        options=dataclasses.replace(options, quantization="none"),
    )
    supervisors = [Supervisor(cfg) for cfg in (config, float_config)]  # started side by side
    answers: dict[str, list[str]] = {}
    try:
        for supervisor in supervisors:
            await supervisor.start()
        for supervisor in supervisors:
            await supervisor.wait_ready(300)
        async with httpx.AsyncClient(timeout=120) as client:
            for supervisor in supervisors:
                name, url = supervisor.config.name, supervisor.replicas[0].url
                bodies = [
                    {"model": name, "prompt": p, "max_tokens": 6, "temperature": 0}
                    for p in ("the cat sees", "a dog follows the moon", "my friend draws")
                ]
                answers[name] = [
                    (await client.post(f"{url}/v1/completions", json=b)).json()["choices"][0]["text"] for b in bodies
                ]
    finally:
        await asyncio.gather(*(s.stop() for s in supervisors))
    assert all(answers["tiny-int8"])
    # Per-channel int8 keeps a trained model's greedy choices on at least some prompts.
    assert any(q == f for q, f in zip(answers["tiny-int8"], answers["tiny"], strict=True)), answers

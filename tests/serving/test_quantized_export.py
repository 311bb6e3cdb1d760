"""Exports quantized by llmcompressor (`python -m serving.quantize`, its own env) to int8 (W8A8)
and int4 (W4A16), calibrated on the model's own training text, served on real vLLM CPU replicas
through Fathom's options, checks, supervisor and router, and compared with the float model by
next-token agreement: the replicas' `prompt_logprobs` against `transformers` in float32 on the
float export, which a float32 replica matches to within 1e-3 nats (tests/serving/test_deployment.py).
vLLM's CPU build has its int4 kernel only for AVX-512 CPUs: on an AVX2 host the int4 export is
made and its deployment refused."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import httpx
import openai
import pytest
import torch
import transformers

from hostworker.devices import cpu_flags
from serving.deployment_config import DeploymentConfig
from serving.quality import Choices, next_token_choices, top1_agreement
from serving.quantize import SUMMARY_FILE, folder_size
from serving.state import read_events, read_state
from serving.supervisor import launch_detached
from serving.vllm import CheckpointInfo, DeviceInfo, OptionError, ReplicaOptions, check_compatible, replica_dtype
from tests.serving.conftest import REPO, process_alive, start_deployment, wait_until
from tools.tiny_checkpoint import TinyLlamaSpec, generated_text

pytestmark = [pytest.mark.vllm, pytest.mark.slow]

# Sentences of the kind the tiny model was trained on (another seed than its training text), so
# that its next-token choices are mostly confident, as a deployed model's are on its own domain.
PROMPTS = generated_text(32, seed=1234)
# The least share of these 253 positions where each quantized model must put the float32 model's
# token first; where they part, the float model itself must have nearly tied (its own
# log-probabilities of its choice and of the quantized model's within TIE_NATS: the runner-up had
# at least e⁻¹ ≈ 37% of the winner's probability). Measured here (llmcompressor 0.14, vLLM 0.32 on
# CPU, 64 calibration documents): int8 253/253; int4 247/253, every parting a near-tie of under
# 0.05 nats, and the same 6 where the float model itself is served in bfloat16 (247/253 against
# float32; int4 against bfloat16 float: 251/253): at this size bfloat16, not 4-bit weights, costs most. int8 (SmoothQuant, then per-channel int8 weights, per-token int8 activations) rounds
# each value to within half of 1/127 of its row's range; int4 (16 levels per group of 128 inputs,
# computed in bfloat16, which its CPU kernel requires) moves the logits several times more, so its
# bar sits lower. Both bars leave room for another kernel or thread count to break a near-tie the
# other way, while a broken quantization (a wrong scale layout, a layer left out, a lost group
# order) parts from the float model far more often and at confident positions.
MIN_TOP1 = {"int8": 0.97, "int4": 0.93}
HOST = DeviceInfo(kind="cpu", cpu_flags=frozenset(cpu_flags()))
TIE_NATS = 1.0
OPTIONS = ReplicaOptions(max_model_len=256, max_num_seqs=4, enforce_eager=True, dtype="float32")


def _float_choices(checkpoint: Path, top: int = 2) -> list[Choices]:
    """The float model's `top` best next tokens at every position after the first of every
    prompt, in order, as `next_token_choices` reads them off a replica."""
    torch.set_num_threads(1)
    model = transformers.AutoModelForCausalLM.from_pretrained(checkpoint, dtype=torch.float32).eval()
    tokenizer = transformers.AutoTokenizer.from_pretrained(checkpoint)
    choices: list[Choices] = []
    with torch.no_grad():
        for prompt in PROMPTS:
            ids = tokenizer(prompt).input_ids
            logprobs = torch.log_softmax(model(torch.tensor([ids])).logits[0, :-1].double(), dim=-1)
            best = logprobs.topk(top, dim=-1)
            choices += [list(zip(t.tolist(), v.tolist(), strict=True)) for v, t in zip(best.values, best.indices, strict=True)]
    return choices


def _quantize(python: str, export: Path, out: Path, scheme: str, calibration: Path) -> dict:  # type: ignore[type-arg]
    """Run the real command line and return its last line (the summary)."""
    done = subprocess.run(
        [python, "-m", "serving.quantize", str(export), str(out), "--scheme", scheme,
         "--calibration", str(calibration), "--samples", "64"],
        cwd=REPO, env={"PATH": "/usr/bin:/bin", "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1"},
        capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-4000:]
    stages = [json.loads(line) for line in done.stdout.splitlines() if line.startswith("{")]
    assert [s["stage"] for s in stages] == ["loading", "calibrating", "saving", "done"]
    return stages[-1]


async def _served_choices(tmp: Path, checkpoint: Path, vllm_python: str, name: str, quantization: str) -> list[Choices]:
    """Serve `checkpoint` on one replica behind the router and read its choices over PROMPTS."""
    # A quantized export in the dtype its deployment gets here (serving.vllm.replica_dtype): int4's
    # CPU kernel computes in bfloat16 only, int8's AMX kernel takes bfloat16 activations, and
    # oneDNN's int8 (no AMX) float32. So each figure is what a deployment of it gives.
    dtype = replica_dtype(ReplicaOptions(quantization=quantization), HOST)  # type: ignore[arg-type]
    options = ReplicaOptions(**{**OPTIONS.to_dict(), "quantization": quantization, "dtype": dtype})
    check_compatible(options, CheckpointInfo.read(checkpoint), HOST)
    with contextlib.contextmanager(start_deployment)(
        tmp, checkpoint, vllm_python, name=name, replicas=1, options=options
    ) as deployment:
        # It answers the official client like any deployment.
        client = openai.AsyncOpenAI(base_url=f"{deployment.router_url}/v1", api_key="unused", max_retries=0)
        answer = await client.completions.create(model=name, prompt="the cat sees", max_tokens=8, temperature=0)
        await client.close()
        assert answer.choices[0].text.strip(), answer
        async with httpx.AsyncClient(timeout=120) as http:
            choices = await next_token_choices(http, deployment.router_url, name, PROMPTS)
    # A new replica answered every request without dying (bfloat16 runs AMX kernels on AMX CPUs).
    assert [e.kind for e in read_events(tmp / name)[0] if e.kind == "replica_died"] == []
    return choices


async def test_int8_and_int4_exports_made_by_llmcompressor_serve_on_cpu_close_to_the_float_model(
    tmp_path: Path, tiny_checkpoint: Path, vllm_python: str, quantize_python: str
) -> None:
    # The model's own data: the text it was trained on, as a dataset file, 8 sentences a document.
    lines = generated_text(4000, TinyLlamaSpec().seed)
    calibration = tmp_path / "train.txt"
    calibration.write_text("\n\n".join(" ".join(lines[i : i + 8]) for i in range(0, len(lines), 8)))

    reference = _float_choices(tiny_checkpoint)
    assert len(reference) >= 200
    for scheme, served_as in (("int8", "int8_w8a8"), ("int4", "int4")):
        out = tmp_path / "exports" / f"tiny-{scheme}"  # apart from the deployments' state folders
        summary = _quantize(quantize_python, tiny_checkpoint, out, scheme, calibration)
        assert json.loads((out / SUMMARY_FILE).read_text()) == {k: v for k, v in summary.items() if k != "stage"}
        assert summary["served_as"] == served_as and summary["samples"] == 64
        assert summary["bytes"] == folder_size(out) < folder_size(tiny_checkpoint)
        assert CheckpointInfo.read(out).quant == served_as

        if scheme == "int4" and not HOST.has_cpu_int4_kernel:
            # On an AVX2 host a user gets the refusal, before any replica starts, and not a
            # replica whose engine dies on the first request.
            with pytest.raises(OptionError, match="'int4' on cpu needs AVX-512"):
                await _served_choices(tmp_path, out, vllm_python, f"tiny-{scheme}", served_as)
            continue
        choices = await _served_choices(tmp_path, out, vllm_python, f"tiny-{scheme}", served_as)
        if scheme == "int4":
            _forced_to_float32_it_fails_with_the_kernels_error(tmp_path, out, vllm_python)
        agreement = top1_agreement(reference, choices)
        print(
            f"{scheme}: size {summary['bytes']} / {summary['source_bytes']} bytes = {summary['size_ratio']}; "
            f"top-1 agreement {agreement.agree}/{agreement.positions} = {agreement.top1:.3f}; parted at {agreement.parted}"
        )
        assert agreement.top1 >= MIN_TOP1[scheme], agreement.parted
        for ref, chosen in agreement.parted:
            assert len(ref) == 2 and ref[1][0] == chosen and ref[0][1] - ref[1][1] < TIE_NATS, (ref, chosen)


def _forced_to_float32_it_fails_with_the_kernels_error(tmp: Path, export: Path, vllm_python: str) -> None:
    """int4 in float32, which Fathom refuses at create and vLLM's CPUWNA16 kernel cannot run (the
    engine dies on the first request), forced on a supervisor told to give up at the first such
    death: the replica is never called ready, and it fails with the engine's error line instead of
    restarting forever. (Two deaths the same way, the default, are test_supervisor_lifecycle's;
    one here spares a vLLM start.)"""
    config = DeploymentConfig(
        name="forced", export=str(export), state_dir=str(tmp / "forced"), python=vllm_python, replicas=1,
        options=ReplicaOptions(**{**OPTIONS.to_dict(), "quantization": "int4", "dtype": "float32"}),
        ready_timeout_s=300, health_interval_s=1.0, restart_backoff_s=0.5, failed_starts_to_give_up=1,
    )  # fmt: skip
    pid = launch_detached(config, python=sys.executable)
    try:

        def failed() -> list:  # type: ignore[type-arg]
            assert process_alive(pid), f"supervisor exited; see {config.state_dir}/supervisor.log"
            return [e for e in read_events(config.state_dir)[0] if e.kind == "replica_failed"]

        (gave_up,) = wait_until(failed, 400, "the replica to give up")
        kinds = [e.kind for e in read_events(config.state_dir)[0]]
        assert kinds == ["replica_starting", "replica_died", "replica_failed"], kinds
        assert gave_up.message.startswith("failed at its only start"), gave_up.message
        assert gave_up.message.endswith(
            "RuntimeError: Worker failed with error '\"cpu_gemm_wna16\" not implemented for 'Float'', please check "
            "the stack trace above for the root cause"
        ), gave_up.message
        (replica,) = read_state(config.state_dir).replicas  # type: ignore[union-attr]
        assert (replica.phase, replica.restarts) == ("failed", 0)
        assert replica.pid is not None and not process_alive(replica.pid)  # nothing of it runs
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(pid, signal.SIGKILL)

"""One place picks where a rank computes: CUDA + NCCL on its own GPU when there is one, else CPU + gloo."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from training.config import SpecError, TrainConfig
from training.device import CPU, ComputeDevice, choose_device, device_from_environment, peak_flops, table_peak_flops


def test_without_a_gpu_a_rank_computes_on_the_cpu_with_gloo() -> None:
    device = choose_device(local_rank=3, cuda_available=False)
    assert device == CPU
    assert (device.backend, device.torch_device) == ("gloo", torch.device("cpu"))


def test_with_gpus_each_rank_takes_the_gpu_of_its_local_rank_with_nccl_for_cuda_tensors_and_gloo_for_cpu_ones() -> None:
    device = choose_device(local_rank=3, cuda_available=True)
    assert device == ComputeDevice(type="cuda", backend="cpu:gloo,cuda:nccl", index=3)
    assert device.torch_device == torch.device("cuda", 3)


def test_this_host_without_cuda_trains_on_the_cpu() -> None:
    assert torch.cuda.is_available() or device_from_environment() == CPU


def test_gpu_peaks_come_from_the_data_sheet_by_device_name() -> None:
    assert table_peak_flops("NVIDIA H100 80GB HBM3") == 989.4e12
    assert table_peak_flops("NVIDIA H100 PCIe") == 756.0e12
    assert table_peak_flops("NVIDIA L4") == 121.0e12
    assert table_peak_flops("NVIDIA L40S") == 362.1e12
    assert table_peak_flops("Some Future Accelerator") is None


def test_the_cpu_peak_is_a_measured_matmul_rate() -> None:
    assert peak_flops(CPU, "fp32") > 0
    assert peak_flops(CPU, "bf16") > 0


def test_a_cpu_peak_is_measured_in_the_runs_precision_on_its_thread_count(tmp_path: Path) -> None:
    threads = torch.get_num_threads()
    try:
        fp32 = peak_flops(CPU, "fp32", tmp_path)
        bf16 = peak_flops(CPU, "bf16", tmp_path)
        torch.set_num_threads(2)
        peak_flops(CPU, "fp32", tmp_path)
    finally:
        torch.set_num_threads(threads)
    names = sorted(path.name.removeprefix(f"{socket.gethostname()}-") for path in tmp_path.iterdir())
    assert names == sorted(
        {f"cpu-{threads}threads-fp32.json", f"cpu-{threads}threads-bf16.json", "cpu-2threads-fp32.json"}
    )
    assert fp32 != bf16  # two probes, not one figure under two names


def test_a_restarted_run_reads_the_peak_its_first_attempt_measured_on_this_host(tmp_path: Path) -> None:
    first = peak_flops(CPU, "fp32", tmp_path)
    (cached,) = tmp_path.iterdir()
    assert json.loads(cached.read_text()) == {"flops": first}
    cached.write_text(json.dumps({"flops": 123.0}))  # proof that the second call measures nothing
    assert peak_flops(CPU, "fp32", tmp_path) == 123.0


def test_a_new_run_takes_the_best_peak_measured_on_this_host_and_raises_it(tmp_path: Path) -> None:
    host = tmp_path / "host"
    measured = peak_flops(CPU, "fp32", tmp_path / "first-run", host)
    (best,) = host.iterdir()
    assert json.loads(best.read_text()) == {"flops": measured}
    # A probe on a busy host reads low: an earlier run's better figure is the denominator.
    best.write_text(json.dumps({"flops": measured * 100}))
    assert peak_flops(CPU, "fp32", tmp_path / "second-run", host) == measured * 100
    # A better probe raises the host's figure.
    best.write_text(json.dumps({"flops": 1.0}))
    third = peak_flops(CPU, "fp32", tmp_path / "third-run", host)
    assert third > 1.0 and json.loads(best.read_text()) == {"flops": third}


def test_a_deterministic_run_turns_on_torchs_deterministic_kernels_and_cublas_fixed_workspace() -> None:
    probe = (
        "import os, torch; from training.device import make_deterministic; make_deterministic(); "
        "print(torch.are_deterministic_algorithms_enabled(), os.environ['CUBLAS_WORKSPACE_CONFIG'])"
    )
    env = {k: v for k, v in os.environ.items() if k != "CUBLAS_WORKSPACE_CONFIG"}
    shown = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, check=True, env=env)
    assert shown.stdout.split() == ["True", ":4096:8"]


def test_train_deterministic_must_be_a_boolean_naming_the_field() -> None:
    with pytest.raises(SpecError, match=r"train\.deterministic.*must be true or false; got 1"):
        TrainConfig(deterministic=1)  # type: ignore[arg-type]

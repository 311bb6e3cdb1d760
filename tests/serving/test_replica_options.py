"""Replica options: each value checked on its own, then against a checkpoint and a device."""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from hostworker.devices import cpu_flags
from serving.deployment_config import DeploymentConfig, replica_gpus
from serving.replica_life import engine_error
from serving.vllm import (
    REPLICA_SITE,
    CheckpointInfo,
    DeviceInfo,
    OptionError,
    ReplicaOptions,
    check_compatible,
    check_device,
    replica_dtype,
    replica_launch,
    replica_tmpdir,
)

CPU = DeviceInfo(kind="cpu", cpu_flags=frozenset({"avx512f", "avx512_bf16"}))
CPU_WITH_AMX = DeviceInfo(kind="cpu", cpu_flags=frozenset({"avx512f", "amx_tile", "amx_bf16"}))
AMPERE = DeviceInfo(kind="cuda", cuda_capability=(8, 0))
TURING = DeviceInfo(kind="cuda", cuda_capability=(7, 5))


def write_checkpoint(
    root: Path,
    *,
    hidden: int = 256,
    heads: int = 4,
    intermediate: int = 768,
    max_pos: int = 2048,
    quant: dict | None = None,
) -> CheckpointInfo:
    root.mkdir(parents=True, exist_ok=True)
    config = {
        "architectures": ["LlamaForCausalLM"],
        "hidden_size": hidden,
        "num_attention_heads": heads,
        "intermediate_size": intermediate,
        "max_position_embeddings": max_pos,
        "dtype": "float32",
    }
    if quant:
        config["quantization_config"] = quant
    (root / "config.json").write_text(json.dumps(config))
    (root / "tokenizer.json").write_text("{}")
    return CheckpointInfo.read(root)


def error_of(fn, *args, **kwargs) -> OptionError:  # type: ignore[no-untyped-def]
    with pytest.raises(OptionError) as caught:
        fn(*args, **kwargs)
    return caught.value


GPTQ4 = {"quant_method": "gptq", "bits": 4, "group_size": 128}
W8A8 = {
    "quant_method": "compressed-tensors",
    "config_groups": {
        "g": {"weights": {"num_bits": 8, "type": "int"}, "input_activations": {"num_bits": 8, "type": "int"}}
    },
}
W8A16 = {
    "quant_method": "compressed-tensors",
    "config_groups": {"g": {"weights": {"num_bits": 8, "type": "int"}, "input_activations": None}},
}


@pytest.mark.parametrize(
    ("field", "value", "allowed"),
    [
        ("device", "tpu", "cpu, cuda"),
        ("dtype", "float8", "auto, float32, bfloat16, float16"),
        ("quantization", "int2", "none, int8_weight_only, int8_w8a8, fp8, int4"),
        ("max_model_len", 0, "from 16 to"),
        ("max_num_seqs", 0, "from 1 to 4096"),
        ("kv_cache_gib", 0.5, "whole number of GiB"),
        ("gpu_memory_utilization", 1.5, "from 0.05 to 1.0"),
        ("block_size", 48, "multiple of 32"),
        ("cpu_threads_bind", "first", "'auto', 'nobind' or core ids"),
        ("enable_prefix_caching", "yes", "true or false"),
        ("tool_call_parser", "Hermes; rm -rf", "vLLM's tool parsers"),
        ("tensor_parallel_size", 3, "1, 2, 4 or 8 GPUs of one host"),
    ],
)
def test_it_rejects_each_bad_value_naming_the_field_and_what_is_allowed(
    field: str, value: object, allowed: str
) -> None:
    error = error_of(ReplicaOptions, **{field: value})
    assert error.field == field
    assert allowed in error.message
    assert repr(value) in error.message


def test_a_tool_call_parser_turns_on_vllms_tool_choice() -> None:
    plain = replica_launch(ReplicaOptions(), "/ckpt", served_model_name="m", port=1, python="py", state_dir="/s").argv
    assert "--tool-call-parser" not in plain
    argv = replica_launch(
        ReplicaOptions(tool_call_parser="hermes"), "/ckpt", served_model_name="m", port=1, python="py", state_dir="/s"
    ).argv
    assert argv[argv.index("--tool-call-parser") + 1] == "hermes"
    assert "--enable-auto-tool-choice" in argv


def test_block_size_rules_follow_the_device() -> None:
    assert ReplicaOptions(device="cuda", block_size=16).block_size == 16
    assert "on cpu must be a multiple of 32" in error_of(ReplicaOptions, device="cpu", block_size=16).message
    assert ReplicaOptions(device="cpu", block_size=64).block_size == 64


def test_it_rejects_unknown_option_names_from_json() -> None:
    error = error_of(ReplicaOptions.from_dict, {"max_model_len": 512, "tensor_paralel": 2})
    assert error.field == "tensor_paralel"
    assert "max_num_seqs" in error.message


def test_a_plain_checkpoint_serves_unquantized_on_cpu(tmp_path: Path) -> None:
    check_compatible(ReplicaOptions(max_model_len=1024), write_checkpoint(tmp_path), CPU)


def test_it_rejects_a_context_longer_than_the_checkpoint_was_trained_for(tmp_path: Path) -> None:
    error = error_of(
        check_compatible, ReplicaOptions(max_model_len=4096), write_checkpoint(tmp_path, max_pos=2048), CPU
    )
    assert error.field == "max_model_len"
    assert "2048" in error.message


def test_it_rejects_head_sizes_the_cpu_attention_kernel_lacks(tmp_path: Path) -> None:
    ckpt = write_checkpoint(tmp_path, hidden=96, heads=4)  # head size 24
    error = error_of(check_compatible, ReplicaOptions(), ckpt, CPU)
    assert error.field == "device"
    assert "24" in error.message
    check_compatible(ReplicaOptions(device="cuda"), ckpt, AMPERE)


def test_int8_weight_only_is_refused_on_cpu_and_served_on_cuda_from_an_8bit_checkpoint(tmp_path: Path) -> None:
    ckpt = write_checkpoint(tmp_path, quant=W8A16)
    error = error_of(check_compatible, ReplicaOptions(quantization="int8_weight_only"), ckpt, CPU)
    assert error.field == "quantization"
    assert "int8_w8a8" in error.message and "int4" in error.message
    check_compatible(ReplicaOptions(device="cuda", quantization="int8_weight_only"), ckpt, AMPERE)


def test_int8_w8a8_is_served_on_cpu_from_a_compressed_tensors_checkpoint(tmp_path: Path) -> None:
    check_compatible(ReplicaOptions(quantization="int8_w8a8"), write_checkpoint(tmp_path, quant=W8A8), CPU)


# The flag sets of the CPUs seen here (docs/serving.md): Sapphire Rapids or newer (AMX), an
# AVX-512 CPU without AMX, an AVX2-only one; and one that reported no x86 flags (ARM, or unknown).
SAPPHIRE_RAPIDS = DeviceInfo(
    kind="cpu", cpu_flags=frozenset({"avx2", "avx512f", "avx512_bf16", "avx512_fp16", "amx_tile", "amx_bf16", "amx_int8"})
)
AVX512_ONLY = DeviceInfo(kind="cpu", cpu_flags=frozenset({"avx2", "avx512f", "avx512bw", "avx512_vnni"}))
AVX2_ONLY = DeviceInfo(kind="cpu", cpu_flags=frozenset({"avx", "avx2", "fma"}))
UNKNOWN_CPU = DeviceInfo(kind="cpu")


@pytest.mark.parametrize(
    ("quantization", "device", "dtype"),
    [
        # int8 W8A8: AMX's kernel takes 16-bit activations; oneDNN's (no AMX) was seen in float32.
        ("int8_w8a8", SAPPHIRE_RAPIDS, "bfloat16"),
        ("int8_w8a8", AVX512_ONLY, "float32"),
        ("int8_w8a8", AVX2_ONLY, "float32"),
        ("int8_w8a8", UNKNOWN_CPU, "auto"),  # vLLM picks where the flags are unknown
        # int4's CPUWNA16 computes in bfloat16 only, whatever the CPU.
        ("int4", SAPPHIRE_RAPIDS, "bfloat16"),
        ("int4", AVX512_ONLY, "bfloat16"),
        # The float model and fp8 keep vLLM's "auto" (bfloat16 from a float32 checkpoint).
        ("none", SAPPHIRE_RAPIDS, "auto"),
        ("none", AVX2_ONLY, "auto"),
        ("fp8", SAPPHIRE_RAPIDS, "auto"),
    ],
)
def test_auto_dtype_is_what_the_quantizations_kernel_takes_on_the_cpu(quantization, device, dtype) -> None:  # type: ignore[no-untyped-def]
    assert replica_dtype(ReplicaOptions(quantization=quantization), device) == dtype


def test_an_explicit_dtype_is_kept_and_checked_against_the_cpus_kernels() -> None:
    int8_float32 = ReplicaOptions(quantization="int8_w8a8", dtype="float32")
    assert replica_dtype(int8_float32, AVX512_ONLY) == "float32"
    check_device(int8_float32, AVX512_ONLY)
    check_device(int8_float32, AVX2_ONLY)
    error = error_of(check_device, int8_float32, SAPPHIRE_RAPIDS)
    assert error.field == "dtype" and "AMX int8 kernel" in error.message and "'auto' or 'bfloat16'" in error.message
    for dtype in ("bfloat16", "float16", "auto"):
        check_device(ReplicaOptions(quantization="int8_w8a8", dtype=dtype), SAPPHIRE_RAPIDS)
    assert error_of(check_device, ReplicaOptions(quantization="int4", dtype="float32"), SAPPHIRE_RAPIDS).field == "dtype"
    # On GPUs the dtype is vLLM's to take as given.
    gpu = ReplicaOptions(device="cuda", quantization="int8_w8a8", dtype="float32")
    assert replica_dtype(gpu, AMPERE) == "float32"
    check_device(gpu, AMPERE)


def test_the_engine_error_line_is_the_cause_not_the_api_servers_engine_died() -> None:
    int8_in_float32 = """\
(EngineCore pid=16716) ERROR 12-05 07:27:12 [core.py:1512]     raise RuntimeError(
(EngineCore pid=16716) ERROR 12-05 07:27:12 [core.py:1512] RuntimeError: Worker failed with error 'int8_scaled_mm_with_quant: expect A to be bfloat16 or half.', please check the stack trace above for the root cause
(APIServer pid=16617) ERROR 12-05 07:27:12 [async_llm.py:906] AsyncLLM output_handler failed.
(APIServer pid=16617) ERROR 12-05 07:27:12 [async_llm.py:906] vllm.v1.engine.exceptions.EngineDeadError: EngineCore encountered an issue. See stack trace (above) for the root cause.
INFO:     127.0.0.1:35976 - "POST /v1/completions HTTP/1.1" 500 Internal Server Error
"""
    assert engine_error(int8_in_float32) == (
        "RuntimeError: Worker failed with error 'int8_scaled_mm_with_quant: expect A to be bfloat16 or half.', "
        "please check the stack trace above for the root cause"
    )
    sigill = """\
Fatal Python error: Illegal instruction

Thread 0x00007f (most recent call first):
(EngineCore pid=14162) ERROR 12-05 07:22:57 [multiproc_executor.py:315] Worker proc VllmWorker-0 died unexpectedly (exit code: None), shutting down executor.
"""
    assert engine_error(sigill) == "Fatal Python error: Illegal instruction"
    assert engine_error("(APIServer pid=1) ERROR 12-05 07:22:57 [x.py:1] port taken\n") == "port taken"
    assert engine_error("INFO: all good\n") == ""


def test_quantized_widths_other_than_fp8_must_come_from_the_checkpoint(tmp_path: Path) -> None:
    error = error_of(check_compatible, ReplicaOptions(quantization="int4"), write_checkpoint(tmp_path), CPU)
    assert error.field == "quantization"
    assert "quantizes online only to fp8" in error.message


def test_fp8_on_cpu_needs_amx(tmp_path: Path) -> None:
    ckpt = write_checkpoint(tmp_path)
    error = error_of(check_compatible, ReplicaOptions(quantization="fp8"), ckpt, CPU)
    assert "AMX" in error.message
    check_compatible(ReplicaOptions(quantization="fp8"), ckpt, CPU_WITH_AMX)


def test_fp8_on_cuda_is_online_from_a_plain_checkpoint_and_needs_turing_or_newer(tmp_path: Path) -> None:
    ckpt = write_checkpoint(tmp_path)
    options = ReplicaOptions(device="cuda", quantization="fp8")
    check_compatible(options, ckpt, TURING)
    assert "7.5" in error_of(check_compatible, options, ckpt, DeviceInfo(kind="cuda", cuda_capability=(7, 0))).message
    argv = replica_launch(options, ckpt.path, served_model_name="m", port=1, python="py", state_dir=tmp_path).argv
    assert argv[argv.index("--quantization") + 1] == "fp8"


def test_int4_on_cpu_needs_linear_sizes_in_multiples_of_32(tmp_path: Path) -> None:
    options = ReplicaOptions(quantization="int4")
    check_compatible(options, write_checkpoint(tmp_path / "a", quant=GPTQ4), CPU)
    error = error_of(check_compatible, options, write_checkpoint(tmp_path / "b", intermediate=700, quant=GPTQ4), CPU)
    assert "intermediate_size is 700" in error.message


def test_int4_on_cpu_is_refused_in_float32_which_its_kernel_lacks(tmp_path: Path) -> None:
    ckpt = write_checkpoint(tmp_path, quant=GPTQ4)
    error = error_of(check_compatible, ReplicaOptions(quantization="int4", dtype="float32"), ckpt, CPU)
    assert error.field == "dtype" and "'auto' or 'bfloat16'" in error.message
    check_compatible(ReplicaOptions(quantization="int4", dtype="bfloat16"), ckpt, CPU)
    check_compatible(ReplicaOptions(device="cuda", quantization="int4", dtype="float32"), ckpt, AMPERE)


def test_int4_on_an_avx2_cpu_is_refused_since_vllms_avx2_build_lacks_its_kernel(tmp_path: Path) -> None:
    ckpt = write_checkpoint(tmp_path, quant=GPTQ4)
    avx2 = DeviceInfo(kind="cpu", cpu_flags=frozenset({"avx", "avx2", "fma"}))
    error = error_of(check_compatible, ReplicaOptions(quantization="int4", dtype="bfloat16"), ckpt, avx2)
    assert error.field == "quantization" and "needs AVX-512" in error.message and "'int8_w8a8'" in error.message
    arm = DeviceInfo(kind="cpu")  # no x86 flags: vLLM has the final word
    check_compatible(ReplicaOptions(quantization="int4", dtype="bfloat16"), ckpt, arm)


def test_a_quantized_checkpoint_must_be_declared(tmp_path: Path) -> None:
    error = error_of(check_compatible, ReplicaOptions(), write_checkpoint(tmp_path, quant=GPTQ4), CPU)
    assert error.field == "quantization"
    assert "set quantization to 'int4'" in error.message


def test_options_for_another_device_are_refused(tmp_path: Path) -> None:
    error = error_of(check_compatible, ReplicaOptions(device="cuda"), write_checkpoint(tmp_path), CPU)
    assert error.field == "device"


def test_the_cpu_launch_sets_kv_cache_cores_and_keeps_files_in_the_state_dir(tmp_path: Path) -> None:
    options = ReplicaOptions(
        max_model_len=512,
        max_num_seqs=8,
        kv_cache_gib=2,
        dtype="float32",
        enforce_eager=True,
        block_size=64,
        enable_prefix_caching=False,
    )
    launch = replica_launch(
        options,
        "/ckpt",
        served_model_name="tiny",
        port=8123,
        python="/venv/bin/python",
        state_dir=tmp_path,
        cpu_threads_bind="1",
    )
    argv = launch.argv
    assert argv[:3] == ["/venv/bin/python", "-m", "vllm.entrypoints.openai.api_server"]
    pairs = dict(zip(argv[3::2], argv[4::2], strict=False))
    assert pairs["--model"] == "/ckpt" and pairs["--served-model-name"] == "tiny" and pairs["--port"] == "8123"
    assert pairs["--max-model-len"] == "512" and pairs["--max-num-seqs"] == "8" and pairs["--dtype"] == "float32"
    assert {"--enforce-eager", "--no-enable-prefix-caching"} <= set(argv)
    assert argv[argv.index("--block-size") + 1] == "64"
    assert launch.env["VLLM_CPU_KVCACHE_SPACE"] == "2"
    # Its processes ask Linux for AMX tile use at start (vLLM's AMX attention does not).
    assert launch.env["PYTHONPATH"] == str(REPLICA_SITE) and (REPLICA_SITE / "sitecustomize.py").is_file()
    assert launch.env["VLLM_CPU_OMP_THREADS_BIND"] == "1"
    assert launch.env["VLLM_CACHE_ROOT"].startswith(str(tmp_path)) and launch.env["TMPDIR"] == str(
        replica_tmpdir(tmp_path)
    )
    assert launch.url == "http://127.0.0.1:8123"


def test_a_deep_state_dir_still_gives_vllm_a_tmpdir_short_enough_for_its_sockets(tmp_path: Path) -> None:
    deep = tmp_path / ("d" * 60) / "deployments" / "tiny"
    tmpdir = replica_launch(ReplicaOptions(), "/ckpt", served_model_name="m", port=1, python="py", state_dir=deep).env[
        "TMPDIR"
    ]
    assert len(tmpdir) + len("/") + 36 <= 107  # vLLM's socket: TMPDIR/<uuid4>
    assert (
        tmpdir
        == replica_launch(ReplicaOptions(), "/ckpt", served_model_name="m", port=2, python="py", state_dir=deep).env[
            "TMPDIR"
        ]
    )


def test_the_cuda_launch_sets_the_memory_fraction_instead_of_a_cpu_cache(tmp_path: Path) -> None:
    launch = replica_launch(
        ReplicaOptions(device="cuda", gpu_memory_utilization=0.8),
        "/ckpt",
        served_model_name="m",
        port=1,
        python="py",
        state_dir=tmp_path,
    )
    assert launch.argv[launch.argv.index("--gpu-memory-utilization") + 1] == "0.8"
    assert "VLLM_CPU_KVCACHE_SPACE" not in launch.env


def test_a_tensor_parallel_replica_needs_cuda_and_a_size_that_divides_the_heads(tmp_path: Path) -> None:
    error = error_of(ReplicaOptions, tensor_parallel_size=2)
    assert (error.field, "needs device 'cuda'" in error.message) == ("tensor_parallel_size", True)
    three_heads = write_checkpoint(tmp_path / "ckpt", hidden=192, heads=3)
    error = error_of(check_compatible, ReplicaOptions(device="cuda", tensor_parallel_size=2), three_heads, AMPERE)
    assert error.field == "tensor_parallel_size" and "3 attention heads" in error.message
    check_compatible(ReplicaOptions(device="cuda", tensor_parallel_size=2), write_checkpoint(tmp_path / "four"), AMPERE)


def test_each_cuda_replica_is_launched_on_its_own_gpus(tmp_path: Path) -> None:
    options = ReplicaOptions(device="cuda", tensor_parallel_size=2)
    launch = replica_launch(options, "/ckpt", served_model_name="m", port=1, python="py", state_dir=tmp_path, gpus="4,5")
    assert launch.argv[launch.argv.index("--tensor-parallel-size") + 1] == "2"
    assert launch.env["CUDA_VISIBLE_DEVICES"] == "4,5"
    # The supervisor splits the GPUs its host worker claimed for it, in order, between its replicas.
    assert [replica_gpus("4,5,6,7", i, 2) for i in (0, 1)] == ["4,5", "6,7"]
    assert replica_gpus("3", 0, 1) == "3"
    # Given no list (a supervisor started without hosts), or one too short: what it sees stays.
    assert replica_gpus(None, 0, 1) is None and replica_gpus("0", 1, 1) is None
    single = replica_launch(ReplicaOptions(device="cuda"), "/ckpt", served_model_name="m", port=1, python="py", state_dir=tmp_path)
    assert "--tensor-parallel-size" not in single.argv and "CUDA_VISIBLE_DEVICES" not in single.env


def test_a_deployment_config_round_trips_through_json_and_checks_its_fields(tmp_path: Path) -> None:
    config = DeploymentConfig(
        name="tiny",
        export="/c",
        state_dir=str(tmp_path),
        python="py",
        replicas=2,
        cpu_binds=("0", "1"),
        ports=(31000, 31099),
        options=ReplicaOptions(kv_cache_gib=2),
    )
    again = DeploymentConfig.from_dict(json.loads(json.dumps(config.to_dict())))
    assert again == config
    assert error_of(dataclasses.replace, config, replicas=0).field == "replicas"
    for ports in ((31099, 31000), (80, 81), (31000,), (31000, 70000)):
        assert error_of(dataclasses.replace, config, ports=ports).field == "ports"
    assert error_of(dataclasses.replace, config, cpu_binds=("zero",)).field == "cpu_threads_bind"
    assert error_of(DeploymentConfig.from_dict, {**config.to_dict(), "replica": 3}).field == "replica"
    # A config file written before `checkpoint` was renamed `export` (a supervisor restarted
    # across the upgrade) still reads.
    written_before = {("checkpoint" if k == "export" else k): v for k, v in config.to_dict().items()}
    assert DeploymentConfig.from_dict(written_before) == config


def test_a_cpu_replicas_processes_may_run_amx_tile_instructions_where_the_cpu_has_them() -> None:
    # What vLLM's spawned processes do at start: run Python with the replica's PYTHONPATH. Linux
    # then reports tile data (XFEATURE 18) among the process's permitted features; on a CPU
    # without AMX the request is refused and the process runs as before.
    asks_linux = (
        "import ctypes; v = ctypes.c_ulong(0); "
        "ctypes.CDLL(None).syscall(158, 0x1022, ctypes.byref(v)); print(v.value >> 18 & 1)"  # ARCH_GET_XCOMP_PERM
    )
    env = {"PATH": os.environ.get("PATH", "/usr/bin:/bin"), "PYTHONPATH": str(REPLICA_SITE)}
    done = subprocess.run([sys.executable, "-c", asks_linux], env=env, capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    if os.uname().machine == "x86_64":
        assert done.stdout.strip() == ("1" if "amx_tile" in cpu_flags() else "0")
    without = subprocess.run([sys.executable, "-c", asks_linux], env={"PATH": env["PATH"]}, capture_output=True, text=True)
    assert without.stdout.strip() in ("0", "")  # a process that did not ask has no permission

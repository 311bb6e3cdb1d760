"""Run by every Python process of a CPU replica at start (`serving.vllm.replica_launch` puts this
folder on the replica's PYTHONPATH, which vLLM's engine and worker processes inherit).

Linux lets a process run AMX tile instructions only after it asked for the tile-data state
(`arch_prctl(ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA)`); without it the first such instruction
is SIGILL. The permission is per process and reset by exec, so each of vLLM's spawned processes
must ask. torch asks when oneDNN takes an AMX path, but vLLM 0.32's own AMX attention kernel
(bfloat16 on AMX CPUs) does not: its worker died of SIGILL on its first request. Asking here
costs one system call; on a CPU without AMX the kernel refuses it and nothing changes.
"""

import ctypes
import os
import sys

_SYS_ARCH_PRCTL = 158  # x86-64 only
_ARCH_REQ_XCOMP_PERM = 0x1023
_XFEATURE_XTILEDATA = 18

if sys.platform == "linux" and os.uname().machine == "x86_64":
    try:
        ctypes.CDLL(None, use_errno=True).syscall(_SYS_ARCH_PRCTL, _ARCH_REQ_XCOMP_PERM, _XFEATURE_XTILEDATA)
    except (OSError, AttributeError):  # no libc symbols to call: nothing asked, nothing lost
        pass

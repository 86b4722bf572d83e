"""Run a command as a container under Docker's default seccomp profile would run it: `kcmp`,
`pidfd_getfd`, `ptrace` and `process_vm_readv`/`_writev` refused with EPERM (what that
profile does without CAP_SYS_PTRACE), inherited by every process the command starts.

    python3 tests/python/no_ptrace.py COMMAND [ARGS...]
"""
import ctypes
import os
import platform
import struct
import sys

# Syscall numbers and the audit architecture, per machine.
_NR = {
    "x86_64": (0xC000003E, {"ptrace": 101, "process_vm_readv": 310, "process_vm_writev": 311, "kcmp": 312,
                            "pidfd_getfd": 438}),
    "aarch64": (0xC00000B7, {"ptrace": 117, "process_vm_readv": 270, "process_vm_writev": 271, "kcmp": 272,
                             "pidfd_getfd": 438}),
}
_LD_W_ABS, _JEQ_K, _RET_K = 0x20, 0x15, 0x06
_ALLOW, _ERRNO_EPERM = 0x7FFF0000, 0x00050000 | 1
_PR_SET_NO_NEW_PRIVS, _PR_SET_SECCOMP, _SECCOMP_MODE_FILTER = 38, 22, 2


class _Prog(ctypes.Structure):
    _fields_ = [("len", ctypes.c_ushort), ("filter", ctypes.c_void_p)]


def confine():
    """Install the filter on this (single-threaded) process."""
    arch, nrs = _NR[platform.machine()]
    refused = list(nrs.values())
    n = len(refused)
    ins = [(_LD_W_ABS, 0, 0, 4), (_JEQ_K, 0, n + 2, arch), (_LD_W_ABS, 0, 0, 0)]
    ins += [(_JEQ_K, n - i, 0, nr) for i, nr in enumerate(refused)]
    ins += [(_RET_K, 0, 0, _ALLOW), (_RET_K, 0, 0, _ERRNO_EPERM), (_RET_K, 0, 0, _ALLOW)]
    raw = b"".join(struct.pack("HBBI", *i) for i in ins)
    buf = ctypes.create_string_buffer(raw, len(raw))
    prog = _Prog(len(ins), ctypes.cast(buf, ctypes.c_void_p))
    libc = ctypes.CDLL(None, use_errno=True)
    libc.prctl.argtypes = [ctypes.c_int, ctypes.c_ulong, ctypes.c_void_p, ctypes.c_ulong, ctypes.c_ulong]
    if libc.prctl(_PR_SET_NO_NEW_PRIVS, 1, None, 0, 0) != 0 or \
            libc.prctl(_PR_SET_SECCOMP, _SECCOMP_MODE_FILTER, ctypes.addressof(prog), 0, 0) != 0:
        raise OSError(ctypes.get_errno(), "installing the seccomp filter: " + os.strerror(ctypes.get_errno()))


if __name__ == "__main__":
    confine()
    os.execvp(sys.argv[1], sys.argv[1:])

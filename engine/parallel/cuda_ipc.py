"""The few CUDA runtime calls that map one GPU buffer into the peer processes (CUDA IPC), via ctypes.

PyTorch exposes IPC only through ``torch.multiprocessing``, which opens a peer's buffer in the
context of the *peer's* device (enabling no access from this GPU, and creating a context there);
the one-shot all-reduce needs the peer's memory mapped for this rank's GPU. So, as vLLM's custom
all-reduce does, this calls ``libcudart`` directly: the copy PyTorch already loaded (found in
``/proc/self/maps``), so the calls share PyTorch's CUDA context.
"""

from __future__ import annotations

import ctypes
from dataclasses import dataclass

__all__ = ["CudaRuntime", "IpcHandle"]

_IPC_HANDLE_BYTES = 64
_LAZY_ENABLE_PEER_ACCESS = 1  # cudaIpcMemLazyEnablePeerAccess


class _IpcMemHandle(ctypes.Structure):
    _fields_ = [("reserved", ctypes.c_char * _IPC_HANDLE_BYTES)]


@dataclass(frozen=True, slots=True)
class IpcHandle:
    """A buffer's IPC handle, as bytes another process can open."""

    data: bytes


def _loaded_cudart() -> str:
    with open("/proc/self/maps") as maps:
        for line in maps:
            path = line.split()[-1]
            if "libcudart" in path and ".so" in path:
                return path
    raise RuntimeError("libcudart is not loaded in this process (initialise CUDA through torch first)")


class CudaRuntime:
    """``cudaMalloc`` / ``cudaIpc*`` of the process's own libcudart; every call raises on an error."""

    def __init__(self) -> None:
        lib = ctypes.CDLL(_loaded_cudart())
        lib.cudaGetErrorString.restype = ctypes.c_char_p
        lib.cudaIpcOpenMemHandle.argtypes = [ctypes.POINTER(ctypes.c_void_p), _IpcMemHandle, ctypes.c_uint]
        self._lib = lib

    def _call(self, name: str, *args: object) -> None:
        err = getattr(self._lib, name)(*args)
        if err != 0:
            raise RuntimeError(f"{name}: {self._lib.cudaGetErrorString(err).decode()} ({err})")

    def set_device(self, index: int) -> None:
        self._call("cudaSetDevice", ctypes.c_int(index))

    def malloc_zeroed(self, size: int) -> int:
        """A new device buffer of ``size`` bytes on the current device, zeroed (synchronously)."""
        ptr = ctypes.c_void_p()
        self._call("cudaMalloc", ctypes.byref(ptr), ctypes.c_size_t(size))
        assert ptr.value is not None
        self._call("cudaMemset", ptr, ctypes.c_int(0), ctypes.c_size_t(size))
        self._call("cudaDeviceSynchronize")
        return ptr.value

    def free(self, ptr: int) -> None:
        self._call("cudaFree", ctypes.c_void_p(ptr))

    def ipc_handle(self, ptr: int) -> IpcHandle:
        handle = _IpcMemHandle()
        self._call("cudaIpcGetMemHandle", ctypes.byref(handle), ctypes.c_void_p(ptr))
        return IpcHandle(bytes(handle))  # all 64 bytes (.reserved would stop at a NUL)

    def ipc_open(self, handle: IpcHandle) -> int:
        """Map a peer's buffer for the current device (peer access enabled on first use)."""
        ptr = ctypes.c_void_p()
        raw = _IpcMemHandle()
        ctypes.memmove(ctypes.addressof(raw), handle.data, _IPC_HANDLE_BYTES)
        self._call("cudaIpcOpenMemHandle", ctypes.byref(ptr), raw, ctypes.c_uint(_LAZY_ENABLE_PEER_ACCESS))
        assert ptr.value is not None
        return ptr.value

    def ipc_close(self, ptr: int) -> None:
        self._call("cudaIpcCloseMemHandle", ctypes.c_void_p(ptr))

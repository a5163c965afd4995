"""A ``phloem serve`` subprocess on a free loopback port, started fresh for one benchmark run, and
the resident memory of a local process (the benchmarks report the server's)."""

from __future__ import annotations

import time

import httpx

__all__ = ["LocalServer", "rss_mib"]


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def rss_mib(pid: int) -> float:
    """Resident memory of a local process (Linux ``/proc``), MiB."""
    with open(f"/proc/{pid}/status") as status:
        for line in status:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    return 0.0


class LocalServer:
    """A ``phloem serve`` subprocess on a free loopback port, for one benchmark mode."""

    def __init__(self, args: list[str], data_dir: str) -> None:
        import subprocess
        import sys

        self.port = _free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        cmd = [sys.executable, "-m", "phloem.cli", "serve", "--port", str(self.port), "--data-dir", data_dir, *args]
        self.log = open(f"{data_dir}/server.log", "wb")
        self.proc = subprocess.Popen(cmd, stdout=self.log, stderr=subprocess.STDOUT)

    def wait(self, timeout_s: float = 300.0) -> None:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"phloem serve exited with {self.proc.returncode}; see {self.log.name}")
            try:
                if httpx.get(self.url + "/health", timeout=2).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.3)
        raise TimeoutError(f"phloem serve did not answer /health within {timeout_s} s")

    def stop(self) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(30)
        except Exception:
            self.proc.kill()
            self.proc.wait()
        self.log.close()

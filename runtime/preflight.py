"""What ``phloem`` checks before anything heavy starts: the model folder, the device, the port.

A mistake found here costs a second, not the tens of seconds of loading a model first, and it
is one line for a person (``phloem serve: error: ...``, exit status 2), never a traceback:

- ``check_model_folder`` (a bad ``--model``) raises ``ValueError``: a usage error, printed
  under the command's usage line like any bad flag value. It never imports torch.
  ``resolve_model_folder`` also takes a Hub id (``Qwen/Qwen3.5-35B-A3B``): the snapshot already
  in the local Hugging Face cache, else a usage error saying how to download it (nothing is
  downloaded at start: a 70 GB download is a step of its own). ``check_chat_template`` reads a
  ``--chat-template`` file and parses it as Jinja.
- ``check_device`` and ``bind_port`` raise ``StartupError``: the command line is fine but this
  machine cannot do it (no CUDA, the port is taken); the one line says which flag changes it.
  ``check_device`` imports torch only for a CUDA device on a machine with an NVIDIA GPU.

``bind_port`` binds the server's socket at once and hands it to uvicorn later
(``api.app.serve``), so the port cannot be taken while the model loads. It does not listen
yet: until the server is ready, connecting is refused, as if nothing ran there.
"""

from __future__ import annotations

import errno
import json
import re
import socket
from pathlib import Path

__all__ = ["StartupError", "best_device", "bind_port", "check_chat_template", "check_device", "check_model_folder",
           "resolve_model_folder"]

# ``org/name`` as the Hugging Face Hub spells a repository id.
_HUB_ID = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]*/[A-Za-z0-9][A-Za-z0-9_.-]*")


class StartupError(Exception):
    """This machine cannot do what the command line asks; the message is one line for a person."""


def check_model_folder(model: str | Path | None, flag: str = "--model") -> None:
    """A model folder must exist and hold a readable ``config.json``.

    Args:
        model: The folder; None (the built-in model) passes.
        flag: The flag (or variable) that gave it, named in the message.

    Raises:
        ValueError: The folder is missing, not a folder, or has no valid ``config.json``.
    """
    if model is None:
        return
    path = Path(model).expanduser()
    if not path.exists():
        raise ValueError(f"{flag}: no such folder {str(model)!r}; give a Hugging Face model folder "
                         "(with config.json and *.safetensors), or leave it out for the built-in model")
    if not path.is_dir():
        raise ValueError(f"{flag}: expected a model folder, got the file {str(model)!r}")
    config = path / "config.json"
    try:
        json.loads(config.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise ValueError(f"{flag}: {str(model)!r} has no config.json: not a Hugging Face model folder") from None
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise ValueError(f"{flag}: cannot read {str(config)!r}: {exc}") from None


def resolve_model_folder(model: str | None, flag: str = "--model") -> str | None:
    """The model folder ``model`` names: a folder as given, or for a Hub id that is no folder here
    (``Qwen/Qwen3.5-35B-A3B``) its snapshot in the local Hugging Face cache.

    Args:
        model: A folder, a Hub id, or None (the built-in model, returned as is).
        flag: The flag (or variable) that gave it, named in the message.

    Raises:
        ValueError: No such folder; a Hub id not downloaded yet (the message gives the ``hf
            download`` command); or the folder fails ``check_model_folder``.
    """
    if model is None or Path(model).expanduser().exists() or not _HUB_ID.fullmatch(model):
        check_model_folder(model, flag)
        return model
    snapshot = _cached_snapshot(model)
    if snapshot is None:
        name = model.split("/")[1]
        raise ValueError(f"{flag}: {model!r} is a Hugging Face Hub id and no folder; download it first: "
                         f"`hf download {model} --local-dir ~/models/{name}`, then `--model ~/models/{name}` "
                         "(docs/models.md)")
    check_model_folder(snapshot, flag)
    return snapshot


def _cached_snapshot(repo_id: str) -> str | None:
    """The folder of ``repo_id``'s snapshot in the local Hugging Face cache; None when
    ``huggingface_hub`` is not installed or the model is not there. Never downloads."""
    try:
        from huggingface_hub import snapshot_download
    except ImportError:
        return None
    try:
        return str(snapshot_download(repo_id, local_files_only=True))
    except Exception:  # noqa: BLE001 - not cached (LocalEntryNotFoundError), or a cache it cannot read
        return None


def check_chat_template(path: Path) -> Path:
    """A ``--chat-template`` file must be readable UTF-8 text that parses as a Jinja template.

    Returns:
        ``path``, expanded (``~``).

    Raises:
        ValueError: The file cannot be read or is no Jinja template (the message names it).
    """
    path = path.expanduser()
    try:
        text = path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        raise ValueError(f"--chat-template: cannot read {str(path)!r}: {getattr(exc, 'strerror', None) or exc}") from None
    import jinja2

    try:
        jinja2.Environment().parse(text)
    except jinja2.TemplateSyntaxError as exc:
        raise ValueError(f"--chat-template: {str(path)!r} is no Jinja template: line {exc.lineno}: {exc.message}") from None
    return path


def check_device(device: str, flag: str = "--device") -> None:
    """A CUDA device must exist on this machine (``cpu`` always passes, without importing torch).

    Raises:
        StartupError: No CUDA, or no GPU of that index.
    """
    if not device.startswith("cuda"):
        return
    if not _has_nvidia_device():
        raise StartupError(f"CUDA is not available on this machine (no NVIDIA GPU); use {flag} cpu")
    import torch

    if not torch.cuda.is_available():
        raise StartupError(f"CUDA is not available on this machine (torch {torch.__version__}); "
                           f"use {flag} cpu")
    index = device.partition(":")[2]
    count = torch.cuda.device_count()
    if index and int(index) >= count:
        raise StartupError(f"{flag} {device}: this machine has {count} CUDA device(s), "
                           f"cuda:0..cuda:{count - 1}")


def best_device() -> str:
    """``cuda`` when a CUDA GPU is usable here, else ``cpu`` (imports torch only where a GPU is)."""
    if not _has_nvidia_device():
        return "cpu"
    import torch

    return "cuda" if torch.cuda.is_available() else "cpu"


def _has_nvidia_device() -> bool:
    """Whether the NVIDIA driver shows a GPU (``/dev/nvidia0``...): without one CUDA cannot be
    available, which is known without importing torch (seconds on a loaded machine)."""
    return any(Path("/dev").glob("nvidia[0-9]*"))


def bind_port(host: str, port: int) -> socket.socket:
    """Bind (without listening) the server's TCP socket, as uvicorn would.

    Args:
        host: The bind address.
        port: The port; 0 binds any free one.

    Returns:
        The bound socket; the caller passes it to the server, or closes it.

    Raises:
        StartupError: The port is in use, the address is not this machine's, or binding is not
            allowed (a port below 1024 without privileges).
    """
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((host.strip("[]"), port))
    except OSError as exc:
        sock.close()
        raise StartupError(_bind_problem(host, port, exc)) from None
    sock.set_inheritable(True)
    return sock


def _bind_problem(host: str, port: int, exc: OSError) -> str:
    if exc.errno == errno.EADDRINUSE:
        return (f"port {port} on {host} is already in use (another phloem serve?); choose another "
                "with --port (or $PHLOEM_PORT), or stop what holds it")
    if exc.errno == errno.EACCES:
        return f"port {port} needs privileges on this machine; choose one above 1023 with --port"
    if exc.errno in (errno.EADDRNOTAVAIL, errno.EAFNOSUPPORT) or isinstance(exc, socket.gaierror):
        return f"--host {host}: not an address of this machine ({exc.strerror or exc})"
    return f"cannot bind {host}:{port}: {exc.strerror or exc}"

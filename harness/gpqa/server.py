"""OpenAI-compatible servers for the GPQA server route: check one that is already up (``--base-url``),
or start ``vllm serve MODEL --moe-backend X`` where vLLM is installed, wait until it is healthy, and
stop it afterwards, keeping its log so that a server that dies is reported with the log's tail.

Only loopback and addresses the user names are ever contacted; nothing here picks a host itself.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import time
import urllib.error
import urllib.request
from pathlib import Path

from mxmoe.harness.gpqa.lm import ServerError
from mxmoe.kernels.vllm_layer import MOE_BACKEND_STRINGS

VLLM_MOE_BACKENDS = tuple(dict.fromkeys(MOE_BACKEND_STRINGS.values()))
"""vLLM's ``--moe-backend`` values for MXFP4, from the one table the vLLM adapters use."""


def _get(url: str, timeout: float) -> tuple[int, bytes]:
    req = urllib.request.Request(url, headers={"Accept": "application/json"})
    with urllib.request.urlopen(req, timeout=timeout) as resp:  # noqa: S310 (a URL the user gave)
        return resp.status, resp.read()


def served_models(base_url: str, timeout: float = 10.0) -> list[str]:
    """The model ids an OpenAI-compatible server at ``base_url`` (``http://host:port/v1``) serves;
    ServerError saying why when it cannot be reached or does not answer as one."""
    url = base_url.rstrip("/") + "/models"
    try:
        status, body = _get(url, timeout)
    except (urllib.error.URLError, OSError, TimeoutError) as exc:
        reason = getattr(exc, "reason", exc)
        raise ServerError(f"server at {base_url} unreachable: GET {url} failed: {reason}") from None
    try:
        ids = [m["id"] for m in json.loads(body)["data"]]
    except (ValueError, KeyError, TypeError):
        raise ServerError(f"server at {base_url} is not OpenAI-compatible: GET {url} answered {status} "
                          f"{body[:200]!r}") from None  # fmt: skip
    if not ids:
        raise ServerError(f"server at {base_url} serves no model (GET {url})")
    return ids


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class VllmServer:
    """``vllm serve`` as a child process on a loopback port, its output in ``log``."""

    def __init__(self, model: str, moe_backend: str, log: Path, extra: list[str] | None = None,
                 startup_timeout: float = 1800.0) -> None:  # fmt: skip
        if moe_backend not in VLLM_MOE_BACKENDS:
            raise ValueError(f"--backend for --serve vllm is vLLM's --moe-backend value, one of "
                             f"{', '.join(VLLM_MOE_BACKENDS)}; got {moe_backend!r}")  # fmt: skip
        self.exe = shutil.which("vllm")
        if self.exe is None:
            raise ServerError("vLLM is not installed here (no `vllm` on PATH): start the server yourself, "
                              "`vllm serve MODEL --moe-backend X`, and pass its URL with --base-url")  # fmt: skip
        self.model, self.moe_backend, self.log, self.extra = model, moe_backend, Path(log), list(extra or [])
        self.port = free_port()
        self.base_url = f"http://127.0.0.1:{self.port}/v1"
        self.startup_timeout = startup_timeout
        self.proc: subprocess.Popen | None = None

    @property
    def command(self) -> list[str]:
        return [self.exe, "serve", self.model, "--moe-backend", self.moe_backend, "--host", "127.0.0.1",
                "--port", str(self.port), *self.extra]  # fmt: skip

    def tail(self, lines: int = 40) -> str:
        try:
            return "\n".join(self.log.read_text(errors="replace").splitlines()[-lines:])
        except OSError:
            return "(no log)"

    def start(self) -> None:
        """Start it and wait until ``/health`` answers 200 and ``/v1/models`` lists the model;
        ServerError with the log's tail if it exits first or takes longer than the timeout."""
        self.log.parent.mkdir(parents=True, exist_ok=True)
        with open(self.log, "wb") as f:
            self.proc = subprocess.Popen(self.command, stdout=f, stderr=subprocess.STDOUT, start_new_session=True,
                                         env=os.environ.copy())  # fmt: skip
        deadline = time.monotonic() + self.startup_timeout
        root = self.base_url.removesuffix("/v1")
        while time.monotonic() < deadline:
            self.check_alive()
            try:
                if _get(root + "/health", 5.0)[0] == 200:
                    served_models(self.base_url)
                    return
            except (urllib.error.URLError, OSError, ServerError):
                pass
            time.sleep(1.0)
        self.stop()
        raise ServerError(f"`{' '.join(self.command)}` not healthy after {self.startup_timeout:.0f} s; "
                          f"log {self.log}, its end:\n{self.tail()}")  # fmt: skip

    def check_alive(self) -> None:
        """ServerError with the log's tail if the process has exited."""
        if self.proc is not None and self.proc.poll() is not None:
            raise ServerError(f"`{' '.join(self.command)}` exited with code {self.proc.returncode}; "
                              f"log {self.log}, its end:\n{self.tail()}")  # fmt: skip

    def stop(self) -> None:
        if self.proc is None or self.proc.poll() is not None:
            return
        os.killpg(self.proc.pid, signal.SIGTERM)
        try:
            self.proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait()

    def __enter__(self) -> VllmServer:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

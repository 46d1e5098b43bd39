"""A throwaway ``redis-server`` on 127.0.0.1: to try the shared tier on one machine,
and what maxkv's tests (``redis`` marker) and benchmarks start.

    with LocalRedisServer(directory) as server:
        config = TierConfig(model_id="...", redis_url=server.url)
"""

from __future__ import annotations

import shutil
import socket
import subprocess
import time
from collections.abc import Sequence
from pathlib import Path

__all__ = ["LocalRedisServer"]

BINARY = shutil.which("redis-server")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class LocalRedisServer:
    """``redis-server --port N --bind 127.0.0.1 --save "" --appendonly no`` (nothing
    persisted), started by :meth:`start` (or ``with``) and stopped by :meth:`stop`.

    Raises:
        RuntimeError: If ``redis-server`` is not on the PATH, exits, or does not
            listen within 10 s.
    """

    def __init__(
        self,
        directory: Path,
        port: int | None = None,
        *,
        extra_args: Sequence[str] = (),
        tls: tuple[Path, Path] | None = None,
    ) -> None:
        """Args:
        directory: The server's working directory.
        port: Its port (default: a free one).
        extra_args: More ``redis-server`` arguments (``--aclfile``, ``--requirepass``).
        tls: ``(certificate, private key)`` PEM files: the port speaks TLS only
            (clients are not asked for certificates), :attr:`url` is ``rediss://``.
        """
        if BINARY is None:
            raise RuntimeError(
                "redis-server is not installed (Debian: apt-get install redis-server)"
            )
        self.directory = directory
        self.port = port or free_port()
        self.process: subprocess.Popen[bytes] | None = None
        self.extra_args = list(extra_args)
        self.tls = tls

    @property
    def url(self) -> str:
        scheme = "rediss" if self.tls else "redis"
        return f"{scheme}://127.0.0.1:{self.port}/0"

    def start(self) -> LocalRedisServer:
        assert BINARY is not None
        if self.tls is None:
            ports = ["--port", str(self.port)]
        else:
            cert, key = self.tls
            ports = ["--port", "0", "--tls-port", str(self.port), "--tls-auth-clients", "no"]
            ports += ["--tls-cert-file", str(cert), "--tls-key-file", str(key)]
            ports += ["--tls-ca-cert-file", str(cert)]
        self.process = subprocess.Popen(
            [
                BINARY,
                *ports,
                "--bind",
                "127.0.0.1",
                "--save",
                "",
                "--appendonly",
                "no",
                "--dir",
                str(self.directory),
                *self.extra_args,
            ],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            try:
                with socket.create_connection(("127.0.0.1", self.port), timeout=0.2):
                    return self
            except OSError:
                if self.process.poll() is not None:
                    raise RuntimeError(f"redis-server exited: {self.process.returncode}") from None
                time.sleep(0.05)
        self.stop()
        raise RuntimeError(f"redis-server did not listen on {self.port} within 10 s")

    def __enter__(self) -> LocalRedisServer:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def stop(self) -> None:
        if self.process is not None and self.process.poll() is None:
            self.process.kill()
            self.process.wait(timeout=10)
        self.process = None

"""An SGLang server launched as a subprocess (``python -m sglang.launch_server``); the
:class:`~rollout_sglang.sglang_client.client.SGLangClient` talks to it."""

from __future__ import annotations

import logging
import os
import signal
import subprocess
import tempfile
import time
from pathlib import Path

from rollout_sglang.sglang_client.common import SGLangConfig, require_sglang

logger = logging.getLogger(__name__)


class SGLangServer:
    """A launched SGLang server process (``python -m sglang.launch_server``), health-checked.

    ``command`` overrides the launch command (tests use a stand-in speaking the same HTTP
    API). The process gets its own process group so :meth:`stop` ends all its workers. Its
    output goes to ``log_path`` (default: a new ``sglang-server-*.log`` in the temporary
    directory), whose last lines a server that exits before it is healthy raises with.
    """

    def __init__(
        self,
        config: SGLangConfig,
        *,
        command: list[str] | None = None,
        log_path: str | Path | None = None,
        startup_timeout: float = 600.0,
        env: dict[str, str] | None = None,
        wait: bool = True,
    ) -> None:
        if command is None:
            require_sglang()
            command = config.server_command()
        self.config = config
        self.url = f"http://{config.host}:{config.port}"
        if log_path is None:
            fd, log_path = tempfile.mkstemp(prefix="sglang-server-", suffix=".log")
            os.close(fd)
        self.log_path = Path(log_path)
        self._log = open(self.log_path, "ab")  # noqa: SIM115
        logger.info(
            "launching SGLang server on %s (log %s): %s", self.url, self.log_path, " ".join(command)
        )
        self.process = subprocess.Popen(
            command,
            stdout=self._log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
            env={**os.environ, **(env or {})},
        )
        if wait:  # wait=False lets a caller start several servers, then wait for each
            self.wait_healthy(startup_timeout)

    def wait_healthy(self, timeout: float) -> None:
        import requests as http  # server mode only: the HF-engine path runs without requests

        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise RuntimeError(
                    f"SGLang server exited with code {self.process.returncode} before it was "
                    f"healthy (command: {' '.join(map(str, self.process.args))}); the last "
                    f"lines of its log {self.log_path}:\n{self.log_tail()}"
                )
            try:
                if http.get(self.url + "/health", timeout=5).status_code == 200:
                    logger.info("SGLang server %s is healthy", self.url)
                    return
            except http.RequestException:
                pass
            time.sleep(0.5)
        self.stop()
        raise TimeoutError(f"SGLang server {self.url} not healthy after {timeout:.0f}s")

    def stop(self, timeout: float = 30.0) -> None:
        if self.process.poll() is None:
            os.killpg(self.process.pid, signal.SIGTERM)
            try:
                self.process.wait(timeout)
            except subprocess.TimeoutExpired:
                os.killpg(self.process.pid, signal.SIGKILL)
                self.process.wait()
        self._log.close()

    def log_tail(self, lines: int = 20) -> str:
        """The last ``lines`` lines of the server's output (its log file)."""
        text = self.log_path.read_text(errors="replace")
        return "\n".join(text.splitlines()[-lines:])

"""Service processes kept up: a service that dies is started again where it was, the others stay up.

Each service is a command that takes ``--port P`` and ``--ready-file F`` and writes its URL into F once
it serves (osvl's loopback SGLang server, tool server and loopback judge all do). The first start is
in order, each service waited for; a service that cannot start then is a configuration error and
stops the launch. Afterwards every death is logged with its exit status and the service is started
again on the port it had, after a delay that doubles with each restart (``RestartPolicy``); a service
that dies more than ``max_restarts`` times within ``window_s`` keeps dying, and the supervisor stops
every service and returns 1. Asked to stop, it stops them all and returns 0.
"""

from __future__ import annotations

import signal
import subprocess
import sys
import threading
import time
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from urllib.parse import urlsplit


@dataclass(frozen=True)
class RestartPolicy:
    max_restarts: int = 5  # restarts of one service within window_s; one more death stops everything
    window_s: float = 600.0
    first_delay_s: float = 1.0  # before the first restart; doubled for each further one in the window
    max_delay_s: float = 30.0
    ready_timeout_s: float = 300.0  # a (re)started service must write its ready file within this

    def __post_init__(self) -> None:
        if self.max_restarts < 0:
            raise ValueError(f"RestartPolicy.max_restarts must be >= 0, got {self.max_restarts}")
        for name in ("window_s", "first_delay_s", "max_delay_s", "ready_timeout_s"):
            if not getattr(self, name) > 0:
                raise ValueError(f"RestartPolicy.{name} must be positive, got {getattr(self, name)}")


@dataclass(frozen=True)
class ServiceSpec:
    name: str
    argv: tuple[str, ...]  # the command without --port and --ready-file
    port: int = 0  # where it listens at first; 0 = any free port (kept for its restarts)


@dataclass
class _Service:
    spec: ServiceSpec
    port: int
    process: subprocess.Popen | None = None
    ready_file: Path | None = None
    started_at: float = 0.0
    url: str = ""
    starting: bool = False
    restart_at: float | None = None
    deaths: deque[float] = field(default_factory=deque)
    starts: int = 0


def exit_status(code: int) -> str:
    """``exit status 3`` or ``signal SIGKILL`` for a Popen return code."""
    if code >= 0:
        return f"exit status {code}"
    try:
        return f"signal {signal.Signals(-code).name}"
    except ValueError:
        return f"signal {-code}"


def _log(line: str) -> None:
    print(f"serve: {line}", file=sys.stderr, flush=True)


class Supervisor:
    """``urls = supervisor.start()``, then ``supervisor.run(stop)`` until ``stop`` is set (0) or a service
    keeps dying (1); every service is stopped when it returns."""

    def __init__(
        self,
        specs: Sequence[ServiceSpec],
        directory: Path,
        policy: RestartPolicy = RestartPolicy(),
        log: Callable[[str], None] = _log,
    ) -> None:
        self.services = [_Service(spec, spec.port) for spec in specs]
        self.directory, self.policy, self.log = Path(directory), policy, log

    def start(self) -> list[str]:
        """Every service, in order, each waited for; their URLs. RuntimeError (all stopped) when one does
        not come up."""
        try:
            for service in self.services:
                self._launch(service)
                deadline = time.monotonic() + self.policy.ready_timeout_s
                while not self._ready(service):
                    if service.process.poll() is not None:
                        raise RuntimeError(
                            f"{service.spec.name} ended with {exit_status(service.process.returncode)} before serving"
                        )
                    if time.monotonic() > deadline:
                        raise RuntimeError(
                            f"{service.spec.name} did not come up within {self.policy.ready_timeout_s:.0f}s"
                        )
                    time.sleep(0.1)
        except BaseException:
            self.stop()
            raise
        return [s.url for s in self.services]

    def run(self, stop: threading.Event, poll_s: float = 0.2) -> int:
        """Supervise until ``stop`` is set (0) or a service keeps dying (1); stops every service."""
        try:
            while not stop.wait(poll_s):
                for service in self.services:
                    if not self._tend(service):
                        return 1
            return 0
        finally:
            self.stop()

    def stop(self) -> None:
        """SIGTERM to every service, SIGKILL to those still up 30 s later."""
        running = [s.process for s in self.services if s.process is not None and s.process.poll() is None]
        for process in running:
            process.terminate()
        for process in running:
            try:
                process.wait(30)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait(30)

    # -- one service ----------------------------------------------------------------------------

    def _launch(self, service: _Service) -> None:
        service.starts += 1
        service.ready_file = self.directory / f"{service.spec.name.replace(' ', '-')}.{service.starts}.url"
        argv = [*service.spec.argv, "--port", str(service.port), "--ready-file", str(service.ready_file)]
        service.process = subprocess.Popen(argv)
        service.started_at, service.starting, service.restart_at = time.monotonic(), True, None

    def _ready(self, service: _Service) -> bool:
        if not service.ready_file.is_file():
            return False
        service.url = service.ready_file.read_text().strip()
        service.port = urlsplit(service.url).port or service.port  # a restart comes back where it was
        service.starting = False
        return True

    def _tend(self, service: _Service) -> bool:
        """Notices a death, a restart due or a restart come up; False when the service keeps dying."""
        now = time.monotonic()
        process = service.process
        if process is not None and process.poll() is not None:
            service.process = None
            while service.deaths and now - service.deaths[0] > self.policy.window_s:
                service.deaths.popleft()
            service.deaths.append(now)
            restarts = len(service.deaths)
            what = "before serving again" if service.starting else "while serving"
            if restarts > self.policy.max_restarts:
                self.log(
                    f"{service.spec.name} (pid {process.pid}) ended with {exit_status(process.returncode)} {what}: "
                    f"{restarts} deaths within {self.policy.window_s:.0f}s, it keeps dying; stopping every service"
                )
                return False
            delay = min(self.policy.first_delay_s * 2 ** (restarts - 1), self.policy.max_delay_s)
            service.restart_at = now + delay
            self.log(
                f"{service.spec.name} (pid {process.pid}) ended with {exit_status(process.returncode)} {what}; "
                f"restart {restarts} of at most {self.policy.max_restarts} within {self.policy.window_s:.0f}s "
                f"in {delay:.1f}s on port {service.port}"
            )
        elif service.restart_at is not None and now >= service.restart_at:
            self._launch(service)
            self.log(f"{service.spec.name} restarted (pid {service.process.pid})")
        elif process is not None and service.starting:
            if self._ready(service):
                self.log(f"{service.spec.name} is back at {service.url}")
            elif now - service.started_at > self.policy.ready_timeout_s:
                self.log(f"{service.spec.name} did not come back within {self.policy.ready_timeout_s:.0f}s; killing it")
                process.kill()
        return True

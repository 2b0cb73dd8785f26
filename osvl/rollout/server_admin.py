"""What the SGLang and vLLM clients (``osvl.rollout.sglang``, ``osvl.rollout.vllm``) do alike with their
servers, whatever the protocol: the fleet's config (generation URLs, the weight servers, routing), the
choice of a server per generation, a route's JSON read naming its server, and the check that every weight
server reports the trainer's version after an update (never assumed from a 200)."""

from __future__ import annotations

import asyncio
import itertools
from dataclasses import dataclass
from typing import Any, ClassVar, Literal

import httpx

from osvl.rollout.engine import EngineError

Routing = Literal["round_robin", "least_loaded"]


@dataclass(frozen=True)
class FleetConfig:
    urls: tuple[str, ...]  # where /generate goes
    update_urls: tuple[str, ...] = ()  # the servers that take weight updates; () = urls
    routing: Routing = "least_loaded"
    timeout_s: float = 600.0

    def __post_init__(self) -> None:
        kind = type(self).__name__
        for name in ("urls", "update_urls"):
            urls = getattr(self, name)
            if (name == "urls" and not urls) or any(not u.startswith(("http://", "https://")) for u in urls):
                raise ValueError(f"{kind}.{name} needs http(s) base URLs, got {urls!r}")
        if self.routing not in ("round_robin", "least_loaded"):
            raise ValueError(f"unknown routing {self.routing!r}; expected round_robin or least_loaded")
        if not self.timeout_s > 0:
            raise ValueError(f"timeout_s must be positive, got {self.timeout_s}")

    @property
    def weight_urls(self) -> tuple[str, ...]:
        return self.update_urls or self.urls


class ServerFleet:
    """The protocol-free half of an HTTP engine client; a subclass names its servers' ``kind`` and the
    GET route that reports their weight version."""

    kind: ClassVar[str]  # "SGLang", "vLLM": how errors name a server
    version_route: ClassVar[str]  # answers {"weight_version": ...}

    def __init__(self, config: FleetConfig, client: httpx.AsyncClient | None = None, policy_version: int = 0) -> None:
        self.config = config
        self.client = client or httpx.AsyncClient(timeout=config.timeout_s, trust_env=False)
        self._version = policy_version
        self._next = itertools.cycle(range(len(config.urls)))
        self.in_flight = [0] * len(config.urls)

    @property
    def policy_version(self) -> int:
        return self._version

    def _pick(self) -> int:
        if self.config.routing == "round_robin":
            return next(self._next)
        return min(range(len(self.in_flight)), key=lambda i: self.in_flight[i])

    async def _get(self, url: str, path: str, timeout_s: float | None) -> httpx.Response:
        return await self.client.get(f"{url}{path}", timeout=timeout_s or self.config.timeout_s)

    async def get_json(self, url: str, path: str, timeout_s: float | None = None) -> Any:
        """A GET route's JSON body; ``EngineError`` naming the server otherwise."""
        try:
            response = await self._get(url, path, timeout_s)
            response.raise_for_status()
            return response.json()
        except (httpx.HTTPError, ValueError) as error:
            raise EngineError(f"{self.kind} server {url}: GET {path} failed: {error!r}") from None

    async def confirm_version(self, version: int) -> None:
        """Every weight server reports ``version``, or ``EngineError`` names the skew."""
        urls = self.config.weight_urls
        infos = await asyncio.gather(*(self.get_json(url, self.version_route) for url in urls))
        stale = [
            f"{url} reports {info.get('weight_version')!r}"
            for url, info in zip(urls, infos)
            if str(info.get("weight_version")) != str(version)
        ]
        if stale:
            raise EngineError(f"weight version skew after the update to {version}: " + "; ".join(stale))
        self._version = version

    async def aclose(self) -> None:
        await self.client.aclose()

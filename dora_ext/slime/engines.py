"""The rollout instances, as slime runs them: SGLang engines behind slime's router.

The scheduler pins every trajectory to one instance (R1), so requests go to an engine directly
rather than through the router, which would spread them over engines holding other versions.
Generation still goes through slime's own code path: `generate_and_rm(args_i, sample, params)`
with `args_i` a copy of `args` whose router address is that engine's address. slime's
`generate` (or the user's `--custom-generate-function-path`) and its reward models run unchanged
and never notice. Weights are loaded with SGLang's `/update_weights_from_disk`, tagged with the
version so that SGLang reports it in every response (`Sample.weight_versions`).

`SglangEngines` takes its HTTP client and its `generate_and_rm` as arguments: slime's by default,
a stand-in in tests (where no SGLang server can exist).
"""

from __future__ import annotations

import copy
import importlib
from typing import Any, Awaitable, Callable, Protocol
from urllib.parse import urlsplit

from .settings import SlimeSettings


class AdapterError(RuntimeError):
    """Something the adapter cannot recover from; raised to slime from the rollout function."""


class Engines(Protocol):
    """What the rollout worker needs from a fleet of engines."""

    async def discover(self) -> list[int]:
        """Capacities of the instances, in instance-id order."""

    async def generate(self, instance_id: int, sample: Any, sampling_params: dict) -> Any:
        """Generate (and reward) one trajectory on that instance; returns the Sample (or a list)."""

    async def load(self, instance_id: int, version_tag: str, path: str | None) -> None:
        """Load the checkpoint at `path` on an idle instance, reporting `version_tag` from now on."""


GenerateAndRm = Callable[..., Awaitable[Any]]


def slime_generate_and_rm() -> GenerateAndRm:
    """slime's per-sample generate + reward step, or (slime absent) the custom-generate call alone.

    Without slime there is no reward hub and no default SGLang client: the sample must be produced
    by `args.custom_generate_function_path`, with its reward filled, as slime's contract allows.
    """
    try:
        from slime.rollout.sglang_rollout import generate_and_rm
    except ImportError:
        return _custom_generate_only
    return generate_and_rm


async def _custom_generate_only(args: Any, sample: Any, sampling_params: dict, evaluation: bool = False) -> Any:
    path = getattr(args, "custom_generate_function_path", None)
    if not path:
        raise AdapterError("slime is not importable and no custom_generate_function_path is set: nothing can generate")
    fn = load_object(path)
    out = await fn(args, sample, sampling_params)
    for s in out if isinstance(out, list) else [out]:
        if s.reward is None and not getattr(args, "group_rm", False):
            raise AdapterError(f"{path} returned sample {s.index} without a reward, and slime's reward hub is absent")
    return out


def load_object(path: str) -> Any:
    """`module.attr` -> the object (slime's `load_function` semantics, without requiring slime)."""
    module, _, attr = path.rpartition(".")
    if not module:
        raise AdapterError(f"expected a dotted path module.name, got {path!r}")
    return getattr(importlib.import_module(module), attr)


def slime_http() -> Any:
    """slime's async HTTP helpers (`get(url)`, `post(url, payload)`), as a namespace."""
    from slime.utils import http_utils

    return http_utils


class SglangEngines:
    """slime's SGLang engines, addressed one by one.

    `http` must offer `async get(url) -> dict` and `async post(url, payload) -> dict`.
    """

    def __init__(
        self,
        args: Any,
        settings: SlimeSettings,
        *,
        http: Any = None,
        generate_and_rm: GenerateAndRm | None = None,
    ) -> None:
        self.args = args
        self.settings = settings
        self.http = http if http is not None else slime_http()
        self._generate_and_rm = generate_and_rm if generate_and_rm is not None else slime_generate_and_rm()
        self.urls: list[str] = []
        self._args: list[Any] = []

    async def discover(self) -> list[int]:
        router = f"http://{self.args.sglang_router_ip}:{self.args.sglang_router_port}"
        reply = await self.http.get(f"{router}/workers")
        workers = [w for w in reply.get("workers", []) if w.get("worker_type", "regular") == "regular"]
        if not workers:
            raise AdapterError(f"slime's router at {router} lists no regular SGLang worker")
        self.urls = sorted(w["url"].rstrip("/") for w in workers)
        cap = self.settings.capacity or getattr(self.args, "sglang_server_concurrency", None)
        if not isinstance(cap, int) or cap < 1:
            raise AdapterError(f"no engine capacity: set dora_slime.capacity (got sglang_server_concurrency={cap!r})")
        self._args = [self._args_for(url) for url in self.urls]
        return [cap] * len(self.urls)

    def _args_for(self, url: str) -> Any:
        # generate() builds its URL from args.sglang_router_ip/port: point them at one engine.
        parts = urlsplit(url)
        host = parts.hostname or ""
        a = copy.copy(self.args)
        a.sglang_router_ip = f"[{host}]" if ":" in host else host
        a.sglang_router_port = parts.port
        return a

    async def generate(self, instance_id: int, sample: Any, sampling_params: dict) -> Any:
        return await self._generate_and_rm(self._args[instance_id], sample, sampling_params, evaluation=False)

    async def load(self, instance_id: int, version_tag: str, path: str | None) -> None:
        url = self.urls[instance_id]
        reply = await self.http.post(
            f"{url}/update_weights_from_disk", {"model_path": path, "weight_version": version_tag}
        )
        if isinstance(reply, dict) and reply.get("success") is False:
            raise AdapterError(f"engine {url} failed to load {path}: {reply.get('message')}")


class PassThroughEngines:
    """No engines at all: slime's contract harness calls the rollout function with `args=None`.

    The harness's data source hands out samples that are already generated and rewarded; this
    "engine" returns them unchanged and refuses any sample that still needs generating, so the
    scheduler, batching and output shapes are exercised without pretending to generate.
    """

    def __init__(self, capacities: list[int]) -> None:
        self.capacities = capacities

    async def discover(self) -> list[int]:
        return list(self.capacities)

    async def generate(self, instance_id: int, sample: Any, sampling_params: dict) -> Any:
        status = getattr(sample.status, "value", sample.status)
        if status not in ("completed", "truncated") or sample.reward is None:
            raise AdapterError(
                f"args is None (no engines): sample {sample.index} is {status} with reward {sample.reward!r}; "
                "only already generated samples can pass through"
            )
        return sample

    async def load(self, instance_id: int, version_tag: str, path: str | None) -> None:
        return None

"""Host profiles: what the weight path, a migration and KV memory cost on each host (`--host`).

A preset's constants describe the hardware; a host profile says how the host's implementation
spends it. Four profiles (`HOSTS`), selectable per run (`simulate(..., host=...)`,
`dora-ext simulate --host NAME[:field=value,...]`):

- `ideal` (the default): the preset's `broadcast_s` per version on the trainer, `weight_load_s`
  per load, KV moved at `migrate_bytes_per_s`, capacity a sequence count.
- `verl`: the verl adapter's rollout-side weight store: one trainer->store transfer per version
  (`publish_*`), then every replica load reads the store without the trainer (`load_*`). A
  migration re-prefills on the destination (vLLM/SGLang cannot move KV); KV memory is the
  preset's KV-token budget with recompute preemption.
- `verl-gather`: verl's older path: every subset load is an FSDP gather + broadcast on the
  trainer thread (`load_on_trainer`): the trainer is blocked for each instance load.
- `slime`: slime's dora twin: a full HF checkpoint written per version on the trainer's critical
  path (`publish_bytes_per_s`), reloaded from disk by each engine; migration and KV as in verl.
- `embedded`: `dora_ext.runtime`: the semantics of `ideal` (the trainer packs the weights, each
  engine copies them in, migrations move KV); its JSON also reports the costs below.

Every profile but `ideal` adds `trainer_weight_sync_s_per_step`, `reprefilled_tokens` (from
migrations), `preemptions` (KV budget) and `host` to the JSON.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from .workload import WorkloadError


@dataclass(frozen=True)
class HostProfile:
    """How a host pays for weights, migrations and KV memory (see the module docstring).

    `publish_fixed_s`/`load_fixed_s` None: the preset's `broadcast_s`/`weight_load_s`, and the
    `*_bytes_per_s` terms are not added. Otherwise trainer seconds per version are
    `publish_fixed_s + weight_bytes / publish_bytes_per_s` (0 bytes/s: no such term) and an
    instance load `load_fixed_s + weight_bytes / load_bytes_per_s`.
    """

    name: str
    publish_fixed_s: float | None = None
    publish_bytes_per_s: float = 0.0
    load_fixed_s: float | None = None
    load_bytes_per_s: float = 0.0
    load_on_trainer: bool = False  # each load also blocks the trainer for its duration
    migrate_kv: bool = True  # False: a migration re-prefills the context on the destination
    kv_memory: bool = False  # capacity also bounded by the preset's `kv_budget_tokens`

    def publish_s(self, preset) -> float:
        if self.publish_fixed_s is None:
            return preset.trainer.broadcast_s
        return self.publish_fixed_s + _per_bytes(preset.engine.weight_bytes, self.publish_bytes_per_s)

    def load_s(self, preset) -> float:
        if self.load_fixed_s is None:
            return preset.engine.weight_load_s
        return self.load_fixed_s + _per_bytes(preset.engine.weight_bytes, self.load_bytes_per_s)


def _per_bytes(n: float, rate: float) -> float:
    return n / rate if rate > 0 else 0.0


HOSTS: dict[str, HostProfile] = {h.name: h for h in (
    HostProfile("ideal"),
    # [hw] FSDP all-gather of the bf16 weights over NVLink and the copy into the store's pinned
    # host memory at ~10 GB/s (+1 s of gather setup); a replica pulls them at ~5 GB/s (H2D/RDMA).
    HostProfile("verl", publish_fixed_s=1.0, publish_bytes_per_s=10e9, load_fixed_s=0.5,
                load_bytes_per_s=5e9, migrate_kv=False, kv_memory=True),
    # [hw] a gather + NCCL broadcast per subset load at ~5 GB/s, on the trainer thread.
    HostProfile("verl-gather", publish_fixed_s=0.0, load_fixed_s=1.0, load_bytes_per_s=5e9,
                load_on_trainer=True, migrate_kv=False, kv_memory=True),
    # [hw] an HF safetensors checkpoint written at ~1.5 GB/s (+2 s of gather and conversion), each
    # engine reading it back at ~2 GB/s (shared file system / page cache) plus ~2 s of engine setup.
    HostProfile("slime", publish_fixed_s=2.0, publish_bytes_per_s=1.5e9, load_fixed_s=2.0,
                load_bytes_per_s=2e9, migrate_kv=False, kv_memory=True),
    HostProfile("embedded"),
)}


def get_host(spec: "str | HostProfile | None") -> HostProfile:
    """`None` (ideal), a profile, or `NAME[:field=value,...]` (e.g. `slime:publish_bytes_per_s=4e9`)."""
    if spec is None:
        return HOSTS["ideal"]
    if isinstance(spec, HostProfile):
        return spec
    name, _, rest = str(spec).partition(":")
    if name not in HOSTS:
        raise WorkloadError(f"host: unknown host {name!r}; accepted: {', '.join(HOSTS)}")
    host = HOSTS[name]
    fields = {f.name: f.type for f in dataclasses.fields(HostProfile) if f.name != "name"}
    changes: dict[str, object] = {}
    for item in filter(None, rest.split(",")):
        key, eq, value = item.partition("=")
        if key not in fields or not eq:
            raise WorkloadError(f"host: {item!r}: expected field=value with a field of {', '.join(fields)}")
        try:
            changes[key] = value.lower() in ("1", "true", "yes") if "bool" in str(fields[key]) else float(value)
        except ValueError:
            raise WorkloadError(f"host: {key}: expected a number, got {value!r}") from None
    return dataclasses.replace(host, **changes) if changes else host

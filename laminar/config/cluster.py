"""The distributed system's sections: `cluster:` (Ray placement, waits and liveness),
`manager:` (health checks, repack, re-created rollouts) and `relay:` (the weight relays:
addresses, chunks, heartbeats)."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import Field, field_validator, model_validator

from laminar.config.base import Section


class ClusterConfig(Section):
    backend: Literal["ray", "local"] = Field(
        "ray", description="`ray`: every component an actor (the real system). `local`: the same "
        "components in one process without Ray, for debugging a task or reward; runs the "
        "global-batch schedules (sync, one_step, stream).")
    address: str | None = Field(None, description="Ray cluster to join (e.g. ray://head:10001 or "
                                "auto); unset = start an embedded local cluster.")
    virtual_nodes: int = Field(1, ge=1, description="On one machine: split the rollout workers "
                               "into this many groups, each with its own relay process, so the "
                               "relay chain runs for real.")
    rollouts_on_head: bool = Field(
        False, description="On a multi-node cluster: also place rollouts on the driver's node (the "
        "head, which runs the trainer, the pools and the master relay). Default: rollouts go to the "
        "other nodes, and to the head only when it is the only node.")
    rollouts_per_new_node: int = Field(
        1, ge=0, description="On a multi-node cluster: a node that joins while the job runs gets a "
        "relay (it joins the chain and catches up to the newest version) and this many rollouts; "
        "0 = leave new nodes alone.")
    trainer_resources: dict[str, float] = Field(
        default_factory=dict, description="On a cluster: Ray resources the trainer actor asks for "
        "(e.g. {GPU: 1} or a custom resource of the node it should run on); empty = the driver's "
        "node.")
    rollout_resources: dict[str, float] = Field(
        default_factory=dict, description="Ray resources each rollout actor reserves (it stays on "
        "its relay's node), e.g. {GPU: 0.5}: two rollouts per GPU, or one beside a trainer "
        "holding the other half. Ray hides GPUs from an actor that reserves none, so "
        "rollout.device=cuda under cluster.backend=ray needs a GPU here (refused at start "
        "without one) and rollout.device=auto is the CPU. Each of rollout.num_workers reserves "
        "this much: they and cluster.trainer_resources must fit the cluster's GPUs. Empty = no "
        "GPU.")
    trainer_placement: Literal["spread", "pack"] = Field(
        "spread", description="trainer.world_size > 1 on a cluster: `spread` puts the ranks one "
        "per node where possible; `pack` on as few nodes as possible, beside rank 0 on the "
        "driver's node first (e.g. 8 ranks on one 8-GPU node: FSDP's collectives stay inside "
        "it and every rank writes its own rows of a push).")
    num_cpus: int | None = Field(None, ge=1, description="Logical CPUs of the embedded cluster "
                                 "(default: enough for every actor).")
    cpu_affinity: Literal["off", "split", "lend", "auto"] = Field(
        "auto", description="One machine: `split` pins the trainer and the rollouts to disjoint "
        "CPU cores, as GPUs are disjoint devices on a real cluster: the trainer gets "
        "cluster.trainer_cpus cores, each rollout its own share of the rest (rollouts share a "
        "core only when there are more rollouts than cores left). The driver, Ray's daemons, "
        "pools, manager and relays run on the cores that are not the trainer's; a sandbox's "
        "tool programs on all of them. `off`: the OS schedules everything on every core "
        "(rollout.cpu_sched and rollout.cpu_nice still let the trainer go first). `lend`: "
        "`split`, and each rollout also runs on the trainer's cores while the trainer waits "
        "for data (work-conserving: a core the trainer does not use is the rollouts'). "
        "`auto` (default): `lend` where a cluster would give the trainer devices of its own: a "
        "schedule that trains while the rollouts generate (not sync), trainer and native-engine "
        "rollouts on this machine's CPU under the embedded Ray cluster, and the trainer's cores "
        "(cluster.trainer_cpus, unset: trainer.threads x trainer.world_size) leaving at least "
        "one for the rollouts; else `off`. The job prints its choice at start. docs/devices.md.")
    trainer_cpus: int | None = Field(
        None, ge=1, description="cluster.cpu_affinity split/lend: cores for the trainer (all its "
        "ranks); unset = half of the cores this process may use, at least one, leaving at "
        "least one for the rollouts (`auto`: trainer.threads x trainer.world_size).")
    wait_timeout_s: float = Field(300.0, gt=0.0, description="Longest any component may wait for "
                                  "another (data, weights, a step) before the run fails naming it.")
    heartbeat_s: float = Field(
        2.0, gt=0.0, description="Liveness period: a rollout renews its prompt leases this often "
        "and the manager waits this long at most for a health-check answer before going on. (A "
        "killed rollout is noticed at once, by its calls failing; a silent one after "
        "cluster.hang_timeout_s. Relays have their own: relay.heartbeat_s, relay.timeout_s; "
        "every liveness knob: docs/config.md.)")
    hang_timeout_s: float = Field(
        30.0, gt=0.0, description="A rollout whose process is alive but that has answered no "
        "health check for this long is declared hung, failed over and replaced. Generous on "
        "purpose: a busy machine or a vLLM engine loading weights can keep a healthy rollout "
        "silent for seconds (at 6 s, a loaded 2-core host replaced healthy vLLM rollouts), and "
        "a killed process does not wait for it. Must exceed cluster.heartbeat_s.")


    @field_validator("cpu_affinity", mode="before")
    @classmethod
    def _yaml_off(cls, v: Any) -> Any:
        return "off" if v is False else v  # YAML reads a bare `off` as false

    @model_validator(mode="after")
    def _hang_after_heartbeat(self) -> "ClusterConfig":
        if self.hang_timeout_s <= self.heartbeat_s:
            raise ValueError(f"cluster.hang_timeout_s={self.hang_timeout_s} must exceed "
                             f"cluster.heartbeat_s={self.heartbeat_s}, or a rollout is declared "
                             "hung between two health checks: raise cluster.hang_timeout_s")
        return self

    @model_validator(mode="after")
    def _affinity_on_one_machine(self) -> "ClusterConfig":
        if self.cpu_affinity in ("split", "lend") and (self.address or self.backend == "local"):
            where = (f"cluster.address={self.address!r} (a Ray cluster: give rollouts and the "
                     "trainer their own nodes or cluster.rollout_resources)" if self.address else
                     "cluster.backend=local (one process: nothing to pin)")
            raise ValueError(f"cluster.cpu_affinity={self.cpu_affinity} pins actors to this "
                             "machine's cores; "
                             f"it does not apply with {where}: set cluster.cpu_affinity=off")
        return self


class ManagerConfig(Section):
    repack: bool = Field(True, description="Dynamic repack of long-tail trajectories (laminar mode).")
    interval_s: float = Field(0.5, gt=0.0, description="Period of the manager's checks: health, "
                              "and repack's idleness check, which compares each rollout's KV use "
                              "with the previous check's (the paper uses 5 s on GPUs; CPU "
                              "trajectories are shorter). A check that sees a newly published "
                              "version is followed by another after a quarter of this (the "
                              "post-update trigger). docs/repack.md.")
    c_max: float = Field(0.99, gt=0.0, le=1.0, description="KV utilisation threshold C_max of "
                         "Algorithm 1: a rollout at or above it is full (plateau), and no repack "
                         "fills a destination beyond it.")
    batch_bound: int | None = Field(
        None, ge=1, description="Batch bound B of Algorithm 1: the most trajectories a "
        "destination may hold after a repack, where decode turns compute-bound. None = the knee "
        "of this machine's decode curve for the run's model (the batch at which a decode step "
        "costs 2x a batch-1 step; laminar/engine/knee.py), cached in .cache/engine-knee-*.json "
        "and measured once in a few seconds if missing. Never above "
        "rollout.engine.max_batch_size. Set it on a cluster whose rollouts run on other "
        "hardware than the head node.")
    recreate: bool = Field(True, description="Start a new rollout in place of one whose process "
                           "died, once its work has failed over: on the same node (another live "
                           "relay's when that node's relay is gone too), under a new incarnation "
                           "id `<rollout>.<n>`, from the starting weights, pulling the newest "
                           "version from its relay before it generates.")
    max_recreates: int = Field(3, ge=0, description="Times one rollout slot is re-created (a "
                               "failed start counts); after that the job goes on with one rollout "
                               "fewer, so a rollout that dies at every start cannot loop.")


class RelayConfig(Section):
    host: str = Field(
        "auto", description="The address each relay listens on and advertises, resolved on its own "
        "node: `auto` (the node's Ray address on a cluster, loopback on one machine), an interface "
        "name (`eth1`: the weight network), a CIDR (`10.0.0.0/16`: the node's address inside it), "
        "`0.0.0.0` (listen on all, advertise the node's address) or a literal address (one "
        "machine only).")
    port_range: tuple[int, int] | None = Field(
        None, description="Inclusive [first, last] port range a relay binds its first free port "
        "in; unset = an ephemeral port chosen by the OS.")
    chunk_bytes: int = Field(1 << 20, ge=4096, description="Chunk size of the pipelined "
                             "broadcast; a relay forwards chunk i while receiving chunk i+1.")
    keep_versions: int = Field(2, ge=2, description="Versions a relay keeps (the newest complete "
                               "one stays readable while the next arrives); older ones are freed "
                               "as soon as no reader holds them.")
    secret_env: str = Field("LAMINAR_RELAY_SECRET", min_length=1, description="Environment "
                            "variable holding the job secret every relay connection must prove; "
                            "when unset the runtime generates a random secret per job.")
    shm_dir: str = Field("/dev/shm", description="tmpfs directory holding the versions.")
    heartbeat_s: float = Field(1.0, gt=0.0, description="Ping period on idle links and of the "
                               "relay group's heartbeat checks (rollouts: cluster.heartbeat_s).")
    timeout_s: float = Field(5.0, gt=0.0, description="A relay that makes no progress for this "
                             "long (connect, handshake, send, ping) is declared dead and cut out.")
    transport: Literal["tcp"] = Field("tcp", description="Relay-to-relay transport.")
    full_every: int = Field(
        8, ge=0, description="Delta versions: the master sends a version as a delta against the "
        "previous one (its changed 16-bit words; bit-exact, docs/relay.md) and a whole version "
        "every this many versions, so a chain of deltas stays short. After a delta that was not "
        "smaller than 0.9 of its version (every word moves: fp32, large learning rates) the "
        "versions go whole until the next of those. 0 or 1: every version whole.")

    @model_validator(mode="after")
    def _timeout_after_heartbeat(self) -> "RelayConfig":
        if self.timeout_s <= self.heartbeat_s:
            raise ValueError(f"relay.timeout_s={self.timeout_s} must exceed relay.heartbeat_s="
                             f"{self.heartbeat_s}, or idle links are declared dead between pings")
        if self.port_range is not None and not 0 < self.port_range[0] <= self.port_range[1] < 65536:
            raise ValueError(f"relay.port_range={list(self.port_range)} must be [first, last] with "
                             "0 < first <= last < 65536")
        return self

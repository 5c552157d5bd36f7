"""A trainer run in a fresh process, for test_train_runs.py (device counts and jax.distributed are
fixed when jax starts, so these cannot run inside the pytest process).

    python tests/train_worker.py CONFIG --steps N --mesh 4x2 --mesh single [--coordinator HOST:PORT
        --num-processes P --process-id I] [--export DIR]

Prints one JSON object on the last line of stdout: {mesh: [loss of step 1, ..., loss of step N]}.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys


def main(argv=None) -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("config")
    parser.add_argument("--steps", type=int, required=True)
    parser.add_argument("--mesh", action="append", required=True, help="DATAxFSDP over all devices, or 'single'")
    parser.add_argument("--coordinator")
    parser.add_argument("--num-processes", type=int)
    parser.add_argument("--process-id", type=int)
    parser.add_argument("--export", help="then export the last mesh's merged model here")
    args = parser.parse_args(argv)

    import jax

    from jaxembed.train.config import DistributedSection, MeshSection, load_train_config
    from jaxembed.train.trainer import Trainer, initialize_distributed

    cfg = load_train_config(args.config)
    if args.coordinator:
        cfg = dataclasses.replace(
            cfg, distributed=DistributedSection(args.coordinator, args.num_processes, args.process_id)
        )
        initialize_distributed(cfg)
    losses = {}
    for mesh in args.mesh:
        if mesh == "single":
            trainer = Trainer(dataclasses.replace(cfg, mesh=MeshSection(1, 1)), show_progress=False,
                              devices=jax.devices()[:1])
        else:
            data, fsdp = (int(v) for v in mesh.split("x"))
            trainer = Trainer(dataclasses.replace(cfg, mesh=MeshSection(data, fsdp)), show_progress=False)
        losses[mesh] = [trainer.train_step(step)["loss"] for step in range(args.steps)]
    if args.export:
        trainer.export(args.export)
    if jax.process_index() == 0:
        print(json.dumps(losses))
    return 0


if __name__ == "__main__":
    sys.exit(main())

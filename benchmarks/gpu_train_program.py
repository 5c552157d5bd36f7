"""The GPU program of one training step, compiled here without a GPU: FLOPs, HBM traffic by kind,
temporaries, and the floor they put under the step's time.

Issue #20 asks for 250k tokens/s (Mamba2, 24 layers, d_model 768) and 1M tokens/s (8 layers,
d_model 512) on an H100, batch 256 triples, LoRA on every linear layer. This compiles the
trainer's own step (jaxembed/train/step.py: adapters applied, InfoNCE, GradCache off, per-layer
remat, AdamW) for an H100 or H200 through XLA's deviceless compilation (benchmarks/_cuda_target.py)
and reads, from the executable:

* the GEMMs' FLOPs (2 M N K of every cuBLAS call and Triton GEMM, times its loop trips), and
  their time at the datasheet's dense bf16 peak;
* HBM traffic by kind (benchmarks/_hlo_traffic.py): GEMMs, the Pallas kernels, copies, glue,
  and the glue's launches; non-GEMM bytes at the HBM peak;
* `memory_analysis()` temporaries.

"GEMM roof ms" = each GEMM launch at its roofline, the longer of its FLOPs at the bf16 peak and
its bytes at the HBM peak (LoRA's rank-r GEMMs are all bytes); "floor ms" = that + every other
launch's bytes at the HBM peak: no step runs faster (kernels run one after another, and neither
peak is reached). "tokens/s ceiling" divides the real
tokens of a batch (`--real-tokens`, from benchmarks/train_padding.py on the same corpus) by it.

    python benchmarks/gpu_train_program.py [--configs configs/train/gpu-throughput-8l-512.yaml,...]
        [--plans "256;32,128,256,256"] [--real-tokens 94500] [--target h100] [--top 6] [--hlo-dir DIR]

Needs jax's CUDA plugin (see gpu_program.py), and optax. Nothing is timed.
"""

from __future__ import annotations

import argparse
import sys
import time
from functools import partial
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

import _cuda_target  # noqa: E402
from _hlo_traffic import traffic  # noqa: E402

_cuda_target.setup()

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402

from jaxembed import models  # noqa: E402
from jaxembed.config import load_config  # noqa: E402
from jaxembed.train import lora as lora_lib  # noqa: E402
from jaxembed.train.config import load_train_config  # noqa: E402
from jaxembed.train.step import StepConfig, TrainState, make_optimizer, train_step  # noqa: E402

GiB = 2.0**30
PEAK_FLOPS = {"h100": 989e12, "h200": 989e12}  # dense bf16, datasheet (as train.sharding.PEAK_BF16_FLOPS)
CONFIGS = "configs/train/gpu-throughput-24l-768.yaml,configs/train/gpu-throughput-8l-512.yaml"


def abstract_step_inputs(cfg, sharding):
    """(state, base) of the trainer for a train config, as shapes on the target: the base cast as
    the trainer casts it, LoRA adapters and AdamW state float32."""
    model = load_config(ROOT / cfg.model.init)
    family = models.family(model)
    lora = (lora_lib.LoraConfig(cfg.lora.rank, cfg.lora.alpha, cfg.lora.targets, cfg.lora.modules_to_save)
            if cfg.lora is not None else None)
    optimizer, schedule = make_optimizer(cfg.train.learning_rate, cfg.train.max_steps or 1000,
                                         warmup_steps=cfg.train.warmup_steps)

    def build():
        params = family.init_params(model, jax.random.key(0))
        full = lora or lora_lib.LoraConfig.full(params)
        base = models.cast_params(family, params, cfg.model.dtype)
        adapters = lora_lib.init_adapters(model, base, full, jax.random.key(1))
        return TrainState(jnp.zeros((), jnp.int32), adapters, optimizer.init(adapters),
                          jnp.zeros((2,), jnp.uint32)), base

    state, base = jax.eval_shape(build)
    place = partial(jax.tree.map, lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=sharding))
    full = lora or lora_lib.LoraConfig.full(jax.eval_shape(lambda: family.init_params(model, jax.random.key(0))))
    return model, full, optimizer, schedule, place(state), place(base)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--configs", default=CONFIGS)
    ap.add_argument("--plans", default="256;32,128,256,256",
                    help="length plans to compile, ';' between plans (one group: '256')")
    ap.add_argument("--no-remat", action="store_true", help="compile without per-layer rematerialisation")
    ap.add_argument("--chunk-size", type=int, default=None, help="the SSD chunk Q (default: the config's)")
    ap.add_argument("--real-tokens", type=float, default=None, help="real tokens per batch, for tokens/s")
    ap.add_argument("--target", default="h100", choices=sorted(_cuda_target.TARGETS))
    ap.add_argument("--top", type=int, default=0, help="list this many of the largest glue ops")
    ap.add_argument("--hlo-dir", default=None, help="write each program's optimised HLO here")
    args = ap.parse_args(argv)
    sharding = _cuda_target.sharding(args.target)
    bandwidth, peak = _cuda_target.BANDWIDTH[args.target], PEAK_FLOPS[args.target]
    print(f"target: {args.target} (compiled here, nothing run); jax {jax.__version__}; {time.strftime('%Y-%m-%d')}")
    print(f"{'config':<24} {'plan':<18} {'computed tok':>12} {'GEMM TFLOP':>10} {'at peak ms':>10} {'GEMM GB':>8} "
          f"{'GEMM roof ms':>12} {'kernel GB':>9} {'copy GB':>8} {'glue GB':>8} {'launches':>8} {'bytes ms':>8} "
          f"{'temps GiB':>9} {'floor ms':>8} {'tok/s ceiling':>13}")
    for path in args.configs.split(","):
        cfg = load_train_config(ROOT / path)
        model, lora, optimizer, schedule, state, base = abstract_step_inputs(cfg, sharding)
        b, k = cfg.train.batch_size, cfg.data.negatives_per_query
        sc = StepConfig(model, lora, cfg.train.temperature, None, cfg.train.remat and not args.no_remat, "pallas",
                        args.chunk_size or cfg.model.chunk_size or model.chunk_size)
        for plan_text in args.plans.split(";"):
            plan = tuple(int(x) for x in plan_text.split(","))
            L = plan[-1]
            shapes = {"query_ids": (b, L), "query_len": (b,), "pos_ids": (b, L), "pos_len": (b,),
                      "neg_ids": (b, k, L), "neg_len": (b, k)}
            batch = {key: jax.ShapeDtypeStruct(s, jnp.int32, sharding=sharding) for key, s in shapes.items()}
            step = jax.jit(partial(train_step, sc=sc, optimizer=optimizer, lr_schedule=schedule, plan=plan),
                           donate_argnums=0)
            compiled = step.lower(state, base, batch).compile()
            hlo = compiled.as_text()
            t = traffic(hlo)
            if args.hlo_dir:
                Path(args.hlo_dir).mkdir(parents=True, exist_ok=True)
                (Path(args.hlo_dir) / f"{Path(path).stem}-{plan_text.replace(',', '-')}.hlo.txt").write_text(hlo)
            flops = t["gemm_flops"]
            temps = compiled.memory_analysis().temp_size_in_bytes
            computed = b * (2 + k) // len(plan) * sum(plan)
            at_peak = flops / peak
            gemm_roofline = sum(max(f / peak, moved_bytes / bandwidth) * runs for f, moved_bytes, runs in t["gemms"])
            moved = (t["kernel"] + t["copy"] + t["glue"]) / bandwidth
            floor = gemm_roofline + moved
            ceiling = "" if args.real_tokens is None else f"{args.real_tokens / floor:,.0f}"
            print(f"{Path(path).stem[-24:]:<24} {plan_text:<18} {computed:12,d} {flops / 1e12:10.2f} "
                  f"{1e3 * at_peak:10.1f} {t['gemm'] / 1e9:8.1f} {1e3 * gemm_roofline:12.1f} {t['kernel'] / 1e9:9.1f} "
                  f"{t['copy'] / 1e9:8.1f} "
                  f"{t['glue'] / 1e9:8.1f} {t['glue_launches']:8d} {1e3 * moved:8.1f} {temps / GiB:9.2f} "
                  f"{1e3 * floor:8.1f} {ceiling:>13}", flush=True)
            for bytes_moved, name, times, shape in t["top_glue"][: args.top]:
                print(f"{'':>26}{bytes_moved / 1e9:8.2f} GB  x{times:<5} {name[:40]:<40} {shape}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

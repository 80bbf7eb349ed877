"""Write the demo model (once; cached by fingerprint) and print its sizes.

    python scripts/make_demo_model.py [--out DIR] [--force] [--json]

Prints the model directory, dense and routed-expert bytes (read back from the
checkpoint's safetensors headers by the expert store), the slot size and the
suggested `--memory-budget` with the residency plan it gives. Default
directory: <repo>/.cache/demo-model. See shared/demo_model.py.
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
from pathlib import Path

try:
    from shared.demo_model import ensure_demo_model
except ImportError:  # run from a checkout without the editable install
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    from shared.demo_model import ensure_demo_model

from shared.plan import plan_expert_residency
from shared.store import ExpertStore


def _mib(value: int) -> str:
    return f"{value / (1 << 20):.1f} MiB"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="Write the moeslab demo model and print its sizes.")
    parser.add_argument("--out", type=Path, default=None, help="model directory (default <repo>/.cache/demo-model)")
    parser.add_argument("--force", action="store_true", help="rebuild even if a matching model is cached")
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    try:
        demo = ensure_demo_model(args.out, force=args.force)
    except FileExistsError as error:
        print(f"make_demo_model: error: {error}", file=sys.stderr)
        return 2
    store = ExpertStore.open(demo.path)  # the sizes as the runtime will see them
    sizes = demo.sizes
    plan = plan_expert_residency(
        budget_bytes=demo.budget_bytes,
        fixed_bytes=store.dense_bytes,
        slot_bytes=store.slot_bytes,
        sparse_layers=len(store.sparse_layers),
        working_slots=store.top_k,
    )
    report = {
        "model_dir": str(demo.path),
        "built": demo.built,
        "build_seconds": round(demo.seconds, 2),
        "dense_bytes": store.dense_bytes,
        "expert_bytes": store.expert_bytes,
        "slot_bytes": store.slot_bytes,
        "sparse_layers": len(store.sparse_layers),
        "experts_per_layer": store.experts_per_layer,
        "top_k": store.top_k,
        "floor_bytes": store.dense_bytes + (store.top_k + len(store.sparse_layers)) * store.slot_bytes,
        "memory_budget": demo.budget_bytes,
        "experts_over_budget": round(store.expert_bytes / demo.budget_bytes, 3),
        "slots_per_layer_at_budget": plan.slots_per_layer,
        "config": {
            key: demo.config[key]
            for key in (
                "model_type",
                "hidden_size",
                "moe_intermediate_size",
                "num_experts",
                "num_experts_per_tok",
                "num_hidden_layers",
                "num_attention_heads",
                "num_key_value_heads",
                "head_dim",
                "vocab_size",
                "torch_dtype",
            )
        },
    }
    if (store.dense_bytes, store.expert_bytes) != (sizes.dense_bytes, sizes.expert_bytes):
        print("make_demo_model: warning: the checkpoint's sizes differ from the config arithmetic", file=sys.stderr)
    if args.json:
        print(json.dumps(report))
        return 0
    config = report["config"]
    state = f"built in {demo.seconds:.1f} s" if demo.built else "cached"
    print(f"model dir      {demo.path} ({state})")
    print(
        f"config         {config['model_type']} {config['torch_dtype']}: {config['num_hidden_layers']} layers, "
        f"hidden {config['hidden_size']}, {config['num_experts']} experts x {config['moe_intermediate_size']} "
        f"(top-{config['num_experts_per_tok']}), vocab {config['vocab_size']}"
    )
    print(f"dense bytes    {store.dense_bytes} ({_mib(store.dense_bytes)})")
    print(
        f"expert bytes   {store.expert_bytes} ({_mib(store.expert_bytes)}), "
        f"{report['experts_over_budget']:g}x the budget"
    )
    print(f"slot bytes     {store.slot_bytes} ({_mib(store.slot_bytes)}); startup floor {_mib(report['floor_bytes'])}")
    print(
        f"--memory-budget {demo.budget_bytes}  ({_mib(demo.budget_bytes)}: "
        f"{plan.slots_per_layer} of {store.experts_per_layer} experts resident per layer)"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""``python -m probes sae PLAN [PLAN ...]``: train, evaluate and score an SAE plan's SAEs and record them.

examples:
  python -m probes sae manifests/sae-demo.yaml --data data            # small plan: one worker here
  python -m probes sae plan.yaml --scheduler local --workers 2 --memory-limit 1GiB
  python -m probes sae plan.yaml --force                                     # retrain SAEs already recorded
  python -m queries sae_features --data data                                 # the features that track each truth variable

Weights go to <workspace>/sae/<key>/ (cfg.json + sae_weights.safetensors, SAELens's layout:
sae_lens.SAE.load_from_disk opens it); results to sae_models, sae_feature_scores, sae_activations.
"""

from __future__ import annotations

import argparse
import sys


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m probes sae", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("plans", nargs="+", metavar="plan", help="SAE plan YAML (docs/probes.md, 'SAE features')")
    p.add_argument("--data", default=None, help="workspace folder (default: $AGNOSIA_DATA, else ./data)")
    p.add_argument("--force", action="store_true", help="retrain SAEs already recorded")
    p.add_argument("--scheduler", default=None, help="auto | inline | local | a Dask scheduler address")
    p.add_argument("--workers", type=int, default=None, help="worker processes (local)")
    p.add_argument("--memory-limit", default=None, help="worker memory limit, e.g. 1GiB (checked per SAE first)")
    p.add_argument("--in-process", action="store_true", help="no Dask: SAEs train here, one by one")
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(sys.argv[1:] if argv is None else argv)
    from probes.errors import ProbeError
    from probes.sae.farm import run_sae_plan
    from probes.sae.plan import load_sae_plan
    from store import resolve_path
    from store.errors import StoreError

    failed = 0
    try:
        plans = [load_sae_plan(p) for p in args.plans]
        for plan in plans:
            rep = run_sae_plan(plan, resolve_path(args.data), force=args.force, scheduler=args.scheduler,
                               workers=args.workers, memory_limit=args.memory_limit, in_process=args.in_process)
            print(f"sae plan {plan.name}: {rep.trained} trained, {rep.skipped} skipped, {rep.failed} failed"
                  f" in {rep.seconds:.1f} s")
            for line in rep.errors[:5]:
                print(f"  error: {line}", file=sys.stderr)
            failed += rep.failed
    except (ProbeError, StoreError) as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("interrupted: finished SAEs are recorded and checkpoints kept; run the same command to resume",
              file=sys.stderr)
        return 130
    return 1 if failed else 0

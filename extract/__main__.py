"""``python -m extract MANIFEST``: run (or resume) an extraction manifest into a workspace."""

from __future__ import annotations

import argparse
import sys

from extract.manifest import ManifestError, load_manifest


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m extract",
        description="Run a VLM over stimulus sets once and store the requested activations, attention rows and"
        " generations in a workspace (Zarr + DuckDB). Re-running a manifest resumes it.",
    )
    parser.add_argument("manifest", help="extraction manifest (YAML), e.g. manifests/demo.yaml")
    parser.add_argument("--data", default=None,
                        help="workspace folder (default: the manifest's workspace, else $AGNOSIA_DATA, else ./data)")
    parser.add_argument("--dry-run", action="store_true",
                        help="validate the manifest and stimuli, print the plan and the bytes it will write; load no weights")
    parser.add_argument("--codec", default="none",
                        help="array codec: none (default, fastest), zstd (lossless), bitround7 / bitround8 (lossy)")
    parser.add_argument("--shard", default=None, metavar="I/K",
                        help="fill only chunk I of every K (start K processes, I = 0..K-1, e.g. one per GPU with"
                        " CUDA_VISIBLE_DEVICES=I): together they write the run once, into one workspace")
    parser.add_argument("--no-progress", action="store_true", help="no progress bar")
    parser.add_argument("--stimuli-root", default=None, metavar="DIR",
                        help="read the manifest's stimuli/... sets from DIR instead (where `make stimuli STIMULI=DIR`"
                        " wrote them); other set paths are kept")
    from extract.dry_run import Hardware

    hw = Hardware()
    plan = parser.add_argument_group("--dry-run time estimate (docs/scale.md)")
    plan.add_argument("--gpu-tflops", type=float, default=hw.gpu_tflops, help=f"prefill TFLOP/s (default {hw.gpu_tflops:g})")
    plan.add_argument("--gpu-bandwidth-gbs", type=float, default=hw.gpu_bandwidth_gbs,
                      help=f"GPU memory read rate when decoding, GB/s (default {hw.gpu_bandwidth_gbs:g})")
    plan.add_argument("--step-ms-per-layer", type=float, default=hw.step_ms_per_layer,
                      help=f"generate's overhead per decoder layer and step, ms (default {hw.step_ms_per_layer:g})")
    plan.add_argument("--disk-mbps", type=float, default=hw.disk_mbps, help=f"store write rate, MB/s (default {hw.disk_mbps:g})")
    args = parser.parse_args(argv)
    from extract.models.errors import ModelError
    from extract.stimuli.base import StimulusError
    from store import StoreError

    try:
        manifest = load_manifest(args.manifest)
        if args.shard is not None:
            from extract.manifest import parse_manifest

            manifest = parse_manifest({**manifest.model_dump(exclude_unset=True), "shard": args.shard}, "--shard")
        if args.stimuli_root is not None:
            from extract.manifest import with_stimuli_root

            manifest = with_stimuli_root(manifest, args.stimuli_root)
        if args.dry_run:
            from extract.dry_run import dry_run

            hardware = Hardware(gpu_tflops=args.gpu_tflops, gpu_bandwidth_gbs=args.gpu_bandwidth_gbs,
                                disk_mbps=args.disk_mbps, step_ms_per_layer=args.step_ms_per_layer)
            print(dry_run(manifest, codec=args.codec, hardware=hardware))
            return 0
        from extract.run import run_extraction

        print(run_extraction(manifest, workspace=args.data, progress=not args.no_progress, codec=args.codec))
    except (ManifestError, ModelError, StimulusError, StoreError) as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""``python -m extract MANIFEST [MANIFEST ...]``: run (or resume) extraction manifests into a workspace.

Several manifests run one after another in one process: torch and transformers are imported once
(seconds of CPU per process on a small machine: `make demo` runs ten manifests). Every manifest is
read and checked before the first run starts, so a bad one among several stores nothing."""

from __future__ import annotations

import argparse
import errno
import os
import sys
from pathlib import Path

from extract.manifest import Manifest, ManifestError, load_manifest

# What a write into a workspace the process may not change raises (read-only mount, permissions).
_NOT_WRITABLE = {errno.EROFS, errno.EACCES, errno.EPERM}


def check_workspace_target(path: Path) -> None:
    """Refuse, before the model loads, a workspace that is a file or that cannot be written."""
    from store import WorkspaceError

    if path.exists() and not path.is_dir():
        raise WorkspaceError(f"workspace {str(path)!r} is a file, not a folder: pass --data a folder (new or existing)")
    existing = next(p for p in (path, *path.parents) if p.exists())
    if not existing.is_dir():
        raise WorkspaceError(f"workspace {str(path)!r} cannot be created: {str(existing)!r} is a file")
    if os.statvfs(existing).f_flag & os.ST_RDONLY:
        raise WorkspaceError(f"workspace {str(path)!r} is on a read-only file system ({str(existing)!r}):"
                             " pass --data a writable folder, or remount it read-write")
    writable = [existing] + ([path / "manifest.duckdb"] if (path / "manifest.duckdb").exists() else [])
    for p in writable:
        if not os.access(p, os.W_OK):
            raise WorkspaceError(f"workspace {str(path)!r}: {str(p)!r} is not writable by this user: fix its"
                                 " permissions or pass --data a folder you can write")


def parser() -> argparse.ArgumentParser:
    """The command line; the dry run's hardware assumptions default to :class:`extract.dry_run.Hardware`'s."""
    parser = argparse.ArgumentParser(
        prog="python -m extract",
        description="Run a VLM over stimulus sets once and store the requested activations, attention rows and"
        " generations in a workspace (Zarr + DuckDB). Re-running a manifest resumes it.",
    )
    parser.add_argument("manifests", nargs="+", metavar="manifest",
                        help="extraction manifest (YAML), e.g. manifests/demo.yaml; several run in order, in one process")
    parser.add_argument("--data", default=None,
                        help="workspace folder (default: the manifest's workspace, else $AGNOSIA_DATA, else ./data)")
    parser.add_argument("--dry-run", action="store_true",
                        help="validate the manifest and stimuli, print the arrays, bytes and time it will take; load no weights")
    parser.add_argument("--codec", default="none",
                        help="array codec: none (default, fastest), zstd (lossless), bitround7 / bitround8 (lossy)")
    parser.add_argument("--shard", default=None, metavar="I/K",
                        help="fill only chunk I of every K (start K processes, I = 0..K-1, e.g. one per GPU with"
                        " CUDA_VISIBLE_DEVICES=I): together they write the run once, into one workspace")
    parser.add_argument("--scheduler", default=None, metavar="ADDRESS",
                        help="run on a Dask cluster (docs/scale.md): the address of a scheduler whose workers hold a GPU"
                        " resource (dask worker --resources GPU=1), or auto | local | inline; this process is then"
                        " the only writer of the manifest. With --dry-run: plan for that cluster's GPU workers")
    parser.add_argument("--workers", type=int, default=None, metavar="N",
                        help="--scheduler local: start N worker processes; --dry-run: plan for N GPU workers")
    parser.add_argument("--no-progress", action="store_true", help="no progress bar")
    parser.add_argument("--stimuli-root", default=None, metavar="DIR",
                        help="read the manifest's sets/... folders from DIR instead (where `make stimuli STIMULI=DIR`"
                        " wrote them); other set paths are kept")
    from extract.dry_run import Hardware

    hw = Hardware()
    dry = parser.add_argument_group("--dry-run time estimate (docs/scale.md)")
    dry.add_argument("--gpu-tflops", type=float, default=hw.gpu_tflops, help=f"prefill TFLOP/s (default {hw.gpu_tflops:g})")
    dry.add_argument("--gpu-bandwidth-gbs", type=float, default=hw.gpu_bandwidth_gbs,
                     help=f"GPU memory read rate when decoding, GB/s (default {hw.gpu_bandwidth_gbs:g})")
    dry.add_argument("--step-ms-per-layer", type=float, default=hw.step_ms_per_layer,
                     help=f"generate's overhead per decoder layer and step, ms (default {hw.step_ms_per_layer:g})")
    dry.add_argument("--disk-mbps", type=float, default=hw.disk_mbps, help=f"store write rate, MB/s (default {hw.disk_mbps:g})")
    return parser


def manifest_from(args: argparse.Namespace, path: str) -> Manifest:
    """The manifest file ``path`` with the command line's ``--shard`` and ``--stimuli-root`` applied."""
    from extract.manifest import parse_manifest, with_stimuli_root

    manifest = load_manifest(path)
    if args.shard is not None:
        manifest = parse_manifest({**manifest.model_dump(exclude_unset=True), "shard": args.shard}, "--shard")
    if args.stimuli_root is not None:
        manifest = with_stimuli_root(manifest, args.stimuli_root)
    return manifest


def check_distinct_runs(args: argparse.Namespace, manifests: list[tuple[str, Manifest]]) -> None:
    """Two manifests of one command writing one run of one workspace would resume each other's rows."""
    seen: dict[tuple[str, str], str] = {}
    for path, manifest in manifests:
        where = (str(args.data or manifest.workspace), manifest.run)
        if where in seen:
            raise ManifestError(f"{seen[where]} and {path} both write run {manifest.run!r} into one workspace: give"
                                " each manifest its own run name, or extract them one at a time")
        seen[where] = path


def preflight(args: argparse.Namespace, manifest: Manifest) -> None:
    """Refuse, before any model loads, a manifest whose workspace or stimulus sets would stop it later."""
    from extract.samples import collect_samples
    from store.workspace import resolve_path

    check_workspace_target(resolve_path(args.data or manifest.workspace))
    collect_samples(manifest)  # reads each set's rows: a missing set, task or truth key stops here


def run(args: argparse.Namespace, manifest: Manifest) -> None:
    """Print the dry run's estimate, or run (resume) the extraction and print its summary."""
    if args.dry_run:
        from extract.dry_run import Hardware, dry_run

        hardware = Hardware(gpu_tflops=args.gpu_tflops, gpu_bandwidth_gbs=args.gpu_bandwidth_gbs,
                            disk_mbps=args.disk_mbps, step_ms_per_layer=args.step_ms_per_layer)
        print(dry_run(manifest, codec=args.codec, hardware=hardware, workers=planned_workers(args)))
        return
    from extract.run import run_extraction
    from store.workspace import resolve_path

    check_workspace_target(resolve_path(args.data or manifest.workspace))
    if args.no_progress:  # no bar at all: transformers' weight-loading bar too
        from transformers.utils import logging as hf_logging

        hf_logging.disable_progress_bar()
    print(run_extraction(manifest, workspace=args.data, progress=not args.no_progress, codec=args.codec))


def planned_workers(args: argparse.Namespace) -> int | None:
    """The GPU workers a dry run plans for: ``--workers``, else those of the ``--scheduler`` it reaches."""
    if args.scheduler is None or args.workers is not None:
        return args.workers
    if args.scheduler in ("auto", "local", "inline"):
        return 1

    from extract.cluster.scheduler import connect, gpu_workers

    client, _ = connect(args.scheduler, None, lambda _: None)
    try:
        return len(gpu_workers(client))
    finally:
        client.close()


def run_on_cluster(args: argparse.Namespace, loaded: list[tuple[str, Manifest]]) -> None:
    """Extract every manifest of ``loaded`` on the cluster ``--scheduler`` names; print each run's summary."""
    from extract.cluster.client import run_cluster

    # No weight-loading bar to hide here: the workers load the model (without bars).
    for summary in run_cluster(loaded, scheduler=args.scheduler, workers=args.workers, data=args.data, codec=args.codec,
                               progress=not args.no_progress, log=lambda line: print(line, file=sys.stderr)):
        print(summary)


def main(argv: list[str] | None = None) -> int:
    args = parser().parse_args(argv)
    if args.workers is not None and args.workers < 1:
        parser().error("--workers must be at least 1")
    if args.workers is not None and not args.dry_run and args.scheduler not in ("local", "auto"):
        parser().error("--workers starts a LocalCluster (--scheduler local) or plans a cluster (--dry-run); a running"
                       " scheduler has the workers it has")
    if args.scheduler is not None and args.shard is not None:
        parser().error("--shard and --scheduler both split a run: use one (the cluster spreads chunks over its workers)")
    from extract.cluster.errors import ClusterError
    from extract.models.errors import ModelError
    from stimuli.base import StimulusError
    from store import StoreError

    names: list[str] = args.manifests
    at = names[0]  # the manifest being read, checked or run: a failure names it when there are several
    try:
        loaded = []
        for at in names:
            loaded.append((at, manifest_from(args, at)))
        check_distinct_runs(args, loaded)
        if not args.dry_run:
            for at, manifest in loaded:  # noqa: B007 - `at` names the failing manifest in the error below
                preflight(args, manifest)
        if args.scheduler is not None and not args.dry_run:
            at = ", ".join(names)
            run_on_cluster(args, loaded)
        else:
            for at, manifest in loaded:  # noqa: B007 - as above
                run(args, manifest)
    except (ManifestError, ModelError, StimulusError, StoreError, ClusterError) as err:
        where = f"{at}: " if len(names) > 1 and at not in str(err) else ""
        print(f"error: {where}{err}", file=sys.stderr)
        return 2
    except OSError as err:
        if err.errno not in _NOT_WRITABLE:
            raise
        print(f"error: cannot write {err.filename or 'the workspace'}: {err.strerror}. Pass --data a folder this"
              " user can write; chunks committed so far are kept, so re-running the same command resumes",
              file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        # the writer has committed every chunk that was whole (its context exits before this)
        again = ["python -m extract", *names] + (["--data", args.data] if args.data else [])
        again += ["--shard", args.shard] if args.shard else []
        again += ["--scheduler", args.scheduler] if args.scheduler else []
        again += ["--workers", str(args.workers)] if args.workers else []
        again += ["--codec", args.codec] if args.codec != "none" else []
        again += ["--stimuli-root", args.stimuli_root] if args.stimuli_root else []
        print(f"interrupted: the chunks committed so far are kept; run `{' '.join(again)}` to resume", file=sys.stderr)
        return 130
    return 0


if __name__ == "__main__":
    sys.exit(main())

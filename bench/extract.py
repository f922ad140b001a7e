"""Extraction overhead: a full run vs a bare batched ``generate`` of the same model on the same
stimuli, and peak memory as the number of stimuli grows 10x (the writer must stream).

Model: the tiny random Qwen2-VL of ``python -m extract.tiny`` (built into a temp folder).
"""

from __future__ import annotations

import json
import subprocess
import sys
import tempfile
from pathlib import Path

RUN_SNIPPET = """
import json, resource, sys, time
from extract.manifest import parse_manifest
from extract.run import run_extraction
manifest = parse_manifest(json.loads(sys.argv[1]))
t = time.perf_counter()
s = run_extraction(manifest, workspace=sys.argv[2], progress=False)
print(json.dumps({"seconds": time.perf_counter() - t, "samples": s.samples,
                  "peak_mib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024}))
"""

# A bare loop over the same samples and batches: no hooks, no store; {step} is one batch's model call.
_BARE_LOOP = """
import json, resource, sys, time, torch
from extract.models import load_model, prepare_batch
from extract.run import collect_samples
from extract.manifest import parse_manifest
manifest = parse_manifest(json.loads(sys.argv[1]))
t = time.perf_counter()
_, samples = collect_samples(manifest)
lm = load_model(manifest.model.path, dtype=manifest.model.dtype, device="cpu")
bs = manifest.batch_size
with torch.inference_mode():
    for i in range(0, len(samples), bs):
        chunk = samples[i:i + bs]
        batch = prepare_batch(lm, [s.image for s in chunk], [s.prompt for s in chunk], padding_side="left")
        {step}
print(json.dumps({{"seconds": time.perf_counter() - t, "samples": len(samples),
                  "peak_mib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024}}))
"""
BARE_SNIPPET = _BARE_LOOP.format(
    step="lm.model.generate(**batch.inputs, do_sample=False, max_new_tokens=manifest.generation.max_new_tokens)")
BARE_FORWARD_SNIPPET = _BARE_LOOP.format(
    step="lm.model(**batch.inputs, use_cache=False, logits_to_keep=1).logits[:, -1].float().argmax(-1).tolist()")


def _python(snippet: str, *args: str) -> dict:
    out = subprocess.run([sys.executable, "-c", snippet, *args], capture_output=True, text=True, check=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


def main(quick: bool = False) -> None:
    from extract.models import tiny
    from stimuli import get_family
    from stimuli.io import write_set

    n = 16 if quick else 64
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        model = root / "tiny-qwen2-vl"
        tiny.build("qwen2_vl", model, seed=0)
        g2m = get_family("g2m")
        config = g2m.config(grid_sizes=(4,), colors=(3,), image_size=224)
        small = write_set(g2m, config, n=n, seed=0, split="test", out=root / "small")
        large = write_set(g2m, config, n=10 * n, seed=0, split="test", out=root / "large")

        def manifest(stimuli: Path, run: str) -> str:
            return json.dumps({
                "run": run, "model": {"path": str(model)}, "stimuli": [{"set": str(stimuli)}],
                "taps": [{"tap": "vision", "layers": [-1]},
                         {"tap": "llm", "layers": "all", "tokens": ["image", "last", "answer"]}],
                "generation": {"max_new_tokens": 16}, "batch_size": 8, "chunk_samples": 16,
            })

        # Warm the page cache and imports once so neither side pays them alone.
        _python(BARE_SNIPPET, manifest(small, "warm"))
        bare = _python(BARE_SNIPPET, manifest(small, "bare"))
        full = _python(RUN_SNIPPET, manifest(small, "full"), str(root / "ws-small"))
        big = _python(RUN_SNIPPET, manifest(large, "big"), str(root / "ws-large"))

    ratio = full["seconds"] / bare["seconds"]
    print(f"   tiny Qwen2-VL, G2M 224 px, {n} samples, batch 8, 16 new tokens, taps vision[-1] + llm[all] x"
          " image/last/answer")
    print(f"   bare generate (load + batches):  {bare['seconds']:6.2f} s  {bare['samples'] / bare['seconds']:6.1f} samples/s")
    print(f"   extraction into the store:       {full['seconds']:6.2f} s  {full['samples'] / full['seconds']:6.1f} samples/s"
          f"  -> {ratio:.2f}x bare (aim <= 1.2x)")
    print(f"   peak RSS: {full['peak_mib']:.0f} MiB at {n} samples, {big['peak_mib']:.0f} MiB at {10 * n}"
          f" ({big['peak_mib'] / full['peak_mib']:.2f}x; aim: flat) — bare generate {bare['peak_mib']:.0f} MiB")
    prompt_only(quick)


def _load() -> str:
    with open("/proc/loadavg") as f:
        return " ".join(f.read().split()[:3])


def _prompt_manifest(model: Path, stimuli: Path, bs: int, run: str, path: str) -> str:
    return json.dumps({
        "run": run, "model": {"path": str(model)}, "stimuli": [{"set": str(stimuli)}],
        "taps": [{"tap": "vision", "layers": [0, -1]}, {"tap": "llm", "layers": [0, -1], "tokens": ["image"]}],
        "generation": {"max_new_tokens": 1, "path": path}, "batch_size": bs, "chunk_samples": 16,
    })


def prompt_only(quick: bool = False, rounds: int = 3) -> None:
    """agnosia with one new token (the forward path, and forced through generate) vs a bare forward with
    no hooks and no storage, at batch 1 and 8, on tiny Qwen2-VL and LLaVA: the median of ``rounds``
    interleaved rounds, each side a fresh process (load included), the 1-minute load average beside it."""
    from statistics import median

    from extract.models import tiny
    from stimuli import get_family
    from stimuli.io import write_set

    n = 8 if quick else 32
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        g2m = get_family("g2m")
        stimuli = write_set(g2m, g2m.config(grid_sizes=(4,), colors=(3,), image_size=224), n=n, seed=0,
                            split="test", out=root / "g2m")
        print(f"   prompt-only: G2M 224 px, {n} samples, 1 new token, taps vision[0,-1] + llm[0,-1] x image;"
              f" median of {rounds} interleaved rounds, fresh process each, load included")
        for arch in ("qwen2_vl", "llava"):
            model = tiny.build(arch, root / arch, seed=0)
            for bs in (1, 8):
                times: dict[str, list[float]] = {"bare": [], "forward": [], "generate": []}
                loads = []
                bare_spec = _prompt_manifest(model, stimuli, bs, "bare", "auto")
                _python(BARE_FORWARD_SNIPPET, bare_spec)  # page cache and imports warm for every side
                for r in range(rounds):
                    loads.append(_load())
                    times["bare"].append(_python(BARE_FORWARD_SNIPPET, bare_spec)["seconds"])
                    for path in ("forward", "generate"):
                        spec = _prompt_manifest(model, stimuli, bs, path, "auto" if path == "forward" else path)
                        where = str(root / f"ws-{arch}-{bs}-{path}{r}")
                        times[path].append(_python(RUN_SNIPPET, spec, where)["seconds"])
                bare, fwd, gen = (median(times[k]) for k in ("bare", "forward", "generate"))
                print(f"   {arch:9s} batch {bs}: bare forward {bare:5.2f} s | agnosia forward path {fwd:5.2f} s"
                      f" ({fwd / bare:.2f}x) | agnosia via generate {gen:5.2f} s ({gen / bare:.2f}x)"
                      f"  load avg {'; '.join(loads)}")

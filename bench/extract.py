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

BARE_SNIPPET = """
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
        lm.model.generate(**batch.inputs, do_sample=False, max_new_tokens=manifest.generation.max_new_tokens)
print(json.dumps({"seconds": time.perf_counter() - t, "samples": len(samples),
                  "peak_mib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024}))
"""


def _python(snippet: str, *args: str) -> dict:
    out = subprocess.run([sys.executable, "-c", snippet, *args], capture_output=True, text=True, check=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


def main(quick: bool = False) -> None:
    from extract.models import tiny
    from extract.stimuli import get_family
    from extract.stimuli.io import write_set

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

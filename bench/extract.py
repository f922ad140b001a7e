"""Extraction overhead against a bare model, peak memory as the stimuli grow, and manifest connects.

Ten parts, all printed by ``python -m bench extract [--samples N] [--rounds R]`` (one of them
with ``--part overhead|memory|connects|steps|steady|cast|arrays|capture|interference|warm``):

1. **Overhead**, interleaved: on tiny Qwen2-VL and tiny LLaVA (``python -m extract.tiny``), the same
   G2M 224 px images, taps ``vision[0,-1]`` + ``llm[0,-1]`` at image tokens, torch on 2 threads:
   agnosia vs bare ``generate`` at batch 8 and 16 new tokens; agnosia prompt-only (one new token:
   the forward path) vs a bare forward at batch 1 and 8. Each round runs every configuration once,
   each in a fresh process (``bench._extract_worker``: imports before the clock, weights load
   timed), the two sides of a comparison back to back and their order alternating between rounds;
   a ratio is the median of the rounds' agnosia/bare ratios, printed with the load average
   (``os.getloadavg``) at the start of each round.
2. **Memory**: agnosia's peak RSS at N and 8N samples (prompt-only, batch 8, tiny Qwen2-VL): the
   writer streams, so the ratio should stay <= 1.05.
3. **Connects**: manifest opens while a writer registers 4 arrays, and during a whole tiny
   Qwen2-VL run of N samples: the store's attaches (read-write connections to the process's one
   DuckDB instance) and ``duckdb.connect`` calls (instances built; store/db.py).

4. **Steps**: one run of each side at batch 1 and 8 (prompt-only, tiny Qwen2-VL) with a timer
   around each step (run set-up, the writer's calls, ``prepare_batch``, the model's forward with
   its hooks), printed side by side: where agnosia's extra time goes; with each run's minor page faults.
5. **Steady**: what each further sample costs, apart from the run's fixed set-up: agnosia and the
   bare side at N and 4N samples of one set (prompt-only, batch 8, both models, interleaved, each
   a fresh process), the ratio of the differences (agnosia(4N) - agnosia(N)) / (bare(4N) - bare(N))
   as the median of the rounds, and the fixed set-up agnosia adds at N samples.
6. **Cast**: the writer thread's cast to the stored float16 at a 7B model's shape (one batch of 8
   samples x 256 image tokens x d = 3,584, from bfloat16 and from float32), the C kernel
   (store/_halfcast.c) against numpy's passes, alternated, each the median of 15, under the
   extraction's malloc settings (store/heap.py): MiB/s of source
   and the samples/s one writer thread could cast for a run keeping all 28 LLM layers.
7. **Arrays**: ``Writer.arrays`` declaring 4 and 200 dense arrays (vision layers' image tokens,
   LLM layers' image and last tokens) of a 200-sample run in a new workspace: node creation,
   fsyncs and manifest rows, median of 5 each.
8. **Capture**: the capture's own cost per batch, paired batch by batch with a bare forward
   (``bench._capture_worker``).
9. **Interference**: what the writer thread's storing of a batch costs the main thread's next step,
   and the writer's commits (``bench._interference_worker``).
10. **Warm**: part 1's comparisons with the weights loaded once per model, in one process per model
   (``bench._warm_worker``): a warm-up run of each side, then the rounds, sides back to back in
   alternating order. Part 1 times the weights load on both sides, which dilutes what a run adds;
   this part does not, and a GPU machine, whose process starts take tens of seconds, runs it in
   minutes. On the CPU each run is also split into the model's forward calls (hooks included) and
   the rest: what the capture and the writer beside it cost the model, and what the run adds around it.

``--quick`` is a smoke run (16 samples, 3 rounds): its figures are not ones to report. ``--device cuda``
runs parts 1, 8 and 10 with the models in bfloat16 on that device (the others stay on the CPU).
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path
from statistics import median
from typing import Any

from bench import record

ARCHS = ("qwen2_vl", "llava")
THREADS = 2
TAPS = [{"tap": "vision", "layers": [0, -1]}, {"tap": "llm", "layers": [0, -1], "tokens": ["image"]}]
# (label, bare side, batch size, new tokens, aim for agnosia / bare)
COMPARISONS = (
    ("batch 8, 16 new tokens / bare generate", "generate", 8, 16, 1.05),
    ("batch 8, prompt-only / bare forward", "forward", 8, 1, 1.05),
    ("batch 1, prompt-only / bare forward", "forward", 1, 1, 1.15),
)


def _worker(spec: dict[str, Any], module: str = "bench._extract_worker") -> dict[str, Any]:
    """What the worker ``module`` prints for ``spec``, in a fresh process on ``THREADS`` threads."""
    env = dict(os.environ, OMP_NUM_THREADS=str(THREADS), MKL_NUM_THREADS=str(THREADS), HF_HUB_OFFLINE="1")
    spec = dict(spec, threads=THREADS)
    out = subprocess.run([sys.executable, "-m", module, json.dumps(spec)], capture_output=True, text=True, env=env)
    if out.returncode != 0:
        raise RuntimeError(f"bench worker {module} ({spec.get('side', 'paired')}) failed:\n{out.stderr[-3000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def _dtype(device: str) -> str:
    """float32 on the CPU, bfloat16 on an accelerator (as a GPU run loads a VLM)."""
    return "float32" if device == "cpu" else "bfloat16"


def _model(model: Path, device: str) -> dict[str, str]:
    """A manifest's ``model`` on ``device``, in its dtype."""
    return {"path": str(model), "device": device, "dtype": _dtype(device)}


def _manifest(model: Path, stimuli: Path, batch: int, new_tokens: int, run: str,
              limit: int | None = None, device: str = "cpu") -> dict[str, Any]:
    return {"run": run, "model": _model(model, device), "stimuli": [{"set": str(stimuli), "limit": limit}],
            "taps": TAPS, "generation": {"max_new_tokens": new_tokens}, "batch_size": batch, "chunk_samples": 64}


def _agnosia(root: Path, manifest: dict[str, Any]) -> dict[str, Any]:
    ws = Path(tempfile.mkdtemp(dir=root, prefix="ws-"))
    try:
        return _worker({"side": "agnosia", "manifest": manifest, "workspace": str(ws)})
    finally:
        shutil.rmtree(ws, ignore_errors=True)


def _part(name: str, device: str) -> str:
    """A part's name in the recorded figures: a device's figures are their own part, so a CPU run
    does not replace a GPU run's in the table."""
    return name if device == "cpu" else f"{name} on {device}"


def _load() -> str:
    return "/".join(f"{x:.1f}" for x in os.getloadavg())


def overhead(root: Path, models: dict[str, Path], stimuli: Path, n: int, rounds: int, device: str = "cpu") -> None:
    print(f"   (1) overhead: G2M 224 px, {n} samples, taps vision[0,-1] + llm[0,-1] x image, torch {THREADS} threads,"
          f" {_dtype(device)} on {device};"
          f" {rounds} interleaved rounds, each configuration a fresh process, weights load timed")
    ratios: dict[tuple[str, str], list[float]] = {}
    seconds: dict[tuple[str, str, str], list[float]] = {}
    loads = []
    for _ in range(1):  # page cache and bytecode warm for every side
        _worker({"side": "forward", "manifest": _manifest(models[ARCHS[0]], stimuli, 8, 1, "warm", device=device)})
    for r in range(rounds):
        loads.append(_load())
        for arch in ARCHS:
            for label, bare_side, batch, new, _aim in COMPARISONS:
                manifest = _manifest(models[arch], stimuli, batch, new, "bench", device=device)
                order = ("bare", "agnosia") if r % 2 == 0 else ("agnosia", "bare")
                got = {side: (_worker({"side": bare_side, "manifest": manifest}) if side == "bare"
                              else _agnosia(root, manifest)) for side in order}
                for side, res in got.items():
                    seconds.setdefault((arch, label, side), []).append(res["seconds"])
                ratios.setdefault((arch, label), []).append(got["agnosia"]["seconds"] / got["bare"]["seconds"])
        print(f"     round {r + 1}: load average (1/5/15 min) {loads[-1]} at its start")
    for arch in ARCHS:
        print(f"   tiny {arch}:")
        for label, _side, _batch, _new, aim in COMPARISONS:
            rs = ratios[(arch, label)]
            bare, agn = median(seconds[(arch, label, "bare")]), median(seconds[(arch, label, "agnosia")])
            print(f"     {label:40s} {median(rs):5.2f}x  (aim <= {aim:.2f}x; rounds "
                  f"{', '.join(f'{x:.2f}' for x in rs)}; median {agn:.2f} s vs {bare:.2f} s)")
            record.figure(_part("overhead", device), f"tiny {arch}, {label}", median(rs), "x", aim=f"<= {aim:.2f}x",
                          setting=f"{n} G2M 224 px samples, {_dtype(device)} on {device}, torch {THREADS} threads;"
                          f" median of {rounds} interleaved rounds, fresh processes, weights load timed")
    print(f"   load average per round: {'; '.join(loads)}")


def memory(root: Path, model: Path, small: Path, large: Path, n: int) -> None:
    got = [_agnosia(root, _manifest(model, s, 8, 1, "rss")) for s in (small, large)]
    a, b = got[0]["peak_mib"], got[1]["peak_mib"]
    print(f"   (2) peak RSS, agnosia prompt-only batch 8, tiny qwen2_vl: {a:.0f} MiB at {n} samples,"
          f" {b:.0f} MiB at {8 * n} -> {b / a:.3f}x (aim <= 1.05x); load average {_load()}")
    record.figure("memory", f"peak RSS at {8 * n} / at {n} samples", b / a, "x", aim="<= 1.05x",
                  setting=f"tiny qwen2_vl, prompt-only, batch 8; {a:.0f} MiB at {n} samples")


def connects(root: Path, model: Path, stimuli: Path, n: int) -> None:
    run = _agnosia(root, _manifest(model, stimuli, 8, 1, "connects"))
    registering = _registration_connects(root)
    print(f"   (3) manifest opens: {registering} while a writer registers 4 arrays (one transaction); during a"
          f" whole {n}-sample tiny qwen2_vl run (prompt-only, batch 8, chunks of 64) {run['attaches']} attaches"
          f" (read-write connections) and {run['connects']} duckdb.connect calls (DuckDB instances built)")
    setting = f"tiny qwen2_vl, {n} samples, prompt-only, batch 8, chunks of 64"
    record.figure("connects", "manifest opens while registering 4 arrays", registering, "", setting="one transaction")
    record.figure("connects", "DuckDB instances built in a whole run", run["connects"], "", setting=setting)
    record.figure("connects", "read-write attaches in a whole run", run["attaches"], "", setting=setting)


def _registration_connects(root: Path) -> int:
    """Manifest opens (``duckdb.connect`` calls and the store's attaches) made by ``Writer.arrays``
    for 4 arrays, counted in this process."""
    import duckdb

    import store.db
    from bench._extract_worker import counting
    from store import ArraySpec, RunInfo, Workspace

    ws = Workspace.open(root / "ws-register")
    real_connect, count = duckdb.connect, [0]
    with ws.writer(RunInfo(run="register", model="none")) as w:
        w.set_samples(w.register_stimuli([{"id": str(i)} for i in range(16)], dataset="s"))
        specs = [ArraySpec(tap="llm", layer=i, tokens="image", shape=(4, 8), dtype="float32") for i in range(4)]
        duckdb.connect, attached = counting(real_connect, count), store.db.OPENS.attaches
        try:
            w.arrays(specs)
        finally:
            duckdb.connect = real_connect
            count[0] += store.db.OPENS.attaches - attached
        w.finish(partial_ok=True)
    return count[0]


PARTS = ("overhead", "memory", "connects", "steps", "steady", "cast", "arrays", "capture", "interference", "warm")
ON_DEVICE = ("overhead", "capture", "warm")  # the parts that take --device


def steps(root: Path, model: Path, stimuli: Path, n: int) -> None:
    """Where agnosia's time goes against the bare forward, step by step (one run of each, batch 1 and 8)."""
    print(f"   (4) steps, tiny qwen2_vl, prompt-only, {n} samples, one run per side; load average {_load()}:")
    for batch in (1, 8):
        manifest = _manifest(model, stimuli, batch, 1, "steps")
        bare = _worker({"side": "forward", "manifest": manifest, "steps": True})
        agn = _worker({"side": "agnosia", "manifest": manifest, "steps": True,
                       "workspace": str(Path(tempfile.mkdtemp(dir=root, prefix="ws-")))})
        print(f"     batch {batch}: agnosia {agn['seconds']:.2f} s, bare forward {bare['seconds']:.2f} s;"
              f" minor page faults {agn['page_faults']:,} vs {bare['page_faults']:,}")
        names = sorted(set(agn["steps"]) | set(bare["steps"]), key=lambda k: -agn["steps"].get(k, [0.0])[0])
        for name in names:
            a, b = agn["steps"].get(name), bare["steps"].get(name)
            each = " / ".join(f"{1e3 * x[0] / x[1]:.2f} ms x{x[1]}" if x else "-" for x in (a, b))
            print(f"       {name:32s} {a[0] if a else 0:6.3f} s  vs {b[0] if b else 0:6.3f} s   (each: {each})")


def steady(root: Path, models: dict[str, Path], stimuli: Path, n: int, rounds: int) -> None:
    """Marginal cost per sample (N -> 4N samples) of agnosia vs the bare forward, and the fixed set-up."""
    print(f"   (5) steady state: prompt-only, batch 8, {n} and {4 * n} samples of one set; {rounds} interleaved"
          " rounds, each run a fresh process")
    got: dict[tuple[str, str, int], list[float]] = {}
    loads = []
    for r in range(rounds):
        loads.append(_load())
        for arch in ARCHS:
            for size in (n, 4 * n):
                manifest = _manifest(models[arch], stimuli, 8, 1, "bench", limit=size)
                for side in (("bare", "agnosia") if r % 2 == 0 else ("agnosia", "bare")):
                    res = _worker({"side": "forward", "manifest": manifest}) if side == "bare" else _agnosia(root, manifest)
                    got.setdefault((arch, side, size), []).append(res["seconds"])
    for arch in ARCHS:
        def at(side: str, size: int, r: int, arch: str = arch) -> float:
            return got[(arch, side, size)][r]

        per = [(at("agnosia", 4 * n, r) - at("agnosia", n, r)) / (at("bare", 4 * n, r) - at("bare", n, r))
               for r in range(rounds)]
        # agnosia(N) - bare(N) = fixed + (per - 1) * (the bare cost of N samples, (bare(4N) - bare(N)) / 3)
        fixed = [(at("agnosia", n, r) - at("bare", n, r)) - (per[r] - 1) * (at("bare", 4 * n, r) - at("bare", n, r)) / 3
                 for r in range(rounds)]
        print(f"     tiny {arch}: each further sample {median(per):.3f}x the bare forward's (rounds"
              f" {', '.join(f'{x:.3f}' for x in per)}); fixed set-up beyond that {median(fixed):.2f} s"
              f" (bare {median(got[(arch, 'bare', n)]):.2f} s at {n}, {median(got[(arch, 'bare', 4 * n)]):.2f} s"
              f" at {4 * n})")
        record.figure("steady", f"tiny {arch}, each further sample / the bare forward's", median(per), "x",
                      aim="<= 1.05x", setting=f"prompt-only, batch 8, {n} -> {4 * n} samples; median of {rounds} rounds;"
                      f" fixed set-up beyond that {median(fixed):.2f} s")
    print(f"   load average per round: {'; '.join(loads)}")


def capture_cost(models: dict[str, Path], stimuli: Path, quick: bool, device: str = "cpu") -> None:
    """The capture's own time per batch over a bare forward's, paired batch by batch (part 8)."""
    rounds = 4 if quick else 12
    print(f"   (8) the capture's own cost per batch (no store), paired with a bare forward of the same batch,"
          f" {_dtype(device)} on {device};"
          f" {rounds - 2} rounds after 2 of warm-up, median; load average {_load()}:")
    for arch in ARCHS:
        for batch in (1, 8):
            samples = 16 if quick else 48 * (1 + (batch > 1))  # batch 8: 12 batches a round
            got = _worker({"model": _model(models[arch], device), "set": str(stimuli), "batch": batch,
                           "samples": samples, "rounds": rounds, "taps": TAPS}, "bench._capture_worker")
            extra, forward = 1e3 * got["extra_s"], 1e3 * got["forward_s"]
            print(f"     tiny {arch:8s} batch {batch}: {extra:+.3f} ms over a {forward:.2f} ms forward"
                  f" ({extra / forward:+.1%}; {got['pairs']} pairs of {samples} samples)")
            record.figure(_part("capture", device), f"tiny {arch} batch {batch}, capture's cost per batch", extra, "ms",
                          setting=f"over a {forward:.2f} ms forward, {_dtype(device)} on {device}; median of"
                          f" {got['pairs']} pairs")


def interference(models: dict[str, Path], stimuli: Path, quick: bool) -> None:
    """The main thread's steps slowed by the writer thread storing a batch beside them (part 9)."""
    print("   (9) the writer thread storing one batch beside the main thread's next step: that step's extra time,"
          f" paired with the writer idle, median; load average {_load()}:")
    for arch in ARCHS:
        for batch in (1, 8):
            samples = 16 * batch if quick else (96 if batch == 1 else 200)
            got = _worker({"model": _model(models[arch], "cpu"), "set": str(stimuli), "batch": batch,
                           "samples": samples, "taps": TAPS}, "bench._interference_worker")
            steps = "; ".join(f"{name} {1e3 * got[name]['extra_s']:+.3f} ms over {1e3 * got[name]['idle_s']:.2f}"
                              f" ({got[name]['extra_s'] / got[name]['idle_s']:+.1%})" for name in ("prepare", "forward"))
            c = got["prepare"]
            print(f"     tiny {arch:8s} batch {batch}: {steps}; {c['pairs']} pairs each; the writer's commits:"
                  f" {c['commits']} in {c['batches']} batches, {1e3 * c['commit_cpu_s'] / max(c['commits'], 1):.1f} ms"
                  f" of CPU each ({1e3 * c['commit_wall_s'] / max(c['commits'], 1):.1f} ms wall),"
                  f" {1e3 * c['commit_cpu_s'] / c['batches']:.2f} ms a batch")
            f = got["forward"]
            record.figure("interference", f"tiny {arch} batch {batch}, forward slowed by the writer", 1e3 * f["extra_s"],
                          "ms", setting=f"over a {1e3 * f['idle_s']:.2f} ms forward; median of {f['pairs']} pairs")


def warm(root: Path, models: dict[str, Path], stimuli: Path, n: int, rounds: int, device: str = "cpu") -> None:
    """Part 1's comparisons with the weights loaded once per model, and what each further batch costs (part 10)."""
    print(f"   (10) overhead with the weights loaded once: part 1's comparisons, {n} samples and one batch,"
          f" {_dtype(device)} on {device}; one process per model, a warm-up run of each side,"
          f" then {rounds} rounds, sides back to back in alternating order; weights load not timed;"
          f" load average {_load()}:")
    for arch in ARCHS:
        manifests, bare = {}, {}
        for label, side, batch, new, _aim in COMPARISONS:
            for limit in (None, batch):  # all the samples, and one batch: the difference is the per-batch cost
                key = label if limit is None else f"{label}, one batch"
                manifests[key] = _manifest(models[arch], stimuli, batch, new, "bench", limit=limit, device=device)
                bare[key] = side
        out = _worker({"manifests": manifests, "bare": bare, "rounds": rounds, "root": str(root)}, "bench._warm_worker")
        got = out["rounds"]
        print(f"     tiny {arch}:")
        for label, _side, batch, _new, aim in COMPARISONS:
            pairs, one = got[label], got[f"{label}, one batch"]
            rs = [a / b for a, b in pairs]
            agn, bare_s = median(a for a, _ in pairs), median(b for _, b in pairs)
            agn1, bare1 = median(a for a, _ in one), median(b for _, b in one)
            batches = -(-n // batch) - 1
            print(f"       {label:40s} {median(rs):5.2f}x  (aim <= {aim:.2f}x; rounds {', '.join(f'{x:.2f}' for x in rs)};"
                  f" median {agn:.2f} s vs {bare_s:.2f} s); each further batch {(agn - agn1) / (bare_s - bare1):.3f}x"
                  f" ({1e3 * ((agn - agn1) - (bare_s - bare1)) / batches:+.2f} ms), set-up with one batch"
                  f" {agn1 - bare1:+.3f} s")
            record.figure(_part("warm", device), f"tiny {arch}, {label}", median(rs), "x", aim=f"<= {aim:.2f}x",
                          setting=f"{n} samples, weights loaded once, {_dtype(device)} on {device};"
                          f" median of {rounds} rounds; each further batch {(agn - agn1) / (bare_s - bare1):.3f}x")
            if out["forward"] is not None:
                print(f"         {_split(pairs, out['forward'][label])}")


def _split(pairs: list[list[float]], forward: list[list[float]]) -> str:
    """Part 10's rounds of one comparison split into the model's forward calls and the rest of each run."""
    ratios = [a / b for a, b in forward]
    rest = [(a - fa, b - fb) for (a, b), (fa, fb) in zip(pairs, forward, strict=True)]
    return (f"in the model's forward {median(ratios):.3f}x (median {median(a for a, _ in forward):.2f} s vs"
            f" {median(b for _, b in forward):.2f} s: capture and writer beside it); the rest"
            f" {median(a - b for a, b in rest):+.3f} s (median {median(a for a, _ in rest):.2f} s vs"
            f" {median(b for _, b in rest):.2f} s: set-up, store calls, scoring)")


def arrays(root: Path) -> None:
    """``Writer.arrays`` for 4 and 200 dense arrays in a new workspace, median of 5."""
    import time

    from store import ArraySpec, RunInfo, Workspace

    print(f"   (7) Writer.arrays in a new workspace (200 samples, chunks of 64), median of 5; load average {_load()}:")
    for n in (4, 200):
        took = []
        for i in range(5):
            ws = Workspace.open(root / f"ws-arrays-{n}-{i}")
            with ws.writer(RunInfo(run="r", model="m", chunk_samples=64)) as w:
                w.set_samples(w.register_stimuli([{"id": str(k)} for k in range(200)], dataset="s"))
                specs = [ArraySpec(tap="vision", layer=layer, tokens="image", shape=(64, 128)) for layer in range(n // 2)]
                specs += [ArraySpec(tap="llm", layer=layer, tokens=kind, shape=(64, 128) if kind == "image" else (1, 128))
                          for layer in range(n // 4) for kind in ("image", "last")]
                started = time.perf_counter()
                w.arrays(specs)
                took.append(time.perf_counter() - started)
                w.finish(partial_ok=True)
            shutil.rmtree(ws.path, ignore_errors=True)
        print(f"     {len(specs):4d} arrays: {1e3 * median(took):7.1f} ms ({', '.join(f'{1e3 * t:.0f}' for t in took)})")
        record.figure("arrays", f"Writer.arrays, {len(specs)} arrays", 1e3 * median(took), "ms",
                      setting="a new workspace, 200 samples, chunks of 64; median of 5")


def cast() -> None:
    """The writer's float16 cast at a real model's shape: kernel vs numpy, alternated."""
    import time

    import numpy as np

    from store import dtypes
    from store.heap import tune_malloc

    tune_malloc()  # as run_extraction sets it: each cast's 15 MiB output is then reused heap, not fresh pages
    if not dtypes.HAS_KERNEL:
        print("   (6) cast: store/_halfcast.c was not built (no C compiler at install): nothing to compare")
        return
    shape, layers = (8, 256, 3584), 28
    rng = np.random.default_rng(0)
    f32 = (rng.standard_normal(shape, dtype=np.float32) * 4).astype(np.float32)
    sources = {"bfloat16": dtypes.float32_to_bf16_bits(f32), "float32": f32}
    print(f"   (6) cast to float16 on the writer thread, one batch {shape[0]} x {shape[1]} x {shape[2]}"
          f" (a 7B model's image tokens), median of 15 alternated; load average {_load()}:")
    for kind, src in sources.items():
        took: dict[str, list[float]] = {"kernel": [], "numpy": []}
        for _ in range(15):
            for path in ("kernel", "numpy"):
                started = time.perf_counter()
                dtypes.cast(src, kind, "float16", "error", "bench", kernel=path == "kernel")
                took[path].append(time.perf_counter() - started)
        k, n = median(took["kernel"]), median(took["numpy"])
        per_sample = src.nbytes / shape[0] * layers
        print(f"     from {kind:8s}: kernel {src.nbytes / k / 2**20:6.0f} MiB/s, numpy {src.nbytes / n / 2**20:6.0f}"
              f" MiB/s ({n / k:.1f}x); one writer thread casts {shape[0] / k / layers:5.1f} vs"
              f" {shape[0] / n / layers:4.1f} samples/s of {layers} layers ({per_sample / 2**20:.0f} MiB each)")
        record.figure("cast", f"cast to float16 from {kind}, C kernel vs numpy", n / k, "x faster",
                      setting=f"one batch {shape[0]} x {shape[1]} x {shape[2]}, median of 15 alternated;"
                      f" kernel {src.nbytes / k / 2**20:.0f} MiB/s")


def main(quick: bool = False, samples: int | None = None, rounds: int | None = None, part: str | None = None,
         device: str = "cpu") -> None:
    """Every part, or only ``part`` (one of PARTS). ``device`` other than ``cpu`` (e.g. ``cuda``, in
    bfloat16) is taken by the parts that compare against a bare model (ON_DEVICE)."""
    if device != "cpu" and part not in ON_DEVICE:
        raise SystemExit(f"--device {device}: only the parts {', '.join(ON_DEVICE)} run on another device; pass --part")
    from extract.models import tiny
    from stimuli import get_family
    from stimuli.io import write_set

    if part in ("cast", "arrays"):  # no model, no stimuli
        if part == "cast":
            cast()
        else:
            with tempfile.TemporaryDirectory() as tmp:
                arrays(Path(tmp))
        return
    n = samples or (16 if quick else 200)
    rounds = rounds or 3
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        models = {arch: tiny.build(arch, root / arch, seed=0) for arch in ARCHS}
        g2m = get_family("g2m")
        config = g2m.config(grid_sizes=(4,), colors=(3,), image_size=224)
        small = write_set(g2m, config, n=n, seed=0, split="test", out=root / "g2m")
        if part in (None, "overhead"):
            overhead(root, models, small, n, rounds, device)
        if part in (None, "memory"):
            large = write_set(g2m, config, n=8 * n, seed=0, split="test", out=root / "g2m-8x")
            memory(root, models["qwen2_vl"], small, large, n)
        if part in (None, "connects"):
            connects(root, models["qwen2_vl"], small, n)
        if part in (None, "steps"):
            steps(root, models["qwen2_vl"], small, n)
        if part in (None, "steady"):
            steady(root, models, write_set(g2m, config, n=4 * n, seed=0, split="test", out=root / "g2m-4x"), n, rounds)
        if part in (None, "capture"):
            capture_cost(models, small, quick, device)
        if part in (None, "interference"):
            interference(models, small, quick)
        if part in (None, "warm"):
            warm(root, models, small, n, rounds, device)
    if part is None:
        cast()
        with tempfile.TemporaryDirectory() as tmp:
            arrays(Path(tmp))

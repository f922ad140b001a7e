"""Variant runs that record results rather than activations: head ablation, token compression.

Both register the run's stimuli and row map like any run and record the plain greedy answers
(head ablation) or the compressed-prefill answers (token compression) in ``generations``; head
ablation adds one ``head_ablations`` row per (stimulus, layer, head). A re-run resumes: stimuli
whose results are stored are skipped.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

import torch

from extract.generation import answer_length, stop_ids, stop_reason
from extract.interventions.compression import compress, greedy, load_decoder, punctuation_ids
from extract.interventions.heads import HeadSite, ablate, head_site
from extract.manifest import HeadAblationSpec, Manifest, ManifestError, TokenCompressionSpec, expand_layers
from extract.models import LoadedModel, prepare_batch
from extract.samples import Sample, by_modality, run_progress
from extract.scoring import score_answer
from store import Generation, RunInfo, Workspace


def run_variant(lm: LoadedModel, manifest: Manifest, sets: list[tuple[Path, str]], samples: list[Sample],
                where: str | Path | None, info: RunInfo, *, progress: bool = True
                ) -> tuple[Workspace, int, float | None]:
    """Run (or resume) a head-ablation or token-compression manifest: (workspace, computed, accuracy)."""
    spec = manifest.intervention
    sites = _sites(lm, spec) if isinstance(spec, HeadAblationSpec) else []
    if not sites:
        if not isinstance(spec, TokenCompressionSpec):
            raise ManifestError(f"this runner handles head ablation and token compression, not {type(spec).__name__}")
        decoder = load_decoder(lm, spec.decoder)
        dropped = punctuation_ids(lm.tokenizer) if spec.drop_punctuation else set()
    ws = Workspace.open(where)
    with ws.writer(info) as w:
        for path, dataset in sets:
            w.register_stimulus_set(path, dataset=dataset)
        w.set_samples([s.key for s in samples])
        done = _done(ws, manifest.run, sites, spec)
        todo = [(i, s) for i, s in enumerate(samples) if s.key not in done]
        bar = run_progress(len(todo), manifest.run, progress)
        correct = scored = 0
        step = manifest.batch_size if sites else 1
        for lo in range(0, len(todo), step):
            chunk = todo[lo : lo + step]
            for offset, group in by_modality([s for _, s in chunk]):
                rows = [i for i, _ in chunk[offset : offset + len(group)]]
                if sites:
                    assert isinstance(spec, HeadAblationSpec)  # sites come only from a head ablation
                    gens = _ablate_group(lm, ws, manifest, group, rows, sites, spec)
                else:
                    gens = [_compressed_answer(lm, manifest, s, spec, decoder, dropped) for s in group]
                for r, g in zip(rows, gens, strict=False):
                    w.record_generations(r, [g])
                scored += sum(g.correct is not None for g in gens)
                correct += sum(bool(g.correct) for g in gens)
            bar.update(len(chunk))
        bar.close()
        w.finish()
    return ws, len(todo), (correct / scored if scored else None)


# ------------------------------------------------------------------------------------------ head ablation

def _sites(lm: LoadedModel, spec: HeadAblationSpec) -> list[HeadSite]:
    try:
        layers = expand_layers(spec.layers, lm.adapter.n_layers(spec.tap))
    except ManifestError as err:
        raise ManifestError(f"intervention.layers: {err}") from None
    sites = [head_site(lm, spec.tap, layer) for layer in layers]
    if spec.heads != "all":
        bad = [h for h in spec.heads if not 0 <= h < sites[0].n_heads]
        if bad:
            raise ManifestError(f"intervention.heads: {bad} do not exist; {spec.tap} layers have heads 0..{sites[0].n_heads - 1}")
    return sites


def _done(ws: Workspace, run: str, sites: list[HeadSite], spec: Any) -> set[str]:
    """Stimuli whose results are stored. Head-ablation rows commit at once, the generation through
    the writer's queue a moment later: a stimulus is done only when both are there."""
    if sites:
        per_stimulus = sum(s.n_heads if spec.heads == "all" else len(spec.heads) for s in sites)
        rows = ws.rows(
            "SELECT h.stimulus, count(*) FROM head_ablations h JOIN generations g ON g.run = h.run"
            " AND g.stimulus = h.stimulus WHERE h.run = ? GROUP BY h.stimulus", [run])
        return {r[0] for r in rows if r[1] >= per_stimulus}
    return {r[0] for r in ws.rows("SELECT stimulus FROM generations WHERE run = ?", [run])}


def _ablate_group(lm: LoadedModel, ws: Workspace, manifest: Manifest, group: list[Sample], rows: list[int],
                  sites: list[HeadSite], spec: HeadAblationSpec) -> list[Generation]:
    forced = prepare_batch(lm, [s.image for s in group], [s.prompt for s in group],
                           answers=[s.answer for s in group], strings=[s.strings for s in group])
    found = ablate(lm, forced, sites, None if spec.heads == "all" else spec.heads)
    ws.record_head_ablations(manifest.run, [
        {**r, "stimulus": group[r["sample"]].key, "array_row": rows[r["sample"]]} for r in found
    ])
    return _greedy_answers(lm, manifest, group)


def _greedy_answers(lm: LoadedModel, manifest: Manifest, group: list[Sample]) -> list[Generation]:
    """The unablated model's greedy answers: the baseline the ablation is read against."""
    batch = prepare_batch(lm, [s.image for s in group], [s.prompt for s in group],
                          strings=[s.strings for s in group], padding_side="left")
    max_new = _max_new(manifest, group)
    with torch.inference_mode():
        seq = lm.model.generate(**batch.inputs, max_new_tokens=max_new, do_sample=False,
                                pad_token_id=lm.tokenizer.pad_token_id)
    new = seq[:, batch.seq_len :].cpu()
    stop = stop_ids(lm)
    out = []
    for b, s in enumerate(group):
        _, n_text = answer_length(new[b], stop, new.shape[1])
        text = lm.tokenizer.decode(new[b][:n_text], skip_special_tokens=True)
        g = score_answer(s.family, s.task, text, s.answer, s.truth, n_tokens=n_text)
        out.append(dataclasses.replace(g, stop_reason=stop_reason(new[b], n_text)))
    return out


def _max_new(manifest: Manifest, group: list[Sample]) -> int:
    max_new = manifest.generation.max_new_tokens
    if max_new == "from_stimulus":
        max_new = max(int(s.params.get("max_new_tokens", 32)) for s in group)
    return int(max_new)


# ------------------------------------------------------------------------------------------ token compression

def _compressed_answer(lm: LoadedModel, manifest: Manifest, s: Sample, spec: Any, decoder: torch.Tensor,
                       dropped: set[int]) -> Generation:
    batch = prepare_batch(lm, [s.image], [s.prompt], strings=[s.strings])
    c = compress(lm, batch, decoder, dropped, spec.keep)
    cap = _max_new(manifest, [s])
    ids = greedy(lm, c.embeds, cap, stop_ids(lm))
    text = lm.tokenizer.decode(ids, skip_special_tokens=True)
    g = score_answer(s.family, s.task, text, s.answer, s.truth, n_tokens=len(ids))
    # greedy() breaks before appending a stop id, so a full-length answer never saw one
    g = dataclasses.replace(g, stop_reason="eos" if len(ids) < cap else "cap")
    metrics = {**dict(g.metrics or {}), "retained_ratio": c.retained_ratio, "image_tokens": c.n_image,
               "kept_tokens": c.n_kept}
    return dataclasses.replace(g, metrics=metrics)

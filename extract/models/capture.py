"""Run a forward (or ``generate``) and keep only the requested taps at the requested tokens.

Hooks are registered only on the modules behind the requested taps and removed afterwards; each
hook copies only what is kept (e.g. the image and last-prompt positions of one LLM layer), so two
requested layers never cost the hidden states of every layer. Attention maps come from the
``"capture"`` attention implementation (:mod:`extract.models.compat`): every layer's output comes
from the model's own kernel, and requested layers compute weights beside it for the requested query
rows only (rows x keys memory, not keys x keys).

Everything is validated before the forward: unknown taps, layers, sites or token kinds raise
:class:`~extract.models.errors.TapError` listing what exists.
"""

from __future__ import annotations

import inspect
from collections import defaultdict
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

import numpy as np
import torch
from torch import nn

from .compat import ACTIVE_SINK, CAPTURE_ATTN, set_attention
from .errors import NonFiniteActivationError, TapError
from .inputs import Batch
from .layout import SampleLayout
from .loading import LoadedModel
from .taps import IMAGE_ONLY_TAPS, SITES, CaptureKey, TapSpec, check_kinds, kinds_for

TapLike = TapSpec | str | tuple
Taps = (Sequence[TapLike] | Sequence["Point"] | Mapping[str, Sequence[str]] | Mapping[TapSpec, Sequence[str]]
        | Mapping[tuple, Sequence[str]])


@dataclass(frozen=True, eq=False)
class RaggedTokens:
    """Per-sample token arrays of different lengths: row ``b`` is ``values[offsets[b]:offsets[b+1]]``.

    Rows are ``[tokens, dim]``; for attention ``[query_rows, heads, keys]``.
    """

    values: torch.Tensor
    offsets: np.ndarray

    def row(self, b: int) -> torch.Tensor:
        return self.values[int(self.offsets[b]) : int(self.offsets[b + 1])]

    def rows(self) -> list[torch.Tensor]:
        return [self.row(b) for b in range(len(self.offsets) - 1)]

    def cpu(self) -> RaggedTokens:
        return RaggedTokens(self.values.cpu(), self.offsets)


Captured = torch.Tensor | RaggedTokens


@dataclass
class CaptureResult:
    """What one batch produced.

    ``values[CaptureKey(tap, layer, site, kind)]`` is ``[batch, tokens, dim]`` (attention:
    ``[batch, heads, query_rows, keys]``), or :class:`RaggedTokens` when samples differ in token
    count. Layers are resolved (``-1`` became the last index). ``module_paths`` gives the raw module
    path behind each key. Tensors are on the CPU in the model's dtype.

    After :func:`capture_generate`, ``sequences`` holds prompt + generated ids, ``generated`` the
    generated ids and ``texts`` their decoding; ``answer`` tokens are the generated tokens that were
    fed back (all but the last), at positions ``batch.seq_len + k``.
    """

    values: dict[CaptureKey, Captured]
    layouts: list[SampleLayout]
    module_paths: dict[CaptureKey, str]
    nonfinite: list[CaptureKey] = field(default_factory=list)
    sequences: torch.Tensor | None = None
    generated: torch.Tensor | None = None
    texts: list[str] | None = None
    # With host_copy="async" on CUDA: the host copies of ``values`` are still in flight until this returns
    ready: Callable[[], None] | None = None

    def __getitem__(self, key: CaptureKey | tuple) -> Captured:
        return self.values[CaptureKey(*key)]

    def __contains__(self, key: object) -> bool:
        return isinstance(key, tuple) and CaptureKey(*key) in self.values

    def keys(self) -> Iterable[CaptureKey]:
        return self.values.keys()


# ------------------------------------------------------------------------------------------------
# hook points: taps -> module paths, validated before any forward
# ------------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Point:
    """One resolved tap: which module, which side of it, which token kinds are kept."""

    spec: TapSpec  # layer resolved to >= 0
    path: str
    on: Literal["output", "input", "attention"]
    kinds: tuple[str, ...]


def resolve_tap(lm: LoadedModel, tap: TapLike) -> TapSpec:
    """Validate a tap against the model and resolve a negative layer; TapError lists valid values."""
    spec = TapSpec.coerce(tap)
    ad = lm.adapter
    sites = ad.sites(spec.tap)
    if spec.site not in sites:
        raise TapError(
            f"{ad.family} has no site {spec.site!r} for tap {spec.tap!r}: valid sites are {', '.join(sites)}"
        )
    n = ad.n_layers(spec.tap)
    if not -n <= spec.layer < n:
        valid = f"valid layers are 0..{n - 1} (or -{n}..-1)" if n > 1 else "the only layer is 0 (or -1)"
        raise TapError(f"{ad.family} has no {spec.tap} layer {spec.layer}: {valid}")
    layer = spec.layer % n
    if spec.site == "pre_merger" and layer != n - 1:
        raise TapError(
            f"site 'pre_merger' is the merger input, i.e. after the last vision block: use layer -1 (or {n - 1}),"
            f" got {spec.layer}"
        )
    return TapSpec(spec.tap, layer, spec.site)


def hook_module(lm: LoadedModel, spec: TapSpec) -> tuple[str, Literal["output", "input", "attention"]]:
    """Module path behind a resolved tap, and which side of the module is read."""
    ad, i = lm.adapter, spec.layer
    if spec.tap == "vision":
        return (ad.projector, "input") if spec.site == "pre_merger" else (f"{ad.vision_layers}.{i}", "output")
    if spec.tap == "projector":
        return ad.projector, "input" if spec.site == "in" else "output"
    if spec.tap == "llm":
        return f"{ad.llm_layers}.{i}", "output"
    if spec.tap == "attn":
        return f"{ad.llm_layers}.{i}.{ad.llm_attention}", "attention"
    return ad.lm_head, "output"


def hook_points(lm: LoadedModel) -> dict[str, str]:
    """Every hook point of the model: normalised name -> raw module path (for manifests and docs)."""
    out = {}
    for tap in SITES:
        n = lm.adapter.n_layers(tap)
        for site in lm.adapter.sites(tap):
            for layer in [n - 1] if site == "pre_merger" else range(n):
                spec = TapSpec(tap, layer, site)
                out[spec.name] = hook_module(lm, spec)[0]
    return out


def resolve_points(lm: LoadedModel, taps: Taps, kinds: Sequence[str]) -> list[Point]:
    """Resolve and validate the requested taps before any forward.

    ``taps`` is a list (every tap keeps ``kinds``) or a mapping tap -> its own token kinds.
    A tap requested twice keeps the union of its kinds. Points resolved before (a run resolves its taps
    once, not per batch) are returned as they are.
    """
    if not taps:
        raise TapError("no taps requested: pass e.g. ['vision.-1', 'llm.0', 'projector.0.out']")
    if not isinstance(taps, Mapping) and all(isinstance(t, Point) for t in taps):
        return [t for t in taps if isinstance(t, Point)]
    if isinstance(taps, Mapping):
        requests = [(tap, check_kinds(tuple(k))) for tap, k in taps.items()]
        for tap, k in requests:
            spec = TapSpec.coerce(tap)
            if spec.tap in IMAGE_ONLY_TAPS and k != ("image",):
                raise TapError(f"tap {spec.name} has image tokens only (it runs before the prompt): use ['image'], got {list(k)}")
    else:
        default = check_kinds(tuple(kinds))
        requests = []
        for one in taps:
            if isinstance(one, Point):
                raise TapError("pass either resolved points only, or tap names/specs only, not a mix of both")
            requests.append((one, default))
    points: dict[TapSpec, Point] = {}
    for tap, wanted in requests:
        spec = resolve_tap(lm, tap)
        path, on = hook_module(lm, spec)
        try:
            lm.model.get_submodule(path)
        except AttributeError as err:
            raise TapError(
                f"{lm.adapter.family}: module {path!r} for tap {spec.name} is missing in this model;"
                f" the adapter {type(lm.adapter).__name__} does not match its structure ({err})"
            ) from None
        previous = points[spec].kinds if spec in points else ()
        points[spec] = Point(spec, path, on, tuple(dict.fromkeys(previous + kinds_for(spec.tap, wanted))))
    return list(points.values())


# ------------------------------------------------------------------------------------------------
# token positions -> gather indices
# ------------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Gather:
    """The positions of one token kind in a batch, with per-sample offsets.

    ``span`` is ``(start, count)`` when every sample's positions are the same run of ``count``
    positions from ``start`` (one image per sample behind the same prompt: the usual batch); a
    slice then takes them. Otherwise ``rows``/``cols`` are the flat (batch row, position) pairs of
    an index gather, which costs several times a slice's dispatch at small batches.
    """

    offsets: np.ndarray
    uniform: int | None  # the count every sample has, None when they differ
    span: tuple[int, int] | None
    rows: torch.Tensor | None  # None when ``span`` is set
    cols: torch.Tensor | None


def gather_positions(layouts: list[SampleLayout], kind: str, device: torch.device) -> Gather:
    pos = [lay.positions(kind) for lay in layouts]
    n = pos[0].size if pos else 0
    if n and all(p.size == n for p in pos):
        start, stop = int(pos[0][0]), int(pos[0][-1])
        # Positions increase and never repeat (SampleLayout), so equal ends make equal runs.
        if stop == start + n - 1 and all(int(p[0]) == start and int(p[-1]) == stop for p in pos[1:]):
            return Gather(np.arange(len(pos) + 1, dtype=np.int64) * n, n, (start, n), None, None)
    counts = [p.size for p in pos]
    rows = np.repeat(np.arange(len(pos)), counts)
    cols = np.concatenate(pos) if pos else np.zeros(0, np.int64)
    return Gather(
        np.concatenate([[0], np.cumsum(counts)]).astype(np.int64),
        counts[0] if counts and counts.count(counts[0]) == len(counts) else None,
        None,
        torch.as_tensor(rows, dtype=torch.long, device=device),
        torch.as_tensor(cols, dtype=torch.long, device=device),
    )


def _take(x: torch.Tensor, g: Gather, dim: int, shift: int = 0) -> Captured:
    """The positions of ``g`` along ``dim`` of ``x`` (batch first; ``shift``: how many leading
    positions ``x`` lacks), copied: ``[B, ..., n at dim, ...]``, or ragged rows of ``[n_b, ...]``
    with ``dim``'s axis moved first."""
    if g.span is not None:
        # a copy of its own: the module's output may be freed or reused once the forward moves on
        return x.narrow(dim, g.span[0] - shift, g.span[1]).clone(memory_format=torch.contiguous_format)
    assert g.rows is not None and g.cols is not None
    cols = g.cols - shift if shift else g.cols
    index: tuple[torch.Tensor | slice, ...] = (g.rows, *[slice(None)] * (dim - 1), cols)
    flat = x[index]  # [N, ...]: the gathered axis first
    n = g.uniform
    if n is None:
        return RaggedTokens(flat, g.offsets)
    packed = flat.reshape(len(g.offsets) - 1, n, *flat.shape[1:])
    return packed.movedim(1, dim) if dim != 1 else packed


def _onto(g: Gather, per: list[np.ndarray], device: torch.device) -> Gather:
    """``g`` re-indexed onto each sample's query rows ``per[b]`` (sorted positions that include all of ``g``'s
    positions of sample ``b``): a span of consecutive positions is consecutive among the rows too, so it stays
    a span where it starts at the same row in every sample; anything else becomes (batch row, row) pairs."""
    if g.span is not None:
        start, n = g.span
        firsts = [int(np.searchsorted(p, start)) for p in per]
        if len(set(firsts)) == 1:
            return Gather(g.offsets, g.uniform, (firsts[0], n), None, None)
        batch = np.repeat(np.arange(len(per)), n)
        cols = np.concatenate([np.arange(f, f + n) for f in firsts])
    else:
        assert g.rows is not None and g.cols is not None
        batch, positions = g.rows.cpu().numpy(), g.cols.cpu().numpy()
        cols = np.array([np.searchsorted(per[b], c) for b, c in zip(batch, positions, strict=True)], dtype=np.int64)
    return Gather(g.offsets, g.uniform, None, torch.as_tensor(batch, dtype=torch.long, device=device),
                  torch.as_tensor(cols, dtype=torch.long, device=device))


def _reaches_before(g: Gather, position: int) -> bool:
    """Whether ``g`` takes any position before ``position``."""
    if g.span is not None:
        return g.span[0] < position
    assert g.cols is not None
    return bool((g.cols < position).any())


def _stack(per_sample: list[torch.Tensor]) -> Captured:
    if len({t.shape[0] for t in per_sample}) == 1:
        joined = _adjacent(per_sample)
        return torch.stack(per_sample) if joined is None else joined
    offsets = np.concatenate([[0], np.cumsum([t.shape[0] for t in per_sample])]).astype(np.int64)
    return RaggedTokens(torch.cat(per_sample), offsets)


def _adjacent(pieces: list[torch.Tensor]) -> torch.Tensor | None:
    """``torch.stack(pieces)`` as a view, when the pieces are equal, contiguous and back to back in one
    buffer (an adapter's ``split`` of the one gather the hook made), else None: a hook copies once."""
    first = pieces[0]
    step = first.numel() * first.element_size()
    storage = first.untyped_storage().data_ptr()
    for i, t in enumerate(pieces):
        if (t.shape != first.shape or t.dtype != first.dtype or not t.is_contiguous()
                or t.untyped_storage().data_ptr() != storage or t.data_ptr() != first.data_ptr() + i * step):
            return None
    return first.as_strided((len(pieces), *first.shape), (first.numel(), *first.stride()), first.storage_offset())


def _first(output: Any) -> torch.Tensor:
    return output[0] if isinstance(output, (tuple, list)) else output


def key_aligned(row: torch.Tensor, n_keys: int) -> torch.Tensor:
    """One query's weights ``[..., keys]`` laid out over key positions ``0..n_keys - 1`` (the query's own
    position is ``n_keys - 1``).

    The cache decides which keys a decode step sees. A sliding-window layer of a dynamic cache (Gemma3,
    Gemma2, Mistral, Qwen2 with ``use_sliding_window``), and a full static sliding-window buffer, hand it
    only the last ``K < n_keys`` positions: they are ``n_keys - K .. n_keys - 1``, and the keys before them
    get weight 0 (left zero padding). A static buffer longer than the sequence starts at position 0 and
    its slots past the query are masked to weight 0: they are dropped.
    """
    k = row.shape[-1]
    if k < n_keys:
        return torch.nn.functional.pad(row, (n_keys - k, 0))
    return row[..., :n_keys]


# ------------------------------------------------------------------------------------------------
# the recorder: hooks + attention sink
# ------------------------------------------------------------------------------------------------
class Recorder:
    """Registers the hooks of resolved points on a model and collects what they keep.

    Step 0 is the prompt (prefill); later steps are generation steps with one new token each,
    whose outputs are kept as ``answer`` tokens.
    """

    def __init__(self, lm: LoadedModel, batch: Batch, points: list[Point], base_implementation: str) -> None:
        self.lm, self.batch, self.points = lm, batch, points
        self.base_implementation = base_implementation
        self.step = -1
        self.seq_len = batch.seq_len
        device = lm.device
        kinds = {k for p in points for k in p.kinds}
        self.gathers = {k: gather_positions(batch.layouts, k, device) for k in kinds}
        self.prefill: dict[CaptureKey, Captured] = {}
        self.steps: dict[CaptureKey, list[torch.Tensor]] = defaultdict(list)
        self.attn_modules: dict[int, Point] = {}
        self._unions: dict[tuple[str, ...], tuple[torch.Tensor, dict[str, Gather]]] = {}
        self.handles: list[Any] = []

    # -- attention sink protocol (compat._capture_attention) --
    def wants(self, module: nn.Module) -> bool:
        return id(module) in self.attn_modules

    def _prompt_kinds(self, point: Point) -> tuple[str, ...]:
        # generation: answer rows come from the decode steps, not the prompt pass
        return tuple(k for k in point.kinds if not (k == "answer" and self.batch.answers is None))

    def query_rows(self, module: nn.Module, q_len: int) -> torch.Tensor | None:
        """The query indices whose weights this step keeps: at the prompt pass the positions of the point's
        token kinds (:meth:`_rows`), at a decode step its one query when answers are kept; empty: none."""
        point = self.attn_modules[id(module)]
        if self.step == 0:
            if q_len != self.seq_len:
                return None  # not the whole prompt in one pass: record() says why it refuses
            kinds = self._prompt_kinds(point)
            return self._rows(kinds)[0] if kinds else torch.zeros(0, dtype=torch.long, device=self.lm.device)
        if "answer" in point.kinds:
            return torch.full((1,), q_len - 1, dtype=torch.long, device=self.lm.device)
        return torch.zeros(0, dtype=torch.long, device=self.lm.device)

    def _rows(self, kinds: tuple[str, ...]) -> tuple[torch.Tensor, dict[str, Gather]]:
        """The query rows of ``kinds`` at the prompt pass, and each kind's gather over those rows.

        Rows are ``[R]`` when every sample keeps the same positions (one prompt layout), else ``[B, R]``
        per sample (left padding shifts each sample's image tokens): a union over the batch would grow with
        the batch. A sample with fewer rows repeats its last one (computed twice, read once)."""
        if kinds not in self._unions:
            per = [np.unique(np.concatenate([lay.positions(k) for k in kinds])) for lay in self.batch.layouts]
            device = self.lm.device
            if all(np.array_equal(p, per[0]) for p in per):
                rows = torch.as_tensor(per[0], dtype=torch.long, device=device)
            else:
                width = max(p.size for p in per)
                padded = [np.concatenate([p, np.full(width - p.size, p[-1] if p.size else 0, dtype=p.dtype)])
                          for p in per]
                rows = torch.as_tensor(np.stack(padded), dtype=torch.long, device=device)
            self._unions[kinds] = (rows, {k: _onto(self.gathers[k], per, device) for k in kinds})
        return self._unions[kinds]

    def record(self, module: nn.Module, weights: torch.Tensor, rows: torch.Tensor | None = None) -> None:
        point = self.attn_modules[id(module)]
        spec = point.spec
        w = weights.detach()
        gathers = self.gathers if rows is None or self.step != 0 else self._rows(self._prompt_kinds(point))[1]
        if self.step == 0:
            if w.shape[-1] < self.seq_len:
                raise TapError(
                    f"{spec.name}: the prompt pass saw {w.shape[-1]} of the prompt's {self.seq_len} keys (chunked"
                    " prefill?): attention rows need the whole prompt in one pass; drop prefill_chunk_size"
                )
            w = w[..., : self.seq_len]  # a static cache's buffer runs past the prompt (weights there are 0)
            for kind in self._prompt_kinds(point):
                # [B, H, Tq, K] (or the R selected rows) -> [B, H, n, K] (ragged: [N, H, K])
                self.prefill[spec.key(kind)] = _take(w, gathers[kind], dim=2)
        elif "answer" in point.kinds:
            # step k's query sits at position seq_len + k - 1 and sees keys 0..seq_len + k - 1
            row = key_aligned(w[:, :, -1, :], self.seq_len + self.step)
            self.steps[spec.key("answer")].append(row)

    # -- hooks --
    def _store_sequence(self, point: Point, x: torch.Tensor) -> None:
        spec = point.spec
        if self.step == 0:
            # generate() may compute logits for the last position only (logits_to_keep)
            shift = self.seq_len - x.shape[1]
            for kind in point.kinds:
                if kind == "answer" and self.batch.answers is None:
                    continue
                g = self.gathers[kind]
                if shift and _reaches_before(g, shift):
                    raise TapError(
                        f"{spec.name}: the model computed this tap only for the last {x.shape[1]} positions;"
                        f" token kind {kind!r} needs earlier ones (during generate, logits exist for 'last' and 'answer')"
                    )
                self.prefill[spec.key(kind)] = _take(x.detach(), g, dim=1, shift=shift)
        elif "answer" in point.kinds:
            self.steps[spec.key("answer")].append(x[:, -1].detach())

    def _store_image(self, point: Point, x: torch.Tensor) -> None:
        spec = point.spec
        key = spec.key("image")
        # The vision tower runs once per generate, and some families (Qwen2-VL) run it while
        # preparing inputs, before the first model forward (step -1): keep its first call.
        if self.step > 0 or key in self.prefill:
            return
        ad, views, aux = self.lm.adapter, self.batch.views, self.batch.aux
        if spec.tap == "vision":
            fn = ad.pre_merger_tokens if spec.site == "pre_merger" else ad.vision_tokens
        else:
            fn = ad.projector_in_tokens if spec.site == "in" else ad.projector_out_tokens
        self.prefill[key] = _stack([t.detach() for t in fn(x.detach(), views, aux)])

    def _hook(self, points: list[Point]) -> Any:
        def store(x: torch.Tensor) -> None:
            for point in points:
                if point.spec.tap in IMAGE_ONLY_TAPS:
                    self._store_image(point, x)
                else:
                    self._store_sequence(point, x)

        if points[0].on == "input":
            return lambda module, args, kwargs: store(args[0] if args else next(iter(kwargs.values())))
        return lambda module, args, kwargs, output: store(_first(output))

    def __enter__(self) -> Recorder:
        model = self.lm.model
        groups: dict[tuple[str, str], list[Point]] = defaultdict(list)
        for p in self.points:
            if p.on == "attention":
                self.attn_modules[id(_submodule(model, p.path))] = p
            else:
                groups[(p.path, p.on)].append(p)

        def count_step(module: nn.Module, args: Any, kwargs: Any) -> None:
            self.step += 1

        try:
            self.handles.append(model.register_forward_pre_hook(count_step, with_kwargs=True))
            for (path, on), pts in groups.items():
                module = _submodule(model, path)
                if on == "input":
                    self.handles.append(module.register_forward_pre_hook(self._hook(pts), with_kwargs=True))
                else:
                    self.handles.append(module.register_forward_hook(self._hook(pts), with_kwargs=True))
            self._token = ACTIVE_SINK.set(self) if self.attn_modules else None
        except BaseException:
            self._remove()
            raise
        return self

    def _remove(self) -> None:
        for h in self.handles:
            h.remove()
        self.handles.clear()

    def __exit__(self, *exc: Any) -> None:
        self._remove()
        if self._token is not None:
            ACTIVE_SINK.reset(self._token)

    # -- results --
    def collect(self) -> dict[CaptureKey, Captured]:
        out = dict(self.prefill)
        for key, steps in self.steps.items():
            if key.tap == "attn":
                width = steps[-1].shape[-1]  # step k has seq_len + k keys: pad earlier rows on the right
                steps = [torch.nn.functional.pad(s, (0, width - s.shape[-1])) for s in steps]
                out[key] = torch.stack(steps, dim=2)  # [B, H, steps, K]
            else:
                out[key] = torch.stack(steps, dim=1)  # [B, steps, D]
        return out


def _submodule(model: nn.Module, path: str) -> nn.Module:
    """``model.get_submodule(path)`` by the registered-children dicts: ~50x faster (each level of
    ``get_submodule`` is a ``hasattr`` and a ``getattr`` that miss the instance first), which counts
    when a batch of one registers its hooks. Anything else (a missing name) goes to ``get_submodule``,
    which raises as it does."""
    module = model
    for name in path.split(".") if path else ():
        child = module._modules.get(name)
        if child is None:
            return model.get_submodule(path)
        module = child
    return module


# ------------------------------------------------------------------------------------------------
# public entry points
# ------------------------------------------------------------------------------------------------
def _check_request(batch: Batch, points: list[Point], generating: bool) -> None:
    wants_answer = any("answer" in p.kinds for p in points)
    if wants_answer and not generating and batch.answers is None:
        raise TapError(
            "token kind 'answer' needs answer tokens: build the batch with prepare_batch(..., answers=[...])"
            " (teacher forcing) or use capture_generate"
        )
    if generating and batch.answers is not None:
        raise TapError("capture_generate takes a batch without answers: the answers are what it generates")
    if generating and batch.padding_side != "left" and batch.size > 1:
        raise TapError("batched generation needs left padding: build the batch with prepare_batch(..., padding_side='left')")


def _all_finite(tensors: list[torch.Tensor]) -> list[bool]:
    """Whether each tensor is free of NaN/inf, with one device sync. A float32 sum is NaN/inf whenever
    a value is, and is ~10x cheaper than ``isfinite(t).all()`` (no bool tensor); a sum that overflows
    on finite values is settled by the exact check."""
    if not tensors:
        return []
    sums = torch.stack([t.sum(dtype=torch.float32) if t.is_floating_point() else t.new_zeros((), dtype=torch.float32)
                        for t in tensors])
    flags = torch.isfinite(sums).tolist()
    return [ok or bool(torch.isfinite(t).all()) for t, ok in zip(tensors, flags, strict=True)]


def _finish(lm: LoadedModel, rec: Recorder, on_nonfinite: str,
            host_copy: str = "sync") -> tuple[dict, list[CaptureKey], Callable[[], None] | None]:
    values = rec.collect()
    tensors = {k: (v.values if isinstance(v, RaggedTokens) else v) for k, v in values.items()}
    flags = _all_finite(list(tensors.values()))
    bad = [k for k, ok in zip(tensors, flags, strict=False) if not ok]
    if bad and on_nonfinite == "raise":
        raise NonFiniteActivationError(
            f"NaN/inf in captured activations {', '.join(k.name for k in bad)} of {lm.source}"
            f" (dtype {lm.dtype}): fp16 overflow is the usual cause; load with dtype='float32' or 'bfloat16',"
            " or pass on_nonfinite='flag' to keep the values and record the keys"
        )
    if host_copy == "async" and lm.device.type == "cuda":
        host, ready = _copy_to_host(values, lm.device)
        return host, bad, ready
    return {k: v.cpu() for k, v in values.items()}, bad, None  # on the CPU: the tensors themselves, no copy


_COPY_STREAMS: dict[torch.device, Any] = {}


def _copy_to_host(values: dict[CaptureKey, Captured], device: torch.device
                  ) -> tuple[dict[CaptureKey, Captured], Callable[[], None]]:
    """Start copying ``values`` into pinned host memory on a side stream; the returned callable waits for it.

    The copy runs while the caller prepares and runs the next batch on the compute stream. Pinned blocks
    come from torch's caching host allocator, so they are reused once the store lets go of a batch.
    """
    stream = _COPY_STREAMS.get(device)
    if stream is None:
        stream = _COPY_STREAMS[device] = torch.cuda.Stream(device)
    stream.wait_stream(torch.cuda.current_stream(device))  # the copy starts after the forward wrote them

    def host(t: torch.Tensor) -> torch.Tensor:
        pinned = torch.empty(t.shape, dtype=t.dtype, pin_memory=True)
        pinned.copy_(t, non_blocking=True)
        t.record_stream(stream)  # the allocator must not hand t's memory to the next batch before the copy
        return pinned

    out: dict[CaptureKey, Captured] = {}
    with torch.cuda.stream(stream):
        for k, v in values.items():
            out[k] = RaggedTokens(host(v.values), v.offsets) if isinstance(v, RaggedTokens) else host(v)
        done = torch.cuda.Event()
        done.record(stream)
    return out, done.synchronize


class _attention_mode:
    """Switch to the "capture" attention implementation while attention taps are recorded."""

    def __init__(self, lm: LoadedModel, points: list[Point]) -> None:
        self.lm = lm
        self.active = any(p.on == "attention" for p in points)
        self.previous = lm.model.config._attn_implementation

    @property
    def base(self) -> str:
        return self.previous if self.previous in ("eager", "sdpa") else "sdpa"

    def __enter__(self) -> _attention_mode:
        if self.active and self.previous != CAPTURE_ATTN:
            set_attention(self.lm.model, CAPTURE_ATTN)
        return self

    def __exit__(self, *exc: Any) -> None:
        if self.active and self.previous != CAPTURE_ATTN:
            set_attention(self.lm.model, self.previous)


_ACCEPTS: dict[tuple[type, str], bool] = {}


def _accepts(model: nn.Module, name: str) -> bool:
    key = (type(model), name)  # inspect.signature per batch costs more than a small forward's hooks
    if key not in _ACCEPTS:
        _ACCEPTS[key] = name in inspect.signature(model.forward).parameters
    return _ACCEPTS[key]


def capture(
    lm: LoadedModel,
    batch: Batch,
    taps: Taps,
    tokens: Sequence[str] = ("image", "last"),
    *,
    on_nonfinite: Literal["raise", "flag"] = "raise",
) -> CaptureResult:
    """One forward over ``batch`` (teacher-forced when it has answers), keeping ``taps`` at ``tokens``.

    ``taps`` is a list of names / TapSpecs / tuples, each kept at ``tokens``, or a mapping from tap to
    its own token kinds (as a manifest gives them: ``{"llm.3": ["image", "last"], "attn.3": ["last"]}``).
    Token kinds apply to LLM-sequence taps (llm, attn query rows, logits); vision and projector taps
    always yield the image's tokens, raster-ordered per the batch layouts.
    """
    points = resolve_points(lm, taps, tokens)
    _check_request(batch, points, generating=False)
    kwargs: dict[str, Any] = dict(batch.inputs, use_cache=False)
    if not any(p.spec.tap == "logits" for p in points) and _accepts(lm.model, "logits_to_keep"):
        kwargs["logits_to_keep"] = 1  # the LM head over every position is wasted work
    with _attention_mode(lm, points) as mode, Recorder(lm, batch, points, mode.base) as rec, torch.inference_mode():
        lm.model(**kwargs)
    values, bad, _ = _finish(lm, rec, on_nonfinite)
    return CaptureResult(values, batch.layouts, {_key(p, k): p.path for p in points for k in p.kinds}, bad)


def capture_generate(
    lm: LoadedModel,
    batch: Batch,
    taps: Taps,
    tokens: Sequence[str] = ("image", "last", "answer"),
    *,
    max_new_tokens: int = 32,
    on_nonfinite: Literal["raise", "flag"] = "raise",
    host_copy: Literal["sync", "async"] = "sync",
    **generate_kwargs: Any,
) -> CaptureResult:
    """Greedy ``generate`` (unless ``generate_kwargs`` say otherwise) keeping ``taps``.

    The prompt pass yields ``image``/``last`` tokens; every later step adds its fed-back token to
    ``answer`` (``[batch, steps, dim]``; attention rows ``[batch, heads, steps, keys]``, keys
    zero-padded to the final length). Rows that finished early keep producing pad tokens.

    ``host_copy="async"``: on CUDA the values are copied into pinned host memory on a side stream, so the
    copy overlaps whatever the caller runs next; call ``result.ready()`` before reading them. On any other
    device the values are the captured tensors themselves and ``ready`` is None.

    ``generate``'s automatic ``torch.compile`` is off (``disable_compile``): the hooks need every step's
    own tensors.
    """
    points = resolve_points(lm, taps, tokens)
    _check_request(batch, points, generating=True)
    _check_generate_logits(points)
    gen = dict(do_sample=False, max_new_tokens=max_new_tokens)
    gen.update(generate_kwargs)
    # On CUDA, generate() compiles the forward of a static cache into CUDA graphs; a replay reuses
    # its output buffers, so a hook's tensor of one step is overwritten by the next. Each step runs eagerly.
    gen["disable_compile"] = True
    with _attention_mode(lm, points) as mode, Recorder(lm, batch, points, mode.base) as rec, torch.inference_mode():
        sequences = lm.model.generate(**batch.inputs, **gen)
    values, bad, ready = _finish(lm, rec, on_nonfinite, host_copy)
    generated = sequences[:, batch.seq_len :].cpu()
    texts = lm.processor.tokenizer.batch_decode(generated, skip_special_tokens=True)
    paths = {_key(p, k): p.path for p in points for k in p.kinds}
    layouts = _fed_layouts(batch, max(generated.shape[1] - 1, 0))
    return CaptureResult(values, layouts, paths, bad, sequences.cpu(), generated, texts, ready)


def _fed_layouts(batch: Batch, n_fed: int) -> list[SampleLayout]:
    """The batch's layouts with the ``n_fed`` generated tokens that were fed back as answer positions."""
    if n_fed == 0 and all(lay.answer_positions.size == 0 for lay in batch.layouts):
        return list(batch.layouts)  # nothing fed back (prompt-only): the layouts as they are
    return [
        SampleLayout(
            geometry=lay.geometry,
            image_positions=lay.image_positions,
            last_position=lay.last_position,
            answer_positions=np.arange(batch.seq_len, batch.seq_len + n_fed, dtype=np.int64),
            first_position=lay.first_position,
            length=lay.length,
        )
        for lay in batch.layouts
    ]


def _key(point: Point, kind: str) -> CaptureKey:
    return point.spec.key(kind)


# ------------------------------------------------------------------------------------------------
# prompt-only generation: the one new token of a greedy generate, from a single forward
# ------------------------------------------------------------------------------------------------
# Settings of a generation config that make greedy generate's first token something other than the
# argmax of the prompt's last logits (each adds a logits processor, or a decoding mode, that can move it),
# with the value at which it is inert.
_INERT: dict[str, Any] = {
    "guidance_scale": (None, 1, 1.0), "sequence_bias": (None,), "encoder_repetition_penalty": (None, 1.0),
    "repetition_penalty": (None, 1.0), "no_repeat_ngram_size": (None, 0), "encoder_no_repeat_ngram_size": (None, 0),
    "bad_words_ids": (None,), "min_length": (None, 0), "min_new_tokens": (None, 0),
    "forced_bos_token_id": (None,), "forced_eos_token_id": (None,), "remove_invalid_values": (None, False),
    "exponential_decay_length_penalty": (None,), "suppress_tokens": (None,), "begin_suppress_tokens": (None,),
    "watermarking_config": (None,), "num_beams": (None, 1), "penalty_alpha": (None,), "assistant_model": (None,),
    "prompt_lookup_num_tokens": (None,),
}


def forward_answer_blockers(lm: LoadedModel) -> list[str]:
    """Why one forward's argmax would not be greedy ``generate``'s first token for this model: the
    generation-config settings that add a logits processor or change the decoding mode (empty: none)."""
    config = getattr(lm.model, "generation_config", None)
    if config is None:
        return []
    out = []
    for name, inert in _INERT.items():
        value = getattr(config, name, None)
        if not any(value is v or (v is not None and value == v) for v in inert):
            out.append(f"generation_config.{name}={value!r}")
    return out


def _check_generate_logits(points: list[Point]) -> None:
    for p in points:
        if p.spec.tap == "logits" and "image" in p.kinds:
            # generate() asks the model for the last position's logits only (logits_to_keep=1)
            raise TapError(
                "during generate, logits exist only for the last prompt token and the answer tokens (the model"
                " computes the last position's logits only): request tokens=('last', 'answer') for the logits tap"
            )


def capture_first_token(
    lm: LoadedModel,
    batch: Batch,
    taps: Taps,
    tokens: Sequence[str] = ("image", "last", "answer"),
    *,
    on_nonfinite: Literal["raise", "flag"] = "raise",
    host_copy: Literal["sync", "async"] = "sync",
) -> CaptureResult:
    """What :func:`capture_generate` with ``max_new_tokens=1`` returns, from one forward and no ``generate``.

    The one new token is the argmax of the prompt's last logits (greedy, as generate picks it, in float32);
    no token is fed back, so ``answer`` rows are empty (absent, as after such a generate). Only valid when
    :func:`forward_answer_blockers` is empty: callers check it. ``host_copy`` as for :func:`capture_generate`.
    """
    points = resolve_points(lm, taps, tokens)
    _check_request(batch, points, generating=True)
    _check_generate_logits(points)
    kwargs: dict[str, Any] = dict(batch.inputs, use_cache=False)
    if _accepts(lm.model, "logits_to_keep"):
        kwargs["logits_to_keep"] = 1
    with _attention_mode(lm, points) as mode, Recorder(lm, batch, points, mode.base) as rec, torch.inference_mode():
        out = lm.model(**kwargs)
        generated = torch.argmax(out.logits[:, -1, :].float(), dim=-1, keepdim=True)
    values, bad, ready = _finish(lm, rec, on_nonfinite, host_copy)
    generated = generated.cpu()
    sequences = torch.cat([batch.inputs["input_ids"].cpu(), generated], dim=1)
    texts = lm.processor.tokenizer.batch_decode(generated, skip_special_tokens=True)
    paths = {_key(p, k): p.path for p in points for k in p.kinds}
    return CaptureResult(values, _fed_layouts(batch, 0), paths, bad, sequences, generated, texts, ready)

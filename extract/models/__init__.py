"""The model side of extraction: load a VLM, name its hook points, capture what a run keeps.

Typical use (a runner does this per batch of stimuli)::

    from extract.models import load_model, prepare_batch, capture, capture_generate, readout

    lm = load_model("path/or/hub-id", dtype="bfloat16")          # adapter chosen by model_type
    batch = prepare_batch(lm, images, prompts, answers=answers)  # chat template + positions
    res = capture(lm, batch, ["vision.-1.pre_merger", "projector.0.out", "llm.3", "attn.3"],
                  tokens=("image", "last", "answer"))
    res[("llm", 3, "resid_post", "image")]   # [batch, image tokens, hidden], raster order
    res.layouts[0].geometry.llm              # the patch grid those tokens form
    lens = readout(lm)                       # unembedding + final norm for an offline logit lens

See docs/adapters.md for the tap vocabulary and how to add an architecture family.
"""

from .adapters import Adapter, adapter_class, adapter_for, register, supported
from .capture import (
    CaptureResult,
    RaggedTokens,
    capture,
    capture_first_token,
    capture_generate,
    forward_answer_blockers,
    hook_points,
    resolve_points,
    resolve_tap,
)
from .errors import (
    ConfigGeometryError,
    InputError,
    ModelError,
    ModelNotFoundError,
    NonFiniteActivationError,
    TapError,
    UnknownArchitectureError,
    UntrustedCodeError,
)
from .inputs import Batch, open_image, prepare_batch
from .layout import GridSegment, ImageGeometry, SampleLayout
from .loading import LoadedModel, load_model
from .readout import FinalNorm, Readout, readout
from .taps import SITES, TAPS, TOKEN_KINDS, CaptureKey, TapSpec

__all__ = [
    "Adapter", "Batch", "CaptureKey", "CaptureResult", "ConfigGeometryError", "FinalNorm", "GridSegment",
    "ImageGeometry", "InputError", "LoadedModel", "ModelError", "ModelNotFoundError", "NonFiniteActivationError",
    "RaggedTokens", "Readout",
    "SITES", "SampleLayout", "TAPS", "TOKEN_KINDS", "TapError", "TapSpec", "UnknownArchitectureError", "UntrustedCodeError",
    "adapter_class", "adapter_for", "capture", "capture_first_token", "capture_generate", "forward_answer_blockers",
    "hook_points", "load_model", "open_image", "resolve_points",
    "prepare_batch", "readout", "register", "resolve_tap", "supported",
]

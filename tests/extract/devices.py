"""Which device and dtype the extraction tests load models with, and the tolerances that go with it.

``AGNOSIA_TEST_DEVICE`` (default ``cpu``) and ``AGNOSIA_TEST_DTYPE`` (default ``float32``) let the
same tests run on an accelerator in reduced precision, e.g. ``AGNOSIA_TEST_DEVICE=cuda
AGNOSIA_TEST_DTYPE=bfloat16 pytest tests/extract`` (bench/gpu_check.sh does this on a GPU machine).
Every test that loads a model goes through :func:`load`; comparisons between a capture and
transformers' own outputs go through :func:`close` / :func:`allclose`, which keep the fp32 tolerance
for fp32 runs and use a bound fitted to the reduced dtype otherwise (below).
"""

from __future__ import annotations

import json
import os
from typing import Any

import numpy as np
import torch

DEVICE = os.environ.get("AGNOSIA_TEST_DEVICE", "cpu").strip() or "cpu"
DTYPE = os.environ.get("AGNOSIA_TEST_DTYPE", "float32").strip() or "float32"
_ALIASES = {"fp32": "float32", "fp16": "float16", "bf16": "bfloat16"}
DTYPE = _ALIASES.get(DTYPE, DTYPE)
if DTYPE not in ("float32", "float16", "bfloat16"):
    raise ValueError(f"AGNOSIA_TEST_DTYPE={DTYPE!r}: expected float32, float16 or bfloat16")
REDUCED = DTYPE != "float32"

# Reduced precision: values that went through the same network twice with different roundings
# (attention rows come from eager code where a reference runs sdpa; a KV-cache step is not shaped like a
# teacher-forced pass) differ by rounding noise that accumulates over the layers and scales with the
# tensor's magnitude, not with each element's. So the bound is relative to the largest reference
# value: |actual - expected| <= REL * (max|expected| + |expected|). bf16 keeps 8 significant bits
# (unit roundoff 2^-8 = 0.4 %). On CPU in bf16 the tiny models used at most 25 % of this bound with
# REL = 1/16 (Gemma3, KV-cache steps vs a teacher-forced pass: |err| ~ 1.7 % of max|expected|); the
# rest is headroom for other kernels (CUDA), while a wrong token, layer or order (an O(1) difference)
# still fails. Set AGNOSIA_TEST_CLOSE_STATS=FILE to log how much of the bound each comparison used.
REL = {"bfloat16": 1 / 16, "float16": 1 / 128}.get(DTYPE, 0.0)


def load(source: Any, **kwargs: Any):
    """``extract.models.load_model`` on the test device and dtype (keyword arguments win)."""
    from extract.models import load_model

    kwargs.setdefault("device", DEVICE)
    kwargs.setdefault("dtype", DTYPE)
    return load_model(source, **kwargs)


def close(actual: torch.Tensor, expected: torch.Tensor, *, rtol: float | None = None, atol: float | None = None,
          msg: str | None = None) -> None:
    """``torch.testing.assert_close`` with the fp32 tolerance given (default: torch's); in a reduced
    dtype, the magnitude-relative bound above (both sides compared as float32 on the CPU)."""
    if not REDUCED:  # on the CPU: captures are CPU tensors, references may be on the GPU
        torch.testing.assert_close(actual.detach().cpu(), expected.detach().cpu(), rtol=rtol, atol=atol, msg=msg)
        return
    a, e = actual.detach().float().cpu(), expected.detach().float().cpu()
    scale = float(e.abs().amax()) if e.numel() else 0.0
    _record(a.numpy(), e.numpy(), scale, msg)
    torch.testing.assert_close(a, e, rtol=REL, atol=REL * scale, msg=msg)


def allclose(actual: np.ndarray, expected: np.ndarray, *, rtol: float, atol: float, err_msg: str = "") -> None:
    """``np.testing.assert_allclose`` likewise (stored values are float16, references float32)."""
    if not REDUCED:
        np.testing.assert_allclose(actual, expected, rtol=rtol, atol=atol, err_msg=err_msg)
        return
    e = np.asarray(expected, dtype=np.float32)
    scale = float(np.abs(e).max()) if e.size else 0.0
    _record(np.asarray(actual, dtype=np.float32), e, scale, err_msg)
    np.testing.assert_allclose(np.asarray(actual, dtype=np.float32), e, rtol=REL, atol=REL * scale, err_msg=err_msg)


def _record(a: np.ndarray, e: np.ndarray, scale: float, what: str | None) -> None:
    """With AGNOSIA_TEST_CLOSE_STATS=FILE, append how much of the reduced-dtype bound each comparison
    used (``used`` = max |a - e| / (REL * (max|e| + |e|)); a comparison fails above 1)."""
    path = os.environ.get("AGNOSIA_TEST_CLOSE_STATS")
    if not path or not e.size or a.shape != e.shape:
        return
    used = float((np.abs(a - e) / (REL * (scale + np.abs(e)) + 1e-30)).max())
    line = {"test": os.environ.get("PYTEST_CURRENT_TEST", "?").split(" ")[0], "what": what or "", "used": round(used, 4),
            "max_abs_err": float(np.abs(a - e).max()), "scale": scale, "device": DEVICE, "dtype": DTYPE}
    with open(path, "a") as f:
        f.write(json.dumps(line) + "\n")


def model_config() -> dict[str, str]:
    """The ``model`` keys of a manifest that runs on the test device and dtype."""
    return {"dtype": DTYPE, "device": DEVICE}


def cpu(x: torch.Tensor) -> torch.Tensor:
    """A model output as a CPU tensor (the capture returns CPU tensors; references may be on the GPU)."""
    return x.detach().cpu()


def numpy(x: torch.Tensor):
    """A model output as a float32 numpy array (numpy has no bfloat16)."""
    return x.detach().float().cpu().numpy()

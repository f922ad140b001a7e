"""The SAE and transcoder modules, written in SAELens's on-disk layout.

Three architectures, each with SAELens's parameter names and arithmetic, so
``sae_lens.SAE.load_from_disk(folder)`` opens what :func:`save` writes and reconstructs the same:

* ``topk``: ``acts = relu(topk_k((x - b_dec) @ W_enc + b_enc))``, ``x_hat = acts @ W_dec + b_dec``
  (SAELens ``TopKSAE``);
* ``standard``: ReLU with an L1 penalty on ``acts * |W_dec row|`` (SAELens ``StandardSAE``);
* ``transcoder``: ReLU + L1 from one site to another, ``acts = relu(x @ W_enc + b_enc)``,
  ``y_hat = acts @ W_dec + b_dec`` (SAELens ``Transcoder``: no input centring, ``d_out`` outputs).

SAELens itself is not imported here: importing ``sae_lens`` loads ``transformers``,
``transformer_lens``, ``datasets`` and ``wandb`` (~310 MiB more resident memory than torch alone),
which the farm's workers must not hold (docs/probes.md, "SAE features").
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Literal

import numpy as np
import torch
from safetensors.torch import load_file, save_file
from torch import nn

from probes.errors import ProbeError

Architecture = Literal["topk", "standard", "transcoder"]
ARCHITECTURES: tuple[str, ...] = ("topk", "standard", "transcoder")
#: The SAELens version whose layout these files follow (cfg.json keys, parameter names).
SAELENS_LAYOUT = "6.54.12"
CFG_FILE = "cfg.json"
WEIGHTS_FILE = "sae_weights.safetensors"


class SparseAutoencoder(nn.Module):
    """A TopK or ReLU/L1 SAE, or a ReLU/L1 transcoder (``d_out`` outputs), in float32."""

    def __init__(self, architecture: str, d_in: int, d_sae: int, *, k: int | None = None, d_out: int | None = None,
                 seed: int = 0, metadata: dict[str, Any] | None = None) -> None:
        super().__init__()
        if architecture not in ARCHITECTURES:
            raise ProbeError(f"architecture must be one of {ARCHITECTURES}, got {architecture!r}")
        if architecture == "topk" and not (k and 0 < k <= d_sae):
            raise ProbeError(f"a topk SAE needs 0 < k <= d_sae ({d_sae}), got k={k}")
        self.architecture = architecture
        self.d_in, self.d_sae, self.k = d_in, d_sae, k
        self.d_out = d_out if architecture == "transcoder" and d_out else d_in
        self.metadata = dict(metadata or {})
        g = torch.Generator().manual_seed(seed)
        w_dec = torch.randn(d_sae, self.d_out, generator=g)
        w_dec /= w_dec.norm(dim=1, keepdim=True)
        self.W_dec = nn.Parameter(w_dec)
        # the encoder starts as the decoder's transpose (SAELens's init for TopK and standard SAEs)
        w_enc = w_dec.T.contiguous() if self.d_out == d_in else torch.randn(d_in, d_sae, generator=g) / d_in ** 0.5
        self.W_enc = nn.Parameter(w_enc)
        self.b_enc = nn.Parameter(torch.zeros(d_sae))
        self.b_dec = nn.Parameter(torch.zeros(self.d_out))

    @property
    def centres_input(self) -> bool:
        """SAELens's ``apply_b_dec_to_input``: SAEs subtract ``b_dec`` first, a transcoder does not."""
        return self.architecture != "transcoder"

    def pre(self, x: torch.Tensor) -> torch.Tensor:
        """Pre-activations ``[batch, d_sae]``."""
        return ((x - self.b_dec) if self.centres_input else x) @ self.W_enc + self.b_enc

    def encode(self, x: torch.Tensor) -> torch.Tensor:
        """Feature activations ``[batch, d_sae]`` (non-negative, at most k non-zero for topk)."""
        h = self.pre(x)
        if self.architecture == "topk":
            assert self.k is not None
            vals, idx = torch.topk(h, self.k, dim=-1, sorted=False)
            return torch.zeros_like(h).scatter(-1, idx, vals.relu())
        return torch.relu(h)

    def decode(self, acts: torch.Tensor) -> torch.Tensor:
        """Reconstruction (or, for a transcoder, prediction) ``[batch, d_out]``."""
        return acts @ self.W_dec + self.b_dec

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.decode(self.encode(x))

    @torch.no_grad()
    def normalise_decoder(self) -> None:
        """Unit-norm decoder rows (TopK training keeps them so; the L1 kinds weigh acts by the norm)."""
        self.W_dec.div_(self.W_dec.norm(dim=1, keepdim=True).clamp_min(1e-8))

    def cfg(self) -> dict[str, Any]:
        """SAELens's ``cfg.json`` for this module (``SAEConfig.to_dict`` keys)."""
        out: dict[str, Any] = {
            "d_in": self.d_in, "d_sae": self.d_sae, "dtype": "float32", "device": "cpu",
            "apply_b_dec_to_input": self.centres_input, "normalize_activations": "none",
            "reshape_activations": "none",
            "metadata": {"sae_lens_version": SAELENS_LAYOUT, "sae_lens_training_version": SAELENS_LAYOUT,
                         **self.metadata},
            "architecture": self.architecture,
        }
        if self.architecture == "topk":
            out.update(k=self.k, rescale_acts_by_decoder_norm=False)
        if self.architecture == "transcoder":
            out["d_out"] = self.d_out
        return out

    def tensors(self) -> dict[str, torch.Tensor]:
        """The weights under SAELens's names, contiguous float32."""
        return {n: p.detach().contiguous().float() for n, p in self.named_parameters()}


def save(sae: SparseAutoencoder, folder: str | Path) -> Path:
    """Write ``cfg.json`` and ``sae_weights.safetensors`` into ``folder`` (SAELens's layout).

    Parameters
    ----------
    sae : SparseAutoencoder
        The module to save.
    folder : str or Path
        Created if missing; the two files are replaced whole (written beside, then renamed).

    Returns
    -------
    Path
        The folder.
    """
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    tmp = folder / (WEIGHTS_FILE + ".tmp")
    save_file(sae.tensors(), str(tmp))
    tmp.replace(folder / WEIGHTS_FILE)
    tmp = folder / (CFG_FILE + ".tmp")
    tmp.write_text(json.dumps(sae.cfg(), indent=1, sort_keys=True))
    tmp.replace(folder / CFG_FILE)
    return folder


def load(folder: str | Path) -> SparseAutoencoder:
    """An SAE saved by :func:`save` (or by SAELens, for the three architectures here).

    Parameters
    ----------
    folder : str or Path
        Holds ``cfg.json`` and ``sae_weights.safetensors``.

    Returns
    -------
    SparseAutoencoder
        In float32 on the CPU.
    """
    folder = Path(folder)
    if not (folder / CFG_FILE).exists() or not (folder / WEIGHTS_FILE).exists():
        raise ProbeError(f"{folder} holds no SAE: expected {CFG_FILE} and {WEIGHTS_FILE} (SAELens's layout)")
    cfg = json.loads((folder / CFG_FILE).read_text())
    arch = cfg.get("architecture", "standard")
    meta = {k: v for k, v in (cfg.get("metadata") or {}).items() if not k.startswith("sae_lens")}
    sae = SparseAutoencoder(arch, int(cfg["d_in"]), int(cfg["d_sae"]), k=cfg.get("k"), d_out=cfg.get("d_out"),
                            metadata=meta)
    state = load_file(str(folder / WEIGHTS_FILE))
    missing = {"W_enc", "W_dec", "b_enc", "b_dec"} - set(state)
    if missing:
        raise ProbeError(f"{folder / WEIGHTS_FILE} lacks {sorted(missing)}: not an SAE of architecture {arch}")
    sae.load_state_dict({k: v.float() for k, v in state.items() if k in ("W_enc", "W_dec", "b_enc", "b_dec")})
    return sae


def encode_numpy(sae: SparseAutoencoder, x: np.ndarray, batch: int = 8192) -> np.ndarray:
    """Feature activations of rows ``x`` ``[n, d_in]`` as float32 numpy, a batch at a time."""
    out = np.empty((len(x), sae.d_sae), np.float32)
    with torch.no_grad():
        for s in range(0, len(x), batch):
            out[s:s + batch] = sae.encode(torch.from_numpy(np.ascontiguousarray(x[s:s + batch], np.float32))).numpy()
    return out

"""Sparse autoencoders from the store: a streamed shuffled activation source, SAE and transcoder
training as a farm job, and every feature scored against the stimuli's exact truth.

``probes.sae.source`` is numpy only; the SAE modules import torch (never ``transformers``). The
on-disk layout of a trained SAE is SAELens's (``cfg.json`` + ``sae_weights.safetensors``), so
``sae_lens.SAE.load_from_disk`` opens it (docs/probes.md, "SAE features").
"""

from probes.sae.source import ActivationSource, ArrayRef, SourceStats

__all__ = ["ActivationSource", "ArrayRef", "SourceStats"]

"""Load a VLM and its processor from a local folder or a Hugging Face id, the transformers way.

``AutoModelForImageTextToText`` + ``AutoProcessor`` (with the family's chat template), ``dtype``,
``device`` or ``device_map``, an attention implementation, ``trust_remote_code`` off. The family
adapter is chosen from ``config.model_type`` *before* any weight is read, so an unsupported model
fails in a second, not after a multi-gigabyte download.
"""

from __future__ import annotations

import json
import os
import sys
import warnings
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError

from store.vocab import STACKS

from .adapters import Adapter, adapter_class, registry
from .compat import patch_processors_without_torchvision, register_capture_attention
from .errors import DeviceError, ModelNotFoundError, UnknownArchitectureError, UntrustedCodeError, WeightsError

_DTYPES = {"float32": torch.float32, "fp32": torch.float32, "float16": torch.float16, "fp16": torch.float16,
           "bfloat16": torch.bfloat16, "bf16": torch.bfloat16}


@dataclass
class LoadedModel:
    """A model ready for capture: weights, processor, adapter and what to record about the run."""

    model: Any  # a transformers PreTrainedModel (nn.Module + generate + a dynamic config)
    processor: Any
    adapter: Adapter
    source: str
    dtype: torch.dtype
    device: torch.device
    attn_implementation: str
    revision: str | None = None
    versions: dict[str, str] = field(default_factory=dict)

    @property
    def tokenizer(self) -> Any:
        return self.processor.tokenizer

    @property
    def model_type(self) -> str:
        return str(self.model.config.model_type)

    def describe(self) -> dict[str, Any]:
        """Plain values for the manifest's ``runs`` row."""
        return {
            "model": self.source,
            "revision": self.revision,
            "model_type": self.model_type,
            "adapter": type(self.adapter).__name__,
            "family": self.adapter.family,
            "dtype": str(self.dtype).removeprefix("torch."),
            "device": str(self.device),
            "attn_implementation": self.attn_implementation,
            "versions": dict(self.versions),
            "layers": {tap: self.adapter.n_layers(tap) for tap in STACKS},
        }


def _looks_like_path(source: str) -> bool:
    # "org/name" is a hub id; anything absolute, relative-dotted, home-relative or deeper is a folder
    return source.startswith(("/", ".", "~")) or source.count("/") > 1 or os.sep != "/" and os.sep in source


def resolve_source(source: str | os.PathLike[str]) -> str:
    """A local folder (must hold config.json) or a hub id; raises ModelNotFoundError otherwise."""
    path = Path(source).expanduser()
    if path.exists():
        if not path.is_dir():
            raise ModelNotFoundError(f"model source {str(source)!r} is a file: expected a model folder holding config.json")
        if not (path / "config.json").is_file():
            raise ModelNotFoundError(
                f"model folder {str(path)!r} has no config.json: expected a saved transformers model"
                " (save_pretrained output, a hub snapshot, or `python -m extract.tiny ARCH --out DIR`)"
            )
        return str(path)
    if isinstance(source, Path) or _looks_like_path(str(source)):
        raise ModelNotFoundError(
            f"model folder {str(source)!r} does not exist: pass an existing folder holding config.json,"
            " or a Hugging Face id such as 'Qwen/Qwen2-VL-2B-Instruct'"
        )
    return str(source)


def _dtype(dtype: str | torch.dtype) -> torch.dtype | str:
    if isinstance(dtype, torch.dtype) or dtype == "auto":
        return dtype
    if dtype not in _DTYPES:
        raise ValueError(f"dtype {dtype!r}: expected one of {', '.join(_DTYPES)}, 'auto' or a torch.dtype")
    return _DTYPES[dtype]


def load_config(source: str, *, revision: str | None = None, trust_remote_code: bool = False) -> Any:
    from transformers import AutoConfig

    try:
        config = AutoConfig.from_pretrained(source, revision=revision, trust_remote_code=trust_remote_code)
    except ValueError as err:
        if "trust_remote_code" not in str(err):
            raise _unreadable_config(source, err) from err
        raise UntrustedCodeError(
            f"{source!r} ships its own Python code (config.json auto_map), which agnosia never runs unless asked:"
            " read that code, then set `model: {trust_remote_code: true}` in the manifest to allow it"
            " (or pass trust_remote_code=True to load_model)"
        ) from err
    except OSError as err:
        offline = os.environ.get("HF_HUB_OFFLINE") == "1"
        raise ModelNotFoundError(
            f"cannot read the config of {source!r}: {str(err).rstrip('.')}."
            + (" HF_HUB_OFFLINE=1 is set, so only locally cached hub models load; pass a local folder." if offline else "")
        ) from err
    if not trust_remote_code:
        _warn_ignored_code(source, config)
    return config


def _unreadable_config(source: str, err: ValueError) -> UnknownArchitectureError:
    """transformers' ValueError for a config without a ``model_type`` or with one it does not know."""
    text = str(err).split("\n", 1)[0]
    if "model_type" in text:  # transformers: "Unrecognized model in X. Should have a `model_type` key ..."
        return UnknownArchitectureError(
            f"the config.json of {source!r} names no model_type: expected the config of a saved"
            " transformers vision-language model, e.g. {\"model_type\": \"qwen2_vl\", ...}; save the model again"
        )
    text = text.split(". ", 1)[0].rstrip(".")  # the first sentence; the rest is advice to upgrade
    return UnknownArchitectureError(
        f"cannot read the config.json of {source!r}: {text}. agnosia reads the model types"
        f" {', '.join(sorted(registry()))}: fix its model_type, or upgrade transformers if the architecture is newer"
    )


def _warn_ignored_code(source: str, config: Any) -> None:
    # A known model_type wins over the folder's own code: transformers loads its own classes and the
    # auto_map is silently ignored. Say so, since the folder's author may have changed the model.
    auto_map = getattr(config, "auto_map", None)
    local = Path(source) / "config.json"
    if auto_map is None and local.is_file():
        try:
            auto_map = json.loads(local.read_text()).get("auto_map")
        except (OSError, ValueError, AttributeError):
            auto_map = None
    if auto_map:
        print(f"warning: {source!r} names its own code in config.json (auto_map: {', '.join(sorted(auto_map))});"
              f" it is not run: transformers' own {config.model_type!r} classes are loaded instead (set"
              " `model: {trust_remote_code: true}` to run that code)", file=sys.stderr)


def load_processor(source: str, adapter: type[Adapter], *, revision: str | None = None,
                   trust_remote_code: bool = False) -> Any:
    patch_processors_without_torchvision()
    return adapter.load_processor(source, revision=revision, trust_remote_code=trust_remote_code)


def load_model(
    source: str | os.PathLike[str],
    *,
    dtype: str | torch.dtype = "float32",
    device: str | torch.device | None = None,
    device_map: str | dict[str, Any] | None = None,
    attn_implementation: str | None = None,
    revision: str | None = None,
    trust_remote_code: bool = False,
) -> LoadedModel:
    """Load model + processor + adapter.

    ``attn_implementation`` defaults to ``"sdpa"``. Capturing ``attn`` taps needs no special load:
    the capture switches the model to the ``"capture"`` implementation (sdpa for every layer's
    output, eager weights of the kept query rows beside it) for that forward. Pass ``"eager"`` to
    reproduce ``output_attentions`` runs exactly.
    ``device`` (default: cuda if available, else cpu) is ignored when ``device_map`` is given.
    """
    import transformers

    src = resolve_source(source)
    registry()  # family modules may register Auto classes of their own (e.g. a toy model) before the config is read
    config = load_config(src, revision=revision, trust_remote_code=trust_remote_code)
    adapter_cls = adapter_class(config.model_type)  # unknown architectures fail before any weight loads
    register_capture_attention()
    impl = attn_implementation or "sdpa"
    torch_dtype = _dtype(dtype)
    kwargs: dict[str, Any] = dict(
        dtype=torch_dtype, attn_implementation=impl, revision=revision, trust_remote_code=trust_remote_code
    )
    if device_map is not None:
        kwargs["device_map"] = device_map
    target = check_device(device) if device_map is None else None  # before the weights: fail in a second
    model = _read_weights(src, kwargs)
    if target is not None:
        model.to(target)
    model.eval()
    processor = load_processor(src, adapter_cls, revision=revision, trust_remote_code=trust_remote_code)
    first = next(model.parameters())
    return LoadedModel(
        model=model,
        processor=processor,
        adapter=adapter_cls(model),
        source=src,
        dtype=first.dtype,
        device=first.device,
        attn_implementation=impl,
        revision=revision,
        versions={"torch": torch.__version__, "transformers": transformers.__version__},
    )


def _read_weights(src: str, kwargs: dict[str, Any]) -> Any:
    """The model with its weights, or one line naming why they cannot be read (missing, damaged, a pickle)."""
    from transformers import AutoModelForImageTextToText

    try:
        with warnings.catch_warnings():  # torch's note on odd pickle protocols: the refusal below says it all
            warnings.filterwarnings("ignore", message="Detected pickle protocol")
            return AutoModelForImageTextToText.from_pretrained(src, **kwargs)
    except OSError as err:
        raise ModelNotFoundError(f"cannot load the weights of {src!r}: {err}") from err
    except SafetensorError as err:
        raise WeightsError(
            f"the weights of {src!r} cannot be read ({err}): a model.safetensors file is truncated or damaged;"
            " download or save the model again"
        ) from err
    except Exception as err:
        # torch's safe loader refuses a pickle with pickle.UnpicklingError; matched by name, since
        # model-loading code imports no pickle module at all (tests/security/test_no_pickle.py)
        if type(err).__name__ != "UnpicklingError":
            raise
        raise WeightsError(
            f"the weights of {src!r} are a pickle (.bin) that torch's safe loader (weights_only=True) refuses:"
            " loading it could run code, so agnosia does not. Use a safetensors copy of the model (model.safetensors)"
        ) from err


def _default_device() -> torch.device:
    return torch.device("cuda" if torch.cuda.is_available() else "cpu")


def check_device(device: str | torch.device | None) -> torch.device:
    """The torch device to load onto (default: cuda if available, else cpu), if this machine has it."""
    if device is None:
        return _default_device()
    try:
        dev = torch.device(device)
    except (RuntimeError, TypeError) as err:
        raise DeviceError(
            f"device {str(device)!r} is not a torch device ({err}): use cpu, cuda, cuda:N or mps"
        ) from err
    if dev.type == "cuda":
        count = torch.cuda.device_count() if torch.cuda.is_available() else 0
        if dev.index is None and count == 0 or dev.index is not None and dev.index >= count:
            built = f"CUDA {torch.version.cuda}" if torch.version.cuda else "without CUDA"
            raise DeviceError(
                f"device {str(device)!r} is not available: this machine has {count} CUDA device(s) (torch"
                f" {torch.__version__}, built {built}). Set `model: {{device: cpu}}` in the manifest, or run"
                " where a GPU is visible (check nvidia-smi and CUDA_VISIBLE_DEVICES)"
            )
    if dev.type == "mps" and not torch.backends.mps.is_available():
        raise DeviceError(f"device {str(device)!r} is not available on this machine: set `model: {{device: cpu}}`")
    return dev

"""Tiny random-init VLMs of every supported family, built offline and saved as normal model folders.

Each adapter's ``build_tiny(seed)`` returns a model and a processor built from the helpers here:
a byte-level BPE tokenizer (256 byte tokens, no merges, the family's special tokens), a chat
template in the family's turn format, and the recipe sizes in :data:`TINY`. :func:`build` saves
them (safetensors, config, tokenizer, processor, chat template) so that the loader reads them back
exactly like a downloaded checkpoint. Same seed, same weights.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from .compat import patch_processors_without_torchvision

if TYPE_CHECKING:  # adapters import this module for their tiny recipes
    from .adapters.base import Adapter


@dataclass(frozen=True)
class TinySizes:
    hidden: int = 64  # both towers
    layers: int = 2
    heads: int = 2
    ff: int = 128
    image: int = 112  # px: 8x8 patches of 14 px; small enough for a fast test suite


TINY = TinySizes()


def byte_tokenizer(
    roles: dict[str, str], named: dict[str, str] | None = None, plain: list[str] | tuple[str, ...] = ()
) -> Any:
    """A byte-level BPE tokenizer with special tokens.

    ``roles`` maps tokenizer roles (bos_token, eos_token, pad_token, unk_token) to token strings;
    ``named`` adds named special tokens that processors read as attributes (``tok.image_token`` and
    ``tok.image_token_id``); ``plain`` adds further special tokens without a name (turn markers).
    """
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())
    core = Tokenizer(models.BPE(vocab={ch: i for i, ch in enumerate(alphabet)}, merges=[]))
    core.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    core.decoder = decoders.ByteLevel()
    tok = PreTrainedTokenizerFast(tokenizer_object=core, **roles, extra_special_tokens=dict(named or {}))
    if plain:
        tok.add_special_tokens({"additional_special_tokens": list(plain)}, replace_extra_special_tokens=False)
    return tok


def chat_template(
    turns: dict[str, tuple[str, str]], image: str, generation: str | None = None, prefix: str = ""
) -> str:
    """A Jinja chat template: ``turns[role] = (before, after)`` each message; images become ``image``.

    ``generation`` is what ``add_generation_prompt`` appends (default: the assistant's ``before``).
    """
    gen = turns["assistant"][0] if generation is None else generation

    def lit(s: str) -> str:
        return json.dumps(s)  # a JSON string is a valid Jinja string literal

    parts = [f"{{{{ {lit(prefix)} }}}}{{% for m in messages %}}"]
    for i, (role, (before, after)) in enumerate(turns.items()):
        parts.append(f"{{% {'if' if i == 0 else 'elif'} m['role'] == {lit(role)} %}}{{{{ {lit(before)} }}}}")
        parts.append(
            "{% if m['content'] is string %}{{ m['content'] }}{% else %}{% for c in m['content'] %}"
            f"{{% if c['type'] == 'image' %}}{{{{ {lit(image)} }}}}"
            "{% elif c['type'] == 'text' %}{{ c['text'] }}{% endif %}{% endfor %}{% endif %}"
            f"{{{{ {lit(after)} }}}}"
        )
    parts.append(f"{{% endif %}}{{% endfor %}}{{% if add_generation_prompt %}}{{{{ {lit(gen)} }}}}{{% endif %}}")
    return "".join(parts)


def init_model(model_cls: type[nn.Module], config: Any, seed: int) -> nn.Module:
    """Construct with a fixed seed; give zero-initialised matrices random values.

    Some connectors start at zero (Gemma3's projection, LLaVA-OV's image newline): a random model
    would then map every image token to the same vector and no geometry test could tell them apart.
    """
    torch.manual_seed(seed)
    model = model_cls(config)
    gen = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for name, p in model.named_parameters():
            # zero biases are the normal start; Gemma norms store (scale - 1), so 0.02 noise is harmless
            if p.numel() > 1 and not name.endswith("bias") and not p.any():
                p.copy_(torch.randn(p.shape, generator=gen) * 0.02)
    return model.eval()


def architectures() -> list[str]:
    from .adapters import registry

    return sorted(name for name, cls in registry().items() if _has_tiny(cls))


def _has_tiny(cls: type[Adapter]) -> bool:
    from .adapters.base import Adapter

    # a classmethod is bound anew on each access: compare the functions behind it
    return getattr(cls.build_tiny, "__func__", None) is not getattr(Adapter.build_tiny, "__func__", None)


def build(arch: str, out: str | Path, seed: int = 0) -> Path:
    """Build the tiny ``arch`` model and save it as a model folder at ``out``; returns the folder."""
    from transformers.utils import logging

    from .adapters import adapter_class

    patch_processors_without_torchvision()
    logging.disable_progress_bar()  # a tiny folder is written in well under a second
    cls = adapter_class(arch)
    if not _has_tiny(cls):
        raise ValueError(f"{arch}: no tiny-model recipe; families with one: {', '.join(architectures())}")
    model: Any
    model, processor = cls.build_tiny(seed)
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out)
    processor.save_pretrained(out)
    (out / "agnosia_tiny.json").write_text(json.dumps({"arch": arch, "seed": seed}, indent=1) + "\n")
    return out

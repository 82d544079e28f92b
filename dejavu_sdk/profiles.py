"""Built-in model and hardware profiles for the planner, and roofline estimates of prefill and decode times.

Models: the paper's OPT-13B, OPT-30B, OPT-66B and BLOOM-176B in float16 (layer counts, hidden sizes and
parameter counts from their published configurations), or any Hugging Face `config.json`.
Hardware: one GPU's memory, dense float16 tensor throughput and memory bandwidth, from the vendors' data
sheets (A100-80GB SXM, V100-16GB SXM2, H200 SXM); a machine is `gpus` of them.

The time estimates are a roofline: prefill is compute-bound, a decode step reads every weight (and the
cache) once. They give the planner the right order of magnitude and, above all, the right ratio Y/t.
Measure your own model (`dejavu plan --measure`) for decisions that matter.
"""

from __future__ import annotations

import json
import os

import attrs

from .errors import ConfigError


@attrs.frozen
class ModelProfile:
    """What the planner needs to know about a model: its size and its KV cache per token."""

    name: str
    layers: int
    parameters: float
    kv_bytes_per_token_per_layer: float  # keys and values of one token in one layer
    dtype_bytes: int = 2

    @property
    def weight_bytes(self) -> float:
        return self.parameters * self.dtype_bytes

    @property
    def weight_bytes_per_layer(self) -> float:
        return self.weight_bytes / self.layers

    def cache_bytes_per_layer(self, batch: int, tokens: int) -> float:
        return batch * tokens * self.kv_bytes_per_token_per_layer


@attrs.frozen
class HardwareProfile:
    """One accelerator: memory (bytes), dense float16 throughput (FLOP/s), memory and host-link bandwidth (B/s)."""

    name: str
    memory: float
    flops: float
    memory_bandwidth: float
    host_bandwidth: float


def _opt_like(name: str, layers: int, hidden: int, parameters: float) -> ModelProfile:
    return ModelProfile(name, layers, parameters, kv_bytes_per_token_per_layer=2 * hidden * 2)


MODELS = {
    "opt-13b": _opt_like("OPT-13B", 40, 5120, 12.85e9),
    "opt-30b": _opt_like("OPT-30B", 48, 7168, 29.97e9),
    "opt-66b": _opt_like("OPT-66B", 64, 9216, 65.7e9),
    "bloom-176b": _opt_like("BLOOM-176B", 70, 14336, 176.2e9),
}

HARDWARE = {
    "a100-80gb": HardwareProfile("A100-80GB", 80e9, 312e12, 2.039e12, 25e9),
    "v100-16gb": HardwareProfile("V100-16GB", 16e9, 125e12, 0.9e12, 12e9),
    "h200": HardwareProfile("H200", 141e9, 989e12, 4.8e12, 50e9),
}


def model_profile(name: str) -> ModelProfile:
    """A built-in model profile by name (case-insensitive), e.g. `opt-66b`."""
    try:
        return MODELS[name.lower()]
    except KeyError:
        raise ConfigError(f"unknown model profile {name!r}; choose from {', '.join(MODELS)} "
                          "or pass a Hugging Face config.json") from None


def hardware_profile(name: str) -> HardwareProfile:
    """A built-in accelerator profile by name (case-insensitive), e.g. `a100-80gb`."""
    try:
        return HARDWARE[name.lower()]
    except KeyError:
        raise ConfigError(f"unknown hardware profile {name!r}; choose from {', '.join(HARDWARE)}") from None


def profile_from_hf_config(path: str, dtype_bytes: int = 2) -> ModelProfile:
    """Estimate a profile from a Hugging Face `config.json` (or the directory holding it).

    Parameters are counted from the shapes: embeddings, attention projections (with grouped-query
    attention's fewer KV heads) and the MLP (three matrices when gated, as in Llama, two otherwise).
    """
    file = os.path.join(path, "config.json") if os.path.isdir(path) else path
    try:
        with open(file, encoding="utf-8") as handle:
            config = json.load(handle)
    except (OSError, ValueError) as error:
        raise ConfigError(f"cannot read a Hugging Face config from {path!r}: {error}") from None
    try:
        layers = int(config.get("num_hidden_layers", config.get("n_layer")))
        hidden = int(config.get("hidden_size", config.get("n_embd")))
        heads = int(config.get("num_attention_heads", config.get("n_head")))
        kv_heads = int(config.get("num_key_value_heads") or heads)
        head_dim = int(config.get("head_dim") or hidden // heads)
        inner = int(config.get("intermediate_size") or config.get("ffn_dim") or config.get("n_inner") or 4 * hidden)
        vocab = int(config.get("vocab_size", 0))
    except (TypeError, ValueError):
        raise ConfigError(f"{file} lacks the layer count, hidden size or head count of a transformer") from None
    gated = config.get("hidden_act") == "silu"  # Llama, Mistral, Qwen2 and kin: gate, up and down projections
    attention = hidden * heads * head_dim * 2 + hidden * kv_heads * head_dim * 2
    mlp = (3 if gated else 2) * hidden * inner
    embeddings = vocab * hidden * (1 if config.get("tie_word_embeddings", True) else 2)
    parameters = embeddings + layers * (attention + mlp)
    name = config.get("_name_or_path") or os.path.basename(os.path.dirname(os.path.abspath(file))) or file
    return ModelProfile(name, layers, float(parameters), 2 * kv_heads * head_dim * dtype_bytes, dtype_bytes)


@attrs.frozen
class Roofline:
    """Roofline times of one microbatch on the whole model, on machines of `gpus` accelerators each.

    `compute_efficiency` and `bandwidth_efficiency` are the fractions of peak that real kernels reach.
    """

    model: ModelProfile
    hardware: HardwareProfile
    gpus: int = 1
    compute_efficiency: float = 0.5
    bandwidth_efficiency: float = 0.7

    @property
    def machine_memory(self) -> float:
        return self.gpus * self.hardware.memory

    def prompt_time(self, batch: int, prompt_tokens: int) -> float:
        """Y: prefill is compute-bound, 2 FLOPs per parameter per token."""
        flops = 2 * self.model.parameters * batch * prompt_tokens
        return flops / (self.gpus * self.hardware.flops * self.compute_efficiency)

    def token_time(self, batch: int, context_tokens: int) -> float:
        """t: one decode step reads every weight and the batch's cache, or is compute-bound if larger."""
        read = self.model.weight_bytes + self.model.layers * self.model.cache_bytes_per_layer(batch, context_tokens)
        memory_time = read / (self.gpus * self.hardware.memory_bandwidth * self.bandwidth_efficiency)
        compute_time = 2 * self.model.parameters * batch / (self.gpus * self.hardware.flops * self.compute_efficiency)
        return max(memory_time, compute_time)

"""The Llama model that every script in this collection trains.

The math and the parameter names are Hugging Face Llama's (``model.`` is called ``base_model.`` here), so
weights move between the two by renaming one prefix. Three properties make it easy to split into pipeline
stages, and the training scripts rely on all of them:

* Layers live in a ``ModuleDict`` keyed by their global index, and ``forward`` skips whatever a stage does
  not hold (embedding, any layer, final norm, head). A stage is just a trimmed model, and its state_dict keys
  are a subset of the full model's keys, so checkpoints line up whatever the number of stages.
* No module is passed into another module's forward: each attention layer owns its RoPE frequencies and
  builds its cos/sin tables itself. The pipeline tracer rejects modules that cross a call boundary.
* ``init_weights(seed)`` re-creates every parameter *and buffer* after ``to_empty``, and seeds each module
  from (seed, its fully-qualified name), so a stage gets the same initial weights however the model is split.
"""

import dataclasses
import hashlib
import math

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch import Tensor


@dataclasses.dataclass
class LlamaConfig:
    vocab_size: int = 50000
    max_position_embeddings: int = 2048
    hidden_size: int = 768
    intermediate_size: int = 4 * 768
    num_hidden_layers: int = 12
    num_attention_heads: int = 12
    num_key_value_heads: int = 3  # grouped-query attention: fewer K/V heads than query heads
    rope_theta: float = 10000.0
    rms_norm_eps: float = 1e-5
    initializer_range: float = 0.02
    head_dim: int | None = None  # size of each attention head; None: hidden_size / num_attention_heads
    tie_word_embeddings: bool = False  # the head is the embedding matrix (Llama 3.2 1B and 3B, SmolLM)
    # Llama 3.1+ long-context RoPE: {"rope_type": "llama3", "factor", "low_freq_factor", "high_freq_factor",
    # "original_max_position_embeddings"}; None: plain RoPE.
    rope_scaling: dict | None = None

    def __post_init__(self):
        if self.head_dim is None:
            if self.hidden_size % self.num_attention_heads:
                raise ValueError("hidden_size must be a multiple of num_attention_heads (or give head_dim)")
            self.head_dim = self.hidden_size // self.num_attention_heads
        if self.num_attention_heads % self.num_key_value_heads:
            raise ValueError("num_attention_heads must be a multiple of num_key_value_heads")
        if self.rope_scaling is not None and self.rope_scaling.get("rope_type") != "llama3":
            raise ValueError(f"rope_scaling: only rope_type llama3 is implemented, got {self.rope_scaling}")


# Named shapes for --model. `small` is the seed article's model; the llama-* entries use the layer shapes of
# the Llama 3 family (plain RoPE, no long-context frequency scaling, untied head; a real checkpoint brings its
# own config with --init-from). The vocabulary always
# comes from the tokenizer, so it is not part of a preset.
PRESETS: dict[str, dict] = {
    "tiny": dict(hidden_size=128, intermediate_size=384, num_hidden_layers=6, num_attention_heads=4,
                 num_key_value_heads=2, max_position_embeddings=1024),
    "small": dict(),
    "llama-1b": dict(hidden_size=2048, intermediate_size=8192, num_hidden_layers=16, num_attention_heads=32,
                     num_key_value_heads=8, max_position_embeddings=8192, rope_theta=500000.0),
    "llama-3b": dict(hidden_size=3072, intermediate_size=8192, num_hidden_layers=28, num_attention_heads=24,
                     num_key_value_heads=8, max_position_embeddings=8192, rope_theta=500000.0),
    "llama-8b": dict(hidden_size=4096, intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32,
                     num_key_value_heads=8, max_position_embeddings=8192, rope_theta=500000.0),
}


def config_from_preset(name: str, vocab_size: int, num_layers: int | None = None) -> LlamaConfig:
    """The preset's config with the tokenizer's vocabulary and, optionally, another number of layers."""
    overrides = dict(PRESETS[name], vocab_size=vocab_size)
    if num_layers is not None:
        overrides["num_hidden_layers"] = num_layers
    return LlamaConfig(**overrides)


# ----------------------------------------------------------------------------------------------------------
# Rotary position embedding (the "rotate half" convention of Hugging Face Llama)

def rope_inv_freq(config: LlamaConfig, device=None) -> Tensor:
    exponents = torch.arange(0, config.head_dim, 2, dtype=torch.float32, device=device) / config.head_dim
    inv_freq = 1.0 / (config.rope_theta ** exponents)
    if config.rope_scaling is None:
        return inv_freq
    # Llama 3.1's long-context adjustment (as transformers computes it): wavelengths shorter than
    # original_max / high_freq_factor stay, those longer than original_max / low_freq_factor are slowed down
    # by `factor`, and the ones between are interpolated smoothly.
    scaling = config.rope_scaling
    factor, low, high = scaling["factor"], scaling["low_freq_factor"], scaling["high_freq_factor"]
    context = scaling["original_max_position_embeddings"]
    wavelength = 2 * math.pi / inv_freq
    scaled = torch.where(wavelength > context / low, inv_freq / factor, inv_freq)
    smooth = (context / wavelength - low) / (high - low)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    medium = ~(wavelength < context / high) * ~(wavelength > context / low)
    return torch.where(medium, smoothed, scaled)


def rope_tables(inv_freq: Tensor, seq_len: int, dtype: torch.dtype) -> tuple[Tensor, Tensor]:
    # Positions always start at 0: every stage sees whole sequences, so each one can rebuild the same tables
    # from the sequence length alone and nothing but hidden states has to travel between stages.
    # The tables are computed in fp32 and only then cast, as in HF, so bf16 runs rotate by the same angles.
    positions = torch.arange(seq_len, device=inv_freq.device, dtype=torch.float32)
    angles = torch.outer(positions, inv_freq.float())
    angles = torch.cat((angles, angles), dim=-1)  # [seq, head_dim]
    return angles.cos().to(dtype), angles.sin().to(dtype)


def apply_rope(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    """Rotate x of shape [batch, heads, seq, head_dim] by position."""
    x1, x2 = x.chunk(2, dim=-1)
    return x * cos + torch.cat((-x2, x1), dim=-1) * sin


# ----------------------------------------------------------------------------------------------------------
# Transformer blocks

class LlamaAttention(nn.Module):
    def __init__(self, config: LlamaConfig):
        super().__init__()
        self.num_heads = config.num_attention_heads
        self.num_kv_heads = config.num_key_value_heads
        self.head_dim = config.head_dim
        self.q_proj = nn.Linear(config.hidden_size, self.num_heads * self.head_dim, bias=False)
        self.k_proj = nn.Linear(config.hidden_size, self.num_kv_heads * self.head_dim, bias=False)
        self.v_proj = nn.Linear(config.hidden_size, self.num_kv_heads * self.head_dim, bias=False)
        self.o_proj = nn.Linear(self.num_heads * self.head_dim, config.hidden_size, bias=False)
        # Each layer keeps its own copy (head_dim / 2 floats) so that no module is shared across layers.
        # Not persistent: it is derived from the config, and HF does not save it either.
        self.register_buffer("inv_freq", rope_inv_freq(config), persistent=False)

    def forward(self, x: Tensor) -> Tensor:
        batch, seq_len, _ = x.shape
        q = self.q_proj(x).view(batch, seq_len, self.num_heads, self.head_dim).transpose(1, 2)
        k = self.k_proj(x).view(batch, seq_len, self.num_kv_heads, self.head_dim).transpose(1, 2)
        v = self.v_proj(x).view(batch, seq_len, self.num_kv_heads, self.head_dim).transpose(1, 2)
        cos, sin = rope_tables(self.inv_freq, seq_len, q.dtype)
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        # Packed training sequences need only the causal mask, which SDPA builds itself; enable_gqa lets the
        # K/V heads serve several query heads without materializing repeated copies.
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
        return self.o_proj(out.transpose(1, 2).reshape(batch, seq_len, -1))


class LlamaMLP(nn.Module):
    def __init__(self, config: LlamaConfig):
        super().__init__()
        self.gate_proj = nn.Linear(config.hidden_size, config.intermediate_size, bias=False)
        self.up_proj = nn.Linear(config.hidden_size, config.intermediate_size, bias=False)
        self.down_proj = nn.Linear(config.intermediate_size, config.hidden_size, bias=False)

    def forward(self, x: Tensor) -> Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))  # SwiGLU


class LlamaDecoderLayer(nn.Module):
    def __init__(self, config: LlamaConfig):
        super().__init__()
        self.input_layernorm = nn.RMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.self_attn = LlamaAttention(config)
        self.post_attention_layernorm = nn.RMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.mlp = LlamaMLP(config)

    def forward(self, x: Tensor) -> Tensor:
        x = x + self.self_attn(self.input_layernorm(x))
        return x + self.mlp(self.post_attention_layernorm(x))


class LlamaModel(nn.Module):
    """Embedding, decoder layers and final norm; any of them may be missing on a pipeline stage."""

    def __init__(self, config: LlamaConfig):
        super().__init__()
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleDict({str(i): LlamaDecoderLayer(config) for i in range(config.num_hidden_layers)})
        self.norm = nn.RMSNorm(config.hidden_size, eps=config.rms_norm_eps)

    def forward(self, x: Tensor) -> Tensor:
        # The first stage gets token ids [batch, seq]; later stages get hidden states [batch, seq, hidden].
        h = self.embed_tokens(x) if self.embed_tokens is not None else x
        for layer in self.layers.values():  # insertion order == global layer order
            h = layer(h)
        return self.norm(h) if self.norm is not None else h


class LlamaForPretraining(nn.Module):
    def __init__(self, config: LlamaConfig):
        super().__init__()
        self.config = config
        self.base_model = LlamaModel(config)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        self.tie_weights()

    def tie_weights(self) -> None:
        """With tie_word_embeddings, make the head use the embedding's matrix, when this module holds both.

        Only for a model whose embedding and head are in one stage: stages that hold just one of them keep
        their own copy, which the training loop keeps equal (training.TiedEmbedding). to_empty() allocates
        shared parameters separately, so call this again after it."""
        if self.config.tie_word_embeddings and self.base_model.embed_tokens is not None and self.lm_head is not None:
            self.lm_head.weight = self.base_model.embed_tokens.weight

    def forward(self, input_ids: Tensor) -> Tensor:
        """Token ids [batch, seq] -> logits [batch, seq, vocab] (or hidden states on a stage with no head)."""
        h = self.base_model(input_ids)
        return self.lm_head(h) if self.lm_head is not None else h

    def init_weights(self, seed: int) -> None:
        """Give every parameter and buffer its initial value, the same for a given seed on any stage layout.

        Works on real devices only: call it after ``to_empty``. See ``init_tensor_``.
        """
        for name, tensor in [*self.named_parameters(), *self.named_buffers()]:
            init_tensor_(name, tensor, seed, self.config)


@torch.no_grad()
def init_tensor_(name: str, tensor: Tensor, seed: int, config: LlamaConfig) -> None:
    """Initialize one parameter or buffer in place, from its name in the full model alone.

    Linear and embedding weights ~ N(0, initializer_range) as in HF Llama, norm weights = 1, RoPE frequencies
    recomputed. Each tensor draws from its own generator seeded by (seed, module name), so its value does not
    depend on which other tensors exist in this process or in what order they are visited: any split of the
    model, by hand or by a tracer, starts from the same weights as long as it knows the full-model names.
    """
    if name.endswith("inv_freq"):
        tensor.copy_(rope_inv_freq(config, device=tensor.device))
    elif name.endswith("norm.weight"):  # input_layernorm, post_attention_layernorm, base_model.norm
        tensor.fill_(1.0)
    elif name.endswith(".weight"):  # every Linear and the embedding
        module_name = name.removesuffix(".weight")
        if config.tie_word_embeddings and module_name == "lm_head":  # one matrix: the embedding's values
            module_name = "base_model.embed_tokens"
        tensor.normal_(0.0, config.initializer_range, generator=_module_generator(seed, module_name, tensor.device))
    else:
        raise ValueError(f"no initializer for {name!r}")


def _module_generator(seed: int, name: str, device: torch.device) -> torch.Generator:
    digest = hashlib.sha256(f"{seed}:{name}".encode()).digest()
    return torch.Generator(device=device).manual_seed(int.from_bytes(digest[:8], "little") >> 1)


def num_parameters(module: nn.Module) -> int:
    return sum(p.numel() for p in module.parameters())

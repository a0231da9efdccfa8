"""Small reference models for the lessons, tests and benchmarks."""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn


class MLP(nn.Module):
    """Flatten, then ``depth`` Linear+ReLU layers of ``width``, then a Linear classifier."""

    def __init__(self, n_in: int = 64, width: int = 256, depth: int = 2, n_out: int = 10) -> None:
        super().__init__()
        layers: list[nn.Module] = [nn.Flatten()]
        for i in range(depth):
            layers += [nn.Linear(n_in if i == 0 else width, width), nn.ReLU()]
        layers.append(nn.Linear(width if depth else n_in, n_out))
        self.net = nn.Sequential(*layers)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)


class ConvNet(nn.Module):
    """Conv-BatchNorm-ReLU blocks on 8x8 digits, then a Linear classifier."""

    def __init__(self, channels: int = 32, n_out: int = 10) -> None:
        super().__init__()
        c = channels
        self.features = nn.Sequential(
            nn.Conv2d(1, c, 3, padding=1), nn.BatchNorm2d(c), nn.ReLU(),
            nn.Conv2d(c, 2 * c, 3, padding=1), nn.BatchNorm2d(2 * c), nn.ReLU(),
            nn.MaxPool2d(2),
            nn.Conv2d(2 * c, 2 * c, 3, padding=1), nn.BatchNorm2d(2 * c), nn.ReLU(),
        )
        self.head = nn.Linear(2 * c * 4 * 4, n_out)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.features(x).flatten(1))


def parameter_bytes(model: nn.Module) -> int:
    """Bytes the model's parameters take, as requested (not rounded)."""
    return sum(p.numel() * p.element_size() for p in model.parameters())


@dataclass
class GPTConfig:
    vocab_size: int = 17      # the digits' pixel values 0..16, read as a sequence of tokens
    block_size: int = 64
    n_layer: int = 2
    n_head: int = 4
    n_embd: int = 64


class CausalSelfAttention(nn.Module):
    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.n_head = cfg.n_head
        self.qkv = nn.Linear(cfg.n_embd, 3 * cfg.n_embd)
        self.proj = nn.Linear(cfg.n_embd, cfg.n_embd)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, T, C = x.shape
        q, k, v = self.qkv(x).split(C, dim=2)
        q, k, v = (t.view(B, T, self.n_head, C // self.n_head).transpose(1, 2) for t in (q, k, v))
        y = nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.proj(y.transpose(1, 2).reshape(B, T, C))


class Block(nn.Module):
    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.ln1, self.ln2 = nn.LayerNorm(cfg.n_embd), nn.LayerNorm(cfg.n_embd)
        self.attn = CausalSelfAttention(cfg)
        self.mlp = nn.Sequential(nn.Linear(cfg.n_embd, 4 * cfg.n_embd), nn.GELU(),
                                 nn.Linear(4 * cfg.n_embd, cfg.n_embd))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln1(x))
        return x + self.mlp(self.ln2(x))


class TinyGPT(nn.Module):
    """A small decoder-only transformer language model (nanoGPT's shape): tokens (B, T) -> logits (B, T, V)."""

    def __init__(self, cfg: GPTConfig | None = None) -> None:
        super().__init__()
        self.cfg = cfg = cfg or GPTConfig()
        self.tok = nn.Embedding(cfg.vocab_size, cfg.n_embd)
        self.pos = nn.Embedding(cfg.block_size, cfg.n_embd)
        self.blocks = nn.Sequential(*[Block(cfg) for _ in range(cfg.n_layer)])
        self.ln_f = nn.LayerNorm(cfg.n_embd)
        self.head = nn.Linear(cfg.n_embd, cfg.vocab_size, bias=False)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        pos = torch.arange(idx.shape[1], device=idx.device)
        return self.head(self.ln_f(self.blocks(self.tok(idx) + self.pos(pos))))


VGG16_LAYERS = [64, 64, "M", 128, 128, "M", 256, 256, 256, "M", 512, 512, 512, "M", 512, 512, 512, "M"]


def vgg16(num_classes: int = 1000) -> nn.Sequential:
    """A VGG16-shaped network (configuration D of Simonyan and Zisserman, 2014) for 224x224 RGB images."""
    layers: list[nn.Module] = []
    channels = 3
    for v in VGG16_LAYERS:
        if v == "M":
            layers.append(nn.MaxPool2d(2))
        else:
            layers += [nn.Conv2d(channels, v, 3, padding=1), nn.ReLU()]
            channels = v
    layers += [nn.Flatten(), nn.Linear(512 * 7 * 7, 4096), nn.ReLU(), nn.Linear(4096, 4096), nn.ReLU(),
               nn.Linear(4096, num_classes)]
    return nn.Sequential(*layers)


def reference_cases(batch_size: int = 128) -> dict[str, tuple]:
    """Training setups on the shipped digits data, for checking predictions against measurements.

    Each value is ``(make_model, make_optimizer, make_batch, make_sample)``; ``make_sample``
    builds the input of one sample (for the rule of thumb).
    """
    from .data import load_digit_tokens, load_digits

    images, labels = load_digits()
    tokens = load_digit_tokens()
    b = batch_size

    def image_batch():
        return images[:b].clone(), labels[:b].clone()

    def token_batch():
        return tokens[:b, :-1].clone(), tokens[:b, 1:].clone()

    def image_sample():
        return torch.zeros(1, 1, 8, 8)

    def token_sample():
        return torch.zeros(1, 63, dtype=torch.long)

    sgd = lambda p: torch.optim.SGD(p, lr=0.1)  # noqa: E731
    momentum = lambda p: torch.optim.SGD(p, lr=0.1, momentum=0.9)  # noqa: E731
    adam = lambda p: torch.optim.Adam(p)  # noqa: E731
    adamw = lambda p: torch.optim.AdamW(p)  # noqa: E731
    return {
        "mlp + sgd": (lambda: MLP(width=256), sgd, image_batch, image_sample),
        "mlp + momentum": (lambda: MLP(width=256), momentum, image_batch, image_sample),
        "deep mlp + adam": (lambda: MLP(width=512, depth=4), adam, image_batch, image_sample),
        "convnet + sgd": (lambda: ConvNet(16), sgd, image_batch, image_sample),
        "convnet + adam": (lambda: ConvNet(32), adam, image_batch, image_sample),
        "tinygpt + adamw": (lambda: TinyGPT(GPTConfig(n_layer=4, n_embd=128)), adamw, token_batch, token_sample),
        "tinygpt + momentum": (lambda: TinyGPT(GPTConfig(n_layer=3)), momentum, token_batch, token_sample),
    }

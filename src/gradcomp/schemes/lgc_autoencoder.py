"""The autoencoder of Learned Gradient Compression (Abrahamyan et al. 2021), and how it is trained.

Architecture (gradcomp's): the encoder maps a vector of L values (L a multiple of 16; callers
pad with zeros) to a latent code of ``latent_channels`` × L/16 floats:

    Conv1d(1→64, k3, s2) → LeakyReLU → Conv1d(64→128, k3, s2) → LeakyReLU → Conv1d(128→256, k3, s2) → LeakyReLU
    → Conv1d(256→64, k3, s2) → LeakyReLU → Conv1d(64→C, k1)

and the decoder mirrors it with transposed convolutions back to length L:

    ConvT(C→64, k1) → LeakyReLU → ConvT(64→256, k3, s2) → LeakyReLU → ConvT(256→128, k3, s2) → LeakyReLU
    → ConvT(128→64, k3, s2) → LeakyReLU → ConvT(64→1, k3, s2)

(padding 1 and output padding 1 on every stride-2 layer, so each halves or doubles the length exactly). With
C = 4 the code holds L/4 floats: the latent is a quarter of the values it encodes.

Choices where the paper is silent:

- **Scale.** Gradient values shrink by orders of magnitude during training; the network sees values divided
  by a scale the caller picks and sends (an fp32), so that it learns shapes, not magnitudes.
- **Losses** over the W workers' value vectors x_i (scaled, at common positions) with codes z_i = E(x_i)
  and their mean z̄; every term is a mean squared error, ``similarity`` (default 0.1) weighs the term that
  pulls the workers' codes together:
  ring: mean_i ‖D(z_i) − x_i‖² + ‖D(z̄) − x̄‖² + similarity · mean_i ‖z_i − z̄‖² — the ring decodes the mean
  code once and uses it as the mean of the values, so it is trained for exactly that;
  parameter server (one decoder D_i per worker, leader ℓ): mean_i ‖D_i(z_ℓ) − x_i‖² (the server rebuilds
  worker i from the leader's code) + mean_i ‖D_i(z_i) − x_i‖² + similarity · mean_i ‖z_i − z̄‖².
- **Optimiser**: Adam, lr 1e-3, one step per exchanged batch of W vectors.
- **Determinism**: weights are initialised from a CPU generator seeded by the shared seed, without touching
  the global RNG, and every worker trains its copy on the same exchanged values in the same order. That keeps
  the copies equal only where training is bitwise reproducible: another intra-op thread count, or CUDA's
  non-deterministic convolution backward, gives other rounding. The copies are therefore *not* relied on to
  be identical: at the switch to the frozen autoencoder the scheme sends the decoders that must agree
  (``decoder_weights`` / ``load_decoder_weights``, one fp32 vector per decoder; see ``gradcomp.schemes.lgc``).

State (``state_dict``): copies of the network's weights and of the optimiser's state (cloned tensors, a deep
copy), so a state taken mid-training keeps describing that moment; ``load_state_dict`` copies what it is
given, so the caller's dict is never changed by later training.
"""

from __future__ import annotations

import copy
import hashlib
import time
from typing import Any

import torch
from torch import Tensor, nn

from gradcomp.errors import ConfigError

LENGTH_MULTIPLE = 16  # four stride-2 layers
_WIDTHS = (64, 128, 256, 64)


def padded_length(n: int) -> int:
    """The smallest multiple of 16 that holds n values (at least 16)."""
    return max(LENGTH_MULTIPLE, -(-n // LENGTH_MULTIPLE) * LENGTH_MULTIPLE)


def _encoder(latent_channels: int) -> nn.Sequential:
    a, b, c, d = _WIDTHS
    return nn.Sequential(
        nn.Conv1d(1, a, 3, stride=2, padding=1), nn.LeakyReLU(0.2),
        nn.Conv1d(a, b, 3, stride=2, padding=1), nn.LeakyReLU(0.2),
        nn.Conv1d(b, c, 3, stride=2, padding=1), nn.LeakyReLU(0.2),
        nn.Conv1d(c, d, 3, stride=2, padding=1), nn.LeakyReLU(0.2),
        nn.Conv1d(d, latent_channels, 1),
    )  # fmt: skip


def _decoder(latent_channels: int) -> nn.Sequential:
    a, b, c, d = _WIDTHS
    return nn.Sequential(
        nn.ConvTranspose1d(latent_channels, d, 1), nn.LeakyReLU(0.2),
        nn.ConvTranspose1d(d, c, 3, stride=2, padding=1, output_padding=1), nn.LeakyReLU(0.2),
        nn.ConvTranspose1d(c, b, 3, stride=2, padding=1, output_padding=1), nn.LeakyReLU(0.2),
        nn.ConvTranspose1d(b, a, 3, stride=2, padding=1, output_padding=1), nn.LeakyReLU(0.2),
        nn.ConvTranspose1d(a, 1, 3, stride=2, padding=1, output_padding=1),
    )  # fmt: skip


def latent_size(length: int, latent_channels: int = 4) -> int:
    """Floats in the code of a padded vector of ``length`` values."""
    if length % LENGTH_MULTIPLE:
        raise ConfigError(f"the autoencoder takes lengths that are multiples of 16, got {length}")
    return latent_channels * length // LENGTH_MULTIPLE


class GradientAutoencoder(nn.Module):
    """One 1-D convolutional encoder and ``decoders`` transposed-convolution decoders (one per worker for the
    parameter-server variant, one for the ring)."""

    def __init__(self, latent_channels: int = 4, decoders: int = 1):
        super().__init__()
        for name, value in (("latent_channels", latent_channels), ("decoders", decoders)):
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ConfigError(f"{name} must be a positive integer, got {value!r}")
        self.latent_channels = latent_channels
        self.encoder = _encoder(latent_channels)
        self.decoders = nn.ModuleList(_decoder(latent_channels) for _ in range(decoders))

    def encode(self, x: Tensor) -> Tensor:
        """(B, L) values → (B, C·L/16) codes (flat)."""
        if x.dim() != 2 or x.shape[1] % LENGTH_MULTIPLE:
            raise ConfigError(f"encode takes (batch, L) with L a multiple of 16, got {tuple(x.shape)}")
        return self.encoder(x.unsqueeze(1)).flatten(1)

    def decode(self, z: Tensor, decoder: int = 0) -> Tensor:
        """(B, C·L/16) codes → (B, L) values, through decoder number ``decoder``."""
        if z.dim() != 2 or z.shape[1] % self.latent_channels:
            raise ConfigError(f"decode takes (batch, C·L/16) codes, got {tuple(z.shape)}")
        return self.decoders[decoder](z.view(z.shape[0], self.latent_channels, -1)).squeeze(1)


class AutoencoderTrainer:
    """A ``GradientAutoencoder`` with its Adam optimiser and the LGC losses; trained in place, step by step."""

    def __init__(
        self,
        latent_channels: int = 4,
        decoders: int = 1,
        seed: int = 0,
        lr: float = 1e-3,
        similarity: float = 0.1,
        device: torch.device | str = "cpu",
    ):
        for name, value in (("lr", lr), ("similarity", similarity)):
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not value >= 0:
                raise ConfigError(f"{name} must be a non-negative number, got {value!r}")
        if not lr > 0:
            raise ConfigError(f"lr must be positive, got {lr!r}")
        self.model = GradientAutoencoder(latent_channels, decoders)
        gen = torch.Generator().manual_seed(int(seed))
        with torch.no_grad():  # seeded init (PyTorch's default bounds), the global RNG untouched
            for p in self.model.parameters():
                fan_in = p[0].numel() if p.dim() > 1 else 16
                bound = 1.0 / fan_in**0.5
                p.copy_(torch.empty(p.shape).uniform_(-bound, bound, generator=gen))
        self.model.to(device)
        self.similarity = float(similarity)
        self.optimizer = torch.optim.Adam(self.model.parameters(), lr=float(lr))
        self.steps = 0
        self.seconds = 0.0  # spent training

    def ring_losses(self, values: Tensor) -> dict[str, Tensor]:
        """Ring variant, a (W, L) batch of scaled values: every worker's reconstruction, the codes' spread,
        and the decoded mean code against the mean of the values (what the ring uses)."""
        codes = self.model.encode(values)
        mean_code = codes.mean(0, keepdim=True)
        rec = (self.model.decode(codes) - values).pow(2).mean()
        sim = (codes - mean_code).pow(2).mean()
        mean_rec = (self.model.decode(mean_code) - values.mean(0, keepdim=True)).pow(2).mean()
        return {"total": rec + mean_rec + self.similarity * sim, "reconstruction": rec, "similarity": sim,
                "mean_reconstruction": mean_rec}  # fmt: skip

    def ps_losses(self, values: Tensor, leader: int) -> dict[str, Tensor]:
        """Parameter-server variant: decoder i rebuilds worker i's values from the leader's code (what the
        server does), and from worker i's own code; plus the codes' spread."""
        codes = self.model.encode(values)
        mean_code = codes.mean(0, keepdim=True)
        lead = codes[leader : leader + 1]
        cross = torch.stack([(self.model.decode(lead, i)[0] - values[i]).pow(2).mean() for i in range(len(values))])
        own = torch.stack([(self.model.decode(codes[i : i + 1], i)[0] - values[i]).pow(2).mean()
                           for i in range(len(values))])  # fmt: skip
        sim = (codes - mean_code).pow(2).mean()
        return {"total": cross.mean() + own.mean() + self.similarity * sim, "reconstruction": cross.mean(),
                "own_reconstruction": own.mean(), "similarity": sim}  # fmt: skip

    def train_step(self, values: Tensor, leader: int | None = None) -> float:
        """One Adam step on a (W, L) batch (ring loss, or the PS loss with ``leader``); returns the loss."""
        started = time.perf_counter()
        self.model.train()
        self.optimizer.zero_grad(set_to_none=True)
        values = values.detach().to(torch.float32)
        with torch.enable_grad():  # exchanges run under no_grad
            losses = self.ring_losses(values) if leader is None else self.ps_losses(values, leader)
            losses["total"].backward()
        self.optimizer.step()
        self.steps += 1
        self.seconds += time.perf_counter() - started
        return float(losses["total"].detach())

    @torch.no_grad()
    def encode(self, values: Tensor) -> Tensor:
        self.model.eval()
        return self.model.encode(values)

    @torch.no_grad()
    def decode(self, codes: Tensor, decoder: int = 0) -> Tensor:
        self.model.eval()
        return self.model.decode(codes, decoder)

    def digest(self) -> str:
        """A hash of the weights: equal on every worker when the copies are bit-identical."""
        h = hashlib.blake2b(digest_size=8)
        for t in self.model.state_dict().values():
            h.update(t.detach().cpu().contiguous().numpy().tobytes())
        return h.hexdigest()

    def decoder_weights(self, decoder: int = 0) -> Tensor:
        """Decoder number ``decoder``'s weights, flattened into one fp32 vector (parameter order)."""
        return torch.cat([p.detach().reshape(-1).to(torch.float32) for p in self.model.decoders[decoder].parameters()])

    @torch.no_grad()
    def load_decoder_weights(self, decoder: int, flat: Tensor) -> None:
        """Overwrite decoder number ``decoder`` with a vector made by ``decoder_weights`` (copied, not aliased)."""
        params = list(self.model.decoders[decoder].parameters())
        total = sum(p.numel() for p in params)
        if flat.numel() != total:
            raise ConfigError(f"decoder weights: {flat.numel()} values for {total} parameters")
        offset = 0
        for p in params:
            p.copy_(flat[offset : offset + p.numel()].view_as(p))
            offset += p.numel()

    def state_dict(self) -> dict[str, Any]:
        """Copies: later training changes neither the weights nor the Adam state returned here."""
        model = {name: t.detach().clone() for name, t in self.model.state_dict().items()}
        return {"model": model, "optimizer": copy.deepcopy(self.optimizer.state_dict()), "steps": self.steps}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        unknown = set(state) - {"model", "optimizer", "steps"}
        if unknown:
            raise ConfigError(f"unexpected autoencoder state keys {sorted(unknown)}")
        try:
            self.model.load_state_dict(state["model"])
            # torch's Optimizer.load_state_dict keeps the given state tensors (same dtype and device): copy first
            self.optimizer.load_state_dict(copy.deepcopy(state["optimizer"]))
        except (KeyError, RuntimeError, ValueError) as exc:
            raise ConfigError(f"autoencoder state does not fit this autoencoder: {exc}") from None
        self.steps = int(state.get("steps", 0))

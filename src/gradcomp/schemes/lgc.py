"""Learned Gradient Compression: an autoencoder trained during training, parameter-server and ring variants.

Abrahamyan, Chen, Bekoulis, Deligiannis, "Learned Gradient Compression for Distributed Deep Learning", IEEE
TNNLS 2021 (arXiv:2103.08870).

    gradcomp.make("lgc", variant="ring", dense_steps=100, topk_steps=200, density=0.001)
    gradcomp train --model convnet --compressor lgc --param variant=ps

The tensors of one exchange (one slot list: the whole model, or one DDP bucket) are handled together: the
model's first and last layer (``skip=true``, as the paper's implementation does) travel dense, the others are
concatenated into one vector of d values, of which k = ⌈density·d⌉ are sent. Every worker keeps an
error-feedback accumulator a ← residual + g over the d values, and its own autoencoder, per slot list.

**The first and the last layer** are the modules (parameter name without its last component) of the model's
first and last parameter in parameter order (``Slot.index``) — of the model, not of a DDP bucket. A slot list
whose indices are 0 … n − 1 is the whole model (GradientAggregator, or a DDP model in one bucket) unless a
higher index was exchanged at the same step; the DDP hook names the model after each backward pass
(``retain``). Until it has (the first pass of a DDP model in several buckets) every bucket travels dense, as
a bucket that holds only skipped layers always does. A model whose first and last layer are all its layers
(a two-layer MLP) skips nothing. skip needs one slot per parameter: a flattened slot (granularity ``model``,
a DDP hook with granularity ``bucket``) with ``skip=true`` raises ConfigError before anything is sent.
A DDP bucket too small for a code (latent ≥ k) travels dense; the whole model raises ConfigError instead.
Three stages, by step:

1. ``step < dense_steps``: a dense allreduce of everything (no residual).
2. the next ``topk_steps`` steps, top-k with error feedback at **common positions**: the leader (worker
   ``step mod W`` with ``rotate=true``, else 0) takes the k largest |a| and broadcasts their positions,
   Golomb–Rice coded (its length first, as control traffic); every worker allgathers its values a[P]; the
   update is their mean at P; the residual is a with a[P] = 0. Every worker now holds the same W value
   vectors, and trains its copy of the autoencoder (``gradcomp.schemes.lgc_autoencoder``) on them, one Adam
   step per exchange. Identical data, identical order, identical seed: the copies are bit-identical where
   training is bitwise reproducible (the tests compare the digests on gloo and on the simulated cluster), but
   another thread count or CUDA's non-deterministic kernels round differently.
3. afterwards, compressed steps with the autoencoder frozen. Ring, at the first one (per slot list, W > 1):
   rank 0's decoder goes to every worker once (a peer broadcast of ~173k floats, 692 kB with the default 4
   latent channels, booked like everything else), so that every replica decodes the same summed code with the
   same decoder; the encoders need not agree. The ps variant sends no weights: its update is the server's
   broadcast, the same on every replica whatever the copies' rounding. Where the server's copy of decoder i
   differs from worker i's (rounding, which may grow over the training steps), the server's rebuild of
   worker i differs from the prediction worker i subtracted by that much, and the residual does not carry it.
   With bitwise-reproducible training (CPU, same thread count) the copies are identical and nothing is lost;
   sending every worker's decoder to the server would cost 692 kB per worker to close that gap elsewhere.

   ``variant=ring``: positions as in stage 2; a max-allreduce of the workers' RMS of a[P] gives a common
   scale s (one fp32); every worker encodes its a[P] / s (zero-padded to a multiple of 16) with the same
   encoder; one allreduce sums the codes (C·L/16 floats, with the dense layers); every worker decodes the
   mean code once: the update at P is s·D(z̄). Residual: a with a[P] replaced by a[P] − s·D(z_i), what the
   worker's own code does not carry.

   ``variant=ps`` (the server is rank ``root``, 0): the leader broadcasts one message — its scale s_ℓ, its
   code z_ℓ, and the Golomb-coded positions; every worker i predicts its own values from the leader's code
   with decoder i, p_i = s_ℓ·D_i(z_ℓ), and sends its **innovation**: the k' = ⌈innovation·k⌉ largest entries
   of a[P] − p_i (32-bit index into P, fp32 value) with its dense layers, gathered at the server; the server
   rebuilds each worker's values as p_i plus its innovation, averages them, and broadcasts the k means (fp32;
   the positions are known) with the dense means. Residual: a with a[P] replaced by what the innovation left
   out. The autoencoder has one decoder per worker (the server's per-node decoders); every worker holds all
   of them, trained identically, because it needs its own to compute its innovation.

Choices where the paper is silent, and why:

- **Common positions from a rotating leader** (both variants, stages 2 and 3): the encoder needs every
  worker's values at the same positions; the leader's top-k follows the largest gradients, and rotating it
  lets every worker's gradient choose in turn. Its positions cost k·(b + 1 + …) bits (Golomb–Rice, b from the
  density), counted like everything else: the leader is a worker, so its broadcasts (positions; ps: the
  leader's message) and the ring's decoder sync are peer broadcasts (``Broadcast(peer=True)``), booked as the
  sender's upload and the others' download; the ps server's broadcast of the means is the server's downlink.
- **Scale**: the network sees unit-RMS values; the scale is sent as one fp32 (ring: the max over workers,
  by an allreduce, so that all codes share it). Where the squares overflow float32 (entries above about 1e19) the
  RMS is taken of the values divided by their largest magnitude and multiplied back (``_rms``), so a finite
  gradient of any size has a finite scale. A compressed step whose result is still not finite (a mean of values
  near float32's largest) is abandoned on every worker alike, its state put back, instead of applied.
- **Stage 2 is an allgather in both variants**, so that every worker has the training data; the
  parameter-server variant's stage 3 is a true gather/broadcast through the server.
- **Messages**: whatever is not summed by an allreduce (the positions, stage 2's values, the decoder sync, the
  leader's message, the innovations, the server's means) is a container message (``gradcomp.wire``:
  checksummed, every section checked against what the receiver expects; positions a Golomb section, the
  innovation's indices 32-bit sections checked against k), which adds 20 bytes and 10 per section to each; the
  ps variant's rounds 2 and 3 are ``protocols.parameter_server``.
- **Error feedback of what the code does not carry** (ring: own reconstruction error; ps: what the
  innovation left out), so that the compression error is sent later, as top-k's error feedback does.

Bad parameters (a variant other than ring/ps, negative stage lengths, topk_steps = 0 with compressed steps
to follow, densities outside (0, 1], a latent code not smaller than the k values of the whole model, skip
with a flattened slot, a model of empty tensors) raise ConfigError before anything is sent.

State (``state_dict``): per slot list that is compressed, the residual, the autoencoder (its weights and Adam
state) and whether its decoders were synced, in one ``SlotState`` of compressors/state.py (the autoencoder and
the flag in its held fields), keyed by the ``slot_key`` of the list taken as one slot (``list_slot``: its names
joined by ``|``, its d compressed values). The DDP hook's ``retain`` keeps every bucket's state across passes
and drops that of buckets that did not come back (DDP's first-pass buckets after its rebuild).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor

from gradcomp.compressors.base import Slot, check_bool, check_density, check_int, kept_count
from gradcomp.compressors.state import SlotState, key_numel, slot_key
from gradcomp.errors import ConfigError
from gradcomp.finite import finite_flag
from gradcomp.protocols import allgather_buffers, broadcast_buffer, parameter_server
from gradcomp.schemes.accumulation import floats_spec, indices_spec, largest, offsets_of, split_indices
from gradcomp.schemes.base import Scheme
from gradcomp.schemes.lgc_autoencoder import AutoencoderTrainer, latent_size, padded_length
from gradcomp.transport.requests import AllReduce, Rounds
from gradcomp.wire import Codec, FieldSpec, decode, encode, encoded_size
from gradcomp.wire.device import held_for_the_pass
from gradcomp.wire.format import max_encoded_size
from gradcomp.wire.refusals import StepAbandoned
from gradcomp.wire.golomb import optimal_rice_parameter

VARIANTS = ("ring", "ps")
FIELDS = ("residual", "autoencoder", "synced")  # the state's fields; "autoencoder" and "synced" are held ones


@dataclass
class Layout:
    """One slot list: which slots are compressed, the sizes, its training's diagnostics (its state: ``LGC.state``)."""

    names: tuple[str, ...]
    compressed: list[int]
    skipped: list[int]
    d: int  # 0: everything of this slot list travels dense (the model's first / last layer, or too small for a code)
    k: int
    length: int  # k padded to a multiple of 16
    latent: int
    innovation: int
    rice: int
    ends: tuple[str, str] | None = None  # the model's first and last module, sent dense (None: nothing skipped)
    losses: list[float] = field(default_factory=list)  # the autoencoder's training loss per stage-2 step
    # stage 3, per step: (energy of the values, of their m largest, of the error) on the device, read by report()
    held_out: list[Tensor] = field(default_factory=list)


def _decoded(message: Tensor, specs: list[FieldSpec]) -> list[Tensor]:
    """``decode``, its checks joining the step's held ones where a step holds them (the aggregator, the DDP hook,
    FSDP on the device path: read once, with the verdict, at the step's or the pass's end; the positions are clamped
    into their slot meanwhile), else read at once."""
    return decode(message, specs, held_for_the_pass())


class LGC(Scheme):
    name = "lgc"

    def __init__(
        self,
        variant: str = "ring",
        dense_steps: int = 100,
        topk_steps: int = 200,
        density: float = 0.001,
        innovation: float = 0.1,
        latent_channels: int = 4,
        skip: bool = True,
        rotate: bool = True,
        root: int = 0,
        lr: float = 1e-3,
        similarity: float = 0.1,
        seed: int = 0,
    ):
        if variant not in VARIANTS:
            raise ConfigError(f"variant must be one of {VARIANTS}, got {variant!r}")
        self.variant = variant
        self.dense_steps = check_int("dense_steps", dense_steps, minimum=0)
        self.topk_steps = check_int("topk_steps", topk_steps, minimum=1)
        self.density = check_density(density)
        if isinstance(innovation, bool) or not isinstance(innovation, (int, float)) or not 0 < innovation <= 1:
            raise ConfigError(f"innovation must be a fraction of k in (0, 1], got {innovation!r}")
        self.innovation = float(innovation)
        self.latent_channels = check_int("latent_channels", latent_channels, minimum=1)
        self.skip = check_bool("skip", skip)
        self.rotate = check_bool("rotate", rotate)
        self.root = check_int("root", root, minimum=0)
        for name, value in (("lr", lr), ("similarity", similarity)):
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not value >= 0:
                raise ConfigError(f"{name} must be a non-negative number, got {value!r}")
        if not lr > 0:
            raise ConfigError(f"lr must be positive, got {lr!r}")
        self.lr, self.similarity = float(lr), float(similarity)
        self.seed = check_int("seed", seed, minimum=0)
        self._layouts: dict[tuple[str, ...], Layout] = {}
        # per compressed slot list (``list_slot``): its residual, its autoencoder (made at its first top-k step, or
        # the state loaded for it until then) and True once its decoders were made to agree (``_sync``)
        self.state = SlotState("lgc", FIELDS[:1], held=FIELDS[1:])
        self._unseen: set[str] = set()  # the keys loaded whose slot list has not come since: kept through retain
        self._model_size: int | None = None  # the model's number of slots, from retain() (the DDP hook)
        self._model_ends: tuple[str, str] | None = None  # the modules skip sends dense, from retain()
        self._seen: tuple[int, int] = (-1, -1)  # (step, the highest slot index exchanged at that step)
        self._used: set[tuple[str, ...]] = set()  # slot lists exchanged since the last retain()

    def params(self) -> dict[str, Any]:
        return {
            "variant": self.variant,
            "dense_steps": self.dense_steps,
            "topk_steps": self.topk_steps,
            "density": self.density,
            "innovation": self.innovation,
            "latent_channels": self.latent_channels,
            "skip": self.skip,
            "rotate": self.rotate,
            "root": self.root,
            "lr": self.lr,
            "similarity": self.similarity,
            "seed": self.seed,
        }

    def bind(self, rank: int, world_size: int) -> None:
        if self.variant == "ps" and self.root >= world_size:
            raise ConfigError(f"parameter-server root {self.root} is not a rank of a world of size {world_size}")
        super().bind(rank, world_size)

    def defers_verdict(self, slots: Sequence[Slot]) -> bool:
        """True: the leader's positions are broadcast before any message every worker contributes to (with their
        length first: the same collectives whatever the data), and every later message has the size the layout
        fixes; the verdict rides on the first of those and is read after the rounds, with the decoded messages'
        checks (``_decoded``)."""
        return True

    def stage(self, step: int) -> int:
        """1 (dense), 2 (top-k, training the autoencoder) or 3 (compressed with the frozen autoencoder)."""
        if step < self.dense_steps:
            return 1
        return 2 if step < self.dense_steps + self.topk_steps else 3

    # -- sizes ----------------------------------------------------------------------------------------------------

    def layout(self, slots: Sequence[Slot], step: int | None = None) -> Layout:
        """The slot list's layout (cached): which slots travel dense, d, k and the code's size.

        With ``skip`` the model's first and last module must be known: from ``retain`` (the DDP hook), or from a
        slot list that is the whole model (``_whole``, which needs the exchange's ``step``). Until then a slot
        list (a DDP bucket of the first backward pass) travels dense, and nothing is cached for it.
        """
        names = tuple(s.name for s in slots)
        for s in slots:
            if s.shape is not None and math.prod(s.shape) != s.numel:
                raise ConfigError(f"{s.name}: shape {tuple(s.shape)} does not hold {s.numel} elements")
        flat = [s.name for s in slots if s.shape is None and "." not in s.name]
        if self.skip and flat:
            raise ConfigError(
                f"lgc: skip=true sends the model's first and last layer dense, which needs one slot per parameter "
                f"(granularity 'layer'); {flat[0]!r} is a flattened vector (granularity 'model', or a DDP hook with "
                "granularity 'bucket'): use granularity 'layer', or pass skip=false"
            )
        whole = self._whole(slots, step)
        if not self.skip:
            ends = None
        elif self._model_size is not None:
            ends = self._model_ends
        elif whole:
            ends = _skip_ends(slots)
        else:
            return _dense_layout(names, len(slots))
        cached = self._layouts.get(names)
        if cached is not None and cached.ends == ends and cached.d == sum(slots[i].numel for i in cached.compressed):
            return cached
        skipped = [i for i, s in enumerate(slots) if ends is not None and _module(s.name) in ends]
        compressed = [i for i in range(len(slots)) if i not in skipped]
        d = sum(slots[i].numel for i in compressed)
        k = kept_count(self.density, d) if d else 0
        length = padded_length(k)
        latent = latent_size(length, self.latent_channels)
        if latent < k:
            layout = Layout(
                names=names,
                compressed=compressed,
                skipped=skipped,
                d=d,
                k=k,
                length=length,
                latent=latent,
                innovation=max(1, math.ceil(self.innovation * k)),
                rice=optimal_rice_parameter(k / d),
                ends=ends,
            )
        elif not whole:
            layout = _dense_layout(names, len(slots), ends)  # a DDP bucket too small for a code, or skipped whole
        elif d == 0:
            raise ConfigError("lgc: nothing to compress (every tensor is empty)")
        else:
            raise ConfigError(
                f"lgc: a latent code of {latent} floats ({self.latent_channels} channels × {length // 16}) is not "
                f"smaller than the k = {k} values it encodes (density {self.density} of {d}): raise the density "
                "or lower latent_channels"
            )
        self._layouts[names] = layout
        return layout

    def _whole(self, slots: Sequence[Slot], step: int | None) -> bool:
        """Whether a slot list is the whole model: its indices are exactly 0 … n − 1, and n is the model's size
        (once ``retain`` gave it), else no higher index was exchanged at the same ``step`` (another DDP bucket of
        the pass). Without a step (``check_slots``, which the DDP hook calls per bucket) nothing is assumed."""
        if sorted(s.index for s in slots) != list(range(len(slots))):
            return False
        if self._model_size is not None:
            return len(slots) == self._model_size
        if step is None:
            return False
        seen_step, seen_max = self._seen
        return not (seen_step == step and seen_max >= len(slots))

    def check_slots(self, slots: Sequence[Slot]) -> None:
        if slots:
            self.layout(slots)

    def _trainer(self, layout: Layout, device: torch.device) -> AutoencoderTrainer:
        """The slot list's autoencoder, made on ``device`` at its first top-k step (from the state loaded for it,
        if one was)."""
        trainer = self.state.get("autoencoder", list_slot(layout))
        if not isinstance(trainer, AutoencoderTrainer):
            decoders = self.world_size if self.variant == "ps" else 1
            made = AutoencoderTrainer(
                self.latent_channels, decoders, seed=self.seed, lr=self.lr, similarity=self.similarity, device=device
            )
            if trainer is not None:
                made.load_state_dict(trainer)
            trainer = self.state.put("autoencoder", list_slot(layout), made)
        return trainer

    def _trainers(self) -> dict[tuple[str, ...], AutoencoderTrainer]:
        """The autoencoders made so far, by slot list."""
        held = self.state["autoencoder"]
        found = {names: held.get(slot_key(list_slot(lay))) for names, lay in self._layouts.items() if lay.d}
        return {names: t for names, t in found.items() if isinstance(t, AutoencoderTrainer)}

    # -- the rounds -----------------------------------------------------------------------------------------------

    def run(self, slots: Sequence[Slot], tensors: Sequence[Tensor], step: int) -> Rounds:
        if not slots:
            return []
        if len(slots) != len(tensors):
            raise ConfigError(f"{len(slots)} slots but {len(tensors)} tensors")
        layout = self.layout(slots, step)  # raises before anything is sent
        self._seen = (step, max(self._seen[1] if self._seen[0] == step else -1, *(s.index for s in slots)))
        self._used.add(layout.names)
        if self._unseen and layout.d:
            self._seen_since_load(layout)
        flat = [t.reshape(-1).to(torch.float32) for t in tensors]
        world = self.world_size
        stage = self.stage(step)
        if stage == 1 or layout.d == 0:
            summed = yield AllReduce(torch.cat(flat), inplace=True)
            return _split(summed.div_(world), [s.numel for s in slots])

        device = flat[0].device
        acc = torch.cat([flat[i] for i in layout.compressed])
        residual = self.state.get("residual", list_slot(layout), acc)
        if residual is not None:
            acc.add_(residual)
        dense = torch.cat([flat[i] for i in layout.skipped]) if layout.skipped else acc.new_empty(0)
        leader = step % world if self.rotate else 0
        trainer = self._trainer(layout, device)

        if stage == 2:
            positions = yield from self._positions(layout, acc, leader)
            specs = [floats_spec(layout.k)]
            gathered = yield from allgather_buffers(self.rank, encode([acc[positions]], specs),
                                                    [encoded_size(specs)] * world)  # fmt: skip
            batch = torch.stack([_decoded(b, specs)[0] for b in gathered])  # (W, k): the same on every worker
            update = batch.mean(0)
            dense_mean = (yield AllReduce(dense, inplace=True)).div_(world) if dense.numel() else dense
            acc.index_fill_(0, positions, 0.0)  # a scalar fill: no host-to-device copy of the 0
            scale = _rms(batch)
            layout.losses.append(trainer.train_step(_pad(batch / scale, layout.length),
                                                    leader if self.variant == "ps" else None))  # fmt: skip
        else:
            if not self.state.get("synced", list_slot(layout)) and world > 1 and self.variant == "ring":
                yield from self._sync(layout, trainer)
            self.state.put("synced", list_slot(layout), True)
            compressed = self._ring if self.variant == "ring" else self._ps
            positions, update, dense_mean, carried = yield from compressed(layout, acc, dense, leader, trainer)
            self._record_error(layout, acc[positions], carried)
            acc[positions] -= carried
        self.state.put("residual", list_slot(layout), acc)
        _abandon_unless_finite([update, dense_mean])

        out_c = torch.zeros(layout.d, dtype=torch.float32, device=device)
        out_c[positions] = update
        parts_c = _split(out_c, [slots[i].numel for i in layout.compressed])
        parts_d = _split(dense_mean, [slots[i].numel for i in layout.skipped])
        out: list[Tensor] = [torch.empty(0)] * len(slots)
        for i, part in zip(layout.compressed, parts_c):
            out[i] = part
        for i, part in zip(layout.skipped, parts_d):
            out[i] = part
        return out

    def _record_error(self, layout: Layout, values: Tensor, carried: Tensor) -> None:
        """Held-out diagnostics of a compressed step (the autoencoder never trains on these values): the
        relative squared error of what this worker's message carries, and that of plain top-k values of the
        same bits (the m largest of the k values, each an fp32 and an index of ⌈log2 k⌉ bits)."""
        sent_bits = 32 * layout.latent if self.variant == "ring" else 64 * layout.innovation
        m = min(layout.k, sent_bits // (32 + max(1, math.ceil(math.log2(layout.k)))))
        energy = values.pow(2).sum()
        # the m largest magnitudes' energy (which of tied ones is kept does not change it); nothing is read here: the
        # three sums stay on the device until report() reads them all at once
        kept = torch.topk(values.abs(), m, sorted=False).values.pow(2).sum() if m else torch.zeros_like(energy)
        layout.held_out.append(torch.stack([energy, kept, (values - carried).pow(2).sum()]))

    def _sync(self, layout: Layout, trainer: AutoencoderTrainer) -> Rounds:
        """Ring, at the first compressed step: rank 0's decoder to every worker (a peer broadcast of one fp32
        section of known size), so that every replica decodes the same summed code with the same decoder whatever
        rounding each worker's training had (thread counts, CUDA). The encoders need not agree: each encodes its
        own values and the codes are summed. The ps variant needs no sync (see the module docstring)."""
        weights = trainer.decoder_weights(0)
        specs = [floats_spec(weights.numel())]
        message = encode([weights], specs) if self.rank == 0 else None
        message = yield from broadcast_buffer(message, 0, weights.device, encoded_size(specs), peer=True)
        trainer.load_decoder_weights(0, decode(message, specs)[0])

    def _positions(self, layout: Layout, acc: Tensor, leader: int) -> Rounds:
        """The leader's top-k positions, Golomb–Rice coded and broadcast (length first); sorted int64."""
        specs = [self._positions_spec(layout)]
        message = encode([largest(acc, layout.k).sort().values], specs) if self.rank == leader else None
        message = yield from broadcast_buffer(message, leader, acc.device, peer=True, limit=max_encoded_size(specs))
        return _decoded(message, specs)[0].to(acc.device)

    @staticmethod
    def _positions_spec(layout: Layout) -> FieldSpec:
        return FieldSpec(Codec.GOLOMB, count=layout.k, universe=layout.d, golomb_b=layout.rice)

    def _ring(self, layout: Layout, acc: Tensor, dense: Tensor, leader: int, trainer: AutoencoderTrainer) -> Rounds:
        world, k = self.world_size, layout.k
        positions = yield from self._positions(layout, acc, leader)
        values = acc[positions]
        scale = (yield AllReduce(_rms(values), op="max"))[0]
        code = trainer.encode(_pad((values / scale).unsqueeze(0), layout.length))  # (1, latent)
        summed = yield AllReduce(torch.cat([code.reshape(-1), dense]), inplace=True)
        mean_code = summed[: layout.latent].div(world).unsqueeze(0)
        update = trainer.decode(mean_code)[0, :k].mul(scale)
        carried = trainer.decode(code)[0, :k].mul(scale)
        return positions, update, summed[layout.latent :].div(world), carried

    def _ps(self, layout: Layout, acc: Tensor, dense: Tensor, leader: int, trainer: AutoencoderTrainer) -> Rounds:
        world, k, device = self.world_size, layout.k, acc.device
        # round 1: the leader's scale, code and positions, to every worker
        lead_specs = [floats_spec(1 + layout.latent), self._positions_spec(layout)]
        message = None
        if self.rank == leader:
            chosen = largest(acc, k).sort().values
            lead_values = acc[chosen]
            lead_scale = _rms(lead_values)
            lead_code = trainer.encode(_pad((lead_values / lead_scale).unsqueeze(0), layout.length)).reshape(-1)
            message = encode([torch.cat([lead_scale, lead_code]), chosen], lead_specs)
        message = yield from broadcast_buffer(message, leader, device, peer=True, limit=max_encoded_size(lead_specs))
        floats, positions = _decoded(message, lead_specs)
        lead_scale, lead_code = floats[0], floats[1:].unsqueeze(0)
        positions = positions.to(device)

        # round 2: every worker's innovation (and its dense layers) to the server, which sends back the means at
        # the positions and of the dense layers (round 3)
        values = acc[positions]
        predicted = trainer.decode(lead_code, self.rank)[0, :k].mul(lead_scale)
        missing = values - predicted
        picked = largest(missing, layout.innovation)
        n = layout.innovation
        up = [floats_spec(n), indices_spec(n), floats_spec(dense.numel())]
        down = [floats_spec(k + dense.numel())]

        def serve(buffers: list[Tensor]) -> Tensor:
            total = torch.zeros(k + dense.numel(), dtype=torch.float32, device=device)
            for w, received in enumerate(buffers):  # rank order
                their_values, their_index, their_dense = _decoded(received, up)
                (their_index,) = split_indices(their_index, [n], [k], "lgc innovation")
                rebuilt = trainer.decode(lead_code, w)[0, :k].mul(lead_scale)
                rebuilt.index_add_(0, their_index, their_values)
                total[:k].add_(rebuilt)
                total[k:].add_(their_dense)
            return encode([total.div_(world)], down)

        mine = encode([missing[picked], picked, dense], up)
        means = yield from parameter_server(self.rank, mine, serve, self.root, [encoded_size(up)] * world,
                                            encoded_size(down))  # fmt: skip
        (means,) = _decoded(means, down)
        carried = predicted.clone()
        carried[picked] += missing[picked]
        return positions, means[:k], means[k:], carried

    # -- state ----------------------------------------------------------------------------------------------------

    def retain(self, slots: Sequence[Slot]) -> None:
        """``slots``: every slot of the model (the DDP hook passes every slot of the backward pass, after its last
        bucket). Learns the model (its size, the modules ``skip`` sends dense) and keeps the layouts whose slots
        are all among ``slots``, that were exchanged since the last retain (every bucket of the pass; DDP's
        first-pass buckets never come back after its bucket rebuild) and that skip what the model's layouts skip,
        with their state, and the state loaded for slot lists not seen since (DDP's rebuilt buckets come back after
        its first pass)."""
        if slots:
            self._model_size = len(slots)
            self._model_ends = _skip_ends(slots) if self.skip else None
        live = {s.name for s in slots}
        used, self._used = self._used, set()
        self._layouts = {
            key: lay
            for key, lay in self._layouts.items()
            if set(key) <= live and (key in used or not used) and lay.ends == self._model_ends
        }
        loaded = [Slot(key.rpartition("#")[0], 0, key_numel(key)) for key in self._unseen]
        self.state.retain([list_slot(lay) for lay in self._layouts.values() if lay.d] + loaded)

    def report(self) -> dict[str, Any]:
        """What the run's JSON records of the method: the autoencoder's training (time, steps, loss) and its
        held-out errors against plain top-k values of the same bits, per slot list."""
        out: dict[str, Any] = {"autoencoder_seconds": self.training_seconds(), "layouts": []}
        trainers = self._trainers()
        for names, lay in self._layouts.items():
            if lay.d == 0:
                continue
            sums = torch.stack(lay.held_out).tolist() if lay.held_out else []  # (energy, kept, error) per step
            errors = [error / energy for energy, _, error in sums if energy != 0.0]  # a step with nothing to carry
            topk = [1.0 - kept / energy for energy, kept, _ in sums if energy != 0.0]  # is not counted
            out["layouts"].append({
                "compressed": lay.d, "k": lay.k, "latent": lay.latent, "innovation": lay.innovation,
                "autoencoder_steps": trainers[names].steps if names in trainers else 0,
                "train_loss_first": lay.losses[0] if lay.losses else None,
                "train_loss_last": lay.losses[-1] if lay.losses else None,
                "held_out_steps": len(errors),
                "held_out_error": sum(errors) / len(errors) if errors else None,
                "topk_same_bits_error": sum(topk) / len(topk) if topk else None,
            })  # fmt: skip
        return out

    def autoencoder_digests(self) -> dict[tuple[str, ...], str]:
        return {names: trainer.digest() for names, trainer in self._trainers().items()}

    def training_seconds(self) -> float:
        """Time spent training the autoencoder(s) so far."""
        return sum(trainer.seconds for trainer in self._trainers().values())

    def state_dict(self) -> dict[str, Any]:
        """``{"residual": {key: tensor}, "autoencoder": {key: its state_dict()}, "synced": {key: True}}``, ``key``
        a compressed slot list's ``slot_key(list_slot(layout))``; a state loaded and not yet used is the one loaded."""
        return self.state.state_dict()

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if isinstance(state, dict) and not set(state) <= set(FIELDS):
            state = _keyed_by_names(state)
        self.state.load_state_dict(state)
        self._unseen = {key for name in FIELDS for key in self.state[name]}

    def _seen_since_load(self, layout: Layout) -> None:
        """The slot list's loaded state is in use from now on (no longer kept through retain for it); a state
        loaded for the same slot list but another number of compressed values is refused."""
        key = slot_key(list_slot(layout))
        for other in self._unseen - {key}:
            if other.rpartition("#")[0] == key.rpartition("#")[0]:
                raise ConfigError(f"lgc state: saved for {key_numel(other)} compressed values, not {layout.d}")
        self._unseen.discard(key)


def _keyed_by_names(state: dict[str, Any]) -> dict[str, Any]:
    """LGC's earlier state formats, keyed by the compressed slot lists' names joined by ``|`` (``{"residual":
    {key: tensor}, "layouts": {names: {"autoencoder", "synced"}}}``, and before the residuals' SlotState ``{names:
    {"residual", "autoencoder", "synced"}}``), in this one: a slot list's autoencoder and flag go under its
    residual's key. One without a residual had completed no top-k or compressed step (its residual is kept at the
    end of the step that trains its autoencoder): it has nothing to keep."""
    if "layouts" not in state:  # before the residuals' SlotState
        state = {
            "residual": {f"{k}#{p['residual'].numel()}": p["residual"] for k, p in state.items()
                         if isinstance(p, dict) and isinstance(p.get("residual"), Tensor)},
            "layouts": {k: {n: v for n, v in p.items() if n != "residual"} if isinstance(p, dict) else p
                        for k, p in state.items()},
        }
    residual, layouts = state.get("residual", {}), state["layouts"]
    if set(state) - {"residual", "layouts"} or not isinstance(residual, dict) or not isinstance(layouts, dict):
        raise ConfigError("lgc state: expected 'residual' and 'layouts'")
    keys = {key.rpartition("#")[0]: key for key in residual if isinstance(key, str)}
    out: dict[str, Any] = {"residual": residual, "autoencoder": {}, "synced": {}}
    for names, part in layouts.items():
        if not isinstance(part, dict) or set(part) - {"autoencoder", "synced"}:
            raise ConfigError(f"lgc state {names!r}: expected ['autoencoder', 'synced'] per slot list")
        if names in keys and part.get("autoencoder") is not None:
            out["autoencoder"][keys[names]] = part["autoencoder"]
        if names in keys and part.get("synced"):
            out["synced"][keys[names]] = True
    return out


def list_slot(layout: Layout) -> Slot:
    """The slot a compressed slot list's state is kept under: its names joined by ``|``, d values."""
    return Slot(name="|".join(layout.names), index=0, numel=layout.d)


def _module(name: str) -> str:
    """A parameter's module: its name without the last component ("features.0.weight" → "features.0")."""
    return name.rsplit(".", 1)[0]


def _skip_ends(slots: Sequence[Slot]) -> tuple[str, str] | None:
    """The modules of the model's first and last parameter (lowest and highest ``Slot.index``), which ``skip``
    sends dense; None (nothing skipped) when they are all the model's modules (a two-layer model)."""
    ends = _module(min(slots, key=lambda s: s.index).name), _module(max(slots, key=lambda s: s.index).name)
    return ends if any(_module(s.name) not in ends for s in slots) else None


def _dense_layout(names: tuple[str, ...], n: int, ends: tuple[str, str] | None = None) -> Layout:
    """A slot list that travels dense (one allreduce of everything, no state)."""
    return Layout(names=names, compressed=[], skipped=list(range(n)), d=0, k=0, length=0, latent=0, innovation=0,
                  rice=0, ends=ends)  # fmt: skip



def _abandon_unless_finite(results: list[Tensor]) -> None:
    """A compressed step's results, the same on every worker (the means the server broadcast, or the decoded mean
    code): where they are not finite (a gradient near float32's largest value: the scale times the decoder's output,
    the server's sum of rebuilt values), the step is abandoned on every worker alike instead of applied. The flag
    joins the step's held checks (read once, with the verdict) where a step holds them, else it is read here."""
    bad = ~finite_flag(results)
    held = held_for_the_pass()
    if held is not None:
        held.abandon(bad)
    elif bool(bad):
        raise StepAbandoned


def _rms(values: Tensor) -> Tensor:
    """The root mean square of ``values`` (at least 1e-30), one float32 element: the scale a worker's values are
    divided by before the encoder. Squared as they are (the same bits as before this function), except where that
    overflows float32 (entries above about 1e19): then scaled by their largest magnitude first, so that a finite
    gradient of any size has a finite scale. (An Inf scale made every value NaN; in the ring it went into the
    scales' max all-reduce, where it reads as a "not finite" mark: every later step was abandoned.)"""
    plain = values.pow(2).mean().sqrt()
    peak = values.abs().amax()
    scaled = peak * (values / peak).pow(2).mean().sqrt()
    return torch.where(torch.isfinite(plain), plain, scaled).clamp_min(1e-30).reshape(1)

def _pad(x: Tensor, length: int) -> Tensor:
    """(B, n) → (B, length), zeros appended."""
    if x.shape[1] == length:
        return x
    out = x.new_zeros(x.shape[0], length)
    out[:, : x.shape[1]] = x
    return out


def _split(flat: Tensor, sizes: Sequence[int]) -> list[Tensor]:
    offsets = offsets_of(sizes)
    return [flat[offsets[i] : offsets[i + 1]] for i in range(len(sizes))]

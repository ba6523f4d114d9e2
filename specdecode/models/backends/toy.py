"""The toy backend: a tiny model with no transformers inside, for demos and tests (``--backend toy``).

It proves the engine, ``generate``, ``check`` and ``serve`` need nothing but the backend protocol, and it
is the smallest example of a backend: one file and one line in the registry. ``--target toy:SEED`` names
a random toy model; ``toy:SEED:NOISE`` is that model with its weights perturbed (a draft that agrees with
it more or less, like a smaller model of the same family). Its tokenizer has one token per character of
``a-zA-Z0-9`` and an end-of-sequence token.

The toy "model": the hidden state of a query is a position-weighted mean of the embeddings of the
tokens it can see (weight ``exp(-DECAY * (query position - key position))``), plus its own position's
features; logits are a linear map of it. Its "KV cache" stores, per slot and write index, the token
and its position, so writes, tree masks, truncation, compaction and slot copies all behave like a
real cache. :meth:`ToyRunner.reference_logits` recomputes from a plain token list (the slow reference).
"""

from __future__ import annotations

import re
import string
from dataclasses import dataclass

import torch

from specdecode.models.backends.base import Backend, Model, Settings, Supports
from specdecode.models.base import ForwardOutput, Runner
from specdecode.models.loading import ModelNotFoundError

DECAY = 0.3
ALPHABET = string.ascii_lowercase + string.ascii_uppercase + string.digits  # one token per character
EOS = "<eos>"
VOCAB = len(ALPHABET) + 1
CONTEXT = 4096
SPEC = re.compile(r"toy:(\d+)(?::(\d*\.?\d+))?")


class ToyRunner(Runner):
    num_layers = 1
    backend = "toy"

    def __init__(self, vocab_size: int, hidden: int = 16, seed: int = 0, sharpness: float = 4.0) -> None:
        g = torch.Generator().manual_seed(seed)
        self.vocab_size, self.hidden_size = vocab_size, hidden
        self.emb = torch.randn(vocab_size, hidden, generator=g)
        self.freqs = torch.rand(hidden, generator=g) * 0.5
        self.head = torch.randn(hidden, vocab_size, generator=g) * sharpness / hidden**0.5
        self.dtype, self.device = torch.float32, torch.device("cpu")
        self.eos_token_ids = {vocab_size - 1}
        self.identity = f"toy:{seed}:{id(self)}"
        self.num_slots = self.max_len = 0
        self.kv_tok = self.kv_pos = torch.zeros(0, 0, dtype=torch.long)

    def ensure_capacity(self, num_slots: int, max_len: int) -> None:
        if num_slots <= self.num_slots and max_len <= self.max_len:
            return
        self.num_slots, self.max_len = max(num_slots, self.num_slots), max(max_len, self.max_len)
        self.kv_tok = torch.zeros(self.num_slots, self.max_len, dtype=torch.long)
        self.kv_pos = torch.zeros(self.num_slots, self.max_len, dtype=torch.long)

    def kv_bytes(self) -> int:
        return 16 * self.kv_tok.numel()

    def _hidden(
        self, toks: torch.Tensor, kpos: torch.Tensor, visible: torch.Tensor, qpos: torch.Tensor
    ) -> torch.Tensor:
        # toks/kpos [L], visible [q, L] bool, qpos [q] -> [q, H]
        w = torch.exp(-DECAY * (qpos[:, None] - kpos[None, :]).clamp(min=0).float()) * visible
        mixed = (w @ self.emb[toks]) / w.sum(-1, keepdim=True)
        return mixed + torch.sin(qpos[:, None].float() * self.freqs[None])

    def forward(
        self, slots, input_ids, positions, *, write_positions=None, tree_mask=None, tree_start=None, layers=()
    ) -> ForwardOutput:
        writes = positions if write_positions is None else write_positions
        bsz, q = input_ids.shape
        if int(writes.max()) >= self.max_len:
            raise ValueError("past the cache")
        out = torch.zeros(bsz, q, self.hidden_size)
        for b in range(bsz):
            s = int(slots[b])
            self.kv_tok[s, writes[b]] = input_ids[b]
            self.kv_pos[s, writes[b]] = positions[b]
            kv_len = int(writes[b].max()) + 1
            if tree_mask is not None:
                start = int(writes[b].min()) if tree_start is None else int(tree_start[b])
                kv_len = max(kv_len, start + tree_mask.shape[2])
            keys = torch.arange(kv_len)
            if tree_mask is None:
                visible = keys[None, :] <= writes[b][:, None]
            else:
                visible = (keys[None, :] < start).expand(q, -1).clone()
                visible[:, start : start + tree_mask.shape[2]] = tree_mask[b]
            out[b] = self._hidden(self.kv_tok[s, :kv_len], self.kv_pos[s, :kv_len], visible, positions[b])
        feats = {}
        for layer in layers:
            feats[layer] = self.emb[input_ids] if layer == 0 else out
        return ForwardOutput(out, feats)

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return (hidden @ self.head).float()

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.emb[input_ids]

    def prefill(self, slots, prompts, layers=(), starts=None):
        feats = []
        for slot, p, start in zip(slots, prompts, starts or [0] * len(prompts)):
            if not p:
                feats.append({})
                continue
            n = len(p)
            out = self.forward(torch.tensor([slot]), torch.tensor([p]), start + torch.arange(n)[None], layers=layers)
            feats.append({layer: h[0] for layer, h in out.features.items()})
        return feats

    def truncate(self, slot: int, length: int) -> None:
        self.kv_tok[slot, length:] = (
            0  # not needed for correctness (masked by position): proves callers don't rely on it
        )

    def compact(self, slot: int, src, dst_start: int) -> None:
        idx = torch.tensor(list(src), dtype=torch.long)
        self.kv_tok[slot, dst_start : dst_start + len(idx)] = self.kv_tok[slot, idx].clone()
        self.kv_pos[slot, dst_start : dst_start + len(idx)] = self.kv_pos[slot, idx].clone()

    def copy_slot(self, src: int, dst: int, length: int) -> None:
        self.kv_tok[dst, :length] = self.kv_tok[src, :length]
        self.kv_pos[dst, :length] = self.kv_pos[src, :length]

    def export_kv(self, slot: int, length: int):
        return self.kv_tok[slot, :length].clone(), self.kv_pos[slot, :length].clone()

    def import_kv(self, slot: int, state) -> None:
        tok, pos = state
        self.kv_tok[slot, : len(tok)] = tok
        self.kv_pos[slot, : len(pos)] = pos

    # -- the slow reference -----------------------------------------------------------------------
    def reference_logits(self, token_ids: list[int]) -> torch.Tensor:  # [V]: next-token logits after token_ids
        n = len(token_ids)
        pos = torch.arange(n)
        h = self._hidden(torch.tensor(token_ids), pos, torch.ones(1, n, dtype=torch.bool), pos[-1:])
        return self.logits(h)[0]

    def perturb(self, noise: float, seed: int) -> "ToyRunner":
        """Add ``noise`` x std Gaussian noise to every weight table (in place; a draft of this model)."""
        g = torch.Generator().manual_seed(seed)
        for table in (self.emb, self.head):
            table.add_(noise * table.std() * torch.randn(table.shape, generator=g))
        return self


def make_tokenizer():
    """One token per character of :data:`ALPHABET`, then <eos>; decoding concatenates."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {c: i for i, c in enumerate(ALPHABET)} | {EOS: len(ALPHABET)}
    tok = Tokenizer(models.WordLevel(vocab, unk_token=EOS))
    tok.pre_tokenizer = pre_tokenizers.Split("", behavior="isolated")
    tok.decoder = decoders.Fuse()
    return PreTrainedTokenizerFast(tokenizer_object=tok, eos_token=EOS)


@dataclass
class ToyModel(Model):
    seed: int = 0
    noise: float = 0.0

    def runner(self, *, batch_invariant: bool = False, trees: bool = False, draft: bool = False) -> ToyRunner:
        runner = ToyRunner(VOCAB, seed=self.seed)
        runner.identity = f"toy:{self.seed}:{self.noise}"  # equal weights: equal K/V (prefix reuse may share)
        return runner.perturb(self.noise, self.seed + 1) if self.noise else runner


class ToyBackend(Backend):
    name = "toy"
    description = "a tiny built-in model with no transformers inside (toy:SEED[:NOISE]), for demos and tests"
    supports = Supports(
        opens=("toy",),
        opens_text="a toy:SEED[:NOISE] spec",
        devices=("cpu",),
        dtypes=False,
        trees=True,
        features=False,
        transformers=False,
        auto=False,
    )

    def spec_kind(self, spec: str) -> str:
        if not SPEC.fullmatch(spec):
            raise ModelNotFoundError(f"{spec!r} is not a toy model: toy:SEED or toy:SEED:NOISE")
        return "toy"

    def load(self, spec: str, settings: Settings) -> ToyModel:
        match = SPEC.fullmatch(spec)
        if match is None:
            raise ModelNotFoundError(f"{spec!r} is not a toy model: toy:SEED or toy:SEED:NOISE")
        return ToyModel("toy", make_tokenizer(), CONTEXT, VOCAB, seed=int(match[1]), noise=float(match[2] or 0))


BACKEND = ToyBackend()

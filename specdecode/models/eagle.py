"""The EAGLE draft model (Li et al. 2024; EAGLE-3's feature fusion and training-time test): one decoder
layer of the target's family that runs autoregressively *on the target's features*.

At position ``t`` its input is ``fc(concat(std(g_t), norm(e(x_{t+1}))))``: ``g_t`` the target's feature of token
``t`` standardised per dimension (statistics of the training features, stored with the weights) and ``e``
the target's own (frozen) input embedding of the next token. One decoder layer (the target's
architecture, built from its config with ``num_hidden_layers = 1``, its own KV cache, RoPE at the
target's positions; its residual branches start at zero) and a norm give ``f^_{t+1}``, a prediction of
the target's feature of token ``t + 1``, read by an output layer over a *reduced draft vocabulary*
(the target's LM-head rows of the most frequent corpus tokens, frozen; ``id_map`` maps rows to target
ids) for the distribution of token ``t + 2``. The next draft step feeds ``(f^_{t+1}, x_{t+2})``.

Which target feature ``g`` is:

* ``final`` (EAGLE-1): the target's final normed hidden state, the one its LM head reads (its final
  norm is already applied). The draft layer's (learned) norm predicts it standardised; it is regressed
  onto the target's next feature in training, fed back as the next step's feature, and destandardised
  for the LM head.
* several decoder layers, e.g. ``2,14,25`` (EAGLE-3): ``g = fuse(concat(low, mid, high))``; the
  next step feeds back the draft layer's output before the norm, the norm is the target's final norm
  (frozen) and there is no feature regression (as in EAGLE-3).

The decoder is a Hugging Face model (``AutoModelForCausalLM.from_config``: one layer, vocabulary = the
draft vocabulary, the unused input embedding tied to the output layer), so at inference it runs under
the ordinary :class:`~specdecode.models.hf.HFRunner` (slot KV cache, tree masks, compaction) with
``inputs_embeds``. Saved as ``config.json`` + ``eagle.safetensors``; the config names the target
(sizes, fingerprint, the feature layers) and keeps the held-out accuracy by draft position.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import nn

from specdecode.models.medusa import CONFIG, HeadsError, load_dir, save_dir

WEIGHTS = "eagle.safetensors"
FINAL_KEY = "final"
# keys of the target's HF config that do not describe the one decoder layer
_DROP = (
    "architectures",
    "_name_or_path",
    "quantization_config",
    "auto_map",
    "transformers_version",
    "torch_dtype",
    "dtype",
    "layer_types",
    "max_window_layers",
    "_attn_implementation_autoset",
    "id2label",
    "label2id",
)


@dataclass
class EagleConfig:
    hidden_size: int
    vocab_size: int  # the target's
    draft_vocab: int
    feature_layers: list[str]  # feature keys as extracted ("final" or "layerN"), fused in this order
    decoder: dict  # the HF config of the one-layer decoder (model_type, sizes, rope, ...)
    kind: str = "eagle"
    target: dict = field(default_factory=dict)  # spec, model_type, num_layers, fingerprint
    accuracy: dict = field(default_factory=dict)  # held-out accuracy by draft position (see heads.eagle_train)
    training: dict = field(default_factory=dict)

    @property
    def final_mode(self) -> bool:
        return self.feature_layers == [FINAL_KEY]


def decoder_config(target_config, draft_vocab: int, intermediate_size: int | None = None) -> dict:
    """The one-layer decoder's HF config, derived from the target's (a ``PretrainedConfig`` or dict)."""
    raw = target_config.to_dict() if hasattr(target_config, "to_dict") else dict(target_config)
    cfg = {k: v for k, v in raw.items() if k not in _DROP}
    cfg.update(
        num_hidden_layers=1,
        vocab_size=draft_vocab,
        tie_word_embeddings=True,
        use_sliding_window=False,
        sliding_window=None,
        use_cache=True,
        bos_token_id=None,
        eos_token_id=None,
        pad_token_id=None,
    )
    if intermediate_size:
        cfg["intermediate_size"] = int(intermediate_size)
    return cfg


def build_decoder(cfg: dict) -> nn.Module:
    from transformers import AutoConfig, AutoModelForCausalLM

    cfg = dict(cfg)
    model_type = cfg.pop("model_type")
    config = AutoConfig.for_model(model_type, **cfg)
    config._attn_implementation = "sdpa"
    return AutoModelForCausalLM.from_config(config, attn_implementation="sdpa", dtype=torch.float32)


class _Levels:
    """A KV "cache" for training-time test: level ``j`` of the unroll attends to the keys of levels
    ``0..j`` (concatenated along the sequence), under a mask that lets anchor ``a`` see level-0 keys
    ``<= a`` and its own keys of levels ``1..j`` (what inference sees after ``j`` draft steps)."""

    def __init__(self) -> None:
        self.keys: list[torch.Tensor] = []
        self.values: list[torch.Tensor] = []

    def update(self, key_states, value_states, layer_idx, *args, **kwargs):
        self.keys.append(key_states)
        self.values.append(value_states)
        return torch.cat(self.keys, dim=2), torch.cat(self.values, dim=2)

    def get_seq_length(self, layer_idx: int = 0) -> int:
        return sum(k.shape[2] for k in self.keys)


def unroll_mask(valid: torch.Tensor, level: int) -> torch.Tensor:
    """``valid`` [B, T] anchors -> bool [B, 1, T, (level + 1) * T] for training-time test level ``level``."""
    bsz, t = valid.shape
    dev = valid.device
    causal = torch.ones(t, t, dtype=torch.bool, device=dev).tril_()
    eye = torch.eye(t, dtype=torch.bool, device=dev)
    mask = torch.cat([causal] + [eye] * level, dim=1)[None].expand(bsz, -1, -1).clone()
    mask &= torch.cat([valid] * (level + 1), dim=1)[:, None, :]  # padding keys are never seen
    mask[:, torch.arange(t, device=dev), torch.arange(t, device=dev)] = True  # a padding row sees itself (no NaN)
    return mask[:, None]


class EagleModel(nn.Module):
    id_map: torch.Tensor  # [draft_vocab] target ids of the draft vocabulary's rows (a buffer)
    feat_mean: torch.Tensor  # [n, H] per-dimension statistics of the training features (buffers)
    feat_std: torch.Tensor
    decoder: Any  # the one-layer transformers causal LM; its parts are reached by name (base_model.layers[0])

    def __init__(self, config: EagleConfig, id_map: torch.Tensor) -> None:
        super().__init__()
        if id_map.shape != (config.draft_vocab,):
            raise HeadsError(f"id map of {tuple(id_map.shape)} rows for a draft vocabulary of {config.draft_vocab}")
        if int(config.decoder.get("hidden_size", -1)) != config.hidden_size:
            raise HeadsError("the decoder's hidden size differs from the features'")
        self.config = config
        h = config.hidden_size
        n = len(config.feature_layers)
        self.fuse = nn.Linear(n * h, h, bias=False) if n > 1 else None
        eps = float(config.decoder.get("rms_norm_eps", 1e-6))
        # Input features are standardised per dimension with statistics of the training features: a
        # transformer's hidden states carry a few massive dimensions (here up to 130 where the median is
        # 2), which would otherwise swamp everything else, and the token embedding (RMS ~100x smaller)
        # is normalised too (EAGLE-3 normalises both).
        self.register_buffer("feat_mean", torch.zeros(n, h), persistent=True)
        self.register_buffer("feat_std", torch.ones(n, h), persistent=True)
        self.emb_norm = nn.RMSNorm(h, eps=eps)
        self.fc = nn.Linear(2 * h, h, bias=False)
        self.decoder = build_decoder(config.decoder)
        layer = self.decoder.base_model.layers[0]
        with torch.no_grad():  # residual branches start at zero: the untrained layer is fc and a norm
            layer.self_attn.o_proj.weight.zero_()
            layer.mlp.down_proj.weight.zero_()
        self.register_buffer("id_map", id_map.to(torch.long), persistent=True)

    # -- pieces shared by training and drafting --------------------------------------------------------
    def features(self, parts: list[torch.Tensor]) -> torch.Tensor:
        """The target's feature layers (in ``config.feature_layers`` order) -> ``g`` [..., H]: each
        standardised, then fused (EAGLE-3) when there are several."""
        z = [(p - self.feat_mean[i].to(p.dtype)) / self.feat_std[i].to(p.dtype) for i, p in enumerate(parts)]
        if self.fuse is None:
            return z[0]
        return self.fuse(torch.cat(z, dim=-1))

    def step_input(self, g: torch.Tensor, emb: torch.Tensor) -> torch.Tensor:
        return self.fc(torch.cat([g, self.emb_norm(emb.to(g.dtype))], dim=-1))

    def feedback(self, normed: torch.Tensor, raw: torch.Tensor | None) -> torch.Tensor:
        """The next step's feature: the normed output, which predicts the next token's standardised
        final feature (EAGLE-1), or the raw output (fusion, EAGLE-3; the runner was asked for it)."""
        if self.config.final_mode:
            return normed
        assert raw is not None
        return raw

    def to_feature(self, normed: torch.Tensor) -> torch.Tensor:
        """The draft layer's normed output -> what the LM head reads: the predicted final feature
        (destandardised; EAGLE-1) or the normed output itself (fusion: the target's own final norm)."""
        if self.config.final_mode:
            return self.feat_mean[0].to(normed.dtype) + self.feat_std[0].to(normed.dtype) * normed
        return normed

    def set_feature_stats(self, parts: list[torch.Tensor]) -> None:
        """Per-dimension mean and standard deviation of each feature layer (rows of training features)."""
        with torch.no_grad():
            for i, p in enumerate(parts):
                self.feat_mean[i] = p.float().mean(0)
                self.feat_std[i] = p.float().std(0).clamp(min=1e-3)

    @property
    def out(self) -> nn.Linear:
        return self.decoder.get_output_embeddings()

    @property
    def norm(self) -> nn.Module:
        return self.decoder.base_model.norm

    # -- training ------------------------------------------------------------------------------------
    def unroll(
        self, g_parts: list[torch.Tensor], embs: list[torch.Tensor], positions: torch.Tensor, valid: torch.Tensor
    ):
        """Training-time test. ``g_parts`` the target's feature layers [B, T, H] at anchors ``a``; ``embs[j]``
        [B, T, H] the embedding of token ``a + j + 1``; ``positions`` [B, T] anchor positions; ``valid``
        [B, T] real anchors. Level ``j`` sits at position ``a + j`` and predicts token ``a + j + 2``.
        Returns per level ``(normed output [B, T, H], draft logits [B, T, Vd])``; in EAGLE-1 mode the
        normed output predicts the standardised final feature of token ``a + j + 1``."""
        base = self.decoder.base_model
        layer = base.layers[0]
        cache = _Levels()
        g, outs = self.features(g_parts), []
        for j, emb in enumerate(embs):
            x = self.step_input(g, emb)
            pos = positions + j
            h = layer(
                x,
                attention_mask=unroll_mask(valid, j),
                position_ids=pos,
                past_key_values=cache,
                position_embeddings=base.rotary_emb(x, pos),
            )
            h = h[0] if isinstance(h, tuple) else h
            normed = base.norm(h)
            outs.append((normed, self.out(self.to_feature(normed))))
            g = self.feedback(normed, h)
        return outs

    # -- persistence ---------------------------------------------------------------------------------
    def save(self, directory: str | Path) -> None:
        save_dir(directory, {k: v for k, v in self.state_dict().items() if k != _TIED}, self.config, WEIGHTS)

    @classmethod
    def load(cls, directory: str | Path) -> "EagleModel":
        directory = Path(directory).expanduser()
        config, state = load_dir(directory, WEIGHTS, EagleConfig, "an EAGLE drafter")
        model = cls(config, state["id_map"])
        missing, unexpected = model.load_state_dict(state, strict=False)
        if unexpected or set(missing) - {_TIED}:
            raise HeadsError(
                f"{directory / WEIGHTS}: weights do not match {CONFIG} (missing {sorted(missing)[:3]}, "
                f"unexpected {sorted(unexpected)[:3]})"
            )
        model.decoder.tie_weights()
        model.eval().requires_grad_(False)
        return model


_TIED = "decoder.lm_head.weight"  # the same tensor as the decoder's (unused) input embedding


def eagle3_layers(num_layers: int) -> list[int]:
    """EAGLE-3's low, middle and high layers: 2, L/2, L-3 (decoder-layer outputs)."""
    return sorted({min(2, num_layers), max(1, num_layers // 2), max(1, num_layers - 3)})

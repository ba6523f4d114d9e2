"""`specdecode heads train --kind eagle`: train the EAGLE draft layer on extracted features (the target frozen).

A training example is one extracted chunk (the target saw it from position 0, so positions match).
For every anchor ``a`` of the chunk the drafter is unrolled ``--ttt-steps`` levels (training-time
test, EAGLE-3): level 0 reads the target's true feature ``g_a`` (plus ``--feature-noise``) and the
next token's embedding; level ``j`` reads the feature the drafter itself produced at level ``j - 1``
and the embedding of token ``a + j + 1``, and attends to the true keys ``<= a`` and its own earlier
levels, exactly what inference feeds draft position ``j + 1``. Level ``j`` predicts token
``a + j + 2`` and is weighted ``--level-decay ** j``; its loss is cross-entropy against the target's
distribution there (stored top-k, renormalised over the draft vocabulary) mixed with the corpus token
(``--soft-weight``), plus, for final-layer features (EAGLE-1), ``--feature-weight`` times the smooth L1
distance between the predicted and the target's feature of token ``a + j + 1``.

The split is by document (as for Medusa). Held-out accuracy per draft position ``p`` (level ``p - 1``,
unrolled further than trained, up to :data:`EVAL_LEVELS`): ``top1`` = P(the drafter's top-1 is the
target's top-1), ``chain`` = P(positions ``1..p`` all are), whose sum + 1 estimates greedy tokens per
step for a chain of length ``p``. Checkpoints, resume, DDP and the plot work as for Medusa
(:mod:`specdecode.heads.train`).
"""

from __future__ import annotations

import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import ClassVar

import torch

from specdecode.heads.features import FeatureError, FeatureSet, layer_key
from specdecode.heads.train import CommonSettings, Loop, draft_vocabulary, held_out_docs, lm_target
from specdecode.models.eagle import FINAL_KEY, EagleConfig, EagleModel, decoder_config, eagle3_layers

EVAL_LEVELS = 6  # draft positions scored on held-out chunks
# anchor rows whose float32 log-probabilities are formed at once: a [256, 16384] float32 block is 16 MiB, under
# glibc's largest mmap threshold (32 MiB), so with specdecode.allocator's setting its memory is reused; a
# whole 511-anchor chunk (33.5 MB) is mmapped afresh every time (a profile showed ~90 ms per zero-fill)
LOSS_ROWS = 256


@dataclass
class EagleSettings(CommonSettings):
    layers: str = "final"  # feature layers: final | eagle3 | comma-separated decoder-layer indices
    intermediate_size: int = 0  # 0 = the target's
    ttt_steps: int = 3  # unrolled levels per anchor
    batch_chunks: int = 1
    level_decay: float = 0.8
    feature_weight: float = 0.5
    feature_noise: float = 0.05
    positive: ClassVar[tuple[str, ...]] = ("draft_vocab", "ttt_steps", "batch_chunks")

    def validate(self) -> None:
        super().validate()
        if self.intermediate_size < 0:
            raise ValueError("--intermediate-size must be >= 0 (0 = the target's)")
        if self.feature_weight < 0 or self.feature_noise < 0:
            raise ValueError("--feature-weight and --feature-noise must be >= 0")


def resolve_layers(text: str, num_layers: int) -> list[str]:
    """``final`` | ``eagle3`` | ``2,14,25`` -> feature keys as stored by ``heads extract``."""
    if text.strip() == FINAL_KEY:
        return [FINAL_KEY]
    if text.strip() == "eagle3":
        return [layer_key(i) for i in eagle3_layers(num_layers)]
    from specdecode.heads.features import parse_layers

    return [layer_key(i) for i in parse_layers(text, num_layers)]


def chunks_of(fs: FeatureSet) -> list[tuple[int, int]]:
    """[lo, hi) row ranges of the extracted chunks."""
    chunk = fs["chunk"].long()
    edges = torch.nonzero(chunk[1:] != chunk[:-1]).squeeze(1) + 1
    bounds = [0] + edges.tolist() + [len(fs)]
    return [(lo, hi) for lo, hi in zip(bounds[:-1], bounds[1:]) if hi - lo >= 3]


class Batches:
    """Builds padded unroll inputs and labels for a list of chunks."""

    def __init__(self, fs: FeatureSet, keys: list[str], embed: torch.Tensor, to_draft: torch.Tensor) -> None:
        self.fs, self.keys, self.embed, self.to_draft = fs, keys, embed, to_draft
        self.ids = fs["input_ids"].long()
        self.top_ids, self.top_logp = fs["topk_ids"].long(), fs["topk_logp"].float()
        self.final = fs[FINAL_KEY] if FINAL_KEY in fs.layers else None

    def make(self, chunks: list[tuple[int, int]], levels: int) -> dict:
        t = max(hi - lo - 1 for lo, hi in chunks)  # anchors a = 0 .. n - 2
        bsz, n_all = len(chunks), len(self.fs)
        rows = torch.zeros(bsz, t, dtype=torch.long)
        last = torch.zeros(bsz, 1, dtype=torch.long)  # last row of each chunk
        valid = torch.zeros(bsz, t, dtype=torch.bool)
        for b, (lo, hi) in enumerate(chunks):
            n = hi - lo - 1
            rows[b, :n] = torch.arange(lo, hi - 1)
            rows[b, n:] = lo
            valid[b, :n] = True
            last[b] = hi - 1
        out = {
            "valid": valid,
            "positions": (rows - rows[:, :1]).clamp(min=0) * valid,
            "g0": [self.fs[k][rows].float() for k in self.keys],
            "embs": [],
            "levels": [],
        }
        for j in range(levels):
            src = (rows + j + 1).clamp(max=n_all - 1)  # token a+j+1: the input token; the target's law of a+j+2
            ok_src = valid & (rows + j + 1 <= last)
            lab = (rows + j + 2).clamp(max=n_all - 1)
            ok_lab = valid & (rows + j + 2 <= last)
            out["embs"].append(self.embed[self.ids[torch.where(ok_src, src, rows)]])
            mapped = self.to_draft[self.top_ids[src]]  # [B, T, topk]
            q = torch.softmax(self.top_logp[src], -1) * (mapped >= 0) * ok_src[..., None]
            q = q / q.sum(-1, keepdim=True).clamp(min=1e-12)
            level = {
                "soft_ids": mapped.clamp(min=0),
                "soft_q": q,
                "ok": ok_src,
                "hard": torch.where(ok_lab, self.to_draft[self.ids[lab]], -1),
                "teacher": torch.where(ok_src, self.top_ids[src, 0], -1),
            }
            if self.final is not None:
                level["feature"] = self.final[src].float()
            out["levels"].append(level)
        return out


def eagle_loss(module, model: EagleModel, batch: dict, settings: EagleSettings, noise_gen: torch.Generator | None):
    """``module`` runs the unroll (the model, or its DDP wrapper); ``model`` is the bare model."""
    g_parts = batch["g0"]
    if noise_gen is not None and settings.feature_noise > 0:
        g_parts = [
            p
            + settings.feature_noise
            * p.pow(2).mean(-1, keepdim=True).sqrt()
            * torch.randn(p.shape, generator=noise_gen)
            for p in g_parts
        ]
    outs = module(g_parts, batch["embs"], batch["positions"], batch["valid"])
    total = outs[0][1].new_zeros(())
    for j, ((normed, logits), lab) in enumerate(zip(outs, batch["levels"])):
        ok = lab["ok"]
        if not ok.any():
            continue
        hard_ok = lab["hard"] >= 0
        soft = hard = total * 0
        width = max(1, LOSS_ROWS // logits.shape[0])
        for lo in range(0, logits.shape[1], width):  # float32 log-probabilities a slice of anchors at a time
            sl = slice(lo, lo + width)
            logp = torch.log_softmax(logits[:, sl].float(), -1)
            soft = soft - (lab["soft_q"][:, sl] * logp.gather(-1, lab["soft_ids"][:, sl])).sum(-1)[ok[:, sl]].sum()
            hard = hard - logp.gather(-1, lab["hard"][:, sl].clamp(min=0)[..., None]).squeeze(-1)[hard_ok[:, sl]].sum()
        soft = soft / ok.sum()
        hard = hard / hard_ok.sum().clamp(min=1)
        loss = settings.soft_weight * soft + (1 - settings.soft_weight) * hard
        if "feature" in lab and settings.feature_weight > 0 and model.config.final_mode:
            want = model.features([lab["feature"][ok]])  # the next token's standardised final feature
            loss = loss + settings.feature_weight * torch.nn.functional.smooth_l1_loss(normed[ok], want)
        total = total + settings.level_decay**j * loss
    return total


@torch.no_grad()
def evaluate(
    model: EagleModel, batches: Batches, chunks: list[tuple[int, int]], levels: int = EVAL_LEVELS, max_chunks: int = 64
) -> dict:
    pick = chunks[:: max(1, len(chunks) // max_chunks)][:max_chunks]
    hits = [[] for _ in range(levels)]
    hits5 = [[] for _ in range(levels)]
    for lo in range(0, len(pick), 4):
        batch = batches.make(pick[lo : lo + 4], levels)
        outs = model.unroll(batch["g0"], batch["embs"], batch["positions"], batch["valid"])
        chain = batch["valid"].clone()
        for j, ((_, logits), lab) in enumerate(zip(outs, batch["levels"])):
            ok = lab["ok"]
            top = model.id_map[logits.topk(5, -1).indices]  # [B, T, 5] target ids
            hit = top[..., 0] == lab["teacher"]
            chain &= hit | ~ok
            hits[j].append(torch.stack([hit[ok].float().sum(), (chain & ok).float().sum(), ok.float().sum()]))
            hits5[j].append((top == lab["teacher"][..., None]).any(-1)[ok].float().sum())
    res = {"positions": [], "top1": [], "top5": [], "chain": []}
    for j in range(levels):
        s = torch.stack(hits[j]).sum(0)
        n = max(1.0, float(s[2]))
        res["positions"].append(int(s[2]))
        res["top1"].append(round(float(s[0]) / n, 4))
        res["chain"].append(round(float(s[1]) / n, 4))
        res["top5"].append(round(float(torch.stack(hits5[j]).sum()) / n, 4))
    res["tokens_per_step"] = [round(1 + sum(res["chain"][: p + 1]), 3) for p in range(levels)]
    return res


def train(
    fs: FeatureSet,
    out: Path,
    settings: EagleSettings,
    target,
    checkpoint_every: int = 50,
    evals: int = 8,
    progress: bool = True,
) -> EagleModel:
    """Train (or resume) an EAGLE drafter; ``target`` is a model spec or a loaded HF causal LM."""
    settings.validate()
    parts = lm_target(target, fs.manifest["fingerprint"])
    num_layers = parts.config.num_hidden_layers
    keys = resolve_layers(settings.layers, num_layers)
    missing = [k for k in keys if k not in fs.layers]
    if missing:
        raise FeatureError(
            f"{fs.dir}: features hold layers {fs.layers}, not {missing}; extract with "
            f"--layers {','.join(k.removeprefix('layer') for k in keys)}"
        )
    train_docs_mask = ~torch.isin(fs["doc"].long(), held_out_docs(fs, settings.held_out))
    chunks = chunks_of(fs)
    train_chunks = [c for c in chunks if bool(train_docs_mask[c[0]])]
    test_chunks = [c for c in chunks if not bool(train_docs_mask[c[0]])]
    if settings.max_train_tokens:
        kept, total_tokens = [], 0
        for c in train_chunks:
            if total_tokens >= settings.max_train_tokens:
                break
            kept.append(c)
            total_tokens += c[1] - c[0]
        train_chunks = kept
    if not train_chunks or not test_chunks:
        raise FeatureError(
            f"{fs.dir}: {len(train_chunks)} training and {len(test_chunks)} held-out chunks; extract "
            "more tokens (several documents are needed for a held-out split)"
        )
    train_rows = torch.cat([torch.arange(lo, hi) for lo, hi in train_chunks])
    id_map = draft_vocabulary(fs, train_rows, settings.draft_vocab)
    to_draft = torch.full((fs.vocab_size,), -1, dtype=torch.long)
    to_draft[id_map] = torch.arange(len(id_map))
    config = EagleConfig(
        fs.hidden_size,
        fs.vocab_size,
        len(id_map),
        keys,
        decoder_config(parts.config, len(id_map), settings.intermediate_size or None),
        target={**fs.manifest["target"], "num_layers": num_layers, "fingerprint": fs.manifest["fingerprint"]},
    )
    torch.manual_seed(settings.seed)
    model = EagleModel(config, id_map)
    sample = train_rows[
        torch.randperm(len(train_rows), generator=torch.Generator().manual_seed(settings.seed))[:50_000]
    ]
    model.set_feature_stats([fs[k][sample] for k in keys])
    with torch.no_grad():
        model.out.weight.copy_(parts.out_weight[id_map])
        if not config.final_mode:  # fusion: the target's final norm, frozen; EAGLE-1 learns its own
            model.norm.weight.copy_(parts.norm_weight)
    model.out.weight.requires_grad_(False)
    model.norm.weight.requires_grad_(config.final_mode)
    model.forward = model.unroll  # DDP syncs gradients through forward()
    batches = Batches(fs, keys, parts.embed, to_draft)

    steps_per_epoch = max(1, len(train_chunks) // settings.batch_chunks)
    total = max(1, round(settings.epochs * steps_per_epoch))
    fingerprint = {"settings": asdict(settings), "features": [s["sha256"] for s in fs.manifest["shards"]]}
    loop = Loop(
        model,
        settings.lr,
        settings.weight_decay,
        settings.warmup,
        total,
        out,
        fingerprint,
        evals,
        checkpoint_every,
        progress,
        settings.compute_dtype,
    )
    noise_gen = torch.Generator().manual_seed(settings.seed + 7)
    per = settings.batch_chunks
    tokens_per_step = sum(hi - lo for lo, hi in train_chunks) / max(1, len(train_chunks)) * per

    def step_fn(step: int) -> float:
        epoch, b = divmod(step, steps_per_epoch)
        perm = torch.randperm(
            len(train_chunks), generator=torch.Generator().manual_seed(settings.seed * 100_003 + epoch)
        )
        pick = perm[b * per : (b + 1) * per][loop.rank :: loop.world].tolist() or perm[:1].tolist()
        noise_gen.manual_seed(settings.seed * 1_000_003 + step)
        return eagle_loss(
            loop.module, model, batches.make([train_chunks[i] for i in pick], settings.ttt_steps), settings, noise_gen
        )

    def eval_fn(step: int) -> dict:
        res = evaluate(model, batches, test_chunks, max_chunks=16)
        return {"step": step, "tokens_seen": round(step * tokens_per_step), "top1": res["top1"], "chain": res["chain"]}

    t0 = time.perf_counter()
    loop.run(step_fn, eval_fn)
    model.forward = model.unroll
    model.eval().requires_grad_(False)
    if loop.rank == 0:
        result = evaluate(model, batches, test_chunks)
        config.accuracy = result
        config.training = {
            "features": str(fs.dir),
            "feature_tokens": len(fs),
            "train_chunks": len(train_chunks),
            "train_tokens": int(sum(hi - lo for lo, hi in train_chunks)),
            "held_out_chunks": len(test_chunks),
            "steps": total,
            "tokens_seen": round(total * tokens_per_step),
            "seconds": round(loop.seconds, 1),
            "session_seconds": round(time.perf_counter() - t0, 1),
            "world_size": loop.world,
            "settings": asdict(settings),
            "curve": loop.curve,
            "draft_vocab_coverage": round(
                float(
                    (to_draft[fs["input_ids"][torch.cat([torch.arange(lo, hi) for lo, hi in test_chunks])].long()] >= 0)
                    .float()
                    .mean()
                ),
                4,
            ),
        }
        model.save(out)
        loop.finish(lambda c: c["top1"], "held-out top-1 (= target's top-1)", "draft position {p}")
    loop.close()
    return model

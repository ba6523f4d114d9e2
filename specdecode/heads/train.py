"""`specdecode heads train --kind medusa`: train Medusa heads on extracted features (the target frozen).

Data: for a token ``t`` of the training split, head ``j`` learns the token ``t + j + 2`` of the same
chunk from two labels (``--soft-weight`` mixes them): the target's own next-token distribution at
``t + j + 1`` (its stored top-k, renormalised over the draft vocabulary: Medusa-2's
self-distillation; acceptance is judged by the target, so this is the label that matters) and the
corpus token. Head ``j``'s loss is weighted ``head_decay ** j``. The split is by document
(``--held-out``), so held-out accuracy is measured on code the heads never saw; accuracy is the
probability that the head's rank-r token is the target's top-1 there (what greedy acceptance needs).

AdamW with linear warm-up and cosine decay; batches come from a per-epoch permutation seeded by
``--seed``, so a run resumed from its checkpoint (written every ``--checkpoint-every`` steps) takes
exactly the steps an uninterrupted run takes. Under ``torchrun --nproc-per-node N`` the same command
trains with DDP (gloo): each rank takes every N-th row of each batch; rank 0 writes.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import ClassVar

import torch

from specdecode.heads.features import FeatureError, FeatureSet
from specdecode.models.medusa import MedusaConfig, MedusaHeads

CHECKPOINT = "checkpoint.pt"
EVAL_ROWS = 8192  # held-out positions scored per evaluation
RANKS = 10  # accuracy by rank kept for the static tree


def add_train_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--kind",
        choices=("medusa", "eagle"),
        default="medusa",
        help="medusa: independent heads on the final hidden state; eagle: a one-layer draft decoder "
        "autoregressive on the target's features (default medusa)",
    )
    p.add_argument("--features", type=Path, required=True, help="a directory written by `heads extract`")
    p.add_argument("--out", type=Path, required=True, help="where the heads go (resumes from its checkpoint)")
    p.add_argument(
        "--target",
        default=None,
        help="the target model (default: the one named in the features' manifest); its LM-head rows "
        "initialise the output layer",
    )
    p.add_argument("--num-heads", type=int, default=4, help="heads: token t+2 .. t+1+N (default 4)")
    p.add_argument("--depth", type=int, default=1, help="residual blocks per head (default 1)")
    p.add_argument(
        "--draft-vocab",
        type=int,
        default=16384,
        help="output rows: the most frequent corpus tokens (default 16384; others are never drafted)",
    )
    p.add_argument(
        "--train-output",
        action="store_true",
        help="also train the shared output layer (default: frozen at the target's LM-head rows)",
    )
    p.add_argument("--epochs", type=float, default=2.0, help="passes over the training split (default 2)")
    p.add_argument("--batch-size", type=int, default=256, help="medusa: token positions per step (default 256)")
    p.add_argument("--lr", type=float, default=None, help="peak learning rate (default 1e-3)")
    p.add_argument("--weight-decay", type=float, default=0.0, help="AdamW weight decay (default 0)")
    p.add_argument("--warmup", type=float, default=0.05, help="warm-up fraction of the steps (default 0.05)")
    p.add_argument("--head-decay", type=float, default=0.8, help="loss weight of head j is DECAY**j (default 0.8)")
    p.add_argument(
        "--soft-weight",
        type=float,
        default=0.8,
        help="weight of the target's soft labels against the corpus token (default 0.8)",
    )
    p.add_argument("--held-out", type=float, default=0.1, help="fraction of documents held out (default 0.1)")
    p.add_argument(
        "--max-train-tokens",
        type=int,
        default=0,
        help="use only the first N training tokens (0 = all): for accuracy-vs-data curves",
    )
    p.add_argument("--seed", type=int, default=0)
    p.add_argument(
        "--compute-dtype",
        choices=("auto", "float32", "bfloat16"),
        default="float32",
        help="float32, or bfloat16 autocast (weights, optimizer and gradients stay float32); auto = "
        "bfloat16 where the CPU multiplies bf16 natively (AVX512-BF16/AMX), else float32 "
        "(default float32)",
    )
    e = p.add_argument_group("eagle")
    e.add_argument(
        "--eagle-layers",
        default="final",
        help="the target feature the drafter reads: final (EAGLE-1, the normed last state), eagle3 "
        "(fusion of layers 2, L/2, L-3) or decoder-layer indices, e.g. 2,14,25; the features must "
        "hold them (heads extract --layers) (default final)",
    )
    e.add_argument(
        "--intermediate-size", type=int, default=0, help="MLP width of the draft layer (default 0 = the target's)"
    )
    e.add_argument(
        "--ttt-steps",
        type=int,
        default=3,
        help="training-time test: draft steps unrolled on the drafter's own features (default 3)",
    )
    e.add_argument(
        "--batch-chunks",
        type=int,
        default=1,
        help="extracted chunks per step (default 1: on a CPU budget more updates beat bigger batches)",
    )
    e.add_argument(
        "--level-decay", type=float, default=0.8, help="loss weight of draft step j is DECAY**j (default 0.8)"
    )
    e.add_argument(
        "--feature-weight",
        type=float,
        default=0.5,
        help="weight of the smooth-L1 feature regression (final features only; default 0.5)",
    )
    e.add_argument(
        "--feature-noise",
        type=float,
        default=0.05,
        help="Gaussian noise on input features, relative to their RMS (default 0.05)",
    )
    p.add_argument("--checkpoint-every", type=int, default=100, help="steps between checkpoints (default 100)")
    p.add_argument("--evals", type=int, default=8, help="held-out evaluations during training (default 8)")
    p.add_argument("--threads", type=int, default=0, help="CPU threads (default: torch's choice)")
    p.add_argument("--no-progress", action="store_true")


@dataclass
class CommonSettings:
    """What training takes for every drafter kind: the output rows, the schedule, the label mix, the split, the seed."""

    draft_vocab: int = 16384
    epochs: float = 2.0
    lr: float = 1e-3
    weight_decay: float = 0.0
    warmup: float = 0.05
    soft_weight: float = 0.8
    held_out: float = 0.1
    max_train_tokens: int = 0
    seed: int = 0
    compute_dtype: str = "float32"  # or bfloat16: autocast of the forward (Loop)
    positive: ClassVar[tuple[str, ...]] = ()  # a kind's sizes that must be >= 1

    def validate(self) -> None:
        check_compute_dtype(self.compute_dtype)
        for name in self.positive:
            if getattr(self, name) < 1:
                raise ValueError(f"--{name.replace('_', '-')} must be >= 1")
        if not (self.epochs > 0 and self.lr > 0):
            raise ValueError("--epochs and --lr must be > 0")
        if not (0 <= self.soft_weight <= 1 and 0 <= self.warmup < 1 and 0 < self.held_out < 1):
            raise ValueError("need 0 <= --soft-weight <= 1, 0 <= --warmup < 1 and 0 < --held-out < 1")


@dataclass
class TrainSettings(CommonSettings):
    """Medusa heads."""

    num_heads: int = 4
    depth: int = 1
    train_output: bool = False
    batch_size: int = 256
    head_decay: float = 0.8
    positive: ClassVar[tuple[str, ...]] = ("num_heads", "depth", "draft_vocab", "batch_size")


@dataclass
class Data:
    """Per training/held-out position: the feature row and each head's labels (draft-vocab ids)."""

    rows: torch.Tensor  # [N] feature row index
    soft_ids: torch.Tensor  # [N, K, topk] draft ids (0 where unmapped; weight 0 there)
    soft_q: torch.Tensor  # [N, K, topk] teacher probabilities over the draft vocabulary
    hard: torch.Tensor  # [N, K] corpus token as draft id, -1 = none
    teacher: torch.Tensor  # [N, K] the target's top-1 (target ids), -1 = position invalid
    corpus: torch.Tensor  # [N, K] the corpus token (target ids), -1 = invalid


def draft_vocabulary(fs: FeatureSet, train_rows: torch.Tensor, size: int) -> torch.Tensor:
    """The ``size`` most frequent tokens among the corpus tokens and the target's top-1s (training rows)."""
    counts = torch.bincount(fs["input_ids"][train_rows].long(), minlength=fs.vocab_size)
    counts += torch.bincount(fs["topk_ids"][train_rows, 0].long(), minlength=fs.vocab_size)
    size = min(size, fs.vocab_size)
    order = torch.argsort(-counts[: fs.vocab_size], stable=True)
    return order[:size].sort().values


def build_data(fs: FeatureSet, rows: torch.Tensor, num_heads: int, to_draft: torch.Tensor) -> Data:
    n_all = len(fs)
    ids, chunk = fs["input_ids"].long(), fs["chunk"].long()
    top_ids, top_logp = fs["topk_ids"].long(), fs["topk_logp"].float()
    soft_ids, soft_q, hard, teacher, corpus = [], [], [], [], []
    for j in range(num_heads):
        label = rows + j + 2  # the token head j predicts
        src = rows + j + 1  # where the target's distribution of that token was computed
        ok = label < n_all
        ok &= chunk[label.clamp(max=n_all - 1)] == chunk[rows]
        lab, sr = label.clamp(max=n_all - 1), src.clamp(max=n_all - 1)
        mapped = to_draft[top_ids[sr]]  # [N, topk]
        q = torch.softmax(top_logp[sr], dim=-1) * (mapped >= 0) * ok[:, None]
        q = q / q.sum(-1, keepdim=True).clamp(min=1e-12)
        soft_ids.append(mapped.clamp(min=0))
        soft_q.append(q)
        hard.append(torch.where(ok, to_draft[ids[lab]], -1))
        teacher.append(torch.where(ok, top_ids[sr, 0], -1))
        corpus.append(torch.where(ok, ids[lab], -1))
    return Data(
        rows,
        torch.stack(soft_ids, 1),
        torch.stack(soft_q, 1),
        torch.stack(hard, 1),
        torch.stack(teacher, 1),
        torch.stack(corpus, 1),
    )


def held_out_docs(fs: FeatureSet, held_out: float) -> torch.Tensor:
    """The held-out documents: every round(1/held_out)-th document in extraction order (which is
    shuffled), at least one."""
    period = max(2, round(1 / held_out))
    docs = torch.unique(fs["doc"].long())
    held = docs[period - 1 :: period]
    return held if len(held) else docs[-1:]


def split_rows(fs: FeatureSet, held_out: float, max_train_tokens: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """Training and held-out positions, split by document (:func:`held_out_docs`)."""
    held = torch.isin(fs["doc"].long(), held_out_docs(fs, held_out))
    n_all = len(fs)
    chunk = fs["chunk"].long()
    has_label = torch.zeros(n_all, dtype=torch.bool)
    has_label[: n_all - 2] = chunk[: n_all - 2] == chunk[2:]  # head 0 has a label
    train = torch.nonzero(~held & has_label).squeeze(1)
    test = torch.nonzero(held & has_label).squeeze(1)
    if max_train_tokens:
        train = train[:max_train_tokens]
    if len(train) == 0 or len(test) == 0:
        raise FeatureError(
            f"{fs.dir}: {len(train)} training and {len(test)} held-out positions; extract more "
            "tokens (several documents are needed for a held-out split)"
        )
    return train, test


def loss_fn(logits: torch.Tensor, data: Data, idx: torch.Tensor, settings: TrainSettings) -> torch.Tensor:
    logp = torch.log_softmax(logits.float(), dim=-1)  # [b, K, Vd]
    soft = -(data.soft_q[idx] * logp.gather(2, data.soft_ids[idx])).sum(-1)  # [b, K]
    soft_ok = data.soft_q[idx].sum(-1) > 0
    hard_lab = data.hard[idx]
    hard = -logp.gather(2, hard_lab.clamp(min=0)[..., None]).squeeze(-1)
    hard_ok = hard_lab >= 0
    total = logits.new_zeros(())
    for j in range(logits.shape[1]):
        w = settings.head_decay**j
        s = soft[:, j][soft_ok[:, j]].mean() if soft_ok[:, j].any() else total * 0
        h = hard[:, j][hard_ok[:, j]].mean() if hard_ok[:, j].any() else total * 0
        total = total + w * (settings.soft_weight * s + (1 - settings.soft_weight) * h)
    return total


@torch.no_grad()
def evaluate(heads: MedusaHeads, X: torch.Tensor, data: Data, limit: int = EVAL_ROWS) -> dict:
    """Per head: accuracy by rank (P(rank-r token == target's top-1)), top-1/top-5, corpus top-1."""
    n = min(limit, len(data.rows))
    pick = torch.linspace(0, len(data.rows) - 1, n).long()
    ranked = []
    for lo in range(0, n, 1024):
        sel = pick[lo : lo + 1024]
        logits = heads(X[data.rows[sel]].float())
        ranked.append(heads.id_map[logits.topk(RANKS, dim=-1).indices])  # [b, K, R] target ids
    ranked_t = torch.cat(ranked)
    teacher, corpus = data.teacher[pick], data.corpus[pick]
    out = {"positions": n, "by_rank": [], "top1": [], "top5": [], "corpus_top1": []}
    for j in range(ranked_t.shape[1]):
        ok = teacher[:, j] >= 0
        hit = ranked_t[ok, j] == teacher[ok, j][:, None]  # [m, R]
        by_rank = hit.float().mean(0).tolist() if ok.any() else [0.0] * RANKS
        out["by_rank"].append([round(x, 4) for x in by_rank])
        out["top1"].append(round(by_rank[0], 4))
        out["top5"].append(round(sum(by_rank[:5]), 4))
        c_ok = corpus[:, j] >= 0
        out["corpus_top1"].append(
            round(float((ranked_t[c_ok, j, 0] == corpus[c_ok, j]).float().mean()), 4) if c_ok.any() else 0.0
        )
    return out


def _lr_factor(step: int, total: int, warmup: int) -> float:
    if step < warmup:
        return (step + 1) / warmup
    progress = (step - warmup) / max(1, total - warmup)
    return 0.5 * (1 + math.cos(math.pi * min(1.0, progress)))


@dataclass
class TargetParts:
    """What drafter training takes from the (frozen) target: its config, LM head, final norm, embeddings."""

    config: object  # the HF config
    out_weight: torch.Tensor  # [V, H] float32
    norm_weight: torch.Tensor | None  # [H] the final norm's weight
    embed: torch.Tensor  # [V, H] float32 input embeddings


def lm_target(target, fingerprint: list[int]) -> TargetParts:
    """Load the target (a spec, or an already loaded HF causal LM) and check it is the extracted one."""
    from specdecode.models.medusa import same_model
    from specdecode.models.hf import HFRunner
    from specdecode.models.loading import load_model

    model = load_model(target, torch.float32, "cpu")[0] if isinstance(target, str) else target
    if not same_model(fingerprint, HFRunner(model)):
        raise FeatureError(
            f"target {getattr(model.config, 'name_or_path', target)!r} is not the model the features "
            "were extracted from"
        )
    norm = getattr(model.base_model, "norm", None)
    return TargetParts(
        model.config,
        model.get_output_embeddings().weight.detach().float().clone(),
        norm.weight.detach().float().clone() if norm is not None else None,
        model.get_input_embeddings().weight.detach().float().clone(),
    )


def check_compute_dtype(name: str) -> None:
    if name not in ("float32", "bfloat16"):
        raise ValueError(f"--compute-dtype {name!r}: choose float32 or bfloat16 (or auto on the command line)")


class Loop:
    """The training loop shared by every drafter kind: AdamW with linear warm-up and cosine decay,
    held-out evaluations, checkpoints every ``checkpoint_every`` steps and resume from them (a run
    with other settings or features is refused), DDP under ``torchrun`` (rank 0 writes), the loss log
    and the plot. ``compute_dtype`` bfloat16 runs each step's forward under CPU autocast (matrix
    products in bf16, the parameters, their gradients and AdamW's state in float32)."""

    def __init__(
        self,
        model: torch.nn.Module,
        lr: float,
        weight_decay: float,
        warmup: float,
        total: int,
        out: Path,
        fingerprint: dict,
        evals: int,
        checkpoint_every: int,
        progress: bool,
        compute_dtype: str = "float32",
    ) -> None:
        import torch.distributed as dist

        self.world = int(os.environ.get("WORLD_SIZE", "1"))
        self.owns_group = self.world > 1 and not dist.is_initialized()
        if self.owns_group:
            dist.init_process_group("gloo")
        self.rank = dist.get_rank() if self.world > 1 else 0
        out.mkdir(parents=True, exist_ok=True)
        self.model, self.out, self.total, self.progress = model, out, total, progress
        self.checkpoint_every, self.fingerprint = checkpoint_every, fingerprint
        check_compute_dtype(compute_dtype)
        self.autocast = compute_dtype == "bfloat16"
        params = [p for p in model.parameters() if p.requires_grad]
        self.opt = torch.optim.AdamW(params, lr=lr, weight_decay=weight_decay)
        warm = max(1, round(warmup * total))
        self.sched = torch.optim.lr_scheduler.LambdaLR(self.opt, lambda s: _lr_factor(s, total, warm))
        self.module = model
        if self.world > 1:
            from torch.nn.parallel import DistributedDataParallel

            self.module = DistributedDataParallel(model)
        self.step, self.log, self.curve, self.seconds = 0, [], [], 0.0
        ckpt = out / CHECKPOINT
        if ckpt.is_file():
            state = torch.load(ckpt, weights_only=False)
            if state["fingerprint"] != fingerprint:
                raise FeatureError(
                    f"{ckpt} belongs to a run with other settings or features; use another --out or "
                    "delete the checkpoint"
                )
            model.load_state_dict(state["heads"])
            self.opt.load_state_dict(state["opt"])
            self.sched.load_state_dict(state["sched"])
            self.step, self.log, self.curve, self.seconds = (
                state["step"],
                state["log"],
                state["curve"],
                state["seconds"],
            )
        self.eval_at = {round(total * (i + 1) / evals) for i in range(evals)} if evals else set()

    def run(self, step_fn, eval_fn) -> None:
        """``step_fn(step) -> loss`` (a scalar to minimise); ``eval_fn(step) -> dict`` for the curve."""
        bar = None
        if self.progress and self.rank == 0:
            from tqdm import tqdm

            bar = tqdm(total=self.total, initial=self.step, unit="step", desc="train", dynamic_ncols=True)
        t0 = time.perf_counter() - self.seconds
        self.model.train()
        while self.step < self.total:
            with torch.autocast("cpu", dtype=torch.bfloat16, enabled=self.autocast):
                loss = step_fn(self.step)
            self.opt.zero_grad(set_to_none=True)
            loss.backward()
            self.opt.step()
            self.sched.step()
            self.step += 1
            value = loss.item()
            self.log.append([self.step, round(value, 5), self.sched.get_last_lr()[0]])
            if bar is not None:
                bar.update(1)
                bar.set_postfix(loss=f"{value:.3f}")
            if self.step in self.eval_at and self.rank == 0:
                self.model.eval()
                self.curve.append(eval_fn(self.step))
                self.model.train()
            self.seconds = time.perf_counter() - t0
            if (self.step % self.checkpoint_every == 0 or self.step == self.total) and self.rank == 0:
                tmp = self.out / (CHECKPOINT + ".tmp")
                torch.save(
                    {
                        "fingerprint": self.fingerprint,
                        "heads": self.model.state_dict(),
                        "opt": self.opt.state_dict(),
                        "sched": self.sched.state_dict(),
                        "step": self.step,
                        "log": self.log,
                        "curve": self.curve,
                        "seconds": self.seconds,
                    },
                    tmp,
                )
                tmp.replace(self.out / CHECKPOINT)
        if bar is not None:
            bar.close()

    def finish(self, series, ylabel: str, label: str) -> None:
        """Write ``train_log.json`` and ``training.png`` (``series(curve point) -> values per head/position``)."""
        (self.out / "train_log.json").write_text(json.dumps(self.log))
        _plot(self.out, self.log, self.curve, series, ylabel, label)

    def close(self) -> None:
        """Wait for every rank, then take the process group down before the interpreter does. Exiting
        with the group alive aborted a rank once under load ("terminate called without an active
        exception": gloo's worker thread freed a finished work item during finalization), and freeing
        the group right after a gloo barrier deadlocked (the worker needed the GIL to free the barrier's
        work while the main thread held it, joining the worker). So: the last rendezvous goes through
        the store (no gloo work is left in flight), DDP's reducer is dropped first, and the group is
        destroyed while its workers are idle."""
        if self.world <= 1:
            return
        import gc

        import torch.distributed as dist

        store = dist.distributed_c10d._get_default_store()
        store.add("specdecode/loop-closed", 1)
        while store.add("specdecode/loop-closed", 0) < self.world:
            time.sleep(0.05)  # releases the GIL: gloo's workers finish freeing the last gradient work
        self.module = self.model
        gc.collect()
        if self.owns_group:
            dist.destroy_process_group()


def train(
    fs: FeatureSet,
    out: Path,
    settings: TrainSettings,
    target_spec: str,
    checkpoint_every: int = 100,
    evals: int = 8,
    progress: bool = True,
    output_rows=None,
) -> MedusaHeads:
    """Train (or resume training) Medusa heads; writes ``out`` and returns the heads.

    ``output_rows(id_map)`` gives the initial output layer (default: the target's LM-head rows).
    """
    settings.validate()
    if "final" not in fs.layers:
        raise FeatureError(f"{fs.dir}: Medusa heads read the final hidden state; extract with --layers final")
    X = fs["final"]
    train_rows, test_rows = split_rows(fs, settings.held_out, settings.max_train_tokens)
    id_map = draft_vocabulary(fs, train_rows, settings.draft_vocab)
    to_draft = torch.full((fs.vocab_size,), -1, dtype=torch.long)
    to_draft[id_map] = torch.arange(len(id_map))
    train_data = build_data(fs, train_rows, settings.num_heads, to_draft)
    test_data = build_data(fs, test_rows, settings.num_heads, to_draft)
    config = MedusaConfig(
        settings.num_heads,
        fs.hidden_size,
        fs.vocab_size,
        len(id_map),
        settings.depth,
        target={**fs.manifest["target"], "fingerprint": fs.manifest["fingerprint"]},
    )
    rows = output_rows(id_map) if output_rows else lm_target(target_spec, fs.manifest["fingerprint"]).out_weight[id_map]
    heads = MedusaHeads(config, id_map, rows)
    heads.out.weight.requires_grad_(settings.train_output)
    steps_per_epoch = max(1, len(train_rows) // settings.batch_size)
    total = max(1, round(settings.epochs * steps_per_epoch))
    fingerprint = {"settings": asdict(settings), "features": [s["sha256"] for s in fs.manifest["shards"]]}
    loop = Loop(
        heads,
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

    def step_fn(step: int) -> torch.Tensor:
        epoch, b = divmod(step, steps_per_epoch)
        gen = torch.Generator().manual_seed(settings.seed * 100_003 + epoch)
        perm = torch.randperm(len(train_rows), generator=gen)
        idx = perm[b * settings.batch_size : (b + 1) * settings.batch_size][loop.rank :: loop.world]
        return loss_fn(loop.module(X[train_data.rows[idx]].float()), train_data, idx, settings)

    def eval_fn(step: int) -> dict:
        res = evaluate(heads, X, test_data, limit=2048)
        return {"step": step, "tokens_seen": step * settings.batch_size, "top1": res["top1"]}

    loop.run(step_fn, eval_fn)
    heads.eval().requires_grad_(False)
    if loop.rank == 0:
        result = evaluate(heads, X, test_data)
        config.accuracy = result["by_rank"]
        config.training = {
            "features": str(fs.dir),
            "feature_tokens": len(fs),
            "train_positions": len(train_rows),
            "held_out_positions": len(test_rows),
            "steps": total,
            "tokens_seen": total * settings.batch_size,
            "seconds": round(loop.seconds, 1),
            "world_size": loop.world,
            "settings": asdict(settings),
            "held_out": {k: result[k] for k in ("positions", "top1", "top5", "corpus_top1")},
            "curve": loop.curve,
            "draft_vocab_coverage": round(float((to_draft[fs["input_ids"][test_rows].long()] >= 0).float().mean()), 4),
        }
        heads.save(out)
        loop.finish(lambda c: c["top1"], "held-out top-1 (= target's top-1)", "head {j} (t+{t})")
    loop.close()
    return heads


def _plot(out: Path, log: list, curve: list, series, ylabel: str, label: str) -> None:
    """Loss by step; ``series(point)`` per head/position against training tokens seen (``label`` is
    formatted with ``j`` = index, ``p`` = j + 1 and ``t`` = j + 2)."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:  # pragma: no cover - matplotlib is a dependency
        return
    fig, (a, b) = plt.subplots(1, 2, figsize=(10, 4))
    a.plot([r[0] for r in log], [r[1] for r in log], lw=0.8)
    a.set_xlabel("step")
    a.set_ylabel("training loss")
    for j in range(len(series(curve[0])) if curve else 0):
        b.plot(
            [c["tokens_seen"] for c in curve],
            [series(c)[j] for c in curve],
            marker="o",
            label=label.format(j=j, p=j + 1, t=j + 2),
        )
    b.set_xlabel("training tokens seen")
    b.set_ylabel(ylabel)
    if curve:
        b.legend()
    fig.tight_layout()
    fig.savefig(out / "training.png", dpi=100)
    plt.close(fig)

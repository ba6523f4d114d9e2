"""Part 1 for tree drafters: the tree verifier follows the warped target law, on the pair's real trees.

The same design as the chain part (:mod:`specdecode.check.law`), with a tree:

1. the real drafter proposes a tree for the context (its shape, each node's token and the law its
   siblings were drawn from, and the sibling rule); one tree-masked target forward scores every node;
2. with the shape, the per-node draft laws and the per-node target distributions fixed, the engine's
   tree verifier runs ``law_samples`` times, each time with the node tokens *redrawn* the way the
   drafter draws them (per parent: without replacement, i.i.d., or fixed for deterministic
   siblings) and fresh uniforms;
3. for every query ``c`` (the root and each node), among the repetitions whose accepted path reaches
   ``c``, the next emitted token must follow ``warp(target_logits[c])`` (reference warp). Given the
   path reached ``c``, ``c``'s children are fresh draws, so this holds exactly for a correct verifier.

Statistics: chi-square goodness of fit per query with at least ``MIN_SAMPLES`` samples, Bonferroni
over contexts x sampled settings x (tree nodes + 1). Negative controls at the root: emitting the
first child always (what "accept everything" does), and the *wrong sibling rule* — i.i.d. for
siblings drawn without replacement and vice versa, and for deterministic siblings resampling from
the unreduced target after rejecting them all. Greedy: emitted tokens must be the target argmax
path, for the real tree and for a tree forced to be accepted along its first branch.
"""

from __future__ import annotations

import torch

from specdecode.check.common import CheckConfig, EnginePool, Progress
from specdecode.check.contexts import Context
from specdecode.check.law import _verdict, _warped, per_context_and_setting
from specdecode.check.report import PartResult
from specdecode.check.stats import goodness_of_fit
from specdecode.sampling import SamplingSetting, make_generator, sample, warp
from specdecode.tree import tree_layout
from specdecode.verify.tree import DETERMINISTIC, IID, WITHOUT_REPLACEMENT, verify_tree

MIN_SAMPLES = 50
CHUNK = 512


class _View:
    def __init__(self, token_ids, params, generator):
        self.slot, self.token_ids, self.params, self.generator, self.request_id = (
            0,
            token_ids,
            params,
            generator,
            "check",
        )


@torch.inference_mode()
def real_tree(engine, ctx: list[int], setting: SamplingSetting, k: int, seed: int) -> dict:
    """The drafter's tree after ``ctx`` and the target's logits at every node (slot 0 prefilled)."""
    params = setting.params(seed=seed, max_new_tokens=k + 1)
    proposal = engine.drafter.propose([_View(list(ctx), params, make_generator(seed))], [k])
    n = int(proposal.num_tokens[0])
    tokens, parents = proposal.tokens[:1, :n].cpu(), proposal.parents[:1, :n].cpu()
    start = torch.tensor([len(ctx) - 1])
    lay = tree_layout(torch.tensor([ctx[-1]]), tokens, parents, torch.tensor([n]), start)
    out = engine.target.forward(
        torch.tensor([0]), lay.input_ids, lay.positions, write_positions=lay.write_positions, tree_mask=lay.mask
    )
    logits = engine.target.logits(out.hidden)[0].float().cpu()  # [1+n, V]
    laws = None if proposal.probs is None else proposal.probs[0, :n].float().cpu()
    rule = proposal.rule or (DETERMINISTIC if laws is None else IID)
    return {"tokens": tokens[0], "parents": parents[0], "laws": laws, "rule": rule, "logits": logits}


def _redraw(tree: dict, count: int, rule: str, gen: torch.Generator) -> torch.Tensor:  # [count, n]
    tokens, parents, laws = tree["tokens"], tree["parents"].tolist(), tree["laws"]
    out = tokens.expand(count, -1).clone()
    if rule == DETERMINISTIC or laws is None:
        return out
    for parent in sorted(set(parents)):
        kids = [i for i, p in enumerate(parents) if p == parent]
        law = laws[kids[0]]
        m = min(len(kids), int((law > 0).sum())) if rule == WITHOUT_REPLACEMENT else len(kids)
        draws = torch.multinomial(law.expand(count, -1), m, replacement=rule == IID, generator=gen)
        out[:, kids[:m]] = draws
    return out


def _verify_many(verify_fn, tree: dict, target_probs: torch.Tensor, num: int, rule: str, gen) -> tuple:
    n = len(tree["tokens"])
    emitted, paths, accepted = [], [], []
    for lo in range(0, num, CHUNK):
        c = min(CHUNK, num - lo)
        drafts = _redraw(tree, c, tree["rule"], gen)
        laws = None if tree["laws"] is None else tree["laws"].expand(c, -1, -1)
        res = verify_fn(
            drafts,
            tree["parents"].expand(c, -1),
            torch.full((c,), n),
            laws,
            target_probs.expand(c, -1, -1),
            torch.rand(c, n + 1, generator=gen),
            rule,
        )
        width = n + 1
        emitted.append(torch.nn.functional.pad(res.tokens, (0, width - res.tokens.shape[1]), value=-1))
        paths.append(torch.nn.functional.pad(res.path, (0, width - res.path.shape[1]), value=-1))
        accepted.append(res.num_accepted)
    return torch.cat(emitted), torch.cat(paths), torch.cat(accepted)


def tree_law_record(
    tree: dict, setting: SamplingSetting, num_samples: int, level: float, seed: int, verify_fn, warp_fn
) -> dict:
    n = len(tree["tokens"])
    ref = _warped(warp, tree["logits"], setting)  # [1+n, V] the law after each query
    fed = _warped(warp_fn, tree["logits"], setting)
    gen = torch.Generator().manual_seed(seed)
    emitted, paths, accepted = _verify_many(verify_fn, tree, fed, num_samples, tree["rule"], gen)
    positions = []
    for q in range(n + 1):
        depth = (paths == q).long().argmax(1)  # where q sits on each path (0 for the root)
        reached = (paths == q).any(1) if q else torch.ones(len(paths), dtype=torch.bool)
        samples = emitted[reached, depth[reached]]
        if q and len(samples) < MIN_SAMPLES:
            continue
        positions.append({"position": q, **goodness_of_fit(samples.numpy(), ref[q].numpy(), level).to_dict()})
    first_child, wrong = _controls(tree, fed, num_samples, gen)
    return {
        "positions": positions,
        "nodes": n,
        "rule": tree["rule"],
        "mean_accepted": float(accepted.float().mean()),
        "control_draft": goodness_of_fit(first_child, ref[0].numpy(), level).to_dict(),
        "control_skip_residual": goodness_of_fit(wrong, ref[0].numpy(), level).to_dict(),
    }


def _controls(tree: dict, fed: torch.Tensor, num: int, gen) -> tuple:
    """Root-level samples of two wrong verifiers: emit the first child; the wrong sibling rule."""
    rule = tree["rule"]
    drafts = _redraw(tree, num, rule, gen)
    first = drafts[:, 0] if len(tree["tokens"]) else fed[0].argmax().expand(num)
    if rule in (IID, WITHOUT_REPLACEMENT):
        wrong_rule = WITHOUT_REPLACEMENT if rule == IID else IID
        _, wrong, _ = _verify_many(verify_tree, tree, fed, num, wrong_rule, gen)
        return first.numpy(), wrong[:, 0].numpy()
    # deterministic siblings: test them in order (accept with p(x)) but resample from the unreduced p
    kids = [i for i, p in enumerate(tree["parents"].tolist()) if p == -1]
    p0 = fed[0]
    out = sample(p0.expand(num, -1), torch.rand(num, generator=gen))
    done = torch.zeros(num, dtype=torch.bool)
    for i in kids:
        x = int(tree["tokens"][i])
        take = ~done & (torch.rand(num, generator=gen) < p0[x])
        out = torch.where(take, torch.full_like(out, x), out)
        done |= take
    return first.numpy(), out.numpy()


def tree_greedy_record(engine, tree: dict, greedy_fn, verify_fn, seed: int) -> dict:
    """Emitted tokens equal the target's argmax chain: the real tree, and one forced to accept its first branch."""
    argmax = tree["logits"].argmax(-1)  # [1+n]
    n = len(tree["tokens"])
    parents = tree["parents"]
    forced = tree["tokens"].clone()
    node = -1
    for i in range(n):  # along the first-child branch, put the target's argmax
        if int(parents[i]) == node:
            forced[i] = argmax[node + 1]
            node = i
    mismatches, calls = [], 0
    gen = torch.Generator().manual_seed(seed)
    vocab = tree["logits"].shape[-1]
    one_hot = torch.zeros(1 + n, vocab).scatter_(1, argmax[:, None], 1.0)
    for tokens in (tree["tokens"], forced):
        want, q = [], 0
        while True:  # the slow reference: follow children equal to the argmax
            want.append(int(argmax[q]))
            nxt = next((i + 1 for i in range(n) if int(parents[i]) + 1 == q and int(tokens[i]) == want[-1]), None)
            if nxt is None:
                break
            q = nxt
        results = [greedy_fn(tokens[None], parents[None], torch.tensor([n]), argmax[None])]
        laws = torch.zeros(1, n, vocab).scatter_(2, tokens[None, :, None], 1.0)
        for _ in range(4):
            results.append(
                verify_fn(
                    tokens[None],
                    parents[None],
                    torch.tensor([n]),
                    laws,
                    one_hot[None],
                    torch.rand(1, n + 1, generator=gen),
                    tree["rule"],
                )
            )
        for res in results:
            calls += 1
            got = res.tokens[0, : int(res.num_accepted[0]) + 1].tolist()
            if got != want:
                mismatches.append({"tree": tokens.tolist(), "expected_tokens": want, "tokens": got})
    return {"chains": 2, "calls": calls // 2, "mismatches": mismatches[:10], "num_mismatches": len(mismatches)}


def check_tree_law(
    pool: EnginePool,
    contexts: list[Context],
    cfg: CheckConfig,
    progress: Progress,
    verify_fn=None,
    greedy_fn=None,
    warp_fn=None,
) -> PartResult:
    import specdecode.engine as engine_module

    engine = pool.spec(1)
    verify_fn = verify_fn or engine.verifier.tree
    greedy_fn = greedy_fn or engine.verifier.tree_greedy
    warp_fn = warp_fn or engine_module.warp
    sampled = [s for s in cfg.law_settings if not s.greedy]
    num_tests = len(contexts) * len(sampled) * (engine.window)  # tree nodes + 1 (the root)
    level = cfg.part_alpha() / max(1, num_tests)
    progress.part("1 tree verifier law", len(contexts) * len(cfg.law_settings))

    def record(tree: dict, setting: SamplingSetting, seed: int) -> dict:
        if setting.greedy:
            return tree_greedy_record(engine, tree, greedy_fn, verify_fn, seed)
        return tree_law_record(tree, setting, cfg.law_samples, level, seed, verify_fn, warp_fn)

    records = per_context_and_setting(
        engine,
        contexts,
        cfg,
        progress,
        lambda ctx, s, seed: real_tree(engine, ctx, s, pool.k, seed),
        record,
        lambda tree: len(tree["tokens"]),
    )
    result = _verdict(records, sampled, contexts, cfg, level, num_tests)
    result.name = "tree verifier law"
    result.details["test"] = (
        "Pearson chi-square goodness of fit to the reference-warped target law after each "
        "tree node reached; Bonferroni over contexts x sampled settings x (tree nodes + 1); "
        "controls: emit the first child; the wrong sibling rule"
    )
    return result
